"""torch's linear (fp32; bf16 through oneDNN; optionally torch.compile) vs verispec.kernels (fp32 and bf16
weights; GGUF Q4_1 blocks, as SmolLM2's file stores them) on a target's matrix shapes.

    OMP_NUM_THREADS=1 python experiments/small_m_kernel.py [--rows 1,2,4,8,16,24,32] [--repeats 7]
    OMP_NUM_THREADS=1 python experiments/small_m_kernel.py --model smollm2 --rows 1,2,4,8,16 --compile

One "forward" = every projection of the target once (q|k|v, o, gate|up, down per layer, plus the LM head;
``--model tiny``: the embedded 8-layer target, ``smollm2``: SmolLM2-135M's 30 layers), distinct matrices,
so weights stream from memory as in decoding. Prints the median ms per forward for each row count M and
each path, interleaved per repeat. ``torch bf16`` casts the input to bf16 and calls F.linear on bf16
weights (oneDNN, which uses AVX512-BF16 or AMX where the CPU has them); ``--compile`` adds
``torch.compile`` of the fp32 linear (inductor; compiled once per row count before timing). On a CPU
with AVX-512 the kernel's bf16 and Q4_1 paths are also timed on its AVX2 loop ("... avx2").
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from verispec import kernels

MODELS = {  # hidden, q|k|v width, intermediate, layers, vocabulary
    "tiny": (384, 640, 1024, 8, 8192),
    "smollm2": (576, 960, 1536, 30, 49152),
}


def shapes(model: str) -> list[tuple[int, int]]:
    hidden, qkv, intermediate, layers, vocab = MODELS[model]
    return [(hidden, qkv), (hidden, hidden), (hidden, 2 * intermediate), (intermediate, hidden)] * layers + \
        [(hidden, vocab)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,16,24,32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the fp32 linear")
    args = parser.parse_args()
    torch.manual_seed(0)
    SHAPES = shapes(args.model)
    weights = [torch.randn(out, inp).to(torch.bfloat16).float() for inp, out in SHAPES]
    bf16 = [w.to(torch.bfloat16) for w in weights]
    generator = torch.Generator().manual_seed(0)
    q4_1 = [kernels._random_blocks("Q4_1", out, inp, generator).view(torch.int32) for inp, out in SHAPES]
    paths = {
        "torch": lambda x, i: F.linear(x, weights[i]),
        "torch bf16": lambda x, i: F.linear(x.to(torch.bfloat16), bf16[i]),
        "kernel fp32": lambda x, i: kernels.linear(x, weights[i]),
        "kernel bf16": lambda x, i: kernels.linear(x, bf16[i]),
        "kernel Q4_1": lambda x, i: kernels.linear(x, q4_1[i]),
    }
    if kernels.avx512():  # the AVX2 loop on the same CPU, side by side (``avx2`` names switch AVX-512 off)
        paths["bf16 avx2"] = paths["kernel bf16"]
        paths["Q4_1 avx2"] = paths["kernel Q4_1"]
    if args.compile:
        torch._dynamo.config.cache_size_limit = 256  # one graph per (shape, rows): no fallback to eager
        compiled = torch.compile(F.linear, dynamic=False)
        paths["compile"] = lambda x, i: compiled(x, weights[i])
    print(f"threads {torch.get_num_threads()}; kernel {kernels.status()}")
    print(f"{'M':>3} " + " ".join(f"{name:>12}" for name in paths) + "   (ms per forward)")
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = [torch.randn(1, rows, inp) for inp, _ in SHAPES]
        for name, path in paths.items():  # warm-up (and compilation) outside the timing
            kernels.set_avx512(not name.endswith("avx2"))
            for index, x in enumerate(inputs):
                path(x, index)
        times = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, path in paths.items():
                kernels.set_avx512(not name.endswith("avx2"))
                began = time.perf_counter()
                for index, x in enumerate(inputs):
                    path(x, index)
                times[name].append(1e3 * (time.perf_counter() - began))
            kernels.set_avx512(True)
        print(f"{rows:>3} " + " ".join(f"{statistics.median(t):>12.2f}" for t in times.values()))


if __name__ == "__main__":
    main()
