"""Two git revisions of the native kernel (verispec/kernels/small_m_linear.c), side by side on the
embedded target with today's Python: median ms of a fused forward of T new tokens after a C-token
context, the two builds interleaved per pass (11 passes), plus the largest logit difference between
them.

    OMP_NUM_THREADS=1 python experiments/kernel_ab.py BEFORE_REV AFTER_REV
    e.g.  565b536 e392662   (key read once per KV group; 6-row input chunks)
          e392662 f19bca6   (8 keys per step; vector exp for softmax and SiLU)
"""
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from verispec import kernels
from verispec.loading import load_pair


def build(revision: str, folder: Path) -> ctypes.CDLL:
    source = subprocess.run(["git", "show", f"{revision}:verispec/kernels/small_m_linear.c"], check=True,
                            capture_output=True, text=True).stdout
    c_file, so_file = folder / f"{revision}.c", folder / f"{revision}.so"
    c_file.write_text(source)
    subprocess.run(["cc", *kernels.FLAGS, "-o", str(so_file), str(c_file)], check=True)
    lib = ctypes.CDLL(str(so_file))
    current = kernels.library()
    # Today's Python calls these; a revision must export those it is run through (linear: small_m_linear).
    for name in ("small_m_linear", "rms_norm", "decoder_layer", "decoder_layers", "model_pass"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = getattr(current, name).argtypes
            getattr(lib, name).restype = getattr(current, name).restype
    if "int decoder_layer(" not in source:  # before it reported allocation failures
        lib.decoder_layer.restype = None
    return lib


before_rev, after_rev = sys.argv[1:3]
with tempfile.TemporaryDirectory() as scratch:
    libs = {rev: build(rev, Path(scratch)) for rev in (before_rev, after_rev)}
    target = load_pair("tiny", need_draft=False).target
    for context in (100, 500):
        cache = target.new_cache(1, 1024)
        target.forward(torch.randint(0, 8000, (1, context)), cache)
        cache.commit(0, context)
        for new in (1, 4, 5, 8, 9):
            tokens = torch.randint(0, 8000, (1, new))
            times, logits = {rev: [] for rev in libs}, {}
            for _ in range(11):
                for rev, lib in libs.items():
                    kernels.library = lambda lib=lib: lib
                    began = time.perf_counter()
                    logits[rev] = target.forward(tokens, cache)
                    times[rev].append(1e3 * (time.perf_counter() - began))
            diff = (logits[before_rev] - logits[after_rev]).abs().max().item()
            print(f"context {context:3d}  T {new}:  {before_rev} {statistics.median(times[before_rev]):6.2f} ms  "
                  f"{after_rev} {statistics.median(times[after_rev]):6.2f} ms  max |logit diff| {diff:.1e}", flush=True)
