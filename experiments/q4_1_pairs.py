"""Q4_1 rows as stored against the same rows repacked in pairs ("Q4_1 pairs", ``kernels.pair_blocks``): one
linear product of M rows by SmolLM2's matrix shapes, the two layouts interleaved per repeat (medians), and
whether the two give the same bits (they must: the same values multiplied in the same order).

    OMP_NUM_THREADS=1 python experiments/q4_1_pairs.py [--clock-ghz 3.5]

Prints microseconds per product and cycles per block of 32 weights of one weight row at ``--clock-ghz``
(an assumed clock: the figure compares layouts, it is not a cycle count). The loop in use is the one
``kernels.status()`` names; the pairs help the AVX-512 loop (the AVX2 loop reads them too, at its own speed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import kernels
from verispec.kernels.formats import _random_blocks

SHAPES = ((1536, 576), (576, 1536), (576, 576), (8192, 576))  # gate|up, down, q|o, a large one (N, K)


def _time(x: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
    lib = kernels.library()
    start = time.perf_counter()
    for _ in range(calls):
        kernels._product(lib, x, weight, None, x.shape[1])
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,5,8,9,16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--clock-ghz", type=float, default=3.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"kernel {kernels.status()}")
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in SHAPES:
        raw = _random_blocks("Q4_1", out_features, in_features, generator)
        layouts = {"Q4_1": raw.view(torch.int32), "Q4_1 pairs": kernels.pair_blocks(raw)}
        blocks = out_features * in_features / 32
        for rows in (int(v) for v in args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=generator)
            outputs = [kernels._product(kernels.library(), x, w, None, in_features) for w in layouts.values()]
            calls = max(5, int(2e6 / (out_features * in_features * rows) * 20))
            times: dict[str, list[float]] = {name: [] for name in layouts}
            for _ in range(args.repeats):
                for name, weight in layouts.items():
                    _time(x, weight, 3)
                    times[name].append(_time(x, weight, calls))
            medians = {name: statistics.median(values) for name, values in times.items()}
            cells = "  ".join(f"{name} {m * 1e6:7.1f} us ({m * args.clock_ghz * 1e9 / blocks:4.1f} c/block)"
                              for name, m in medians.items())
            print(f"{out_features:5d} x {in_features:4d}, {rows:2d} rows: {cells}  ratio "
                  f"{medians['Q4_1'] / medians['Q4_1 pairs']:.2f}x  same bits: {torch.equal(*outputs)}", flush=True)


if __name__ == "__main__":
    main()
