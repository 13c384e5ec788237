"""Verify-curve experiment: the LM head computed in vocabulary chunks (512 / 1024 / 2048 rows) vs whole.
    python docs/experiments/lm_head_chunks.py verispec/data/target
"""
import torch, time, statistics, sys
import torch.nn.functional as F
from verispec.models.llama import load_checkpoint

torch.set_num_threads(1)
model = load_checkpoint(sys.argv[1])
orig = torch.nn.Linear.forward
def make_chunked(chunk):
    def f(layer, x):
        if layer.out_features >= 4096:
            W = layer.weight
            return torch.cat([F.linear(x, W[i:i + chunk]) for i in range(0, W.shape[0], chunk)], dim=-1)
        return orig(layer, x)
    return f
variants = {"base": orig, "c512": make_chunked(512), "c1024": make_chunked(1024), "c2048": make_chunked(2048)}
Ts = (1, 2, 5, 8, 16)
cache = model.new_cache(1, 256)
ids = torch.randint(0, 8192, (1, 128)); model.forward(ids, cache); cache.commit(0, 128)
times = {(v, T): [] for v in variants for T in Ts}
xs = {T: torch.randint(0, 8192, (1, T)) for T in Ts}
for rep in range(30):
    for T in Ts:
        for v, fn in variants.items():
            torch.nn.Linear.forward = fn
            t = time.perf_counter(); model.forward(xs[T], cache); times[(v, T)].append((time.perf_counter() - t) * 1e3)
for v in variants:
    med = {T: statistics.median(times[(v, T)][3:]) for T in Ts}
    print(v, " ".join(f"T{T}={m:.2f}" for T, m in med.items()), f"ratio8={med[8]/med[1]:.2f}", flush=True)
