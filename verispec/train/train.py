"""Command line for the default-pair recipes: ``verispec train tokenizer | target | draft | eagle``.

    $ python -m verispec.train.train tokenizer                       # -> runs/tokenizer/model
    $ python -m verispec.train.train target --minutes 75             # -> verispec/data/target, runs/target
    $ python -m verispec.train.train draft --minutes 30              # -> verispec/data/draft, runs/draft
    $ python -m verispec.train.train draft --target smollm2 --minutes 80   # -> verispec/data/smollm2-draft
    $ python -m verispec.train.train compressed --minutes 10         # -> runs/compressed/model (not shipped)
    $ python -m verispec.train.train eagle --target smollm2 --extract-minutes 30 --minutes 45
                                                                     # -> verispec/data/smollm2-eagle

Order matters: the target needs the tokenizer, the draft needs a trained target. Each run writes a
train.log and metrics.json into its run dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import replace
from collections.abc import Sequence
from pathlib import Path

import torch

from verispec.train.recipes import (COMPRESSED_DIR, DRAFT_DIR, NEW_TOKENIZER_DIR, SMOLLM2_DRAFT_DIR, TARGET_DIR,
                                    TOKENIZER_DIR,
                                    CompressedRecipe, DraftRecipe, LayerSkipConfig, TargetRecipe)

logger = logging.getLogger(__name__)
DEFAULT_THREADS = 2


def _parser() -> argparse.ArgumentParser:
    from verispec.options import OneLineArgumentParser

    parser = OneLineArgumentParser(prog="verispec train", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    tokenizer = commands.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    tokenizer.add_argument("--out", default=NEW_TOKENIZER_DIR)
    tokenizer.add_argument("--stats", default="runs/tokenizer/corpus_stats.json",
                           help="where to write document / token counts per workload and split")

    target = commands.add_parser("target", help="train the target model (LayerSkip recipe)")
    target.add_argument("--minutes", type=float, required=True, help="wall-clock training budget")
    target.add_argument("--tokenizer", default=TOKENIZER_DIR,
                        help="tokenizer dir (default: the shipped one, in the target checkpoint dir)")
    target.add_argument("--out", default=TARGET_DIR)
    target.add_argument("--run-dir", default="runs/target")
    target.add_argument("--init", default=None, metavar="DIR",
                        help="continue from this target checkpoint (same architecture) instead of from scratch")
    target.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    target.add_argument("--seed", type=int, default=None,
                        help="data order and layer-dropout seed (default: the recipe's; change it when "
                             "continuing from --init so the target sees text it has not seen)")
    target.add_argument("--no-layerskip", action="store_true",
                        help="plain next-token training (no layer dropout, no early-exit loss): the baseline "
                             "that shows what the LayerSkip recipe does for early exits")

    draft = commands.add_parser("draft", help="distil a draft model from a target")
    draft.add_argument("--minutes", type=float, required=True, help="wall-clock training budget")
    draft.add_argument("--target", default=TARGET_DIR,
                       help="target: the tiny target's checkpoint dir (default), smollm2 or a .gguf file "
                            "(then the draft is the target's first layers sharing its embedding, see "
                            "verispec/train/gguf_draft.py)")
    draft.add_argument("--out", default=None,
                       help=f"where the draft goes (default: {DRAFT_DIR}, or {SMOLLM2_DRAFT_DIR} for smollm2)")
    draft.add_argument("--run-dir", default=None, help="logs and checkpoints (default: runs/draft or "
                                                       "runs/smollm2-draft)")
    draft.add_argument("--init", default=None, metavar="DIR",
                       help="warm start from this draft checkpoint (same hidden size; extra layers start as "
                            "identity; a wider MLP keeps its busiest neurons)")
    draft.add_argument("--layers", type=int, default=None, help="draft layers (default: the recipe's)")
    draft.add_argument("--intermediate", type=int, default=None,
                       help="draft MLP width (default: the recipe's)")
    draft.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    draft.add_argument("--sample-fraction", type=float, default=None,
                       help="share of micro-batches the target generated itself (default: the recipe's)")
    draft.add_argument("--greedy-fraction", type=float, default=None,
                       help="share of those generated greedily rather than at temperature 1 (default: the recipe's)")
    draft.add_argument("--ce-weight", type=float, default=None,
                       help="weight of next-token cross-entropy on the text against KL to the target "
                            "(0 = pure distillation; default: the recipe's)")
    draft.add_argument("--argmax-weight", type=float, default=None,
                       help="extra cross-entropy on the target's argmax token, for greedy acceptance "
                            "(default: the recipe's)")
    draft.add_argument("--seed", type=int, default=None,
                       help="data order and sampling seed (default: the recipe's; change it when "
                            "continuing from --init so the draft sees text it has not seen)")

    eagle = commands.add_parser("eagle", help="train an EAGLE-style feature head for a target (--method eagle)",
                                description="Cache the target's features over the training text (chats in its "
                                            "chat template, standard-library code, arithmetic), then train "
                                            "a one-layer head on them (verispec/train/eagle.py).")
    eagle.add_argument("--target", default="smollm2", help="smollm2 (default), tiny, a .gguf file or a native "
                                                           "checkpoint dir")
    eagle.add_argument("--minutes", type=float, required=True, help="wall-clock budget for training the head")
    eagle.add_argument("--extract-minutes", type=float, default=20.0,
                       help="wall-clock budget for adding target features to the cache first (0: train on "
                            "what the cache holds; default 20)")
    eagle.add_argument("--out", default=None, help="where the head goes (default: the shipped head's "
                                                   "directory for smollm2 and tiny)")
    eagle.add_argument("--run-dir", default=None, help="feature cache, logs and checkpoints "
                                                       "(default runs/<target>-eagle)")
    eagle.add_argument("--init", default=None, metavar="DIR", help="continue training this head")
    eagle.add_argument("--draft-vocab", type=int, default=None,
                       help="ids the head scores (default 8192, 2048 for tiny)")
    eagle.add_argument("--unroll", type=int, default=None,
                       help="draft steps trained per position (training-time test; default 2)")
    eagle.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    eagle.add_argument("--seed", type=int, default=None, help="order of the cached windows in training (default: "
                                                             "the recipe's)")

    compressed = commands.add_parser("compressed", help="train a compressed-attention target (not shipped)")
    compressed.add_argument("--minutes", type=float, required=True, help="wall-clock training budget")
    compressed.add_argument("--tokenizer", default=TOKENIZER_DIR)
    compressed.add_argument("--draft", default=DRAFT_DIR, help="draft to evaluate against it (same tokenizer)")
    compressed.add_argument("--out", default=COMPRESSED_DIR)
    compressed.add_argument("--run-dir", default="runs/compressed")

    for command in (tokenizer, target, draft, compressed, eagle):
        command.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch CPU threads")
    for command in (target, draft, eagle):
        command.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                             help="bf16: forward/backward (and the eagle head's feature extraction) under "
                                  "bfloat16 autocast, float32 weights and optimizer state; auto (default): bf16 "
                                  "where the CPU has bf16 matrix units (AMX-BF16 or AVX512-BF16), else fp32")
    for command in (target, draft):
        command.add_argument("--mix", default=None, metavar="code=W,chat=W,math=W",
                             help="share of training windows per workload (normalised; default: the recipe's)")
    return parser


def _log_to(run_dir: str | Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(run_dir) / "train.log"))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _train_tokenizer(args: argparse.Namespace) -> None:
    from verispec.train.tokenizer import corpus_statistics, save_tokenizer, train_tokenizer

    tokenizer = train_tokenizer()
    save_tokenizer(tokenizer, args.out)
    stats = corpus_statistics(tokenizer)
    Path(args.stats).parent.mkdir(parents=True, exist_ok=True)
    Path(args.stats).write_text(json.dumps(stats, indent=2) + "\n")
    logger.info("corpus statistics: %s", json.dumps(stats))


def cpu_has_bf16_matrix_units(cpuinfo: str | None = None) -> bool:
    """True where /proc/cpuinfo lists amx_bf16 or avx512_bf16 (bf16 autocast is then fast on the CPU)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def _optim_changes(args: argparse.Namespace, optim):
    """The recipe's OptimConfig with --lr, --seed and --precision applied."""
    changes = {}
    if args.lr is not None:
        changes["lr"] = args.lr
    if args.seed is not None:
        changes["seed"] = args.seed
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if cpu_has_bf16_matrix_units() else "fp32"
    changes["precision"] = precision
    return replace(optim, **changes)


