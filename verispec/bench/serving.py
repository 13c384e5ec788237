"""Serving runs: streamed requests to OpenAI-compatible endpoints at a fixed arrival rate or concurrency.

Two kinds of load point, measured separately:

- ``rate=R``: open loop; request i is sent at a fixed offset drawn once (seeded) from gamma-distributed
  gaps with mean 1/R and shape ``burstiness`` (1 = Poisson, as vLLM's serving benchmark). Every endpoint
  gets the same offsets and prompt order. Low rates measure latency at low load.
- ``mcN``: closed loop; N requests in flight, the next sent when one finishes (saturated throughput).

Everything is measured client-side from the stream: TTFT (sent -> first non-empty chunk), the gaps
between chunks, end-to-end. Output tokens come from the final usage chunk (``stream_options``); tokens per
chunk, for the per-token ITL, are estimated by re-tokenizing each delta. Our server also returns its own
acceptance statistics (``return_spec_stats``) when asked.

    with launched_server(["--method", "chain", "--gamma", "4"], model_args) as url: ...
    records, wall = asyncio.run(run_load(endpoint, jobs, LoadPoint("rate", 2.0), ...))
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from verispec.bench.config import ServingSettings
from verispec.bench.offline import Job, fail_record, finish_record
from verispec.bench.records import RequestRecord
from verispec.config import SamplingParams
from verispec.errors import VerispecError


@dataclass(frozen=True)
class LoadPoint:
    kind: str  # rate | concurrency
    value: float

    @property
    def name(self) -> str:
        if self.kind == "rate":
            return "rate=inf" if math.isinf(self.value) else f"rate={self.value:g}"
        return f"mc{int(self.value)}"


@dataclass(frozen=True)
class ResolvedEndpoint:
    name: str
    url: str  # base URL without /v1
    model: str
    server_stats: bool


def load_points(settings: ServingSettings) -> list[LoadPoint]:
    return [LoadPoint("rate", r) for r in settings.request_rates] + \
           [LoadPoint("concurrency", c) for c in settings.max_concurrency]


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s) of ``count`` requests: cumulative gamma(shape=burstiness, scale=1/(rate*burstiness))
    gaps, mean 1/rate; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng, now, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        offsets.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


async def run_load(endpoint: ResolvedEndpoint, jobs: list[Job], load: LoadPoint, settings: ServingSettings,
                   sampling: SamplingParams, tokenizer, seed: int, progress=None) -> tuple[list[RequestRecord], float]:
    """All ``jobs`` against one endpoint at one load point; (records, wall seconds first send -> last end)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{endpoint.url}/v1", api_key=settings.api_key, max_retries=0,
                                timeout=settings.timeout_s)
    if load.kind == "rate":
        offsets = arrival_offsets(len(jobs), load.value, settings.burstiness, seed)
        gate = None
    else:
        offsets, gate = [0.0] * len(jobs), asyncio.Semaphore(int(load.value))
    began = time.perf_counter()

    async def one(job: Job, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, began + offset - time.perf_counter()))
        async with gate if gate is not None else contextlib.nullcontext():
            record = await _request(client, endpoint, job, sampling, settings, tokenizer)
        if progress is not None:
            progress.update(1)
        return record

    try:
        records = await asyncio.gather(*(one(job, offset) for job, offset in zip(jobs, offsets)))
    finally:
        await client.close()
    return list(records), time.perf_counter() - began


