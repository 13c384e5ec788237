"""The kernel's AVX-512 loop against its AVX2 loop on the same CPU, side by side in one process: one
target forward of 1 new token (decode) and of n new tokens (verification) after a prefilled context,
the two loops interleaved pass by pass (the weights are packed alike for both), medians.

    OMP_NUM_THREADS=1 python experiments/isa_ab.py --target smollm2 --positions 1,2,4,5,8,16 --repeats 21

Prints ms per forward for each loop and n, verify(n) / decode(1) within each loop, and AVX2 / AVX-512.
Needs a CPU with AVX-512 F/BW/VL/DQ (the kernel's ``avx512()``).
"""

import sys

import torch
from pass_timing import interleaved, parse_args, prefilled

from verispec import kernels
from verispec.loading import load_target_and_tokenizer


def main() -> None:
    args = parse_args(__doc__)
    if not kernels.avx512():
        sys.exit(f"no AVX-512 loop here: {kernels.status()}")
    torch.manual_seed(0)
    model, _ = load_target_and_tokenizer(args.target)
    positions = args.positions
    cache = prefilled(model, torch.randint(0, model.config.vocab_size, (1, args.context)), positions)
    tokens = {n: torch.randint(0, model.config.vocab_size, (1, n)) for n in positions}

    def run(unit):
        isa, n = unit
        kernels.set_avx512(isa == "avx512")
        return model.forward(tokens[n], cache)  # nothing is committed: every pass sees the same context

    median, _ = interleaved([(isa, n) for n in positions for isa in ("avx512", "avx2")], run, args.repeats)
    kernels.set_avx512(True)
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