def _target_recipe(args: argparse.Namespace) -> TargetRecipe:
    recipe = TargetRecipe()
    changes = {"optim": _optim_changes(args, recipe.optim)}
    if args.mix is not None:
        changes["mix"] = _parse_mix(args.mix, recipe.mix, "target")
    if args.no_layerskip:
        changes["layerskip"] = LayerSkipConfig(max_dropout=0.0, exits_per_micro_batch=0)
    return replace(recipe, **changes)


def _eagle_recipe(args: argparse.Namespace):
    from verispec.train.eagle import EagleRecipe

    recipe = EagleRecipe(draft_vocab=2048 if args.target == "tiny" else 8192)
    changes = {"optim": _optim_changes(args, recipe.optim)}
    if args.draft_vocab is not None:
        changes["draft_vocab"] = args.draft_vocab
    if args.unroll is not None:
        changes["unroll"] = args.unroll
    return replace(recipe, **changes)


def _draft_recipe(args: argparse.Namespace) -> DraftRecipe:
    recipe = DraftRecipe()
    changes = {"optim": _optim_changes(args, recipe.optim)}
    model = {}
    if args.layers is not None:
        model["num_hidden_layers"] = args.layers
    if args.intermediate is not None:
        if args.intermediate < 1:
            raise SystemExit("verispec train draft: --intermediate must be a positive width")
        model["intermediate_size"] = args.intermediate
    if model:
        changes["model"] = replace(recipe.model, **model)
    if args.argmax_weight is not None:
        if args.argmax_weight < 0:
            raise SystemExit("verispec train draft: --argmax-weight must not be negative")
        changes["argmax_weight"] = args.argmax_weight
    if args.mix is not None:
        changes["mix"] = _parse_mix(args.mix, recipe.mix, "draft")
    if args.ce_weight is not None:
        if not 0.0 <= args.ce_weight <= 1.0:
            raise SystemExit("verispec train draft: --ce-weight must lie in [0, 1]")
        changes["ce_weight"] = args.ce_weight
    if args.sample_fraction is not None:
        changes["target_sample_fraction"] = args.sample_fraction
    if args.greedy_fraction is not None:
        changes["greedy_sample_fraction"] = args.greedy_fraction
    return replace(recipe, **changes)


