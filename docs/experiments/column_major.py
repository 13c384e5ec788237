"""Verify-curve experiment: weights stored column-major (F.linear then multiplies by a contiguous W^T).
    python docs/experiments/column_major.py verispec/data/target
"""
import torch, time, statistics, sys
from verispec.models.llama import load_checkpoint
torch.set_num_threads(1)
models = {"base": load_checkpoint(sys.argv[1]), "colmajor": load_checkpoint(sys.argv[1]), "colmajor_untied_head": load_checkpoint(sys.argv[1])}
for name in ("colmajor", "colmajor_untied_head"):
    m = models[name]
    with torch.no_grad():
        for layer in m.modules():
            if isinstance(layer, torch.nn.Linear) and (name == "colmajor" or layer is not m.lm_head):
                layer.weight.data = layer.weight.data.t().contiguous().t()
Ts = (1, 2, 5, 8, 16)
caches = {}
ids = torch.randint(0, 8192, (1, 128))
for n, m in models.items():
    c = m.new_cache(1, 256); m.forward(ids, c); c.commit(0, 128); caches[n] = c
xs = {T: torch.randint(0, 8192, (1, T)) for T in Ts}
for n, m in models.items():
    print(n, max((m.forward(xs[T], caches[n]) - models["base"].forward(xs[T], caches["base"])).abs().max().item() for T in Ts))
times = {(n, T): [] for n in models for T in Ts}
for rep in range(25):
    for T in Ts:
        for n, m in models.items():
            t = time.perf_counter(); m.forward(xs[T], caches[n]); times[(n, T)].append((time.perf_counter() - t) * 1e3)
for n in models:
    med = {T: statistics.median(times[(n, T)][3:]) for T in Ts}
    print(n, " ".join(f"T{T}={v:.2f}" for T, v in med.items()), f"ratio8={med[8]/med[1]:.2f}", flush=True)
