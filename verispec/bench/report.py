"""Markdown and HTML reports with plots, both rendered from one list of blocks built from the result JSON.

    paths = write_report(result, out_dir)   # report.md, report.html (plots embedded), *.png

Plots: output tokens/s vs load, latency CDFs at the lowest load, conditional acceptance per draft
position, and the time split per verification round.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from verispec.bench import plots
from verispec.bench.records import load_order

Block = tuple  # ("h1" | "h2" | "p", text) | ("table", headers, rows) | ("img", file name, caption)


def write_report(result: dict, out_dir: str | Path, with_plots: bool = True) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = plots.make_all(result, out) if with_plots else {}
    blocks = build_blocks(result, images)
    paths = {"markdown": out / "report.md", "html": out / "report.html"}
    paths["markdown"].write_text(to_markdown(blocks))
    paths["html"].write_text(to_html(blocks, out, result.get("name", "bench")))
    return {**paths, **{f"plot:{k}": out / v for k, v in images.items()}}


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def speedup_text(row: dict, reference: str) -> str:
    """'1.02x', or '1.02x [0.98-1.05]' with the 95% interval when there were enough repeats for one."""
    text = fmt(row["speedup_vs"].get(reference), 2, "x")
    interval = row.get("speedup_interval_vs", {}).get(reference)
    return text + (f" [{interval['low']:.2f}-{interval['high']:.2f}]" if interval else "")


def _pct(dist: dict | None) -> str:
    dist = dist or {}
    return f"{fmt(dist.get('median'), 1)} / {fmt(dist.get('p95'), 1)}"


def build_blocks(result: dict, images: dict[str, str]) -> list[Block]:
    blocks: list[Block] = [("h1", f"verispec bench: {result.get('name', '')}"),
                           ("p", f"Created {result.get('created')}; took {fmt(result.get('duration_s'), 1)} s. "
                                 "Every number below is from this one run; baselines were measured in it.")]
    blocks += _setup(result)
    for mode in ("offline", "serving"):
        if mode in result:
            blocks += _mode(result[mode], mode, images)
    if "models" in result:
        blocks += _memory(result)
    blocks.append(("h2", "Definitions"))
    blocks.append(("table", ["metric", "definition"], [[k, v] for k, v in result.get("definitions", {}).items()]))
    return blocks


def _setup(result: dict) -> list[Block]:
    config, env = result["config"], result["environment"]
    hw, versions = env["hardware"], env["versions"]
    rows = [["hardware", f"{hw['cpu_model']}; {hw['usable_cores']} usable cores; torch threads {hw['torch_threads']}; "
                         f"device {hw['device']}" + (f" ({hw['gpu']})" if hw.get("gpu") else "")],
            ["versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v)]]
    models = result.get("models")
    if models:
        for role in ("target", "draft"):
            facts = models.get(role)
            if facts:
                rows.append([role, f"{facts['dir']} ({facts['parameters'] / 1e6:.2f}M parameters, {facts['dtype']})"])
    s = config["sampling"]
    rows += [["sampling", f"temperature {s['temperature']}, top_k {s['top_k']}, top_p {s['top_p']}, "
                          f"min_p {s['min_p']}, seed {s['seed']}, ignore_eos {s['ignore_eos']}"],
             ["verification budget", f"D = {config['spec']['budget']} verified nodes per round (chain gamma "
                                     f"{config['spec']['budget'] - 1})"],
             ["cache policy", result.get("cache_policy", "")]]
    prompt_set = result["prompt_set"]
    rows.append(["prompt set", f"{prompt_set['count']} prompts, sha256 {prompt_set['sha256'][:16]}…, identical for "
                               "every variant and endpoint"])
    blocks: list[Block] = [("h2", "Setup"), ("table", ["item", "value"], rows)]
    task_rows = [[task, d["prompts"], d["template"], _dist(d["input_tokens"]), _dist(d["max_tokens"]),
                  " ".join(repr(x) for x in d["stop_strings"]) or "–"] for task, d in prompt_set["by_task"].items()]
    blocks.append(("table", ["task", "prompts", "template", "input tokens min/median/max", "max_tokens min/median/max",
                             "stop strings"], task_rows))
    return blocks


def _dist(d: dict) -> str:
    return f"{d.get('min')}/{fmt(d.get('median'), 0)}/{d.get('max')}"


def _mode(section: dict, mode: str, images: dict[str, str]) -> list[Block]:
    rows, refs = section["rows"], section.get("references", [])
    blocks: list[Block] = [("h2", "Offline (fixed concurrency)" if mode == "offline" else "Serving (client-side)")]
    if mode == "serving":
        blocks.append(("p", "Endpoints: " + ", ".join(f"{e['name']} = {e['url']} (model {e['model']})"
                                                      for e in section.get("endpoints", []))))
    low = _lowest_load(rows)
    blocks.append(("h3", f"Latency at low load ({low})"))
    blocks.append(("table", ["variant", "ok/requests", "TTFT ms p50/p95", "ITL ms p50/p95", "chunk gap ms p50/p95",
                             "TPOT ms p50/p95", "e2e ms p50/p95", "tokens/s"] + [f"per-prompt speedup vs {r}" for r in refs],
                   [[r["variant"], f"{r['ok']}/{r['requests']}", _pct(r["latency_ms"]["ttft"]),
                     _pct(r["latency_ms"]["itl"]), _pct(r["latency_ms"]["chunk_gap"]),
                     _pct(r["latency_ms"].get("tpot")), _pct(r["latency_ms"]["e2e"]),
                     fmt(r["tokens_per_s"], 1)] + [fmt(r["per_prompt_speedup_vs"].get(ref), 2, "x") for ref in refs]
                    for r in rows if r["load"] == low]))
    blocks.append(("h3", "Throughput by load"))
    blocks.append(("table", ["variant", "load", "output tokens/s (min–max)", "requests/s", "errors", "timeouts",
                             "error rate", "CPU s / wall s"] + [f"speedup vs {r} [95% interval]" for r in refs],
                   [[r["variant"], r["load"], f"{fmt(r['tokens_per_s'], 1)} ({fmt(r['tokens_per_s_range'][0], 1)}–"
                     f"{fmt(r['tokens_per_s_range'][1], 1)})", fmt(r["requests_per_s"], 3), r["errors"], r["timeouts"],
                     fmt(r["error_rate"], 3), fmt(r.get("cpu_per_wall"))]
                    + [speedup_text(r, ref) for ref in refs] for r in rows]))
    starved = [f"{r['variant']}@{r['load']}" for r in rows if r.get("cpu_per_wall") is not None
               and r["cpu_per_wall"] < 0.5]
    if starved:
        blocks.append(("p", "Warning: this process got less than half a core while running " + ", ".join(starved) +
                       " (CPU s / wall s < 0.5): other work competed for the CPU, so those timings are not "
                       "comparable."))
    spec_rows = [r for r in rows if r["acceptance"]["rounds"]]
    if spec_rows:
        blocks.append(("h3", "Speculation: rounds, acceptance, time split"))
        blocks.append(("table", ["variant", "load", "committed/round", "acceptance rate", "verified draft nodes/round",
                                 "conditional acceptance by position", "ms/round draft/verify/state/refresh/other (refresh is within state)"],
                       [[r["variant"], r["load"], fmt(r["acceptance"]["committed_per_round"]),
                         fmt(r["acceptance"]["acceptance_rate"], 3), fmt(r["acceptance"]["tree_nodes_per_round"]),
                         " ".join(f"{a:.2f}" for a in r["acceptance"]["per_position_conditional"]) or "–",
                         "/".join(fmt(v, 2) for v in r["time_split_ms"]["per_round"].values())
                         if r["time_split_ms"]["measured"] else "–"] for r in spec_rows]))
    blocks.append(("h3", "Quality and completion per task"))
    tasks = list(dict.fromkeys(task for r in rows for task in r["quality"]))
    headers = ["variant", "load", "identical to baseline"]
    labels = {"math": "math: accuracy, stop/length/failed", "code": "code: format validity, stop/length/failed"}
    headers += [labels.get(t, f"{t}: stop/length/failed") for t in tasks]
    quality_rows = []
    for r in rows:
        cells = [r["variant"], r["load"], fmt(r["identical_to_baseline"], 3)]
        for task in tasks:
            q = r["quality"].get(task)
            if q is None:
                cells.append("–")
                continue
            score = q.get("accuracy", q.get("validity"))
            cells.append((f"{score:.2f}  " if score is not None else "") +
                         f"{q['stop']:.2f}/{q['length']:.2f}/{q['failed']:.2f}")
        quality_rows.append(cells)
    blocks.append(("table", headers, quality_rows))
    if section.get("notes"):
        blocks.append(("p", "Notes: " + " ".join(section["notes"])))
    if section.get("peer_settings"):
        blocks.append(("p", "Peer (transformers generate) settings: " +
                       ", ".join(f"{k} = {v}" for k, v in section["peer_settings"].items())))
    for key, caption in (("throughput", "output tokens/s by load"), ("latency", "latency CDFs at the lowest load"),
                         ("acceptance", "conditional acceptance per draft position"),
                         ("time_split", "time per verification round")):
        name = images.get(f"{mode}_{key}")
        if name:
            blocks.append(("img", name, f"{mode}: {caption}"))
    return blocks


def _lowest_load(rows: list[dict]) -> str:
    loads = list(dict.fromkeys(r["load"] for r in rows))
    return min(loads, key=load_order) if loads else ""


def _memory(result: dict) -> list[Block]:
    models, section = result["models"], result.get("offline", {})
    measured = {}
    for r in section.get("rows", []):
        measured[f"{r['variant']}@{r['load']}"] = r.get("peak_memory_mb")
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    rows = [[key, mib(m["weights_bytes"]), mib(m["draft_weights_bytes"]), mib(m["kv_cache_bytes"]),
             f"{m['speculative_state_bytes'] / 2**10:.1f}", fmt(measured.get(key), 2)]
            for key, m in models["memory_model"].items()]
    return [("h2", "Memory"),
            ("p", f"Estimated by construction (weights, KV for the longest request, speculative state = drafts written "
                  f"per round that may be rolled back, tree branches included) and measured: "
                  f"{section.get('memory_method', '–')}. Process peak RSS over the run: "
                  f"{fmt(result.get('process_peak_rss_mb'), 1)} MiB."),
            ("table", ["variant@load", "weights MiB", "of which draft MiB", "KV cache MiB", "speculative state KiB",
                       "measured peak growth MiB"], rows)]


# ---- rendering -------------------------------------------------------------------------------------------


def to_markdown(blocks: list[Block]) -> str:
    lines = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "table":
            headers, rows = block[1], block[2]
            cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            lines.append("| " + " | ".join(map(cell, headers)) + " |")
            lines.append("|" + "---|" * len(headers))
            lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
            lines.append("")
        elif kind == "img":
            lines += [f"![{block[2]}]({block[1]})", ""]
    return "\n".join(lines)


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px 8px;"
         "text-align:left}th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}")


def to_html(blocks: list[Block], out: Path, title: str) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body>"]
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3", "p"):
            parts.append(f"<{kind}>{html.escape(block[1])}</{kind}>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(str(h))}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                           for row in block[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":  # embedded, so the report is one portable file
            data = base64.b64encode((out / block[1]).read_bytes()).decode()
            parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(block[2])}'>"
                         f"<figcaption>{html.escape(block[2])}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)
