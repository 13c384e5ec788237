"""Soak test of `verispec serve`: many requests at a fixed concurrency, some clients disconnecting
mid-stream and some sending invalid bodies, then checks that the server answered and cleaned up after
every one of them.

    OMP_NUM_THREADS=1 python experiments/soak.py --target smollm2 --max-tokens 24 --out runs/soak.json
    python experiments/soak.py --url http://127.0.0.1:8000 --server-pid 1234      # a server already running

Without ``--url`` it starts ``verispec serve --target TARGET`` (speculation on: the draft model's chain,
gamma 4, the server's defaults) on a free port, plus ``--serve-args``, and stops it with SIGTERM at the
end. It sends ``--requests`` requests (default 2,000), ``--concurrency`` at a time (default 64), in a
seeded order:

- ``--disconnect`` (default 10%): streamed requests whose client closes the connection after 1-3 chunks;
- ``--invalid`` (default 5%): bodies the server must refuse with a 4xx: malformed or truncated JSON, a
  body that is not an object, wrong types, missing fields, out-of-range values;
- the rest, well-formed: completions or chat, streamed or not, greedy or sampled with a seed, some with
  a stop string, logprobs or n = 2, each up to ``--max-tokens`` tokens.

Checks (exit 0 when all pass, 1 otherwise, 2 for bad arguments):

- ``no_5xx``: no response with status >= 500, and no connection the server cut;
- ``all_accounted``: every well-formed request completed (200 with a finish_reason for each choice; a
  stream also ends with ``[DONE]``) or was disconnected by its client on purpose;
- ``invalid_refused``: every invalid body got a 4xx with an error body;
- ``server_counted``: the server's finished-request counters (``verispec:request_success_total``, every
  reason; one per choice) grew by exactly the choices of the well-formed requests;
- ``rss_growth``: the server's resident memory grew less than ``--rss-limit`` (default 5%) from when
  ``--warmup`` requests (default 200) had ended to the end of the run (needs the server's pid: known when
  started here, ``--server-pid`` with ``--url``; otherwise not checked);
- ``slots_free``: ``verispec:num_requests_running`` and ``verispec:num_requests_waiting`` are 0 once the
  last response is in;
- ``clean_exit``: a server started here exits 0 on SIGTERM.

A progress bar goes to stderr, a summary to stdout, the whole record (settings, counts, statuses, RSS
samples, checks) to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPTS = (
    "Name three prime numbers.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain what a hash table is in one sentence.",
    "List four colours of the rainbow.",
    "def fibonacci(n):",
    "def is_palindrome(text: str) -> bool:",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "class Stack:\n    def __init__(self):",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)

INVALID_BODIES = (  # (route, raw body): each must be refused with a 4xx
    ("completions", b'{"prompt": "hi", "max_tokens": 8'),  # truncated JSON
    ("completions", b"{'prompt': 'hi'}"),  # not JSON
    ("chat/completions", b"[1, 2, 3]"),  # not an object
    ("completions", b""),  # empty
    ("completions", json.dumps({"prompt": "hi", "max_tokens": "eight"}).encode()),  # wrong types
    ("chat/completions", json.dumps({"messages": "hello", "max_tokens": 4}).encode()),
    ("completions", json.dumps({"prompt": "hi", "temperature": "hot"}).encode()),
    ("completions", json.dumps({"max_tokens": 4}).encode()),  # missing fields
    ("chat/completions", json.dumps({"max_tokens": 4}).encode()),
    ("chat/completions", json.dumps({"messages": [{"content": "no role"}]}).encode()),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": -3}).encode()),  # out of range
    ("completions", json.dumps({"prompt": "hi", "top_p": 0}).encode()),
)


@dataclass
class Settings:
    requests: int = 2000
    concurrency: int = 64
    max_tokens: int = 24
    disconnect: float = 0.10
    invalid: float = 0.05
    warmup: int = 200
    rss_limit: float = 0.05
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None


@dataclass
class Planned:
    """One request of the run: what to send and how the client behaves."""

    index: int
    kind: str  # normal | disconnect | invalid
    route: str  # completions | chat/completions
    body: bytes
    stream: bool = False
    choices: int = 1
    close_after: int = 0  # disconnect: chunks read before closing the connection


@dataclass
class Outcome:
    index: int
    kind: str
    route: str
    stream: bool
    status: int | None = None
    result: str = "failed"  # completed | disconnected | refused | failed
    detail: str | None = None
    seconds: float = 0.0


def plan_requests(settings: Settings, model: str) -> list[Planned]:
    """The run's requests in sending order; the same for the same settings and seed."""
    rng = random.Random(settings.seed)
    count = settings.requests
    disconnects = round(count * settings.disconnect)
    invalids = round(count * settings.invalid)
    kinds = ["disconnect"] * disconnects + ["invalid"] * invalids + ["normal"] * (count - disconnects - invalids)
    rng.shuffle(kinds)
    planned = []
    for index, kind in enumerate(kinds):
        if kind == "invalid":
            route, body = INVALID_BODIES[rng.randrange(len(INVALID_BODIES))]
            planned.append(Planned(index, kind, route, body))
            continue
        route = rng.choice(("completions", "chat/completions"))
        prompt = f"{rng.choice(PROMPTS)} ({index})" if rng.random() < 0.5 else rng.choice(PROMPTS)
        body: dict = {"model": model, "max_tokens": rng.randint(max(1, settings.max_tokens // 2), settings.max_tokens)}
        if route == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
        stream = kind == "disconnect" or rng.random() < 0.6
        choices = 1
        if kind == "disconnect":
            body["max_tokens"] = settings.max_tokens
            body["ignore_eos"] = True  # still running when its client goes
        else:
            extra = rng.random()
            if extra < 0.1:
                body["stop"] = ["\n\n"]
            elif extra < 0.2:
                body.update({"logprobs": 2} if route == "completions" else {"logprobs": True, "top_logprobs": 2})
            elif extra < 0.25:
                choices = body["n"] = 2
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        planned.append(Planned(index, kind, route, json.dumps(body).encode(), stream, choices,
                               rng.randint(1, 3) if kind == "disconnect" else 0))
    return planned


async def send(client, url: str, item: Planned, headers: dict) -> Outcome:
    """Send one planned request and classify how it ended."""
    import httpx

    outcome = Outcome(item.index, item.kind, item.route, item.stream)
    began = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/{item.route}", content=item.body, headers=headers) as response:
            outcome.status = response.status_code
            if response.status_code != 200 or not item.stream:
                text = (await response.aread()).decode(errors="replace")
                _classify_body(item, outcome, text)
            else:
                await _read_stream(item, outcome, response)
    except (httpx.HTTPError, ValueError, AttributeError) as err:  # a cut connection, no answer in time, a bad chunk
        outcome.result, outcome.detail = "failed", f"{type(err).__name__}: {err}"
    outcome.seconds = time.perf_counter() - began
    return outcome


def _classify_body(item: Planned, outcome: Outcome, text: str) -> None:
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    status = outcome.status
    if item.kind == "invalid":
        ok = 400 <= status < 500 and isinstance(body, dict) and "error" in body
        outcome.result = "refused" if ok else "failed"
        if not ok:
            outcome.detail = f"invalid body answered {status}: {text[:200]}"
        return
    choices = body.get("choices") if isinstance(body, dict) and status == 200 else None
    if choices is not None and len(choices) == item.choices and all(c.get("finish_reason") for c in choices):
        outcome.result = "completed"
    else:
        outcome.result, outcome.detail = "failed", f"status {status}: {text[:200]}"


async def _read_stream(item: Planned, outcome: Outcome, response) -> None:
    chunks, finished, done, error = 0, set(), False, None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:].strip()
        if data == "[DONE]":
            done = True
            break
        chunks += 1
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                finished.add(choice.get("index", 0))
        if item.kind == "disconnect" and chunks >= item.close_after and not finished:
            outcome.result = "disconnected"  # leaving the block closes the connection mid-stream
            return
    if done and error is None and len(finished) == item.choices:
        outcome.result = "completed"
    else:
        outcome.result = "failed"
        outcome.detail = f"stream ended: done={done}, choices finished={len(finished)}/{item.choices}, error={error}"


# ---- the server: metrics, memory, launch ------------------------------------------------------------------


def metric_sum(exposition: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets)."""
    total = 0.0
    for line in exposition.splitlines():
        match = re.fullmatch(r"([^{\s]+)(?:\{.*\})? (\S+)", line)
        if match and match.group(1) == name:
            total += float(match.group(2))
    return total


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (psutil when installed, else /proc), None if it is gone."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and friends
        return None
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class LaunchedServer:
    """``verispec serve`` on a free local port, its output in a temporary file; ``stop`` sends SIGTERM and
    returns the exit status."""

    def __init__(self, serve_args: list[str], ready_timeout_s: float = 300.0):
        from verispec.bench.serving import _wait_ready, free_port

        port = free_port()
        self.command = [sys.executable, "-m", "verispec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                        *serve_args]
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(self.process, self.url, ready_timeout_s, self.log)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 120.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return None
        return self.process.returncode

    def log_tail(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]


# ---- the run -----------------------------------------------------------------------------------------------


async def run_soak(url: str, settings: Settings, pid: int | None = None, model: str | None = None,
                   progress: bool = True) -> dict:
    """Send the planned load to ``url`` and return the record: counts, statuses, RSS, metrics, checks
    (``clean_exit`` is added by the caller that owns the server)."""
    import httpx
    from tqdm import tqdm

    headers = {"Content-Type": "application/json"}
    if settings.api_key:
        headers["Authorization"] = f"Bearer {settings.api_key}"
    limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(settings.timeout_s, connect=30),
                                 headers=headers) as client:
        if model is None:
            listed = (await client.get(f"{url}/v1/models")).json()
            model = listed["data"][0]["id"]
        metrics_before = (await client.get(f"{url}/metrics")).text
        planned = plan_requests(settings, model)
        outcomes: list[Outcome] = []
        rss = {"samples": [], "baseline": None, "end": None}
        gate = asyncio.Semaphore(settings.concurrency)
        began = time.perf_counter()

        def sample_rss() -> int | None:
            value = rss_bytes(pid) if pid is not None else None
            if value is not None:
                rss["samples"].append([round(time.perf_counter() - began, 1), len(outcomes), value])
            return value

        async def sampler() -> None:
            while True:
                await asyncio.sleep(5.0)
                sample_rss()

        async def one(item: Planned, bar) -> None:
            async with gate:
                outcome = await send(client, url, item, headers)
            outcomes.append(outcome)
            if len(outcomes) == settings.warmup:
                rss["baseline"] = sample_rss()
            bar.update(1)

        if settings.warmup == 0:
            rss["baseline"] = sample_rss()
        sampling = asyncio.create_task(sampler()) if pid is not None else None
        with tqdm(total=len(planned), desc="soak", unit="req", file=sys.stderr, disable=not progress) as bar:
            await asyncio.gather(*(one(item, bar) for item in planned))
        wall = time.perf_counter() - began
        if sampling is not None:
            sampling.cancel()
        # Slots: the server frees an aborted request's row before its next round; give it a moment.
        deadline, running, waiting = time.monotonic() + 30, None, None
        while time.monotonic() < deadline:
            exposition = (await client.get(f"{url}/metrics")).text
            running = metric_sum(exposition, "verispec:num_requests_running")
            waiting = metric_sum(exposition, "verispec:num_requests_waiting")
            if running == 0 and waiting == 0:
                break
            await asyncio.sleep(0.5)
        rss["end"] = sample_rss()
        # Read again: a request's counters are updated just after its row's gauge, within one lock hold.
        metrics_after = (await client.get(f"{url}/metrics")).text
    return summarize(settings, planned, outcomes, wall, rss, metrics_before, metrics_after, running, waiting, pid)


def summarize(settings: Settings, planned: list[Planned], outcomes: list[Outcome], wall: float, rss: dict,
              metrics_before: str, metrics_after: str, running, waiting, pid: int | None) -> dict:
    by_index = {o.index: o for o in outcomes}
    counts: dict[str, dict[str, int]] = {}
    statuses: dict[str, int] = {}
    for outcome in outcomes:
        kind = counts.setdefault(outcome.kind, {})
        kind[outcome.result] = kind.get(outcome.result, 0) + 1
        key = str(outcome.status) if outcome.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    well_formed = [p for p in planned if p.kind != "invalid"]
    choices = sum(p.choices for p in well_formed)

    def delta(name: str) -> float:
        return metric_sum(metrics_after, name) - metric_sum(metrics_before, name)

    server = {"finished_choices": delta("verispec:request_success_total"),
              "aborted_choices": _label_delta(metrics_before, metrics_after, "verispec:request_success_total",
                                              "finished_reason", "abort"),
              "failures": delta("verispec:request_failure_total"),
              "generation_tokens": delta("verispec:generation_tokens_total"),
              "running_at_end": running, "waiting_at_end": waiting}
    growth = None
    if rss["baseline"] and rss["end"]:
        growth = rss["end"] / rss["baseline"] - 1
    failures = [asdict(o) for o in outcomes if o.result == "failed"]
    checks = {
        "no_5xx": {"passed": not any(o.status is None or o.status >= 500 for o in outcomes),
                   "value": sum(1 for o in outcomes if o.status is None or o.status >= 500)},
        "all_accounted": {"passed": len(by_index) == len(planned) and all(
            by_index[p.index].result in ("completed", "disconnected") for p in well_formed),
            "value": sum(1 for p in well_formed if by_index.get(p.index) is None
                         or by_index[p.index].result not in ("completed", "disconnected"))},
        "invalid_refused": {"passed": all(by_index[p.index].result == "refused" for p in planned if p.kind == "invalid"),
                            "value": sum(1 for p in planned if p.kind == "invalid" and by_index[p.index].result != "refused")},
        "server_counted": {"passed": server["finished_choices"] == choices,
                           "value": server["finished_choices"], "expected": choices},
        "slots_free": {"passed": running == 0 and waiting == 0, "value": {"running": running, "waiting": waiting}},
    }
    if growth is not None:
        checks["rss_growth"] = {"passed": growth < settings.rss_limit, "value": growth, "limit": settings.rss_limit}
    return {
        "settings": asdict(settings),
        "requests": len(planned), "well_formed": len(well_formed), "well_formed_choices": choices,
        "wall_s": wall, "counts": counts, "statuses": statuses,
        "completed": sum(1 for o in outcomes if o.result == "completed"),
        "disconnected": sum(1 for o in outcomes if o.result == "disconnected"),
        "refused": sum(1 for o in outcomes if o.result == "refused"),
        "failed": len(failures), "failures": failures[:50],
        "server": server,
        "rss": {"pid": pid, "baseline_bytes": rss["baseline"], "end_bytes": rss["end"], "growth": growth,
                "peak_bytes": max((s[2] for s in rss["samples"]), default=None), "samples": rss["samples"]},
        "checks": checks,
    }


def _label_delta(before: str, after: str, name: str, label: str, value: str) -> float:
    pattern = re.compile(rf'{re.escape(name)}\{{[^}}]*{label}="{re.escape(value)}"[^}}]*\}} (\S+)')

    def read(text: str) -> float:
        return sum(float(m.group(1)) for m in pattern.finditer(text))

    return read(after) - read(before)


def passed(record: dict) -> bool:
    return all(check["passed"] for check in record["checks"].values())


def summary_lines(record: dict) -> list[str]:
    rss, server = record["rss"], record["server"]
    lines = [f"requests {record['requests']} in {record['wall_s']:.0f} s: completed {record['completed']}, "
             f"disconnected by the client {record['disconnected']}, invalid refused {record['refused']}, "
             f"failed {record['failed']}",
             f"statuses: {', '.join(f'{k}: {v}' for k, v in sorted(record['statuses'].items()))}",
             f"server: finished choices {server['finished_choices']:g} (expected {record['well_formed_choices']}), "
             f"aborted {server['aborted_choices']:g}, generated tokens {server['generation_tokens']:g}, "
             f"running/waiting at the end {server['running_at_end']}/{server['waiting_at_end']}"]
    if rss["growth"] is not None:
        lines.append(f"server RSS: {rss['baseline_bytes'] / 2**20:.0f} MiB after warm-up -> {rss['end_bytes'] / 2**20:.0f} "
                     f"MiB at the end ({rss['growth']:+.2%}), peak {rss['peak_bytes'] / 2**20:.0f} MiB")
    else:
        lines.append("server RSS: not measured (no server pid)")
    for name, check in record["checks"].items():
        detail = {k: v for k, v in check.items() if k != "passed"}
        lines.append(f"  {'PASS' if check['passed'] else 'FAIL'} {name} {json.dumps(detail)}")
    for failure in record["failures"][:5]:
        lines.append(f"  failed #{failure['index']} ({failure['kind']}, {failure['route']}): {failure['detail']}")
    return lines


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="soak this server (base URL) instead of starting one")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's pid, to measure its memory")
    parser.add_argument("--target", default="smollm2", help="the model the started server serves (default smollm2)")
    parser.add_argument("--serve-args", default="", help="more `verispec serve` arguments, one string")
    parser.add_argument("--requests", type=int, default=Settings.requests, help="requests to send (default 2000)")
    parser.add_argument("--concurrency", type=int, default=Settings.concurrency, help="requests in flight (default 64)")
    parser.add_argument("--max-tokens", type=int, default=Settings.max_tokens,
                        help="most tokens a request asks for (default 24)")
    parser.add_argument("--disconnect", type=float, default=Settings.disconnect,
                        help="share of clients that close their stream early (default 0.10)")
    parser.add_argument("--invalid", type=float, default=Settings.invalid,
                        help="share of invalid bodies (default 0.05)")
    parser.add_argument("--warmup", type=int, default=Settings.warmup,
                        help="requests ended before the RSS baseline is taken (default 200)")
    parser.add_argument("--rss-limit", type=float, default=Settings.rss_limit,
                        help="largest RSS growth from the baseline to the end that passes (default 0.05)")
    parser.add_argument("--seed", type=int, default=Settings.seed, help="request plan seed (default 0)")
    parser.add_argument("--timeout", type=float, default=Settings.timeout_s, help="seconds per request (default 600)")
    parser.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"), help="the server's API key")
    parser.add_argument("--out", help="write the JSON record here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    problems = [f"--requests must be >= 1, got {args.requests}" if args.requests < 1 else None,
                f"--concurrency must be >= 1, got {args.concurrency}" if args.concurrency < 1 else None,
                f"--max-tokens must be >= 1, got {args.max_tokens}" if args.max_tokens < 1 else None,
                f"--warmup must be in 0..{args.requests - 1}, got {args.warmup}"
                if not 0 <= args.warmup < args.requests else None,
                "--disconnect and --invalid must be shares in 0..1 that sum to at most 1"
                if not (0 <= args.disconnect <= 1 and 0 <= args.invalid <= 1 and args.disconnect + args.invalid <= 1)
                else None,
                f"--rss-limit must be > 0, got {args.rss_limit}" if not args.rss_limit > 0 else None,
                f"--timeout must be > 0, got {args.timeout}" if not args.timeout > 0 else None,
                "--server-pid goes with --url" if args.server_pid is not None and not args.url else None]
    problem = next((p for p in problems if p), None)
    if problem:
        raise SystemExit(_usage_error(problem))
    settings = Settings(args.requests, args.concurrency, args.max_tokens, args.disconnect, args.invalid, args.warmup,
                        args.rss_limit, args.seed, args.timeout, args.api_key)
    return args, settings


def _usage_error(message: str) -> int:
    print(f"soak.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        args, settings = parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    server = None
    try:
        if args.url:
            url, pid = args.url.rstrip("/").removesuffix("/v1"), args.server_pid
        else:
            from verispec.errors import VerispecError

            try:
                server = LaunchedServer(["--target", args.target, *shlex.split(args.serve_args)])
            except VerispecError as err:
                print(f"soak.py: error: {str(err).splitlines()[0]}", file=sys.stderr)
                return 2
            url, pid = server.url, server.process.pid
        record = asyncio.run(run_soak(url, settings, pid, progress=not args.quiet))
    finally:
        exit_status = server.stop() if server is not None else None
    if server is not None:
        record["server"]["command"] = server.command
        record["server"]["exit_status"] = exit_status
        record["checks"]["clean_exit"] = {"passed": exit_status == 0, "value": exit_status}
        if not passed(record):
            record["server"]["log_tail"] = server.log_tail()
    record["passed"] = passed(record)
    for line in summary_lines(record):
        print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
