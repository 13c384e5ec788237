"""What reading a prompt costs the embedded target: one prefill pass of L tokens on one row (the
logits of the last position only), median of 7, in ms. Beyond kernels.max_fused() rows the pass runs
as consecutive fused passes (LlamaForCausalLM._run_in_chunks); VERISPEC_FUSED_LAYERS=0 shows torch's
per-op path for comparison.

    OMP_NUM_THREADS=1 python experiments/prefill_cost.py [--lengths 65,128,129,200,352,700]
"""
import argparse, statistics, time, torch
torch.set_num_threads(1)
from verispec import kernels
from verispec.loading import load_pair

ap = argparse.ArgumentParser()
ap.add_argument("--lengths", default="65,128,129,200,352,700")
args = ap.parse_args()
target = load_pair("tiny").target
print(f"kernel: {kernels.status(target)}")
for length in (int(x) for x in args.lengths.split(",")):
    tokens = torch.randint(0, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(1, 1024)
    target.forward(tokens, cache, last_only=True)
    runs = []
    for _ in range(7):
        began = time.perf_counter()
        target.forward(tokens, cache, last_only=True)
        runs.append(time.perf_counter() - began)
    print(f"{length:4d} tokens: {statistics.median(runs) * 1e3:7.2f} ms  "
          f"({statistics.median(runs) * 1e3 / length:.3f} ms/token)", flush=True)
