"""Thin command-line dispatcher: verispec {demo, generate, plan, profile, train, ...}.

Every error a user can cause prints one line ``verispec: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

from verispec.errors import VerispecError
from verispec.options import (DEFAULTS, OneLineArgumentParser, add_spec_options, add_draft_options,
                              spec_from_args, eagle_args, add_threads_option, apply_threads, add_model_options,
                              add_sampling_options, add_grammar_options, grammar_from_args, read_text_file,
                              guided, sampling_from_args)

EPILOG = "Run 'verispec COMMAND --help' for a command's options. Docs: README.md."


MAX_SWEEP = 64  # gammas a plan may sweep or price: the engine's own bound on gamma (SpecConfig)


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
    demo.add_argument("--methods", default="chain,tree,eagle,ngram",
                      help="comma-separated, each compared with plain decoding: chain, tree (the draft model), "
                           "eagle, eagle-tree (the EAGLE head: chain, dynamic:8 tree), ngram, self "
                           "(default chain,tree,eagle,ngram)")
    demo.add_argument("--gamma", type=int, default=DEFAULTS.gamma,
                      help=f"drafts per round of chain, ngram and self (default {DEFAULTS.gamma})")
    demo.add_argument("--tree", default=DEFAULTS.tree, help=f"tree shape for the tree method (default {DEFAULTS.tree})")
    demo.add_argument("--exit-layer", type=int, default=3, help="self: layers that draft (default 3)")
    demo.add_argument("--threads", type=int, default=1,
                      help="torch CPU threads (default 1: on a small CPU, two threads competing with any other "
                           "job make both decoding modes several times slower; 0 = torch's default)")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    demo.set_defaults(run=_run_demo)

    gen = commands.add_parser("generate", help="decode one prompt, with or without speculation",
                              description="Decode PROMPT with the target, verifying a draft model's proposals. "
                                          "With no --target, SmolLM2-135M-Instruct and its shipped draft.")
    gen.add_argument("prompt", metavar="PROMPT", help="prompt text (use --chat to apply the chat template)")
    add_model_options(gen)
    add_threads_option(gen)
    add_sampling_options(gen)
    add_spec_options(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="maximum new tokens (default 64)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable); the text is cut before it")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message with the chat template")
    add_grammar_options(gen)
    gen.add_argument("--prediction", metavar="FILE",
                     help="predicted output: text the answer is expected to repeat (e.g. the file being edited); "
                          "its tokens are the drafts instead of --method's (verified: the output is unchanged)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, stats")
    gen.add_argument("--verbose", action="store_true", help="log progress")
    gen.set_defaults(run=_run_generate)

    plan = commands.add_parser(
        "plan", help="predict tokens per round, cycle cost and speedup (the cost model of docs/algorithms.md)",
        description="E[N] = 1 + a_1 + a_1 a_2 + ... ; cycle = gamma * draft_ms + verify_ms + state_ms; "
                    "ms/token = cycle / E[N]; speedup = baseline_ms / ms/token. Example: "
                    "verispec plan --alpha 0.8 --gamma 4 --draft-ms 1 --verify-ms 12 --state-ms 2 --baseline-ms 10")
    rates = plan.add_mutually_exclusive_group()
    rates.add_argument("--alpha", type=float, help="iid per-position acceptance probability")
    rates.add_argument("--acceptance", help="comma-separated conditional acceptance per draft position "
                                            "(measured; the last value repeats)")
    plan.add_argument("--gamma", type=int, default=DEFAULTS.gamma, help=f"drafts per round (default {DEFAULTS.gamma})")
    plan.add_argument("--profile", metavar="FILE",
                      help="use measured costs (and calibrated acceptance) from 'verispec profile'")
    plan.add_argument("--draft-ms", type=float, help="draft cost per proposed token")
    plan.add_argument("--verify-ms", type=float, help="target verification cost of one round (gamma + 1 positions)")
    plan.add_argument("--verify-slope-ms", type=float, default=None,
                      help="with --sweep or --emit: extra verify ms per extra verified position "
                           "(default 0: flat)")
    plan.add_argument("--state-ms", type=float, default=0.0, help="state handling per round (default 0)")
    plan.add_argument("--baseline-ms", type=float, help="plain decoding cost per token")
    plan.add_argument("--sweep", type=int, nargs="?", const=8, default=None, metavar="MAX_GAMMA",
                      help="tabulate gamma = 1..MAX_GAMMA (default 8) and mark the best")
    plan.add_argument("--emit", metavar="ENGINE",
                      help="print the best gamma per batch size (1..64) as ENGINE's config: vllm (a "
                           "--speculative-config JSON), trtllm (LLM API YAML) or sglang (server flags for "
                           "--batch-size); gammas up to --sweep (default 8). Key names: docs/benchmarking.md")
    plan.add_argument("--batch-size", type=int, default=1, help="--emit sglang: the batch size to plan for (1)")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(run=_run_plan)

    from verispec.audit import add_parser as add_audit_parser

    add_audit_parser(commands)

    from verispec.server.cli import add_parser as add_serve_parser

    add_serve_parser(commands)

    from verispec.bench.cli import add_parser as add_bench_parser

    add_bench_parser(commands)

    prof = commands.add_parser(
        "profile", help="measure draft, verify (vs positions and tree shape), state and decode costs",
        description="Measure on this machine what the planner needs and write a profile JSON; with "
                    "--calibrate, also per-position acceptance on held-out prompts. Then: "
                    "verispec plan --profile FILE")
    add_model_options(prof)
    prof.add_argument("--out", default="profile.json", help="profile JSON path (default profile.json)")
    prof.add_argument("--plot", metavar="PNG", help="also plot verify(n)/decode(1) to this PNG")
    prof.add_argument("--context", type=int, default=128, help="committed tokens before the measured pass")
    prof.add_argument("--max-positions", type=int, default=32, help="verify curve up to n positions (32)")
    prof.add_argument("--repeats", type=int, default=15, help="repeats per measurement; medians (15)")
    prof.add_argument("--calibrate", type=int, default=0, metavar="N",
                      help="measure acceptance on N held-out prompts per workload (default 0: skip)")
    prof.add_argument("--calibrate-gamma", type=int, default=8,
                      help="most drafts per round while calibrating: rounds draft 1, 2, ..., N in turn, so that "
                           "every gamma's round is timed in the real loop (8)")
    add_draft_options(prof)
    prof.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    prof.add_argument("--json", action="store_true", help="print the profile JSON")
    prof.set_defaults(run=_run_profile)

    train = commands.add_parser("train", help="train the embedded pair (tokenizer | target | draft)",
                                add_help=False)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(run=_run_train)
    return parser


def _run_generate(args) -> int:
    from verispec.config import StopRules
    import dataclasses

    from verispec.engine import SpecEngine
    from verispec.loading import build_engine, check_model_args, encode_prompt, eos_ids, load_pair, resolve_draft_vocab

    sampling = sampling_from_args(args)
    spec = spec_from_args(args)
    grammar = grammar_from_args(args)
    prediction = read_text_file("--prediction", args.prediction) if args.prediction is not None else None
    if prediction is not None:  # the prediction drafts, whatever --method says
        from verispec.drafters.prediction import PREDICTION_DRAFTS

        spec = dataclasses.replace(spec, method="chain", drafter="ngram", gamma=PREDICTION_DRAFTS)
    needs_draft = spec.enabled and spec.drafter == "model"
    check_model_args(args.target, args.draft, needs_draft)
    pair = load_pair(args.target, args.draft, device=args.device, need_draft=needs_draft, backend=args.backend,
                     draft_weights=args.draft_weights, **eagle_args(args, spec))
    if needs_draft:
        spec = dataclasses.replace(spec, draft_vocab=resolve_draft_vocab(pair, args.draft_vocab))
    tokenizer = pair.tokenizer
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.chat)
    stop = StopRules(max_tokens=args.max_tokens, eos_ids=tuple(eos_ids(tokenizer, pair.target)),
                     ignore_eos=args.ignore_eos, stop_strings=tuple(args.stop))
    sampling = guided(sampling, grammar, pair, list(stop.eos_ids))
    engine = build_engine(pair, spec)
    if prediction is not None:
        from verispec.drafters.prediction import PredictionDrafter

        engine = SpecEngine(pair.target, PredictionDrafter(tokenizer.encode(prediction, add_special_tokens=False)),
                            decode=engine.decode)
    result = engine.generate(prompt_ids, sampling, spec, stop, seed=args.seed)
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    if result.stop_text_index is not None:
        text = text[:result.stop_text_index]
    summary = result.stats.summary()
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": text, "stats": summary}))
        return 0
    print(text)
    print()
    print(format_stats(summary, spec.enabled))
    return 0


def format_stats(summary: dict, speculative: bool) -> str:
    split = summary["time_split"]
    rows = [
        ("generated tokens", f"{summary['generated_tokens']} ({summary['finish_reason']})"),
        ("tokens/s", f"{summary['tokens_per_s']:.1f}"),
        ("TTFT ms", f"{summary['ttft_ms']:.1f}"),
        ("rounds", str(summary["rounds"])),
    ]
    if speculative:
        conditional = summary["per_position_acceptance"]["conditional"]
        rows += [
            ("committed tokens/round", f"{summary['committed_per_round']:.2f}"),
            ("draft acceptance rate", f"{summary['acceptance_rate']:.3f} ({summary['accepted']}/{summary['drafted']})"),
            ("acceptance by position", " ".join(f"{a:.2f}" for a in conditional) + " (conditional)"),
            ("verified draft nodes/round", f"{summary['tree_nodes']:.2f}"),
        ]
    rows.append(("time split ms", " ".join(f"{k.removesuffix('_ms')}={v:.0f}" for k, v in split.items())))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _run_plan(args) -> int:
    from verispec import costmodel

    acceptance = None
    if args.acceptance is not None:
        try:
            acceptance = [float(x) for x in args.acceptance.split(",")]
        except ValueError:
            raise VerispecError(f"--acceptance must be comma-separated numbers, got {args.acceptance!r}") from None
    if args.emit is not None:
        _check_emit(args)
    if args.profile:
        return _plan_from_profile(args, acceptance)
    missing = [f"--{n.replace('_', '-')}" for n in ("draft_ms", "verify_ms", "baseline_ms") if getattr(args, n) is None]
    if missing or (args.alpha is None and acceptance is None):
        raise VerispecError(f"give --alpha or --acceptance and {', '.join(missing) or 'the costs'}, "
                            "or --profile FILE")
    for name in ("draft_ms", "verify_ms", "state_ms", "baseline_ms", "verify_slope_ms"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < math.inf:  # nan and inf would print a meaningless plan
            raise VerispecError(f"--{name.replace('_', '-')} must be >= 0 and finite, got {value}")
    if not 0 <= args.gamma <= MAX_SWEEP:
        raise VerispecError(f"--gamma must be in 0..{MAX_SWEEP}, got {args.gamma}")
    if args.baseline_ms <= 0 or args.draft_ms + args.verify_ms + args.state_ms <= 0:
        raise VerispecError("--baseline-ms must be > 0 and a round must cost something (draft, verify or state > 0)")
    if args.sweep is not None and not 1 <= args.sweep <= MAX_SWEEP:
        raise VerispecError(f"--sweep must be in 1..{MAX_SWEEP}, got {args.sweep}")
    verify = args.verify_ms
    if (args.sweep is not None or args.emit) and args.verify_slope_ms is not None:
        # --verify-ms is the cost at the given gamma; extrapolate linearly in verified positions.
        base = args.verify_ms - args.gamma * args.verify_slope_ms
        if base + args.verify_slope_ms <= 0:
            raise VerispecError(f"--verify-ms {args.verify_ms:g} at gamma {args.gamma} with --verify-slope-ms "
                                f"{args.verify_slope_ms:g} leaves one verified position costing "
                                f"{base + args.verify_slope_ms:g} ms; it must cost more than 0")
        verify = costmodel.linear_verify_cost(base, args.verify_slope_ms)
    elif args.emit and args.verify_ms <= 0:
        raise VerispecError("--emit scales --verify-ms with the batch size: it must be > 0")
    common = dict(draft_ms=args.draft_ms, verify_ms=verify, state_ms=args.state_ms,
                  baseline_ms=args.baseline_ms, alpha=args.alpha, acceptance=acceptance)
    if args.emit:
        from verispec import plan_emit

        verify_cost = verify if callable(verify) else (lambda positions: args.verify_ms)
        del common["verify_ms"]
        return _print_emit(args, lambda sizes: plan_emit.schedule_from_costs(verify_cost, args.sweep or 8,
                                                                             batch_sizes=sizes, **common))
    try:
        if args.sweep is None:
            result = costmodel.plan(args.gamma, **common)
            if args.json:
                print(json.dumps(result.as_dict()))
            else:
                print(f"expected tokens per round  {result.expected_tokens:.4f}\n"
                      f"cycle ms                   {result.cycle_ms:.4g}\n"
                      f"ms per token               {result.ms_per_token:.3f}\n"
                      f"speedup                    {result.speedup:.3f}x")
            return 0
        plans, best = costmodel.sweep(range(1, args.sweep + 1), **common)
    except ValueError as err:
        raise VerispecError(str(err)) from None
    if args.json:
        print(json.dumps({"plans": [p.as_dict() for p in plans], "best_gamma": best.gamma}))
        return 0
    print("gamma  tokens/round  cycle ms  ms/token  speedup")
    for p in plans:
        mark = "  <- best" if p is best else ""
        print(f"{p.gamma:5d}  {p.expected_tokens:12.4f}  {p.cycle_ms:8.3f}  {p.ms_per_token:8.3f}  {p.speedup:6.3f}x{mark}")
    return 0


def _plan_from_profile(args, acceptance) -> int:
    from pathlib import Path

    from verispec.profile import plan_from_profile

    try:
        data = json.loads(Path(args.profile).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise VerispecError(f"cannot read profile {args.profile!r}: {err}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), (int, float)) and data[k] > 0
                                              for k in ("decode_ms", "draft_ms")):
        raise VerispecError(f"profile {args.profile!r} is not a verispec profile (a JSON object with positive "
                            "decode_ms and draft_ms); write one with verispec profile --out FILE")
    if args.sweep is not None and not 1 <= args.sweep <= MAX_SWEEP:
        raise VerispecError(f"--sweep must be in 1..{MAX_SWEEP}, got {args.sweep}")
    if args.alpha is not None:
        acceptance = [args.alpha]
    if args.emit:
        from verispec import plan_emit

        return _print_emit(args, lambda sizes: plan_emit.schedule_from_profile(data, acceptance, args.sweep or 8,
                                                                               sizes))
    try:
        plans, best = plan_from_profile(data, acceptance, args.sweep or 8)
    except (ValueError, KeyError) as err:
        raise VerispecError(f"profile {args.profile!r} cannot be planned from: {err}") from None
    if args.json:
        print(json.dumps({"plans": [p.as_dict() for p in plans], "best_gamma": best.gamma,
                          "baseline_ms": data["decode_ms"]}))
        return 0
    print(f"measured: decode {data['decode_ms']:.2f} ms, draft {data['draft_ms']:.2f} ms/token, "
          f"state {data['state_ms']:.3f} ms")
    print("gamma  tokens/round  cycle ms  ms/token  speedup")
    for p in plans:
        mark = "  <- best" if p is best else ""
        print(f"{p.gamma:5d}  {p.expected_tokens:12.4f}  {p.cycle_ms:8.3f}  {p.ms_per_token:8.3f}  {p.speedup:6.3f}x{mark}")
    return 0


def _run_profile(args) -> int:
    import torch
    from tqdm import tqdm

    from verispec import profile as profiler
    from verispec.loading import build_engine, load_pair, resolve_draft_vocab

    if args.max_positions < 2 or args.repeats < 1 or args.context < 1 or args.threads < 0:
        raise VerispecError("--max-positions must be >= 2, --repeats and --context >= 1, --threads >= 0")
    if args.calibrate < 0 or not 1 <= args.calibrate_gamma <= MAX_SWEEP:
        raise VerispecError(f"--calibrate must be >= 0 and --calibrate-gamma in 1..{MAX_SWEEP}, got "
                            f"{args.calibrate} and {args.calibrate_gamma}")
    for option, path in (("--out", args.out), ("--plot", args.plot)):  # before measuring, not after
        if path is not None:
            _check_writable(option, path)
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args.target, args.draft, device=args.device, backend=args.backend,
                     draft_weights=args.draft_weights)
    bar = lambda items: tqdm(items, desc="verify curve", unit="pass", file=sys.stderr)
    vocab = resolve_draft_vocab(pair, args.draft_vocab) if pair.draft is not None else None
    room = getattr(pair.target.config, "max_context", None)
    if room is not None and args.context + args.max_positions > room:
        raise VerispecError(f"--context {args.context} + --max-positions {args.max_positions} exceed the target's "
                            f"context of {room} tokens")
    data = profiler.profile(pair.target, pair.draft, args.context, args.max_positions, args.repeats, progress=bar,
                            draft_vocab=vocab)
    data["target"], data["draft"] = str(pair.target_dir), str(pair.draft_dir)
    if args.calibrate:
        from verispec.config import SpecConfig
        from verispec.demo import demo_prompts

        prompts = [pair.tokenizer.encode(p, add_special_tokens=False)
                   for items in demo_prompts(args.calibrate).values() for p in items]
        engine = build_engine(pair, SpecConfig(gamma=args.calibrate_gamma, draft_vocab=vocab))
        data["calibration"] = profiler.calibrate(engine, prompts, args.calibrate_gamma, 64,
                                                 plain_engine=build_engine(pair, SpecConfig(method="none")))
    profiler.save(data, args.out)
    if args.plot:
        profiler.plot_verify_curve(data, args.plot)
    if args.json:
        print(json.dumps(data))
        return 0
    curve = " ".join(f"{n}:{data['verify_ms'][str(n)] / data['decode_ms']:.2f}" for n in (2, 4, 8, 16, 32)
                     if str(n) in data["verify_ms"])
    print(f"decode {data['decode_ms']:.2f} ms; draft {data.get('draft_ms', float('nan')):.2f} ms/token; "
          f"verify(n)/decode: {curve}; few-row kernel {data['small_m_kernel']}; profile written to {args.out}")
    print(f"roofline: {data['weight_bytes_per_token'] / 1e6:.1f} MB of weights + "
          f"{data['kv_bytes_per_token'] / 1e6:.1f} MB of KV per token at {data['bandwidth_gb_s']:.1f} GB/s = "
          f"{data['roofline_ms']:.2f} ms; decode is {data['decode_over_roofline']:.2f}x that")
    return 0


def _check_writable(option: str, path: str) -> None:
    """Refuse, before any long work, an output path that cannot be written: a folder, a missing or
    read-only parent folder."""
    import os

    target = Path(path).expanduser()
    if not path or target.is_dir():
        raise VerispecError(f"{option} {path!r} is a folder; give a file path")
    folder = target.resolve().parent
    if not folder.is_dir():
        raise VerispecError(f"{option} {path}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise VerispecError(f"{option} {path}: not writable")


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


def _check_emit(args) -> None:
    from verispec.plan_emit import ENGINES

    if args.emit not in ENGINES:
        raise VerispecError(f"--emit must be one of {', '.join(ENGINES)}, got {args.emit!r}")
    if args.batch_size < 1:
        raise VerispecError(f"--batch-size must be >= 1, got {args.batch_size}")


def _print_emit(args, schedule_for) -> int:
    """``schedule_for(batch_sizes)``: [(batch size, best gamma)] from the planner."""
    from verispec import plan_emit

    sizes = (args.batch_size,) if args.emit == "sglang" else plan_emit.BATCH_SIZES
    try:
        schedule = schedule_for(sizes)
    except (ValueError, KeyError, ZeroDivisionError) as err:
        raise VerispecError(f"cannot plan a schedule: {err}") from None
    text = plan_emit.emit(args.emit, schedule, args.batch_size)
    if args.json:
        print(json.dumps({"engine": args.emit, "schedule": [list(row) for row in schedule], "config": text}))
    elif text:
        print(text)
    else:
        print(f"verispec: speculation does not pay at batch {args.batch_size}: run without it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
