"""GGUF blocks on AMX tiles against the AVX-512 loop, side by side in one process: the target is loaded
twice (the layout is chosen when weights are packed: VERISPEC_AMX_BLOCKS=1, then 0), and one forward of
n new tokens after a prefilled context runs on each copy in turn, pass by pass, medians.

    OMP_NUM_THREADS=1 python experiments/amx_blocks_ab.py --target smollm2 --positions 1,2,4,5,8,16 --repeats 21

Prints ms per forward for each layout and n, verify(n) / decode(1) within each layout, tiles / loop, and
the largest difference between the two layouts' logits relative to the logits' range (they round in
different places, so they differ in the last bits). Needs a CPU whose kernel tiles GGUF blocks
(``kernels.amx_blocks()``).
"""

import os
import sys

import torch
from pass_timing import interleaved, parse_args, prefilled

from verispec import kernels
from verispec.loading import load_target_and_tokenizer


def load(target: str, tiles: bool):
    os.environ["VERISPEC_AMX_BLOCKS"] = "1" if tiles else "0"
    model, _ = load_target_and_tokenizer(target)
    layouts = {m.packed.dtype for m in model.modules() if isinstance(m, kernels.SmallRowsLinear)}
    on_tiles = bool(layouts & set(kernels.AMX_BLOCKS.values()))
    if on_tiles != tiles:
        sys.exit(f"expected {'tiles' if tiles else 'the loop'}, got {layouts}: {kernels.status(model)}")
    return model


def main() -> None:
    args = parse_args(__doc__)
    kernels.library()
    if not kernels.amx_blocks():
        sys.exit(f"GGUF blocks are not tiled here: {kernels.status()}")
    torch.manual_seed(0)
    models = {"tiles": load(args.target, True), "loop": load(args.target, False)}
    os.environ.pop("VERISPEC_AMX_BLOCKS")
    positions = args.positions
    vocab = models["tiles"].config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context))
    caches = {name: prefilled(model, prompt, positions) for name, model in models.items()}
    tokens = {n: torch.randint(0, vocab, (1, n)) for n in positions}

    def run(unit):
        name, n = unit
        return models[name].forward(tokens[n], caches[name])  # nothing committed: every pass sees the same context

    median, logits = interleaved([(name, n) for n in positions for name in models], run, args.repeats)
    print(f"{args.target}, context {args.context}, {args.repeats} interleaved repeats, {torch.get_num_threads()} "
          f"thread(s); kernel paths: {kernels.paths()}")
    print(f"{'n':>3} {'tiles ms':>9} {'loop ms':>9} {'tiles v/d':>10} {'loop v/d':>9} {'tiles/loop':>11} {'logits diff':>12}")
    first = positions[0]
    for n in positions:
        tiles, loop = median[("tiles", n)], median[("loop", n)]
        a, b = logits[("tiles", n)], logits[("loop", n)]
        diff = float((a - b).abs().max() / (b.max() - b.min()))
        print(f"{n:>3} {tiles:>9.2f} {loop:>9.2f} {tiles / median[('tiles', first)]:>10.2f} "
              f"{loop / median[('loop', first)]:>9.2f} {tiles / loop:>11.2f} {diff:>12.1e}")


if __name__ == "__main__":
    main()
