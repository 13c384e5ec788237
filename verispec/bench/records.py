"""One record per request, and the run's metrics computed from records alone (so tests can hand-make them).

Definitions used by every table (also written into the result JSON as ``DEFINITIONS``):

- A request ends ``ok`` (finish_reason stop or length), ``error`` or ``timeout``. Failed requests are never
  dropped: they count in ``requests`` and ``error_rate``, add 0 useful tokens, and their time counts in the
  wall time that tokens/s and requests/s divide by.
- tokens/s = output tokens of ok requests / wall seconds; requests/s = ok requests / wall seconds.
- Latency percentiles (median, p95) pool the ok requests of all repeats: TTFT; ITL = the gap before each
  emitted token after the first (a chunk of n tokens gives one real gap and n - 1 zeros); chunk gap = the
  gap between emitted chunks (the visible bursts); end-to-end.
- Acceptance is pooled over rounds: rate = accepted draft tokens / proposed draft positions (stats.py);
  committed tokens per round; verified draft nodes per round (tree nodes: not accepted tokens).
- Quality per task: accuracy (math) and format validity (code) over all requests of the task (a failed
  request is neither correct nor valid); completion = share finished by stop / by length / failed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from verispec.stats import ACCEPTANCE_RATE_DEFINITION, RequestStats, median_interval, percentile

DEFINITIONS = {
    "acceptance_rate": ACCEPTANCE_RATE_DEFINITION + " (pooled over all rounds; a tree proposes its depth)",
    "committed_per_round": "committed tokens per verification round (accepted drafts + recovered/bonus, minus "
                           "tokens cut by stops); prefill not counted",
    "tree_nodes_per_round": "verified draft nodes per round (chain: drafts); never accepted tokens",
    "per_position": "unconditional = rounds accepting position i / rounds proposing >= i; conditional = "
                    "rounds accepting i / rounds that reached i",
    "tokens_per_s": "output tokens of ok requests / wall seconds of the measured unit (failed requests' time "
                    "included)",
    "requests_per_s": "ok requests / wall seconds",
    "error_rate": "(errors + timeouts) / all requests",
    "ttft": "offline: request admitted -> first token; serving: request sent -> first non-empty chunk",
    "itl": "gap before each token after the first; a chunk of n tokens: one gap and n - 1 zeros",
    "chunk_gap": "gap between consecutive emitted chunks",
    "tpot": "time per output token after the first, per request: (e2e - TTFT) / (output tokens - 1); the "
            "per-token latency a reader of the stream sees on average (ITL's median is 0 once most tokens "
            "arrive inside multi-token chunks)",
    "latency_population": "ok requests, pooled over repeats",
    "speedup": "variant tokens/s / baseline tokens/s at the same load, per repeat; median over repeats",
    "speedup_interval": "distribution-free interval for that median: the k-th smallest and k-th largest "
                        "per-repeat ratio, k the largest with coverage 1 - 2 P(Binomial(repeats, 1/2) < k) "
                        ">= 95% (needs 6 or more repeats)",
    "accuracy": "math: the first 'The answer is N' equals the reference; failed requests count as wrong",
    "validity": "code: the body (cut at the first dedent) is not blank and prompt + body parses with ast",
    "completion": "share of requests that finished by stop, by length, or failed",
}


@dataclass
class RequestRecord:
    variant: str
    load: str  # "c1" (offline concurrency 1), "rate=2" or "mc4" (serving)
    repeat: int
    prompt_id: str
    task: str
    prompt_tokens: int
    max_tokens: int
    status: str = "ok"  # ok | error | timeout
    finish_reason: str = ""  # stop | length | error | timeout
    output_tokens: int = 0
    text: str = ""
    tokens: list[int] | None = None
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)  # after the first token
    chunk_gaps_s: list[float] = field(default_factory=list)
    rounds: int = 0
    drafted: int | None = None  # None: not observable (peer, remote server without stats)
    accepted: int | None = None
    committed: int = 0
    tree_nodes: int = 0
    position_proposed: list[int] = field(default_factory=list)
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)
    time_split_s: dict = field(default_factory=dict)  # prefill, draft, verify, state, other
    peak_memory_mb: float | None = None
    correct: bool | None = None
    valid: bool | None = None
    identical_to_baseline: bool | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict:
        return asdict(self)


def record_from_stats(record: RequestRecord, stats: RequestStats) -> RequestRecord:
    """Fill a record's timing and acceptance fields from the engine's ``RequestStats``."""
    record.prompt_tokens = stats.prompt_tokens
    record.output_tokens = stats.generated_tokens
    record.ttft_s, record.e2e_s = stats.ttft_s, stats.e2e_s
    record.token_gaps_s = list(stats.token_gaps_s[1:])  # [0] is the TTFT
    record.chunk_gaps_s = list(stats.chunk_gaps_s)
    rounds = stats.rounds
    record.rounds = len(rounds)
    record.drafted, record.accepted = stats.drafted, stats.accepted
    record.committed = sum(r.committed for r in rounds)
    record.tree_nodes = sum(r.tree_nodes for r in rounds)
    depth = max((r.drafted for r in rounds), default=0)
    record.position_proposed = [sum(r.drafted >= i for r in rounds) for i in range(1, depth + 1)]
    record.position_reached = [sum(r.drafted >= i and r.accepted >= i - 1 for r in rounds) for i in range(1, depth + 1)]
    record.position_accepted = [sum(r.accepted >= i for r in rounds) for i in range(1, depth + 1)]
    record.histogram = stats.acceptance_histogram()
    record.time_split_s = {"prefill": stats.prefill_s, "draft": sum(r.draft_s for r in rounds),
                           "verify": sum(r.verify_s for r in rounds), "state": sum(r.state_s for r in rounds),
                           "refresh": sum(r.refresh_s for r in rounds), "other": sum(r.other_s for r in rounds)}
    return record


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """The metrics of one (variant, load, repeat) unit, or of several pooled (``wall_s`` summed)."""
    ok = [r for r in records if r.ok]
    n = len(records)
    tokens = sum(r.output_tokens for r in ok)
    out = {
        "requests": n, "ok": len(ok),
        "errors": sum(r.status == "error" for r in records),
        "timeouts": sum(r.status == "timeout" for r in records),
        "error_rate": (n - len(ok)) / n if n else 0.0,
        "wall_s": wall_s, "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_length": _dist([r.output_tokens for r in ok]),
    }
    out["latency_ms"] = {
        "ttft": _dist([1e3 * r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": _dist([1e3 * g for r in ok for g in r.token_gaps_s]),
        "chunk_gap": _dist([1e3 * g for r in ok for g in r.chunk_gaps_s]),
        "tpot": _dist([1e3 * (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
                       if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1]),
        "e2e": _dist([1e3 * r.e2e_s for r in ok if r.e2e_s is not None]),
    }
    out["acceptance"] = acceptance(ok)
    out["time_split_ms"] = time_split(ok)
    out["peak_memory_mb"] = max((r.peak_memory_mb for r in records if r.peak_memory_mb is not None), default=None)
    out["quality"] = quality(records)
    same = [r.identical_to_baseline for r in ok if r.identical_to_baseline is not None]
    out["identical_to_baseline"] = sum(same) / len(same) if same else None
    return out


def acceptance(records: list[RequestRecord]) -> dict:
    rounds = sum(r.rounds for r in records)
    known = [r for r in records if r.drafted is not None]
    drafted, accepted = sum(r.drafted for r in known), sum(r.accepted for r in known)
    depth = max((len(r.position_proposed) for r in known), default=0)

    def pooled(attr: str) -> list[int]:
        return [sum(getattr(r, attr)[i] for r in known if i < len(getattr(r, attr))) for i in range(depth)]

    proposed, reached, hits = pooled("position_proposed"), pooled("position_reached"), pooled("position_accepted")
    width = max((len(r.histogram) for r in known), default=0)
    return {
        "rounds": rounds,
        "drafted": drafted if known else None,
        "accepted": accepted if known else None,
        "acceptance_rate": accepted / drafted if known and drafted else None,
        "committed_per_round": sum(r.committed for r in records) / rounds if rounds else None,
        "tree_nodes_per_round": sum(r.tree_nodes for r in known) / rounds if known and rounds else None,
        "per_position_unconditional": [a / p if p else 0.0 for a, p in zip(hits, proposed)],
        "per_position_conditional": [a / p if p else 0.0 for a, p in zip(hits, reached)],
        "histogram": [sum(r.histogram[i] for r in known if i < len(r.histogram)) for i in range(width)],
    }


def time_split(records: list[RequestRecord]) -> dict:
    keys = ("prefill", "draft", "verify", "state", "refresh", "other")  # refresh is part of state
    totals = {k: 1e3 * sum(r.time_split_s.get(k, 0.0) for r in records) for k in keys}
    rounds = sum(r.rounds for r in records if r.time_split_s)
    per_round = {k: totals[k] / rounds if rounds else 0.0 for k in keys if k != "prefill"}
    return {"total": totals, "per_round": per_round, "measured": any(r.time_split_s for r in records)}


def quality(records: list[RequestRecord]) -> dict:
    out = {}
    for task in dict.fromkeys(r.task for r in records):
        group = [r for r in records if r.task == task]
        n = len(group)
        row = {"requests": n,
               "stop": sum(r.ok and r.finish_reason == "stop" for r in group) / n,
               "length": sum(r.ok and r.finish_reason == "length" for r in group) / n,
               "failed": sum(not r.ok for r in group) / n}
        if any(r.correct is not None for r in group):
            row["accuracy"] = sum(bool(r.ok and r.correct) for r in group) / n
        if any(r.valid is not None for r in group):
            row["validity"] = sum(bool(r.ok and r.valid) for r in group) / n
        out[task] = row
    return out


def _dist(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "median": None, "p95": None, "mean": None}
    return {"n": len(values), "median": percentile(values, 50), "p95": percentile(values, 95),
            "mean": sum(values) / len(values)}


# ---- across repeats and variants ---------------------------------------------------------------------------


def compare(records: list[RequestRecord], walls: dict, references: tuple[str, ...],
            cpu: dict | None = None) -> list[dict]:
    """One row per (variant, load): pooled metrics, tokens/s and requests/s as the median over repeats,
    and speedups against each reference variant present at the same load (paired by repeat).

    ``walls``: (variant, load, repeat) -> seconds. ``references``: e.g. ("off", "hf"). ``cpu``: same keys,
    this process's CPU seconds; ``cpu_per_wall`` far below the thread count means the run was starved."""
    variants = list(dict.fromkeys(r.variant for r in records))
    keys = sorted(dict.fromkeys((r.variant, r.load) for r in records),
                  key=lambda key: (load_order(key[1]), variants.index(key[0])))
    units = {key: _per_repeat(records, walls, *key) for key in keys}
    rows = []
    for variant, load in keys:
        per_repeat = units[(variant, load)]
        group = [r for r in records if r.variant == variant and r.load == load]
        row = {"variant": variant, "load": load, **summarize(group, sum(u["wall_s"] for u in per_repeat.values()))}
        rates = [u["tokens_per_s"] for u in per_repeat.values()]
        row["tokens_per_s"] = percentile(rates, 50)
        row["tokens_per_s_range"] = [min(rates), max(rates)]
        row["requests_per_s"] = percentile([u["requests_per_s"] for u in per_repeat.values()], 50)
        row["per_repeat"] = [{"repeat": k, **u} for k, u in per_repeat.items()]
        if cpu is not None:
            cpu_s = sum(cpu.get((variant, load, k), 0.0) for k in per_repeat)
            row["cpu_per_wall"] = cpu_s / row["wall_s"] if row["wall_s"] > 0 else None
        row["speedup_vs"], row["speedup_interval_vs"], row["per_prompt_speedup_vs"] = {}, {}, {}
        for reference in references:
            if reference == variant or (reference, load) not in units:
                continue
            base = units[(reference, load)]
            ratios = [per_repeat[k]["tokens_per_s"] / base[k]["tokens_per_s"] for k in per_repeat
                      if k in base and base[k]["tokens_per_s"] > 0]
            row["speedup_vs"][reference] = percentile(ratios, 50) if ratios else None
            interval = median_interval(ratios)
            if interval is not None:
                row["speedup_interval_vs"][reference] = {"low": interval[0], "high": interval[1],
                                                         "coverage": interval[2], "repeats": len(ratios)}
            row["per_prompt_speedup_vs"][reference] = per_prompt_speedup(records, variant, reference, load)
        rows.append(row)
    return rows


