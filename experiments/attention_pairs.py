"""Attention pairs on and off, side by side in one process (``kernels.set_attention_pairs``): one target
pass of n new positions after a prefilled context, the two settings interleaved pass by pass, medians;
the logits of the two compared bit for bit (pairs compute each query exactly as the 8-lane code does).

    OMP_NUM_THREADS=1 python experiments/attention_pairs.py --target smollm2 --contexts 256,1024 --positions 1,3,8

Needs the AVX-512 loop (``kernels.avx512()``)."""

import argparse
import sys

import torch
from pass_timing import interleaved, prefilled

from verispec import kernels
from verispec.loading import load_target_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--positions", default="1,3,8")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not kernels.set_attention_pairs(True):
        sys.exit(f"attention pairs need the AVX-512 loop: {kernels.status()}")
    torch.manual_seed(0)
    model, _ = load_target_and_tokenizer(args.target)
    vocab = model.config.vocab_size
    positions = [int(p) for p in args.positions.split(",")]
    caches, tokens, units = {}, {}, []
    for context in (int(c) for c in args.contexts.split(",")):
        cache = prefilled(model, torch.randint(0, vocab, (1, context)), positions)
        for n in positions:
            caches[(context, n)], tokens[(context, n)] = cache, torch.randint(0, vocab, (1, n))
            units += [(context, n, False), (context, n, True)]

    def run(unit):
        kernels.set_attention_pairs(unit[2])
        return model.forward(tokens[unit[:2]], caches[unit[:2]])  # nothing committed: the same context

    median, logits = interleaved(units, run, args.repeats)
    kernels.set_attention_pairs(True)
    print(f"{args.target}, {args.repeats} interleaved repeats, {torch.get_num_threads()} thread(s); "
          f"kernel paths: {kernels.paths()}")
    print(f"{'context':>7} {'n':>3} {'single ms':>10} {'pairs ms':>9} {'pairs/single':>13} {'identical':>10}")
    for context, n, pairs in units:
        if pairs:
            one, two = median[(context, n, False)], median[(context, n, True)]
            same = torch.equal(logits[(context, n, False)], logits[(context, n, True)])
            print(f"{context:>7} {n:>3} {one:>10.2f} {two:>9.2f} {two / one:>13.3f} {'yes' if same else 'NO':>10}")


if __name__ == "__main__":
    main()
