"""``verispec bench``: compare speculation off / chain / tree / n-gram and the transformers peer on one
prompt set, offline at fixed concurrency and against OpenAI-compatible servers; write JSON + reports.

    verispec bench --quick --target tiny --out bench-quick         # the tiny pair, < 1 min on 2 CPU cores
    verispec bench --config bench.toml --out results/run1
    verispec bench --target T --draft D --variants off,chain,tree:s3_k2_d5 --concurrency 1,2,4 --repeats 3
    verispec bench --url chain=http://127.0.0.1:8000 --rate 0.5 --rate 4 --max-concurrency 8 --mode serving
    verispec bench --serve --mode serving                           # starts our server with spec off and on

Flags override the TOML file; ``--quick`` shrinks sizes only. See docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verispec.errors import VerispecError


def add_parser(commands) -> None:
    from verispec.options import add_model_options, add_sampling_options

    bench = commands.add_parser(
        "bench", help="benchmark speculation off/on, chain vs tree, and transformers generate, with reports",
        description="Run every variant on the same prompts (ShareGPT, code, math), interleaved per prompt, offline "
                    "at fixed concurrency and/or against OpenAI-compatible endpoints at fixed arrival rates or "
                    "concurrency; write result.json, report.md and report.html with plots to --out.")
    bench.add_argument("--config", metavar="TOML", help="bench config file (sections as in docs/benchmarking.md)")
    bench.add_argument("--quick", action="store_true", help="small preset: 2 prompts per workload, 32 tokens, "
                                                            "concurrency 1 and 4, one repeat")
    bench.add_argument("--out", help="output directory (default bench-results)")
    bench.add_argument("--name", help="run name shown in the report")
    bench.add_argument("--mode", choices=["auto", "offline", "serving", "both"],
                       help="auto (default): offline, plus serving when --url/--serve or endpoints are configured")
    add_model_options(bench)
    bench.add_argument("--tokenizer", metavar="DIR", help="tokenizer dir (default: the target's)")
    bench.add_argument("--eagle", metavar="DIR", help="EAGLE head for eagle variants (default: the one shipped for "
                                                      "a named target)")
    bench.add_argument("--precision", choices=["float32", "bfloat16", "float16"], help="weights dtype (float32)")
    bench.add_argument("--threads", type=int, help="torch threads (0 = torch default)")
    add_sampling_options(bench)
    bench.add_argument("--ignore-eos", action="store_true", default=None, help="generate max_tokens every time")
    bench.add_argument("--workloads", help="comma-separated: sharegpt,code,math")
    bench.add_argument("--prompts", type=int, dest="per_workload", help="prompts per workload (default 8)")
    bench.add_argument("--sharegpt", metavar="JSON", help="ShareGPT-format file (default: packaged held-out split)")
    bench.add_argument("--template", choices=["auto", "raw", "chat"], help="prompt template (auto)")
    bench.add_argument("--max-input-tokens", type=int, help="skip longer prompts (default 512)")
    bench.add_argument("--max-output-tokens", type=int, help="output cap per request (default 128)")
    bench.add_argument("--variants", help="comma-separated, e.g. off,chain,tree:s3_k2_d5,tree:dynamic:5,ngram,hf,"
                                          "hf_assisted,hf_prompt_lookup")
    bench.add_argument("--budget", type=int, help="verified nodes per round D (chain gamma = D - 1; default 5)")
    bench.add_argument("--concurrency", help="offline concurrency levels, comma-separated (default 1,2,4)")
    bench.add_argument("--repeats", type=int, help="offline repeats (default 3); medians are reported")
    bench.add_argument("--timeout", type=float, help="seconds per request before it counts as a timeout")
    bench.add_argument("--url", action="append", metavar="[NAME=]URL",
                       help="OpenAI-compatible endpoint to load (repeatable)")
    bench.add_argument("--serve", action="store_true",
                       help="start 'verispec serve' twice (speculation off, chain) and load both")
    bench.add_argument("--rate", type=float, action="append", help="serving arrival rate, requests/s (repeatable)")
    bench.add_argument("--burstiness", type=float, help="gamma shape of arrival gaps (1 = Poisson)")
    bench.add_argument("--max-concurrency", type=int, action="append", help="serving closed-loop load (repeatable)")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.add_argument("--json", action="store_true", help="also print the result JSON's rows to stdout")
    bench.add_argument("--rerender", metavar="RESULT_JSON",
                       help="run nothing: recompute the rows of an earlier result.json (or its directory) from its "
                            "stored requests with today's metrics, and rewrite result.json and the reports there")
    # None means "not given": the TOML file or the bench defaults decide (flags override them).
    bench.set_defaults(run=run_bench_command, device=None, backend=None, temperature=None, top_k=None, top_p=None,
                       min_p=None, seed=None)


def overrides_from_args(args: argparse.Namespace) -> dict:
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()] if text else None  # noqa: E731
    ints = lambda text: [int(x) for x in split(text)] if text else None  # noqa: E731
    serving: dict = {"request_rates": args.rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                     "timeout_s": args.timeout}
    if args.url:
        serving["endpoints"] = [_endpoint(text, i) for i, text in enumerate(args.url)]
    if args.serve:
        serving["launch"] = [{"name": "serve-off", "args": ["--method", "none"]},
                             {"name": "serve-chain", "args": ["--method", "chain"] +
                              (["--gamma", str(args.budget - 1)] if args.budget else [])}]
    try:
        concurrency = ints(args.concurrency)
    except ValueError:
        raise VerispecError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    return {
        "name": args.name, "out": args.out, "mode": args.mode, "plots": False if args.no_plots else None,
        "models": {"target": args.target, "draft": args.draft, "eagle": args.eagle, "tokenizer": args.tokenizer, "device": args.device,
                   "backend": args.backend, "precision": args.precision, "threads": args.threads},
        "prompts": {"workloads": split(args.workloads), "per_workload": args.per_workload,
                    "sharegpt_path": args.sharegpt, "template": args.template,
                    "max_input_tokens": args.max_input_tokens, "max_output_tokens": args.max_output_tokens},
        "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
                     "seed": args.seed, "ignore_eos": args.ignore_eos},
        "spec": {"variants": split(args.variants), "budget": args.budget},
        "offline": {"concurrency": concurrency, "repeats": args.repeats, "timeout_s": args.timeout},
        "serving": serving,
    }


def _endpoint(text: str, index: int) -> dict:
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = f"endpoint{index}", text
    return {"name": name, "url": url}


def run_bench_command(args: argparse.Namespace) -> int:
    import json

    from verispec.bench.config import load_config
    from verispec.bench.report import write_report
    from verispec.bench.run import jsonable, run_bench, write_result

    if args.rerender:
        result, out = _rerender(args.rerender)
        path = write_result(result, out)
        reports = write_report(result, out, with_plots=not args.no_plots)
        print(f"rewrote {path}, {reports['markdown']}, {reports['html']}", file=sys.stderr)
    else:
        config = load_config(args.config, quick=args.quick, overrides=overrides_from_args(args))
        result = run_bench(config)
        path = write_result(result, config.out)
        reports = write_report(jsonable(result), config.out, with_plots=config.plots)
        print(f"wrote {path}, {reports['markdown']}, {reports['html']} ({result['duration_s']:.0f} s)", file=sys.stderr)
    if args.json:
        rows = {mode: result[mode]["rows"] for mode in ("offline", "serving") if mode in result}
        print(json.dumps(jsonable(rows)))
    else:
        print(summary_table(result))
    return 0


def _rerender(where: str) -> tuple[dict, Path]:
    import json

    from verispec.bench.run import recompare

    path = Path(where)
    path = path / "result.json" if path.is_dir() else path
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VerispecError(f"--rerender: cannot read {path}: {exc}") from None
    if not any("requests" in result.get(mode, {}) for mode in ("offline", "serving")):
        raise VerispecError(f"--rerender: {path} holds no stored requests to recompute from")
    return recompare(result), path.parent


def summary_table(result: dict) -> str:
    from verispec.bench.report import speedup_text

    lines = []
    for mode in ("offline", "serving"):
        if mode not in result:
            continue
        refs = result[mode]["references"]
        lines.append(f"{mode}: variant  load  tokens/s  " + "  ".join(f"vs {r}" for r in refs) +
                     "  committed/round  acceptance  errors")
        for row in result[mode]["rows"]:
            acc = row["acceptance"]
            ratios = "  ".join(speedup_text(row, r) for r in refs)
            lines.append(f"  {row['variant']:<18} {row['load']:<8} {row['tokens_per_s']:8.1f}  {ratios}  "
                         f"{acc['committed_per_round'] or 0:.2f}  "
                         f"{acc['acceptance_rate'] if acc['acceptance_rate'] is not None else float('nan'):.2f}  "
                         f"{row['errors'] + row['timeouts']}")
    return "\n".join(lines)