def per_prompt_speedup(records: list[RequestRecord], variant: str, reference: str, load: str) -> float | None:
    """Median over (prompt, repeat) pairs, both ok, of reference ms/token over variant ms/token."""
    def ms_per_token(r: RequestRecord) -> float | None:
        return r.e2e_s / r.output_tokens if r.ok and r.output_tokens and r.e2e_s else None

    theirs = {(r.prompt_id, r.repeat): ms_per_token(r) for r in records if r.variant == reference and r.load == load}
    ratios = []
    for r in records:
        if r.variant == variant and r.load == load:
            mine, base = ms_per_token(r), theirs.get((r.prompt_id, r.repeat))
            if mine and base:
                ratios.append(base / mine)
    return percentile(ratios, 50) if ratios else None


def _per_repeat(records: list[RequestRecord], walls: dict, variant: str, load: str) -> dict[int, dict]:
    out = {}
    for repeat in sorted({r.repeat for r in records if r.variant == variant and r.load == load}):
        group = [r for r in records if r.variant == variant and r.load == load and r.repeat == repeat]
        metrics = summarize(group, walls.get((variant, load, repeat), 0.0))
        out[repeat] = {k: metrics[k] for k in ("tokens_per_s", "requests_per_s", "wall_s", "requests", "ok",
                                                "output_tokens")}
    return out


def mark_identical(records: list[RequestRecord], baseline: str) -> None:
    """For greedy runs: does each ok request's output (tokens; text for served requests) equal the
    baseline's for the same prompt, load and repeat?"""
    def output(r: RequestRecord):
        return r.tokens if r.tokens is not None else r.text  # served requests: text only

    reference = {(r.prompt_id, r.load, r.repeat): output(r) for r in records if r.variant == baseline and r.ok}
    for r in records:
        if r.variant != baseline and r.ok:
            theirs = reference.get((r.prompt_id, r.load, r.repeat))
            r.identical_to_baseline = None if theirs is None or type(theirs) is not type(output(r)) \
                else output(r) == theirs


def load_order(load: str) -> tuple[int, float]:
    """Sort key of load names: c1 < c4 (offline), then rate=0.5 < rate=inf, then mc1 < mc8."""
    match = re.fullmatch(r"(c|rate=|mc)(.+)", load)
    if not match:
        return (3, 0.0)
    kind, value = match.groups()
    return ({"c": 0, "rate=": 1, "mc": 2}[kind], math.inf if value == "inf" else float(value))
