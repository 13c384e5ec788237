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

This module runs the audit and the command; the server client and its probes are in
verispec/audit_endpoint_client.py, the sampling in verispec/audit_endpoint_sampling.py, the report types and
text in verispec/audit_endpoint_report.py (all re-exported here).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

import numpy as np

from verispec.audit import (BUILTIN_PROMPTS, CHAT_PREFIX, DEFAULT_ALPHA, DEFAULT_SAMPLES, DEFAULT_TOKENS,
                            MIN_SAMPLES, THOROUGH_SAMPLES, _parse_ids)
# the client, sampling, report and two-sample names are re-exported: this module is their public path
from verispec.audit_endpoint_client import (RETRY_STATUS, Endpoint, EndpointError, _error_detail,  # noqa: F401
                                            _logprob_sum, _settle, base_url, settle_ignore_eos, settle_logprobs)
from verispec.audit_endpoint_report import EXIT_CODES, EndpointReport, PromptResult, format_report  # noqa: F401
from verispec.audit_endpoint_sampling import (REFERENCE_STREAM, SEED_MODULUS, Sampler, Samples,  # noqa: F401
                                              audit_seeds, collect, endpoint_sampler, local_sampler,
                                              sample_prompts)
from verispec.config import SamplingParams
from verispec.errors import VerispecError
from verispec.two_sample import TwoSample, two_sample_test, verdict_of  # noqa: F401

MAX_ENDPOINT_TOKENS = 64
LOGPROB_TOLERANCE = 0.05  # nats: the most a token sequence's summed logprobs may differ between reports


# ---- the audit ----------------------------------------------------------------------------------------


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
        top = [[text, counts.get(text, 0), ref_counts.get(text, 0)]
               for text, _ in (counts + ref_counts).most_common(5)]
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
