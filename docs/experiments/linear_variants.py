"""Verify-curve experiment (README "Making verification cheaper"): plain F.linear vs pre-transposed weights vs
MKL pre-packed weights vs 2-D mm, interleaved forwards of the target over T new positions, 1 thread.
    python docs/experiments/linear_variants.py verispec/data/target
"""
import torch, time, statistics, sys
import torch.nn.functional as F
from verispec.models.llama import load_checkpoint

torch.set_num_threads(1)
model = load_checkpoint(sys.argv[1])
orig = torch.nn.Linear.forward
Ts = (1, 2, 5, 8, 16)
lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
WT = {id(m): m.weight.t().contiguous() for m in lins}
PK = {id(m): {T: torch.ops.mkl._mkl_reorder_linear_weight(m.weight, T) for T in Ts if T > 1} for m in lins}
def wt(layer, x):
    return torch.matmul(x, WT[id(layer)])
def packed(layer, x):
    rows = x.numel() // x.shape[-1]
    if rows > 1:
        return torch.ops.mkl._mkl_linear(x.reshape(rows, -1), PK[id(layer)][rows], layer.weight, None, rows).view(*x.shape[:-1], -1)
    return F.linear(x, layer.weight)
def addmm2d(layer, x):
    rows = x.numel() // x.shape[-1]
    return torch.mm(x.reshape(rows, -1), layer.weight.t()).view(*x.shape[:-1], -1)
variants = {"base": orig, "wt": wt, "packed": packed, "mm2d": addmm2d}
cache = model.new_cache(1, 256)
ids = torch.randint(0, 8192, (1, 128)); model.forward(ids, cache); cache.commit(0, 128)
times = {(v, T): [] for v in variants for T in Ts}
xs = {T: torch.randint(0, 8192, (1, T)) for T in Ts}
ref = {T: model.forward(xs[T], cache) for T in Ts}
for v, fn in variants.items():
    torch.nn.Linear.forward = fn
    print(v, "maxdiff", max((model.forward(xs[T], cache) - ref[T]).abs().max().item() for T in Ts))
for rep in range(25):
    for T in Ts:
        for v, fn in variants.items():
            torch.nn.Linear.forward = fn
            t = time.perf_counter(); model.forward(xs[T], cache); times[(v, T)].append((time.perf_counter() - t) * 1e3)
for v in variants:
    med = {T: statistics.median(times[(v, T)][3:]) for T in Ts}
    print(v, " ".join(f"T{T}={m:.2f}" for T, m in med.items()), f"ratio8={med[8]/med[1]:.2f}", flush=True)
