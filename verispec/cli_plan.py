"""``verispec plan``: the cost model of docs/algorithms.md from the command line: tokens per round, cycle
cost and speedup for given or profiled costs, a sweep over gamma, or a per-batch-size schedule emitted as
another engine's config (``--emit``).

    verispec plan --alpha 0.8 --gamma 4 --draft-ms 1 --verify-ms 12 --state-ms 2 --baseline-ms 10
"""

from __future__ import annotations

import json
import math
import sys

from verispec.errors import VerispecError
from verispec.options import DEFAULTS

MAX_SWEEP = 64  # gammas a plan may sweep or price: the engine's own bound on gamma (SpecConfig)


def add_parser(commands) -> None:
    """Register ``verispec plan`` on the CLI's subparsers."""
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
    _print_sweep(plans, best)
    return 0


def _print_sweep(plans, best) -> None:
    """One table row per planned gamma, the best one marked."""
    print("gamma  tokens/round  cycle ms  ms/token  speedup")
    for p in plans:
        mark = "  <- best" if p is best else ""
        print(f"{p.gamma:5d}  {p.expected_tokens:12.4f}  {p.cycle_ms:8.3f}  {p.ms_per_token:8.3f}  "
              f"{p.speedup:6.3f}x{mark}")


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
    _print_sweep(plans, best)
    return 0


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