def _parse_mix(text: str, default: dict, command: str) -> dict:
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        try:
            value = float(weight)
        except ValueError:
            raise SystemExit(f"verispec train {command}: --mix wants name=weight pairs, got {part!r}") from None
        if name not in default or value < 0:
            raise SystemExit(f"verispec train {command}: --mix: unknown workload or negative weight in {part!r} "
                             f"(workloads: {', '.join(default)})")
        mix[name] = value
    total = sum(mix.values())
    if total <= 0:
        raise SystemExit(f"verispec train {command}: --mix weights must not all be 0")
    return {name: weight / total for name, weight in mix.items()}


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (checked before anything loads or trains), or None."""
    minutes = getattr(args, "minutes", 1.0)
    if not (0 < minutes < math.inf or (args.command == "eagle" and minutes == 0)) or args.threads < 1:
        return "--minutes must be > 0 and finite, and --threads >= 1"
    if not 0 <= getattr(args, "extract_minutes", 0.0) < math.inf:
        return "--extract-minutes must be >= 0 and finite"
    lr = getattr(args, "lr", None)
    if lr is not None and not 0 < lr < math.inf:
        return f"--lr must be > 0 and finite, got {lr}"
    for name in ("layers", "intermediate", "draft_vocab", "unroll"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    for name in ("sample_fraction", "greedy_fraction", "ce_weight"):
        value = getattr(args, name, None)
        if value is not None and not 0 <= value <= 1:
            return f"--{name.replace('_', '-')} must lie in [0, 1], got {value}"
    weight = getattr(args, "argmax_weight", None)
    if weight is not None and not 0 <= weight < math.inf:
        return f"--argmax-weight must be >= 0 and finite, got {weight}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        print(f"verispec train {args.command}: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    init = getattr(args, "init", None)
    if init is not None and not (Path(init) / "config.json").is_file():
        raise SystemExit(f"verispec train {args.command}: --init {init}: no checkpoint there (no config.json)")
    try:
        return _run(args)
    except ValueError as err:  # a checkpoint that does not fit the recipe, a bad recipe value
        logger.error("%s", err)
        return 2


def _is_gguf_target(target: str) -> bool:
    return target == "smollm2" or str(target).lower().endswith(".gguf")


def _train_recipe(args: argparse.Namespace, required: Path, missing: str, make_recipe, train, *train_args) -> int:
    """Log into ``args.run_dir``; 2 (after logging ``missing``) when the input file ``required`` is absent,
    else ``train(make_recipe(args), *train_args)`` and 0."""
    _log_to(args.run_dir)
    if not required.exists():
        logger.error("%s", missing)
        return 2
    recipe = make_recipe(args)
    logger.info("precision %s", recipe.optim.precision)
    train(recipe, *train_args)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "tokenizer":
        _log_to(Path(args.stats).parent)
        _train_tokenizer(args)
    elif args.command == "target":
        from verispec.train.target import train_target

        return _train_recipe(args, Path(args.tokenizer) / "tokenizer.json",
                             f"no tokenizer in {args.tokenizer}; run `verispec train tokenizer` first",
                             _target_recipe, train_target, args.minutes, args.out, args.run_dir, args.tokenizer,
                             args.init)
    elif args.command == "draft" and _is_gguf_target(args.target):
        from verispec.train.gguf_draft import GgufDraftRecipe, train_gguf_draft

        run_dir = args.run_dir or "runs/smollm2-draft"
        _log_to(run_dir)
        recipe = GgufDraftRecipe()
        changes = {"optim": _optim_changes(args, recipe.optim)}
        if args.layers is not None:
            changes["layers"] = tuple(range(args.layers))
        if args.argmax_weight is not None:
            changes["argmax_weight"] = args.argmax_weight
        if args.mix is not None:
            changes["mix"] = _parse_mix(args.mix, recipe.mix, "draft")
        train_gguf_draft(replace(recipe, **changes), args.minutes, args.target, args.out or SMOLLM2_DRAFT_DIR,
                         run_dir, args.init)
    elif args.command == "draft":
        from verispec.train.draft import train_draft

        args.out, args.run_dir = args.out or DRAFT_DIR, args.run_dir or "runs/draft"
        return _train_recipe(args, Path(args.target) / "config.json",
                             f"no target checkpoint in {args.target}; run `verispec train target` first",
                             _draft_recipe, train_draft, args.minutes, args.target, args.out, args.run_dir, args.init)
    elif args.command == "eagle":
        from verispec.loading import DATA_DIR
        from verispec.train.eagle import train_eagle

        name = Path(args.target).name if not _is_gguf_target(args.target) else Path(args.target).stem
        run_dir = args.run_dir or f"runs/{name}-eagle"
        _log_to(run_dir)
        if args.extract_minutes < 0:
            logger.error("--extract-minutes must be >= 0")
            return 2
        default_out = DATA_DIR / f"{args.target}-eagle" if args.target in ("smollm2", "tiny") else Path(run_dir) / "head"
        train_eagle(_eagle_recipe(args), args.minutes, args.extract_minutes, args.target,
                    args.out or default_out, run_dir, args.init)
    elif args.command == "compressed":
        from verispec.train.compressed import train_compressed

        _log_to(args.run_dir)
        draft = args.draft if (Path(args.draft) / "config.json").exists() else None
        train_compressed(CompressedRecipe(), args.minutes, args.out, args.run_dir, args.tokenizer, draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
