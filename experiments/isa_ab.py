"""The kernel's AVX-512 loop against its AVX2 loop on the same CPU, side by side in one process: one
target forward of 1 new token (decode) and of n new tokens (verification) after a prefilled context,
the two loops interleaved pass by pass (the weights are packed alike for both), medians.

    OMP_NUM_THREADS=1 python experiments/isa_ab.py --target smollm2 --positions 1,2,4,5,8,16 --repeats 21

Prints ms per forward for each loop and n, verify(n) / decode(1) within each loop, and AVX2 / AVX-512.
Needs a CPU with AVX-512 F/BW/VL/DQ (the kernel's ``avx512()``).
"""

import argparse
import statistics
import sys
import time

import torch

from verispec import kernels
from verispec.loading import load_target_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--positions", default="1,2,4,5,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    if not kernels.avx512():
        sys.exit(f"no AVX-512 loop here: {kernels.status()}")
    torch.manual_seed(0)
    model, _ = load_target_and_tokenizer(args.target)
    positions = [int(p) for p in args.positions.split(",")]
    cache = model.new_cache(1, args.context + max(positions) + 1)
    model.forward(torch.randint(0, model.config.vocab_size, (1, args.context)), cache)
    cache.commit(0, args.context)
    tokens = {n: torch.randint(0, model.config.vocab_size, (1, n)) for n in positions}
    units = [(isa, n) for n in positions for isa in ("avx512", "avx2")]
    times: dict[tuple[str, int], list[float]] = {unit: [] for unit in units}
    for index in range(args.repeats + 1):  # the first pass warms up and is not counted
        shift = index % len(units)
        for isa, n in units[shift:] + units[:shift]:
            kernels.set_avx512(isa == "avx512")
            began = time.perf_counter()
            model.forward(tokens[n], cache)  # nothing is committed: every pass sees the same context
            if index:
                times[(isa, n)].append(1e3 * (time.perf_counter() - began))
    kernels.set_avx512(True)
    median = {unit: statistics.median(values) for unit, values in times.items()}
    print(f"{args.target}, context {args.context}, {args.repeats} interleaved repeats, "
          f"{torch.get_num_threads()} thread(s); kernel {kernels.status(model)}")
    print(f"{'n':>3} {'avx512 ms':>10} {'avx2 ms':>10} {'avx512 v/d':>11} {'avx2 v/d':>9} {'avx2/avx512':>12}")
    first = positions[0]
    for n in positions:
        fast, slow = median[("avx512", n)], median[("avx2", n)]
        print(f"{n:>3} {fast:>10.2f} {slow:>10.2f} {fast / median[('avx512', first)]:>11.2f} "
              f"{slow / median[('avx2', first)]:>9.2f} {slow / fast:>12.2f}")


if __name__ == "__main__":
    main()
