"""Thin command-line dispatcher: verispec {demo, generate, plan, profile, train, ...}.

Every error a user can cause prints one line ``verispec: error: ...`` and exits with status 2. Each
subcommand's flags and handler live in its own module (``cli_generate``, ``cli_plan``, ``cli_profile``,
``audit``, ``server.cli``, ``bench.cli``), which registers itself with ``add_parser``; ``demo`` and
``train`` are registered here.
"""

from __future__ import annotations

import argparse
import logging
import sys

from verispec.errors import VerispecError
from verispec.options import DEFAULTS, OneLineArgumentParser, apply_threads

EPILOG = "Run 'verispec COMMAND --help' for a command's options. Docs: README.md."


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its own parser, --help included (argparse's REMAINDER drops a leading option)
        try:
            return _run_train(argparse.Namespace(rest=argv[1:]))
        except VerispecError as err:
            print(f"verispec: error: {err}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        check_text_arguments(args)
        apply_threads(args)
        return args.run(args) or 0
    except VerispecError as err:
        print(f"verispec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `verispec generate --json ... | head`
        sys.stderr.close()
        return 0


TEXT_ARGUMENTS = ("prompt", "stop", "regex", "api_key", "served_model_name", "name")  # text, not paths


def check_text_arguments(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, text arguments that are not valid UTF-8 (undecodable bytes on the
    command line arrive as lone surrogates, which no tokenizer or JSON encoder takes)."""
    for name in TEXT_ARGUMENTS:
        value = getattr(args, name, None)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    option = "the prompt" if name == "prompt" else f"--{name.replace('_', '-')}"
                    raise VerispecError(f"{option} is not valid UTF-8 text") from None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="verispec", epilog=EPILOG,
        description="Lossless speculative decoding: a drafter proposes, the target verifies in one pass, "
                    "and a rejection sampler keeps the target's output distribution exactly.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    demo = commands.add_parser("demo", help="run held-out prompts with speculation off and on (the main job)",
                               description="Load SmolLM2-135M-Instruct and its draft (or --target tiny), decode a "
                                           "few held-out prompts per workload with speculation off and on, and "
                                           "print speed, acceptance and whether greedy output is identical.")
    demo.add_argument("--target", choices=("smollm2", "tiny"), default=None,
                      help="smollm2 (default: the real model, its shipped draft) or tiny (the embedded pair)")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    demo.add_argument("--prompts", type=int, default=2, help="prompts per workload (default 2)")
    demo.add_argument("--methods", default="chain,tree,eagle,eagle-lookup,ngram",
                      help="comma-separated, each compared with plain decoding: chain, tree (the draft model), "
                           "eagle, eagle-tree, eagle-lookup (the EAGLE head: chain, dynamic:8 tree, chain behind "
                           "--lookup 3), ngram, self (default chain,tree,eagle,eagle-lookup,ngram)")
    demo.add_argument("--gamma", type=int, default=DEFAULTS.gamma,
                      help=f"drafts per round of chain, ngram and self (default {DEFAULTS.gamma})")
    demo.add_argument("--tree", default=DEFAULTS.tree, help=f"tree shape for the tree method (default {DEFAULTS.tree})")
    demo.add_argument("--exit-layer", type=int, default=3, help="self: layers that draft (default 3)")
    demo.add_argument("--threads", type=int, default=1,
                      help="torch CPU threads (default 1: on a small CPU, two threads competing with any other "
                           "job make both decoding modes several times slower; 0 = torch's default)")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    demo.set_defaults(run=_run_demo)

    from verispec import audit, cli_generate, cli_plan, cli_profile
    from verispec.bench import cli as bench_cli
    from verispec.server import cli as serve_cli

    for command in (cli_generate, cli_plan, audit, serve_cli, bench_cli, cli_profile):
        command.add_parser(commands)

    train = commands.add_parser("train", help="train the embedded pair (tokenizer | target | draft)",
                                add_help=False)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(run=_run_train)
    return parser


def _run_demo(args) -> int:
    from verispec.demo import run_demo

    return run_demo(args)


def _run_train(args) -> int:
    try:
        from verispec.train.train import main as train_main
    except ImportError as err:
        raise VerispecError(f"training needs the 'train' extra ({err}); pip install 'verispec[train]'") from None
    try:
        return train_main(args.rest) or 0
    except SystemExit as err:  # the trainer's bad-value exits carry their message: make them one-line errors
        if isinstance(err.code, str):
            raise VerispecError(err.code) from None
        raise


if __name__ == "__main__":
    sys.exit(main())
