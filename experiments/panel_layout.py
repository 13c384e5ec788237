"""The shipped few-row kernel (dot products along k) vs a panel layout (W^T in 16-column panels, x
broadcast), on the embedded target's 33 projections per forward, bf16 weights.

    OMP_NUM_THREADS=1 python experiments/panel_layout.py

Compiles panel_layout.c next to this file into a temporary directory; prints the median ms per forward
for M = 1, 2, 4, 8, 16 rows (9 interleaved repeats).
"""

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from verispec import kernels

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 384, 1024, 8, 8192
SHAPES = [(HIDDEN, 640), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)] * LAYERS
SHAPES.append((HIDDEN, VOCAB))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (ceil(N / 16), K, 16): panel p holds columns 16p .. 16p + 15 of W^T."""
    out_features, in_features = weight.shape
    panels = (out_features + 15) // 16
    padded = torch.zeros(panels * 16, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    return padded.view(panels, 16, in_features).transpose(1, 2).contiguous()


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        library = Path(scratch) / "panel.so"
        subprocess.run(["cc", "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-o", str(library),
                        str(Path(__file__).with_name("panel_layout.c"))], check=True)
        function = ctypes.CDLL(str(library)).panels_bf16
        function.restype = None
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        weights = [torch.randn(out, inp).bfloat16() for inp, out in SHAPES]
        panels = [pack(w) for w in weights]

        def panel_linear(x, packed, out_features):
            rows, in_features = x.shape
            y = torch.empty(rows, out_features)
            function(x.data_ptr(), packed.data_ptr(), y.data_ptr(), None, rows, in_features, out_features, 1)
            return y

        x = torch.randn(3, HIDDEN)
        error = (panel_linear(x, panels[0], 640) - torch.nn.functional.linear(x, weights[0].float())).abs().max()
        print(f"max |panel - torch| = {error:.2e}; kernel {kernels.status()}")
        for rows in (1, 2, 4, 8, 16):
            inputs = [torch.randn(rows, inp) for inp, _ in SHAPES]
            times = {"dot (shipped)": [], "panel": []}
            for _ in range(9):
                began = time.perf_counter()
                for weight, x in zip(weights, inputs):
                    kernels.linear(x, weight)
                times["dot (shipped)"].append(1e3 * (time.perf_counter() - began))
                began = time.perf_counter()
                for packed, x, (_, out) in zip(panels, inputs, SHAPES):
                    panel_linear(x, packed, out)
                times["panel"].append(1e3 * (time.perf_counter() - began))
            print(f"M = {rows:2d}: " + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in times.items()))


if __name__ == "__main__":
    main()
