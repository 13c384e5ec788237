"""torch's linear vs verispec.kernels (fp32 and bf16 weights) on the embedded target's matrix shapes.

    OMP_NUM_THREADS=1 python experiments/small_m_kernel.py [--rows 1,2,4,8,16,24,32] [--repeats 7]

One "forward" = every projection of the 8-layer target once (q|k|v, o, gate|up, down per layer, plus the
LM head), distinct matrices, so weights stream from memory as in decoding. Prints the median ms per
forward for each row count M and each path, interleaved per repeat.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from verispec import kernels

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 384, 1024, 8, 8192
SHAPES = [(HIDDEN, 640), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)] * LAYERS
SHAPES.append((HIDDEN, VOCAB))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,16,24,32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(out, inp).to(torch.bfloat16).float() for inp, out in SHAPES]
    bf16 = [w.to(torch.bfloat16) for w in weights]
    paths = {
        "torch": lambda x, i: F.linear(x, weights[i]),
        "kernel fp32": lambda x, i: kernels.linear(x, weights[i]),
        "kernel bf16": lambda x, i: kernels.linear(x, bf16[i]),
    }
    print(f"threads {torch.get_num_threads()}; kernel {kernels.status()}")
    print(f"{'M':>3} " + " ".join(f"{name:>12}" for name in paths) + "   (ms per forward)")
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = [torch.randn(1, rows, inp) for inp, _ in SHAPES]
        times = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, path in paths.items():
                began = time.perf_counter()
                for index, x in enumerate(inputs):
                    path(x, index)
                times[name].append(1e3 * (time.perf_counter() - began))
        print(f"{rows:>3} " + " ".join(f"{statistics.median(t):>12.2f}" for t in times.values()))


if __name__ == "__main__":
    main()