async def _request(client, endpoint: ResolvedEndpoint, job: Job, sampling: SamplingParams,
                   settings: ServingSettings, tokenizer) -> RequestRecord:
    record = job.new_record(endpoint.name)
    began = time.perf_counter()
    try:
        return await asyncio.wait_for(_stream(client, endpoint, job, sampling, tokenizer, record, began),
                                      settings.timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        return fail_record(record, "timeout", f"no finish within {settings.timeout_s:g} s", time.perf_counter() - began)
    except Exception as err:  # HTTP errors, dropped connections, error events: failed, never dropped
        status = "timeout" if getattr(err, "status_code", None) == 504 or "Timeout" in type(err).__name__ else "error"
        return fail_record(record, status, f"{type(err).__name__}: {err}", time.perf_counter() - began)


async def _stream(client, endpoint: ResolvedEndpoint, job: Job, sampling: SamplingParams, tokenizer,
                  record: RequestRecord, began: float) -> RequestRecord:
    prompt, stop = job.prompt, job.stop
    extra = {k: v for k, v in (("top_k", sampling.top_k), ("min_p", sampling.min_p)) if v}
    if stop.ignore_eos:
        extra["ignore_eos"] = True
    if endpoint.server_stats:
        extra["return_spec_stats"] = True
    common = dict(model=endpoint.model, max_tokens=stop.max_tokens, temperature=sampling.temperature,
                  top_p=sampling.top_p, seed=job.seed, stop=list(stop.stop_strings) or None, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra or None)
    if prompt.template == "chat":
        stream = await client.chat.completions.create(messages=prompt.messages, **common)
    else:
        stream = await client.completions.create(prompt=prompt.text, **common)
    times, pieces, finish, usage, stats = [], [], None, None, None
    async for chunk in stream:
        now = time.perf_counter()
        data = chunk.model_dump()
        usage = data.get("usage") or usage
        stats = data.get("spec_stats") or stats
        for choice in data.get("choices") or []:
            delta = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if delta:
                times.append(now)
                pieces.append(delta)
            finish = choice.get("finish_reason") or finish
    elapsed = time.perf_counter() - began
    text = "".join(pieces)
    encode = (lambda p: tokenizer.encode(p, add_special_tokens=False)) if tokenizer is not None else (lambda p: [p])
    counts = [max(1, len(encode(piece))) for piece in pieces]
    record.output_tokens = (usage or {}).get("completion_tokens") or sum(counts)
    counts = apportion(counts, record.output_tokens)
    record.e2e_s = elapsed
    if times:
        record.ttft_s = times[0] - began
        record.chunk_gaps_s = [b - a for a, b in zip(times, times[1:])]
        record.token_gaps_s = [0.0] * (counts[0] - 1)
        for gap, n in zip(record.chunk_gaps_s, counts[1:]):
            record.token_gaps_s += [gap] + [0.0] * (n - 1)
        record.rounds = len(times)
        record.committed = record.output_tokens
    if stats:
        _fill_server_stats(record, stats)
    finish_record(record, job, [], finish or "length", None, lambda _: text)
    record.tokens = None  # the client sees text only
    return record


def apportion(weights: list[int], total: int) -> list[int]:
    """Split ``total`` tokens over chunks in proportion to ``weights`` (largest remainders), each chunk
    at least 1 while there are enough: ``apportion([3, 1], 8) == [6, 2]``."""
    if not weights or sum(weights) == total:
        return list(weights)
    floor = 1 if total >= len(weights) else 0
    spare = total - floor * len(weights)
    shares = [spare * w / sum(weights) for w in weights]
    counts = [floor + int(s) for s in shares]
    order = sorted(range(len(weights)), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def _fill_server_stats(record: RequestRecord, stats: dict) -> None:
    """Acceptance from our server's per-request ``spec_stats`` (a ``RequestStats.summary()``)."""
    rounds = int(stats.get("rounds", 0))
    histogram = list(stats.get("acceptance_histogram", []))
    per_position = stats.get("per_position_acceptance", {})
    unconditional, conditional = per_position.get("unconditional", []), per_position.get("conditional", [])
    accepted_at = [sum(histogram[i:]) for i in range(1, len(histogram))]
    record.rounds, record.histogram = rounds, histogram
    record.drafted, record.accepted = int(stats.get("drafted", 0)), int(stats.get("accepted", 0))
    record.committed = round(stats.get("committed_per_round", 0.0) * rounds)
    record.tree_nodes = round(stats.get("tree_nodes", 0.0) * rounds)
    record.position_accepted = accepted_at
    # The summary holds rates; their denominators follow exactly when a rate is non-zero.
    record.position_proposed = [round(a / u) if u else rounds for a, u in zip(accepted_at, unconditional)]
    record.position_reached = [round(a / c) if c else (accepted_at[i - 1] if i else rounds)
                               for i, (a, c) in enumerate(zip(accepted_at, conditional))]
    split = stats.get("time_split", {})
    record.time_split_s = {k.removesuffix("_ms"): v / 1e3 for k, v in split.items()}


# ---- endpoints -------------------------------------------------------------------------------------------


def resolve_endpoint(name: str, url: str, model: str | None, server_stats: bool,
                     timeout_s: float = 30) -> ResolvedEndpoint:
    """Strip a trailing /v1 and ask /v1/models for the model id when none was given."""
    import json

    base = url.rstrip("/").removesuffix("/v1")
    if model is None:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout_s) as response:
                listed = json.loads(response.read())
            model = listed["data"][0]["id"]
        except (OSError, KeyError, IndexError, ValueError) as err:
            raise VerispecError(f"cannot list models at {base}/v1/models ({err}); is the server up? Or set the "
                                "endpoint's model") from None
    return ResolvedEndpoint(name, base, model, server_stats)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launched_server(serve_args: list[str], ready_timeout_s: float = 180.0, env: dict[str, str] | None = None):
    """Start ``verispec serve`` on a free local port (with ``env`` added to this process's environment);
    yield its base URL; stop it afterwards."""
    port = free_port()
    command = [sys.executable, "-m", "verispec.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **env} if env else None)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(process, url, ready_timeout_s, log)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(process: subprocess.Popen, url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise VerispecError(f"verispec serve exited with status {process.returncode} before it was ready:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.25)
    raise VerispecError(f"verispec serve at {url} was not ready within {timeout_s:g} s")
