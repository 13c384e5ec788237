"""The report's PNG plots (matplotlib, Agg backend), one function per figure.

    images = make_all(result, out_dir)   # {"offline_throughput": "offline_throughput.png", ...}
"""

from __future__ import annotations

from pathlib import Path

from verispec.bench.records import load_order


def make_all(result: dict, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    images = {}
    for mode in ("offline", "serving"):
        section = result.get(mode)
        if not section or not section["rows"]:
            continue
        for key, draw in (("throughput", throughput), ("latency", latency_cdfs), ("acceptance", acceptance),
                          ("time_split", time_split)):
            name = f"{mode}_{key}.png"
            if draw(section, out / name, mode):
                images[f"{mode}_{key}"] = name
    return images


def _save(figure, path: Path) -> bool:
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return True


def throughput(section: dict, path: Path, mode: str) -> bool:
    import matplotlib.pyplot as plt

    rows = section["rows"]
    loads = sorted(dict.fromkeys(r["load"] for r in rows), key=load_order)
    figure, axis = plt.subplots(figsize=(7, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        points = sorted((load_order(r["load"]), r["load"], r["tokens_per_s"]) for r in rows if r["variant"] == variant)
        if mode == "offline":
            axis.plot([p[0][1] for p in points], [p[2] for p in points], marker="o", label=variant)
        else:
            axis.plot([loads.index(p[1]) for p in points], [p[2] for p in points], marker="o", label=variant)
    if mode == "offline":
        levels = sorted({load_order(load)[1] for load in loads})
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [f"{level:g}" for level in levels])
        axis.minorticks_off()
        axis.set_xlabel("concurrency (requests in flight)")
    else:
        axis.set_xticks(range(len(loads)), loads)
        axis.set_xlabel("load point")
    axis.set_ylabel("output tokens/s")
    axis.set_title(f"{mode}: output tokens/s (median over repeats)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(figure, path)


def latency_cdfs(section: dict, path: Path, mode: str) -> bool:
    import matplotlib.pyplot as plt

    loads = sorted(dict.fromkeys(r["load"] for r in section["rows"]), key=load_order)
    low = loads[0]
    requests = [r for r in section["requests"] if r["load"] == low and r["status"] == "ok"]
    if not requests:
        return False
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    metrics = (("TTFT ms", lambda r: [r["ttft_s"]] if r["ttft_s"] is not None else []),
               ("gap between chunks ms", lambda r: r["chunk_gaps_s"]),
               ("end-to-end ms", lambda r: [r["e2e_s"]] if r["e2e_s"] is not None else []))
    for axis, (label, values) in zip(axes, metrics):
        for variant in dict.fromkeys(r["variant"] for r in requests):
            xs = sorted(1e3 * v for r in requests if r["variant"] == variant for v in values(r))
            if xs:
                axis.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=variant)
        axis.set_xlabel(label)
        axis.set_ylabel("fraction")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    figure.suptitle(f"{mode}: latency CDFs at {low}")
    return _save(figure, path)


def acceptance(section: dict, path: Path, mode: str) -> bool:
    import matplotlib.pyplot as plt

    loads = sorted(dict.fromkeys(r["load"] for r in section["rows"]), key=load_order)
    rows = [r for r in section["rows"] if r["load"] == loads[0] and r["acceptance"]["per_position_conditional"]]
    if not rows:
        return False
    figure, axis = plt.subplots(figsize=(7, 4))
    for r in rows:
        values = r["acceptance"]["per_position_conditional"]
        axis.plot(range(1, len(values) + 1), values, marker="o", label=r["variant"])
    axis.set_xlabel("draft position i")
    axis.set_ylabel("P(accept i | reached i)")
    axis.set_ylim(0, 1.05)
    axis.set_title(f"{mode}: conditional acceptance per position at {loads[0]}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(figure, path)


def time_split(section: dict, path: Path, mode: str) -> bool:
    import matplotlib.pyplot as plt

    rows = [r for r in section["rows"] if r["time_split_ms"]["measured"] and r["acceptance"]["rounds"]]
    if not rows:
        return False
    figure, axis = plt.subplots(figsize=(max(6, 0.7 * len(rows) + 2), 4))
    labels = [f"{r['variant']}@{r['load']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in ("draft", "verify", "state", "other"):
        heights = [r["time_split_ms"]["per_round"].get(part, 0.0) for r in rows]
        axis.bar(range(len(rows)), heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axis.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
    axis.set_ylabel("ms per verification round")
    axis.set_title(f"{mode}: time split per round")
    axis.legend(fontsize=8)
    return _save(figure, path)
