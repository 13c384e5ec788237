"""Drawing the endpoint audit's samples: independent seed streams for the endpoint and the reference,
requests in flight at once (``collect``), a server or a local model as the source (``sample_prompts``).
Re-exported by ``verispec.audit_endpoint``."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from verispec.audit import sample_seeds
from verispec.audit_endpoint_client import Endpoint
from verispec.config import SamplingParams

REFERENCE_STREAM = 1 << 20  # the reference's seeds: SeedSequence([seed, REFERENCE_STREAM + prompt index])
SEED_MODULUS = 1 << 63  # seeds sent in [0, 2^63): within every server's range, and seed + choice too


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
