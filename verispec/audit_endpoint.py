"""Black-box lossless audit of any OpenAI-compatible server: ``verispec audit --endpoint URL``.

    verispec audit --endpoint http://gpu-box:8000/v1 --reference http://gpu-box:8001 \\
        --temperature 0.7 --top-k 20 --tokens 3 --samples 2000 --prompt "The capital of France is"
    verispec audit --endpoint http://localhost:8000 --target tiny --temperature 0.8 --top-k 4 --tokens 3
        # (against `verispec serve --target tiny`: the reference is the same model, decoded here)

The server is a black box: all it must do is answer ``POST /v1/completions`` (``/v1/chat/completions``
for a prompt written ``chat: TEXT``, sent as one user message). Speculative decoding is lossless when
the server's continuations follow the same distribution as plain decoding of its target, so the audit
compares the server's continuations with a reference's:

- ``--reference URL``: a second endpoint serving the same model (same weights, same precision) with
  speculation off, e.g. a vLLM without ``--speculative-config`` or ``verispec serve --no-spec``;
- ``--target T``: a model verispec loads (``verispec audit --target`` accepts the same names and paths),
  sampled here with plain decoding. The prompt is tokenized as ``verispec serve`` does (no special
  tokens added); for a server that adds a BOS (vLLM), give ``--prompt-ids`` with the BOS. Its
  probabilities differ from the server's by the server's numerics (dtype, kernels), so against a
  remote GPU server a second endpoint is the fairer reference.

Per prompt: N continuations of n tokens from the endpoint and N_ref from the reference, each request
with its own seed (the reference's from an independent stream), compared as TEXT (no tokenizer needed;
equal token distributions give equal text distributions) by ``verispec.two_sample``: a two-sample
chi-square over the distinct texts, TV against its noise floor, and a Bonferroni verdict over prompts.
Where the servers return logprobs, a second check (``logprob_check``): the same token sequence must get
the same summed logprobs in every sample and at a reference endpoint, else FAIL.
Exit status: 0 pass, 1 FAIL, 2 bad input or an endpoint that cannot be used (one line), 3 inconclusive.
The method, its thresholds and the sample sizes that catch planted verifier bugs: docs/auditing.md.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from verispec.audit import (BUILTIN_PROMPTS, CHAT_PREFIX, DEFAULT_ALPHA, DEFAULT_SAMPLES, DEFAULT_TOKENS,
                            MIN_SAMPLES, THOROUGH_SAMPLES, _parse_ids, prompt_label, sample_seeds)
from verispec.config import SamplingParams
from verispec.errors import VerispecError
from verispec.two_sample import TwoSample, two_sample_test, verdict_of

MAX_ENDPOINT_TOKENS = 64
REFERENCE_STREAM = 1 << 20  # the reference's seeds: SeedSequence([seed, REFERENCE_STREAM + prompt index])
SEED_MODULUS = 1 << 63  # seeds sent in [0, 2^63): within every server's range, and seed + choice too
RETRY_STATUS = (429, 502, 503, 504)
EXIT_CODES = {"pass": 0, "FAIL": 1, "inconclusive": 3}
LOGPROB_TOLERANCE = 0.05  # nats: the most a token sequence's summed logprobs may differ between reports


# ---- talking to a server ------------------------------------------------------------------------------


def base_url(url: str) -> str:
    """The server's base URL: scheme://host[:port][/prefix], with or without a trailing /v1."""
    text = url.strip().rstrip("/")
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not rest:
        raise VerispecError(f"an endpoint must be an http(s) URL such as http://localhost:8000/v1, got {url!r}")
    return text[:-3].rstrip("/") if text.endswith("/v1") else text


