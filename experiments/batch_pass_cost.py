"""What one target pass costs by batch rows B, tokens per row W (W - 1 drafts verified) and context
length L: the embedded target's forward over a KV cache of B rows at length L, median of 30 passes,
in ms. The serving scheduler's round at batch B and gamma g is one such pass with W = g + 1.

    OMP_NUM_THREADS=1 python experiments/batch_pass_cost.py [--lengths 50,700] [--batches 1,8,16,32]
"""
import argparse, statistics, time, torch
torch.set_num_threads(1)
from verispec.loading import load_pair

ap = argparse.ArgumentParser()
ap.add_argument("--lengths", default="50,700")
ap.add_argument("--batches", default="1,8,16,32")
ap.add_argument("--widths", default="1,2,3,4,5")
args = ap.parse_args()
target = load_pair("tiny").target


def pass_ms(batch, width, length, n=30):
    cache = target.new_cache(batch, 1024)
    for row in range(batch):
        cache.set_length(row, length)
    tokens = torch.randint(0, target.config.vocab_size, (batch, width), generator=torch.Generator().manual_seed(0))
    view = cache.prefix_view(batch)
    target.forward(tokens, view)
    runs = []
    for _ in range(n):
        began = time.perf_counter()
        target.forward(tokens, view)
        runs.append(time.perf_counter() - began)
    return statistics.median(runs) * 1e3


for length in (int(x) for x in args.lengths.split(",")):
    for batch in (int(x) for x in args.batches.split(",")):
        print(f"L{length} B{batch}: " + "  ".join(f"W{w} {pass_ms(batch, w, length):6.2f}"
                                                 for w in (int(x) for x in args.widths.split(","))), flush=True)
