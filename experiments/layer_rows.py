"""A target's fused decoder layers and its LM head for a pass of T new tokens after a 200-token context,
one row, median of 41 (ms): where verifying T positions loses against decoding 1 (the kernel's input-row
chunks leave remainders at some T).

    OMP_NUM_THREADS=1 python experiments/layer_rows.py [--target smollm2] [--tokens 1,2,4,5,8]
"""
import argparse
import statistics
import time

import torch

from verispec.loading import load_pair

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--target", default="tiny")
parser.add_argument("--tokens", default="1,2,4,6,8")
args = parser.parse_args()
torch.set_num_threads(1)
target = load_pair(args.target, need_draft=False).target


def median_ms(fn, n=41):
    times = []
    for _ in range(n):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


with torch.inference_mode():
    for new in (int(t) for t in args.tokens.split(",")):
        cache = target.new_cache(1, 1024)
        cache.set_length(0, 200)
        x = target.embed(torch.randint(0, 8000, (1, new), generator=torch.Generator().manual_seed(0)))
        hidden = torch.randn(1, new, target.config.hidden_size)
        layers = median_ms(lambda: target.run_layers(x, cache.prefix_view(1), 0, target.config.num_hidden_layers))
        head = median_ms(lambda: target.logits(hidden))
        print(f"T {new}: layers {layers:5.2f} ms  LM head {head:5.2f} ms", flush=True)
