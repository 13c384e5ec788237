"""The endpoint audit's client: one OpenAI-compatible server (``Endpoint``: base URL, model, retries,
the request body, each sample's text and reported logprobs) and the probes that settle whether it takes
``ignore_eos`` and returns logprobs. Re-exported by ``verispec.audit_endpoint``."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from verispec.audit import CHAT_PREFIX
from verispec.config import SamplingParams
from verispec.errors import VerispecError

RETRY_STATUS = (429, 502, 503, 504)


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
            out = [((c["message"]["content"] if route.startswith("chat") else c["text"]) or "",
                    c.get("finish_reason")) for c in ordered]
        except (KeyError, TypeError, AttributeError):
            raise VerispecError(f"{self.url}/v1/{route} answered without choices: "
                                f"{json.dumps(answer)[:200]}") from None
        if len(out) != choices:
            raise VerispecError(f"{self.url}/v1/{route} returned {len(out)} choices for n = {choices}; "
                                "use --choices 1")
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
