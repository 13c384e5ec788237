"""A target's packed weights gathered in one block of huge pages (``kernels.gather``, what loading does)
against the same weights where packing left them (``kernels.GATHER`` off while the second copy loads:
each layer's or group's own allocation on 4 KiB pages), two copies of the model in one process, passes of
T new tokens after a 200-token context interleaved: median ms per pass and whether the logits are
identical; then the process's huge pages.

    OMP_NUM_THREADS=1 python experiments/weight_arena.py [--target smollm2] [--tokens 1,3,8] [--repeats 15]
"""
import argparse
import statistics
import time

import torch

from verispec import kernels
from verispec.loading import load_pair

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--target", default="smollm2")
parser.add_argument("--tokens", default="1,3,8")
parser.add_argument("--repeats", type=int, default=15)
args = parser.parse_args()
torch.set_num_threads(1)


models = {"gathered": load_pair(args.target, need_draft=False).target}
kernels.GATHER = False
models["separate"] = load_pair(args.target, need_draft=False).target
kernels.GATHER = True
tokens = [int(t) for t in args.tokens.split(",")]
prompt = torch.randint(0, 8000, (1, 200), generator=torch.Generator().manual_seed(0))
times = {(name, t): [] for name in models for t in tokens}
outputs = {}
with torch.inference_mode():
    caches = {}
    for name, model in models.items():
        cache = caches[name] = model.new_cache(1, 512)
        view = cache.prefix_view(1)
        model.forward(prompt, view)
        view.commit(0, 200)
    for repeat in range(args.repeats):
        for name, model in sorted(models.items(), reverse=repeat % 2 == 1):  # either goes first in turn
            for t in tokens:
                fed = torch.arange(100, 100 + t)[None]
                model.forward(fed, caches[name].prefix_view(1))  # the other model's pass evicted this one's
                best = float("inf")
                for _ in range(3):
                    began = time.perf_counter()
                    outputs[(name, t)] = model.forward(fed, caches[name].prefix_view(1))
                    best = min(best, time.perf_counter() - began)
                times[(name, t)].append(best)
print(f"{args.target}, 1 thread, {args.repeats} repeats (best of 3 passes each); kernel {kernels.paths()}")
for t in tokens:
    gathered, separate = (1e3 * statistics.median(times[(n, t)]) for n in ("gathered", "separate"))
    same = torch.equal(outputs[("gathered", t)], outputs[("separate", t)])
    print(f"T {t}: gathered {gathered:6.2f} ms  separate {separate:6.2f} ms  ratio {gathered / separate:.3f}  "
          f"identical logits: {'yes' if same else 'NO'}")
huge = [line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")]
print(f"huge pages in this process: {int(huge[0]) // 1024 if huge else 0} MiB")