@dataclass
class Endpoint:
    """One OpenAI-compatible server: where, which model, and how to ask."""

    url: str  # base URL, without /v1
    model: str | None = None
    api_key: str | None = None
    timeout: float = 120.0
    retries: int = 3
    ignore_eos: bool = True  # send ``ignore_eos: true`` (settled by ``settle_ignore_eos``)
    logprobs: bool = False  # ask for each token's logprob (settled by ``settle_logprobs``)
    # (prompt, tokens) -> the summed token logprobs the server reported for each sample of those tokens
    reported: dict = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def call(self, route: str, body: dict | None = None) -> dict:
        """GET (no body) or POST JSON to {url}/v1/{route}; HTTP errors become one-line VerispecErrors,
        after ``retries`` retries of the transient ones (429, 502-504, a reset connection, a timeout)."""
        url = f"{self.url}/v1/{route}"
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            retry = attempt < self.retries
            try:
                request = urllib.request.Request(url, data=data, headers=headers,
                                                 method="GET" if data is None else "POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = response.read()
            except urllib.error.HTTPError as err:
                detail = _error_detail(err.read())
                if retry and err.code in RETRY_STATUS:
                    time.sleep(min(8.0, 0.5 * 2 ** attempt))
                    continue
                raise EndpointError(f"{url}: HTTP {err.code}: {detail}", err.code, detail) from None
            except (urllib.error.URLError, OSError) as err:
                reason = getattr(err, "reason", err)
                if retry and isinstance(reason, (TimeoutError, ConnectionResetError, ConnectionAbortedError)):
                    time.sleep(min(8.0, 0.5 * 2 ** attempt))
                    continue
                raise EndpointError(f"cannot reach {url}: {reason}") from None
            try:
                return json.loads(payload)
            except ValueError:
                raise EndpointError(f"{url} did not answer with JSON: {payload[:120]!r}") from None
        raise AssertionError("unreachable")

    def discover_model(self) -> str:
        """The first model of GET /v1/models, unless one was given."""
        if self.model is None:
            listing = self.call("models")
            models = listing.get("data") if isinstance(listing, dict) else None
            if not models or not isinstance(models[0], dict) or "id" not in models[0]:
                raise VerispecError(f"{self.url}/v1/models lists no model; give one with --model")
            self.model = str(models[0]["id"])
        return self.model

    def body(self, prompt: str | list[int], sampling: SamplingParams, tokens: int, seed: int,
             choices: int) -> tuple[str, dict]:
        """The route and JSON body of one sampling request."""
        body: dict = {"model": self.model, "max_tokens": tokens, "seed": seed, "temperature": sampling.temperature,
                      "top_p": sampling.top_p, "stream": False}
        if choices != 1:
            body["n"] = choices
        for name, off in (("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
            if getattr(sampling, name) != off:
                body[name] = getattr(sampling, name)
        if self.ignore_eos:
            body["ignore_eos"] = True
        chat = isinstance(prompt, str) and prompt.startswith(CHAT_PREFIX)
        if self.logprobs:
            body["logprobs"] = True if chat else 0  # each sampled token's logprob, no alternatives
        if chat:
            body["messages"] = [{"role": "user", "content": prompt.removeprefix(CHAT_PREFIX)}]
            return "chat/completions", body
        body["prompt"] = prompt
        return "completions", body

    def sample(self, prompt: str | list[int], sampling: SamplingParams, tokens: int, seed: int,
               choices: int = 1) -> list[tuple[str, str | None]]:
        """(text, finish_reason) of each choice of one request."""
        route, body = self.body(prompt, sampling, tokens, seed, choices)
        answer = self.call(route, body)
        try:
            ordered = sorted(answer["choices"], key=lambda choice: choice.get("index", 0))
            out = [((c["message"]["content"] if route.startswith("chat") else c["text"]) or "", c.get("finish_reason"))
                   for c in ordered]
        except (KeyError, TypeError, AttributeError):
            raise VerispecError(f"{self.url}/v1/{route} answered without choices: {json.dumps(answer)[:200]}") from None
        if len(out) != choices:
            raise VerispecError(f"{self.url}/v1/{route} returned {len(out)} choices for n = {choices}; use --choices 1")
        if self.logprobs:
            for choice in ordered:
                found = _logprob_sum(choice, route.startswith("chat"))
                if found is not None:
                    with self._lock:
                        self.reported.setdefault((json.dumps(prompt), found[0]), []).append(found[1])
        return out


def _logprob_sum(choice: dict, chat: bool) -> tuple[tuple, float] | None:
    """The tokens of one choice (as the server names them) and their summed logprobs; None where the
    answer carries none. Keyed by tokens, not text: one text may come from several token sequences (a
    special token that decodes to nothing, another segmentation), each with its own probability."""
    try:
        logprobs = choice.get("logprobs") or {}
        if chat:
            tokens = [entry["token"] for entry in logprobs["content"]]
            values = [entry["logprob"] for entry in logprobs["content"]]
        else:
            tokens, values = logprobs["tokens"], logprobs["token_logprobs"]
        if not values or len(tokens) != len(values) or not all(isinstance(v, (int, float)) for v in values):
            return None
        return tuple(str(t) for t in tokens), float(sum(values))
    except (KeyError, TypeError, AttributeError):
        return None


def logprob_check(endpoint: Endpoint, reference=None, tolerance: float = LOGPROB_TOLERANCE) -> dict | None:
    """The second check, where the servers report logprobs: the same tokens after the same prompt must carry
    the same summed logprobs in every sample (``max_spread``) and, against a reference endpoint that
    reports them too, the same as there (``max_difference``, over the token sequences both sampled),
    within ``tolerance`` nats. A server whose reports do not fit its own samples or the reference's (logprobs
    from another distribution than the one that decided the tokens) fails it. None: nothing reported."""
    if not endpoint.reported:
        return None
    spread = max(max(values) - min(values) for values in endpoint.reported.values())
    theirs = reference.reported if isinstance(reference, Endpoint) else {}
    common = [key for key in endpoint.reported if key in theirs]
    difference = max((abs(float(np.mean(endpoint.reported[key])) - float(np.mean(theirs[key]))) for key in common),
                     default=None)
    agree = spread <= tolerance and (difference is None or difference <= tolerance)
    return {"sequences": len(endpoint.reported), "max_spread": spread, "common": len(common),
            "max_difference": difference, "tolerance": tolerance, "agree": agree}


class EndpointError(VerispecError):
    def __init__(self, message: str, status: int | None = None, detail: str = ""):
        super().__init__(message)
        self.status, self.detail = status, detail


def _error_detail(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", error.get("detail", error)) if isinstance(error, dict) else error
        text = message if isinstance(message, str) else json.dumps(message)
    except ValueError:
        pass
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def _settle(endpoint: Endpoint, option: str, mode: str, prompt, sampling: SamplingParams, tokens: int,
            named: str) -> str:
    """Set ``endpoint.<option>`` for ``mode``: "yes" and "no" as said ("set"); "auto" sends one probe
    request with it on, and turns it off where the server answers 400 naming ``named`` ("refused"),
    else keeps it ("accepted")."""
    setattr(endpoint, option, mode != "no")
    if mode != "auto":
        return "set"
    try:
        endpoint.sample(prompt, sampling, tokens, seed=0)
    except EndpointError as err:
        if err.status == 400 and named in err.detail:
            setattr(endpoint, option, False)
            return "refused"
        raise
    return "accepted"


def settle_ignore_eos(endpoint: Endpoint, mode: str, prompt, sampling: SamplingParams, tokens: int) -> str | None:
    """Decide whether ``endpoint`` gets ``ignore_eos`` ("yes", "no", or "auto": ``_settle``). Returns a note
    when auto turned it off."""
    if _settle(endpoint, "ignore_eos", mode, prompt, sampling, tokens, "ignore_eos") == "refused":
        return f"{endpoint.url} refused ignore_eos: its continuations may end early at EOS"
    return None


def settle_logprobs(endpoint: Endpoint, mode: str, prompt, sampling: SamplingParams, tokens: int) -> str | None:
    """Decide whether ``endpoint`` is asked for logprobs ("yes", "no", or "auto": ``_settle``; an answer
    without them also turns auto off). Returns a note when auto turned it off."""
    outcome = _settle(endpoint, "logprobs", mode, prompt, sampling, tokens, "logprob")
    if outcome == "refused":
        return f"{endpoint.url} refused logprobs: no logprob check"
    if outcome == "accepted":
        probed = bool(endpoint.reported)
        endpoint.reported.clear()  # the probe is not a sample
        if not probed:
            endpoint.logprobs = False
            return f"{endpoint.url} answered without logprobs: no logprob check"
    return None


# ---- sampling -----------------------------------------------------------------------------------------


Sampler = Callable[[Sequence[int]], list[tuple[str, str | None]]]  # seeds -> (text, finish reason) each


def endpoint_sampler(endpoint: Endpoint, prompt, sampling: SamplingParams, tokens: int) -> Sampler:
    """One request per group of seeds: n = len(seeds) choices, seeded with the first."""
    def run(seeds: Sequence[int]) -> list[tuple[str, str | None]]:
        return endpoint.sample(prompt, sampling, tokens, seeds[0], len(seeds))
    return run


def collect(sampler: Sampler, seeds: Sequence[int], choices: int, concurrency: int,
            advance: Callable[[int], None] = lambda n: None) -> tuple[Counter, Counter]:
    """Counts of the texts and of the finish reasons of len(seeds) samples, ``choices`` per call,
    ``concurrency`` calls at once (a failed call cancels the rest and raises)."""
    groups = [list(seeds[i:i + choices]) for i in range(0, len(seeds), choices)]
    texts, finish = Counter(), Counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futures = [pool.submit(sampler, group) for group in groups]
        try:
            for future in futures:
                results = future.result()
                for text, reason in results:
                    texts[text] += 1
                    finish[str(reason)] += 1
                advance(len(results))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return texts, finish


def local_sampler(engine, tokenizer, prompt_ids: list[int], sampling: SamplingParams, tokens: int,
                  eos: Sequence[int], ignore_eos: bool) -> Sampler:
    """Plain decoding of a loaded target, decoded as ``verispec serve`` decodes (special tokens skipped)."""
    from verispec.config import SpecConfig, StopRules

    spec, stop = SpecConfig(method="none"), StopRules(max_tokens=tokens, eos_ids=tuple(eos), ignore_eos=ignore_eos)

    def run(seeds: Sequence[int]) -> list[tuple[str, str | None]]:
        out = []
        for seed in seeds:
            result = engine.generate(prompt_ids, sampling, spec, stop, seed=seed)
            reason = "length" if len(result.tokens) >= tokens else "stop"
            out.append((tokenizer.decode(result.tokens, skip_special_tokens=True), reason))
        return out
    return run


def audit_seeds(seed: int, prompt_index: int, count: int, reference: bool = False) -> list[int]:
    """Independent seeds for the endpoint's and the reference's samples of one prompt."""
    stream = REFERENCE_STREAM + prompt_index if reference else prompt_index
    return [s % SEED_MODULUS for s in sample_seeds(seed, stream, count)]


# ---- statistics (pure) --------------------------------------------------------------------------------


# ---- the audit ----------------------------------------------------------------------------------------


@dataclass
class PromptResult:
    prompt: str | None
    prompt_ids: list[int] | None
    test: TwoSample
    finish: dict  # the endpoint's finish reasons and their counts
    reference_finish: dict
    top: list  # the most common texts: [text, count, reference count]

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "prompt_ids": self.prompt_ids, **asdict(self.test),
                "conclusive": self.test.conclusive, "finish_reasons": self.finish,
                "reference_finish_reasons": self.reference_finish, "top_texts": self.top}


@dataclass
class EndpointReport:
    verdict: str  # "pass", "FAIL" or "inconclusive"
    p_value: float  # Bonferroni over the prompts tested
    tv: float  # mean over prompts
    noise_floor: float  # mean over prompts
    alpha: float
    samples: int
    reference_samples: int
    tokens: int
    seed: int
    endpoint: dict  # url, model
    reference: dict  # url and model, or target
    sampling: SamplingParams
    prompts: list[PromptResult]
    notes: list[str] = field(default_factory=list)
    reason: str | None = None  # why inconclusive, or why FAIL when the logprob check failed
    logprobs: dict | None = None  # logprob_check's result, where the servers reported logprobs

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def as_dict(self) -> dict:
        s = self.sampling
        sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                    "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                    "repetition_penalty": s.repetition_penalty}
        return {"verdict": self.verdict, "p_value": self.p_value, "tv": self.tv, "noise_floor": self.noise_floor,
                "alpha": self.alpha, "samples": self.samples, "reference_samples": self.reference_samples,
                "tokens": self.tokens, "seed": self.seed, "endpoint": self.endpoint, "reference": self.reference,
                "sampling": sampling, "prompts": [p.as_dict() for p in self.prompts], "notes": self.notes,
                "reason": self.reason, "logprobs": self.logprobs}


Samples = list  # per prompt, (Counter of texts, Counter of finish reasons): what ``sample_prompts`` returns


def sample_prompts(source, prompts: Sequence[str | list[int]], sampling: SamplingParams, tokens: int, samples: int,
                   seed: int = 0, concurrency: int = 8, choices: int = 1, reference: bool = False,
                   advance: Callable[[int], None] = lambda n: None) -> Samples:
    """``samples`` continuations of each prompt from ``source``: an Endpoint, or a function prompt -> Sampler
    (a local model: sampled in one thread). ``reference`` picks the reference's independent seed stream."""
    out = []
    for index, prompt in enumerate(prompts):
        seeds = audit_seeds(seed, index, samples, reference)
        if isinstance(source, Endpoint):
            out.append(collect(endpoint_sampler(source, prompt, sampling, tokens), seeds, choices,
                               concurrency, advance))
        else:
            out.append(collect(source(prompt), seeds, 64, 1, advance))
    return out


def run_endpoint_audit(endpoint: Endpoint, reference, prompts: Sequence[str | list[int]], sampling: SamplingParams,
                       tokens: int, samples: int, reference_samples: int | None = None, seed: int = 0,
                       alpha: float = DEFAULT_ALPHA, concurrency: int = 8, choices: int = 1, progress: bool = False,
                       notes: Sequence[str] = (), reference_info: dict | None = None,
                       logprob_tolerance: float = LOGPROB_TOLERANCE) -> EndpointReport:
    """Audit ``endpoint`` against ``reference``: a second Endpoint, a function prompt -> Sampler (a local
    model), or what ``sample_prompts(..., reference=True)`` returned for these prompts (one reference sample
    shared by several audits)."""
    from tqdm import tqdm

    drawn = isinstance(reference, list)
    reference_samples = sum(reference[0][0].values()) if drawn else (reference_samples or samples)
    if drawn and len(reference) != len(prompts):
        raise VerispecError(f"the reference samples cover {len(reference)} prompts, not {len(prompts)}")
    options = dict(sampling=sampling, tokens=tokens, seed=seed, concurrency=concurrency, choices=choices)
    with tqdm(total=len(prompts) * (samples + (0 if drawn else reference_samples)), desc="audit", unit="seq",
              file=sys.stderr, disable=not progress, mininterval=1.0 if sys.stderr.isatty() else 30.0) as bar:
        ours = sample_prompts(endpoint, prompts, samples=samples, advance=bar.update, **options)
        theirs = reference if drawn else sample_prompts(reference, prompts, samples=reference_samples,
                                                        reference=True, advance=bar.update, **options)
    results = []
    for prompt, (counts, finish), (ref_counts, ref_finish) in zip(prompts, ours, theirs):
        test = two_sample_test(counts, ref_counts, seed=seed)
        top = [[text, counts.get(text, 0), ref_counts.get(text, 0)] for text, _ in (counts + ref_counts).most_common(5)]
        results.append(PromptResult(prompt if isinstance(prompt, str) else None,
                                    None if isinstance(prompt, str) else list(prompt), test,
                                    dict(finish), dict(ref_finish), top))
    verdict, p_value, reason = verdict_of([r.test for r in results], alpha)
    check = logprob_check(endpoint, reference, logprob_tolerance)
    if check is not None and not check["agree"]:
        verdict, reason = "FAIL", (f"the logprobs disagree: a token sequence's summed logprobs differ by up to "
                                   f"{check['max_spread']:.3g} between its samples and "
                                   f"{check['max_difference'] or 0.0:.3g} from the reference's (tolerance "
                                   f"{logprob_tolerance:g} nats)")
    notes = list(notes)
    for result in results:
        ours_stop, theirs_stop = result.finish.get("stop", 0), result.reference_finish.get("stop", 0)
        if min(ours_stop, theirs_stop) == 0 and max(ours_stop, theirs_stop) >= max(5, 0.01 * samples):
            notes.append("one side's continuations end at EOS and the other's do not (ignore_eos honoured by one "
                         "only?): that alone makes the texts differ; use --ignore-eos no")
            break
    if reference_info is None:
        reference_info = {"url": reference.url, "model": reference.model} if isinstance(reference, Endpoint) else {}
    return EndpointReport(verdict, p_value, float(np.mean([r.test.tv for r in results])),
                          float(np.mean([r.test.noise_floor for r in results])), alpha, samples, reference_samples,
                          tokens, seed, {"url": endpoint.url, "model": endpoint.model}, reference_info, sampling,
                          results, notes, reason, check)


def format_report(report: EndpointReport) -> str:
    s = report.sampling
    reference = report.reference.get("url") or f"local target {report.reference.get('target')}"
    lines = [f"endpoint audit: {report.endpoint['url']} (model {report.endpoint['model']}) against {reference}"
             + (f" (model {report.reference['model']})" if report.reference.get("model") else ""),
             f"temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}, min-p {s.min_p:g}; n = "
             f"{report.tokens} tokens, N = {report.samples} (reference {report.reference_samples}) per prompt, "
             f"seed {report.seed}",
             f"{'prompt':<24} {'texts':>6} {'cells':>6} {'coverage':>8} {'TV':>7} {'floor':>7} {'chi2/dof':>13} "
             f"{'p-value':>9}"]
    for item in report.prompts:
        t = item.test
        label = prompt_label(item.prompt, item.prompt_ids)
        lines.append(f"{label:<24} {t.distinct:>6} {t.cells:>6} {t.coverage:>8.2f} {t.tv:>7.4f} {t.noise_floor:>7.4f} "
                     f"{f'{t.chi_square:.1f}/{t.dof}':>13} {t.p_value:>9.3g}")
    lines += [f"note: {note}" for note in report.notes]
    if report.logprobs is not None:
        check = report.logprobs
        against = (f", up to {check['max_difference']:.3g} from the reference's over {check['common']} sequences"
                   if check["max_difference"] is not None else "")
        lines.append(f"logprobs: {'agree' if check['agree'] else 'DISAGREE'} (a token sequence's summed logprobs vary "
                     f"by up to {check['max_spread']:.3g} nats between its samples{against}; tolerance "
                     f"{check['tolerance']:g})")
    tail = (f"p = {report.p_value:.3g} {'<' if report.verdict == 'FAIL' else '>='} alpha {report.alpha:g}, Bonferroni "
            f"over {len(report.prompts)} prompt(s); TV {report.tv:.4f} vs noise floor {report.noise_floor:.4f}")
    if report.verdict == "inconclusive":
        tail = f"{report.reason}; {tail}"
    elif report.verdict == "FAIL" and report.reason:
        tail = report.reason
    lines.append(f"verdict: {report.verdict}  ({tail})")
    return "\n".join(lines)


# ---- command line (registered by verispec.audit) ------------------------------------------------------


def add_options(parser) -> None:
    group = parser.add_argument_group(
        "black-box audit of a server (--endpoint)",
        "Compare an OpenAI-compatible server's continuations with a reference's: a second endpoint "
        "(--reference, the same model with speculation off) or a local model (--target, plain decoding). "
        "Exit status 3 when the samples cannot decide. See verispec/audit_endpoint.py.")
    group.add_argument("--endpoint", metavar="URL", help="the server to audit: its base URL, with or without /v1")
    group.add_argument("--reference", metavar="URL", help="a second server, the same model with speculation off")
    group.add_argument("--model", metavar="NAME",
                       help="the endpoint's model name (default: the first of GET /v1/models)")
    group.add_argument("--reference-model", metavar="NAME",
                       help="the reference's model name (default: the first it lists)")
    group.add_argument("--api-key", metavar="KEY",
                       help="bearer token for the endpoint (default: $OPENAI_API_KEY, if set)")
    group.add_argument("--reference-api-key", metavar="KEY",
                       help="bearer token for the reference (default: --api-key)")
    group.add_argument("--reference-samples", type=int, default=None, metavar="N",
                       help="continuations per prompt from the reference (default: --samples)")
    group.add_argument("--concurrency", type=int, default=8, metavar="K",
                       help="requests in flight at once (default 8)")
    group.add_argument("--choices", type=int, default=1, metavar="K",
                       help="continuations per request, OpenAI's n (default 1: one request, one seed each)")
    group.add_argument("--ignore-eos", choices=["auto", "yes", "no"], default="auto",
                       help="send ignore_eos: true (vLLM, verispec); auto drops it if the server refuses it")
    group.add_argument("--logprobs", choices=["auto", "yes", "no"], default="auto",
                       help="also ask for each token's logprob and check them (a token sequence's summed logprobs "
                            "the same in every sample and at the reference, within --logprob-tolerance); auto: "
                            "where the server returns them")
    group.add_argument("--logprob-tolerance", type=float, default=LOGPROB_TOLERANCE, metavar="NATS",
                       help=f"most a token sequence's summed logprobs may differ between reports (default "
                            f"{LOGPROB_TOLERANCE})")
    group.add_argument("--request-timeout", type=float, default=120.0, metavar="S",
                       help="seconds per request (default 120)")


def run_endpoint_command(args) -> int:
    from verispec import options

    if args.endpoint is None:
        raise VerispecError("--reference compares against the server to audit: give --endpoint URL")
    if (args.reference is None) == (args.target is None):
        raise VerispecError("give exactly one reference for --endpoint: --reference URL (the same model with "
                            "speculation off) or --target T (a model verispec loads, sampled here)")
    if any(getattr(args, name, None) for name in ("json_schema", "json_object", "regex", "grammar")):
        raise VerispecError("the endpoint audit does not send structured-output constraints; drop the grammar option")
    tokens = DEFAULT_TOKENS if args.tokens is None else args.tokens
    samples = (THOROUGH_SAMPLES if args.thorough else DEFAULT_SAMPLES) if args.samples is None else args.samples
    reference_samples = samples if args.reference_samples is None else args.reference_samples
    if not 1 <= tokens <= MAX_ENDPOINT_TOKENS:
        raise VerispecError(f"--tokens must be in 1..{MAX_ENDPOINT_TOKENS} for an endpoint audit, got {tokens}")
    if min(samples, reference_samples) < MIN_SAMPLES:
        raise VerispecError(f"--samples and --reference-samples must be >= {MIN_SAMPLES}, got {samples} and "
                            f"{reference_samples}")
    if not 0 < args.alpha < 1:
        raise VerispecError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.seed < 0:
        raise VerispecError(f"--seed must be >= 0 for an audit, got {args.seed}")
    if args.concurrency < 1 or not 1 <= args.choices <= 128:
        raise VerispecError(f"--concurrency must be >= 1 and --choices in 1..128, got {args.concurrency} and "
                            f"{args.choices}")
    if not args.request_timeout > 0:
        raise VerispecError(f"--request-timeout must be > 0, got {args.request_timeout}")
    sampling = options.sampling_from_args(args)
    prompts: list[str | list[int]] = list(args.prompt) + [_parse_ids(text) for text in args.prompt_ids]
    if not prompts:
        prompts = list(BUILTIN_PROMPTS if args.thorough else BUILTIN_PROMPTS[:1])

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    endpoint = Endpoint(base_url(args.endpoint), args.model, api_key, args.request_timeout)
    endpoint.discover_model()
    if not args.logprob_tolerance > 0:
        raise VerispecError(f"--logprob-tolerance must be > 0, got {args.logprob_tolerance}")
    notes = [n for n in [settle_ignore_eos(endpoint, args.ignore_eos, prompts[0], sampling, tokens),
                         settle_logprobs(endpoint, args.logprobs, prompts[0], sampling, tokens)] if n]
    if args.reference is not None:
        reference = Endpoint(base_url(args.reference), args.reference_model, args.reference_api_key or api_key,
                             args.request_timeout)
        reference.discover_model()
        notes += [n for n in [settle_ignore_eos(reference, args.ignore_eos, prompts[0], sampling, tokens),
                              settle_logprobs(reference, args.logprobs, prompts[0], sampling, tokens)] if n]
        if reference.ignore_eos != endpoint.ignore_eos:
            raise VerispecError("one server accepts ignore_eos and the other does not, so their continuations "
                                "would end differently: pass --ignore-eos no")
        info = None
    else:
        reference, info = _local_reference(args, sampling, tokens, endpoint.ignore_eos)
    report = run_endpoint_audit(endpoint, reference, prompts, sampling, tokens, samples, reference_samples,
                                args.seed, args.alpha, args.concurrency, args.choices, progress=True, notes=notes,
                                reference_info=info, logprob_tolerance=args.logprob_tolerance)
    print(json.dumps(report.as_dict()) if args.json else format_report(report))
    return report.exit_code


def _local_reference(args, sampling: SamplingParams, tokens: int, ignore_eos: bool):
    """A prompt -> Sampler function that decodes the loaded --target plainly, and its description."""
    from verispec.config import SpecConfig
    from verispec.loading import build_engine, encode_prompt, eos_ids, load_pair

    pair = load_pair(args.target, None, device=args.device, need_draft=False, backend=args.backend)
    engine = build_engine(pair, SpecConfig(method="none"))
    eos = eos_ids(pair.tokenizer, pair.target)
    end = pair.tokenizer.get_vocab().get("<|end|>")  # verispec serve's chat requests also stop there
    chat_eos = eos + ([end] if end is not None and end not in eos else [])
    vocab = pair.target.config.vocab_size

    def sampler(prompt) -> Sampler:
        if isinstance(prompt, str):
            ids = encode_prompt(pair.tokenizer, prompt.removeprefix(CHAT_PREFIX), chat=prompt.startswith(CHAT_PREFIX))
        else:
            ids = list(prompt)
            if any(not 0 <= t < vocab for t in ids):
                raise VerispecError(f"prompt token ids must be in 0..{vocab - 1} for this target, got {ids}")
        chat = isinstance(prompt, str) and prompt.startswith(CHAT_PREFIX)
        return local_sampler(engine, pair.tokenizer, ids, sampling, tokens, chat_eos if chat else eos, ignore_eos)

    return sampler, {"target": str(args.target)}
