"""Where a verification pass of many rows should leave the kernel for torch's GEMM: whole target passes of
B rows x W positions (a batch-B verify at gamma W-1) after a shared-length context, timed with
``kernels.max_rows()`` forced to each limit in turn (interleaved per repeat; medians).

    OMP_NUM_THREADS=1 python experiments/kernel_rows.py --target tiny --batch 4,8 --widths 1,5,8
    OMP_NUM_THREADS=1 python experiments/kernel_rows.py --target smollm2 --batch 4,8 --widths 1,5,8

A limit below B x W sends the pass's linear layers (and the LM head) beyond it to torch's fp32 GEMM; decoder
layers run fused up to ``kernels.max_fused()`` rows either way. Prints ms per pass and whether the logits
are bit-equal across limits (they are not where the path changes: another summation order).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import kernels
from verispec.loading import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--batch", default="4,8")
    parser.add_argument("--widths", default="1,5,8")
    parser.add_argument("--limits", default="16,32,64")
    parser.add_argument("--context", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_pair(args.target, need_draft=False).target
    limits = [int(v) for v in args.limits.split(",")]
    print(f"kernel {kernels.status()}")
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    for batch in (int(v) for v in args.batch.split(",")):
        cache = target.new_cache(batch, args.context + 64)
        target.forward(torch.randint(0, vocab, (batch, args.context), generator=generator), cache)
        for row in range(batch):
            cache.commit(row, args.context)
        for width in (int(v) for v in args.widths.split(",")):
            fed = torch.randint(0, vocab, (batch, width), generator=generator)
            times: dict[int, list[float]] = {limit: [] for limit in limits}
            logits = {}
            for _ in range(args.repeats):
                for limit in limits:
                    kernels.max_rows = lambda limit=limit: limit  # noqa: E731 (the module's own function)
                    began = time.perf_counter()
                    logits[limit] = target.forward(fed, cache)  # writes past the committed length only
                    times[limit].append(1e3 * (time.perf_counter() - began))
            equal = all(torch.equal(logits[limits[0]], logits[limit]) for limit in limits)
            cells = "  ".join(f"<= {limit}: {statistics.median(times[limit]):7.2f} ms" for limit in limits)
            print(f"B={batch} W={width} ({batch * width:>3} rows)  {cells}  {'bit-equal' if equal else 'differ'}")


if __name__ == "__main__":
    main()
