"""Two builds of the native kernel (verispec/kernels/small_m_linear.c) side by side on a target with
today's Python: median ms of a fused forward of T new tokens after a C-token context, the two builds
interleaved per pass (11 passes), plus the largest logit difference between them. A build is a git
revision (WORK: the file as it is on disk), optionally with extra compiler flags after a colon, so
``WORK WORK:-DAMXQ_PREFETCH=32`` compares a setting of the same source. The weights stay packed by
the loaded library, so both builds must read the same layouts.

    OMP_NUM_THREADS=1 python experiments/kernel_ab.py BEFORE AFTER [--target tiny] [--tokens 1,4,5,8,9]
    e.g.  565b536 e392662   (key read once per KV group; 6-row input chunks)
          e392662 f19bca6   (8 keys per step; vector exp for softmax and SiLU)
"""
import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from verispec import kernels
from verispec.loading import load_pair


def build(spec: str, folder: Path, index: int) -> ctypes.CDLL:
    revision, _, flags = spec.partition(":")
    if revision == "WORK":
        source = kernels.SOURCE.read_text()
    else:
        source = subprocess.run(["git", "show", f"{revision}:verispec/kernels/small_m_linear.c"], check=True,
                                capture_output=True, text=True).stdout
    c_file, so_file = folder / f"build{index}.c", folder / f"build{index}.so"
    c_file.write_text(source)
    subprocess.run(["cc", *kernels.FLAGS, *flags.split(), "-o", str(so_file), str(c_file)], check=True)
    lib = ctypes.CDLL(str(so_file))
    current = kernels.library()
    # Today's Python calls these; a revision must export those it is run through (linear: small_m_linear).
    for name in ("small_m_linear", "rms_norm", "decoder_layer", "decoder_layers", "model_pass", "amx_init"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = getattr(current, name).argtypes
            getattr(lib, name).restype = getattr(current, name).restype
    if "int decoder_layer(" not in source:  # before it reported allocation failures
        lib.decoder_layer.restype = None
    if hasattr(lib, "amx_init"):
        lib.amx_init()
    return lib


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("before")
parser.add_argument("after")
parser.add_argument("--target", default="tiny")
parser.add_argument("--tokens", default="1,4,5,8,9")
parser.add_argument("--contexts", default="100,500")
parser.add_argument("--passes", type=int, default=11)
args = parser.parse_args()
with tempfile.TemporaryDirectory() as scratch:
    specs = [args.before, args.after]
    libs = {spec: build(spec, Path(scratch), i) for i, spec in enumerate(specs)}
    target = load_pair(args.target, need_draft=False).target
    for context in (int(c) for c in args.contexts.split(",")):
        cache = target.new_cache(1, max(1024, context + 64))
        target.forward(torch.randint(0, 8000, (1, context)), cache)
        cache.commit(0, context)
        for new in (int(t) for t in args.tokens.split(",")):
            tokens = torch.randint(0, 8000, (1, new))
            times, logits = {spec: [] for spec in libs}, {}
            for _ in range(args.passes):
                for spec, lib in libs.items():
                    kernels.library = lambda lib=lib: lib
                    began = time.perf_counter()
                    logits[spec] = target.forward(tokens, cache)
                    times[spec].append(1e3 * (time.perf_counter() - began))
            diff = (logits[specs[0]] - logits[specs[1]]).abs().max().item()
            print(f"context {context:3d}  T {new}:  {specs[0]} {statistics.median(times[specs[0]]):6.2f} ms  "
                  f"{specs[1]} {statistics.median(times[specs[1]]):6.2f} ms  max |logit diff| {diff:.1e}", flush=True)
