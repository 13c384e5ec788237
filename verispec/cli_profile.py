"""``verispec profile``: measure on this machine the costs the planner needs (draft, verify by positions,
state, decode) and, with ``--calibrate``, per-position acceptance, into a profile JSON.

    verispec profile --target tiny --calibrate 2 --out profile.json && verispec plan --profile profile.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.cli_plan import MAX_SWEEP
from verispec.errors import VerispecError
from verispec.options import add_draft_options, add_model_options


def add_parser(commands) -> None:
    """Register ``verispec profile`` on the CLI's subparsers."""
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
