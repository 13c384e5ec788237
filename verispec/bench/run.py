"""One benchmark run: load, build the prompt set once, run offline and serving comparisons, return JSON.

    result = run_bench(load_config("bench.toml"))
    result["offline"]["rows"]   # one row per (variant, load): tokens/s, latency, acceptance, speedups

The result holds the resolved config, hardware, package versions, model sizes, the prompt set (hash and
input-length distribution), the metric definitions, every request record and the compared rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import sys
import time
from pathlib import Path

import torch

from verispec.bench.config import CACHE_POLICY, BenchConfig, Variant
from verispec.bench.environment import PeakMemory, describe_hardware, model_facts, package_versions, process_peak_rss_mb
from verispec.bench.offline import Job, NativeRunner, run_offline
from verispec.bench.records import DEFINITIONS, RequestRecord, compare, mark_identical
from verispec.bench.workloads import BenchPrompt, build_prompt_set, describe_prompt_set, eos_for
from verispec.config import SamplingParams, StopRules
from verispec.errors import VerispecError
from verispec.loading import (ModelPair, eos_ids, freeze_long_lived_objects, load_pair, load_tokenizer,
                              TARGET_NAMES, resolve_draft_vocab, resolve_target,
                              shares_embedding)

log = logging.getLogger(__name__)
SCHEMA = "verispec-bench/1"


def run_bench(config: BenchConfig, progress: bool = True) -> dict:
    began = time.perf_counter()
    if config.models.threads:
        torch.set_num_threads(config.models.threads)
    variants = config.variants()
    result = {"schema": SCHEMA, "name": config.name,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "config": config.as_dict(), "environment": {"hardware": describe_hardware(config.models.device),
                                                          "versions": package_versions()},
              "definitions": DEFINITIONS, "cache_policy": CACHE_POLICY, "notes": []}
    pair = _load_pair(config, variants) if config.run_offline else None
    if pair is not None:
        variants = with_draft_vocab(variants, resolve_draft_vocab(pair, config.spec.draft_vocab))
    tokenizer = _tokenizer(config, pair)
    max_context = pair.target.config.max_context if pair is not None else int(min(tokenizer.model_max_length, 1 << 20))
    extra = max(v.num_drafts for v in variants) + 1
    prompts = build_prompt_set(config.prompts, tokenizer, max_context, extra_slots=extra)
    result["prompt_set"] = describe_prompt_set(prompts)
    sampling = SamplingParams(temperature=config.sampling.temperature, top_k=config.sampling.top_k,
                              top_p=config.sampling.top_p, min_p=config.sampling.min_p)
    eos = _eos_ids(tokenizer, pair)

    def make_job(prompt: BenchPrompt, index: int, repeat: int, load: str) -> Job:
        stop = StopRules(max_tokens=prompt.max_tokens, eos_ids=eos_for(prompt, eos, tokenizer),
                         ignore_eos=config.sampling.ignore_eos, stop_strings=prompt.stop_strings)
        return Job(prompt, stop, config.sampling.seed + 1000 * (repeat + 1) + index, repeat, load)

    if pair is not None:
        result["models"] = _models_section(pair, variants, prompts, config)
        result["offline"] = _offline(config, variants, pair, tokenizer, prompts, sampling, make_job, progress)
    if config.run_serving:
        result["serving"] = _serving(config, tokenizer, prompts, sampling, make_job, progress)
    result["process_peak_rss_mb"] = process_peak_rss_mb()
    result["duration_s"] = time.perf_counter() - began
    return result


def with_draft_vocab(variants: list[Variant], vocab: int | None) -> list[Variant]:
    """Draft-model variants with the draft vocabulary ``vocab`` (resolved as verispec generate / serve
    resolve --draft-vocab); the others unchanged."""
    return [dataclasses.replace(v, spec=dataclasses.replace(v.spec, draft_vocab=vocab))
            if v.spec is not None and v.spec.enabled and v.spec.drafter == "model" else v for v in variants]


def _offline(config: BenchConfig, variants: list[Variant], pair: ModelPair, tokenizer, prompts, sampling, make_job,
             progress: bool) -> dict:
    from tqdm import tqdm

    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    runners, settings = {}, config.offline
    peer_models = _peer_models(config, pair, variants)
    longest = max(len(p.prompt_ids) + p.max_tokens for p in prompts)
    for variant in variants:
        if variant.kind == "native":
            runners[variant.name] = NativeRunner(pair, variant, sampling, settings.timeout_s, decode, longest)
        else:
            from verispec.bench.peer import PeerRunner

            runners[variant.name] = PeerRunner(peer_models, variant, sampling, settings.timeout_s, decode)
    total = sum(len(prompts) * settings.repeats * sum(c == 1 or v.batchable for v in variants)
                for c in settings.concurrency)
    memory = PeakMemory(config.models.device)
    freeze_long_lived_objects()  # as verispec serve does: no full collection walks the models mid-run
    with tqdm(total=total, desc="bench offline", unit="req", file=sys.stderr, disable=not progress) as bar:
        outcome = run_offline(runners, prompts, make_job, settings, memory, bar)
    if config.sampling.temperature == 0:
        mark_identical(outcome.records, config.spec.baseline)
    references = tuple(dict.fromkeys(n for n in (config.spec.baseline, "hf") if n in runners))
    return {"rows": compare(outcome.records, outcome.walls, references, outcome.cpu), "references": list(references),
            "memory_method": memory.method, "notes": outcome.notes,
            "peer_settings": peer_models.settings if peer_models is not None else None,
            "requests": [r.as_dict() for r in outcome.records]}


def _serving(config: BenchConfig, tokenizer, prompts, sampling, make_job, progress: bool) -> dict:
    import contextlib

    from tqdm import tqdm

    from verispec.bench.serving import launched_server, load_points, resolve_endpoint, run_load

    settings = config.serving
    loads = load_points(settings)
    records, walls, endpoints = [], {}, []
    # Repeats per set of server processes: all of them in one set, or (relaunch) one set per repeat.
    server_sets = [[r] for r in range(settings.repeats)] if settings.relaunch else [list(range(settings.repeats))]
    total = (len(settings.launch) + len(settings.endpoints)) * len(loads) * settings.repeats * len(prompts)
    with tqdm(total=total, desc="bench serving", unit="req", file=sys.stderr, disable=not progress) as bar:
        for repeats in server_sets:
            with contextlib.ExitStack() as stack:
                endpoints = []
                for spec in settings.launch:
                    url = stack.enter_context(launched_server(_model_args(config) + list(spec.args),
                                                              env=dict(spec.env)))
                    stats = True if settings.server_stats is None else settings.server_stats
                    endpoints.append(resolve_endpoint(spec.name, url, None, stats))
                for e in settings.endpoints:
                    endpoints.append(resolve_endpoint(e.name, e.url, e.model, bool(settings.server_stats)))
                warm = [make_job(p, i, -1, "warmup") for i, p in enumerate(prompts[:1])]
                for endpoint in endpoints:
                    asyncio.run(run_load(endpoint, warm, loads[0], settings, sampling, tokenizer, 0))
                for k, load, repeat in [(k, load, r) for k, load in enumerate(loads) for r in repeats]:
                    jobs = [make_job(p, i, repeat, load.name) for i, p in enumerate(prompts)]
                    shift = (k + repeat) % len(endpoints)
                    for endpoint in endpoints[shift:] + endpoints[:shift]:
                        got, wall = asyncio.run(run_load(endpoint, jobs, load, settings, sampling, tokenizer,
                                                         config.prompts.seed + repeat, bar))
                        records += got
                        walls[(endpoint.name, load.name, repeat)] = wall
    if config.sampling.temperature == 0 and endpoints:
        mark_identical(records, endpoints[0].name)
    references = (endpoints[0].name,) if endpoints else ()
    return {"rows": compare(records, walls, references), "references": list(references),
            "endpoints": [dataclasses.asdict(e) for e in endpoints],
            "load_points": [load.name for load in loads],
            "requests": [r.as_dict() for r in records]}


def recompare(result: dict) -> dict:
    """Recompute every mode's rows from the stored requests and per-repeat walls with today's metrics,
    so that an old result.json gets today's report (e.g. intervals added after it was run)."""
    for mode in ("offline", "serving"):
        section = result.get(mode)
        if not section or "requests" not in section:
            continue
        records = [RequestRecord(**r) for r in section["requests"]]
        walls, cpu = {}, {}
        for row in section["rows"]:
            for unit in row["per_repeat"]:
                key = (row["variant"], row["load"], unit["repeat"])
                walls[key] = unit["wall_s"]
                if row.get("cpu_per_wall") is not None:
                    cpu[key] = row["cpu_per_wall"] * unit["wall_s"]
        section["rows"] = compare(records, walls, tuple(section["references"]), cpu or None)
    result["definitions"] = DEFINITIONS
    return result


# ---- models ------------------------------------------------------------------------------------------------


def _load_pair(config: BenchConfig, variants: list[Variant]) -> ModelPair:
    m = config.models
    needs_draft = any(v.needs_draft for v in variants)
    if needs_draft and m.target is not None and m.target not in TARGET_NAMES and m.draft is None:
        raise VerispecError("the variants chain, tree:* and hf_assisted need a draft: set models.draft (--draft) "
                            "or keep only off, ngram, self, hf and hf_prompt_lookup")
    pair = load_pair(m.target, m.draft, device=m.device, need_draft=needs_draft, backend=m.backend,
                     draft_weights=config.spec.draft_weights, need_eagle=any(v.needs_eagle for v in variants),
                     eagle_dir=m.eagle)
    if m.precision != "float32":
        dtype = getattr(torch, m.precision)
        for model in (pair.target, pair.draft):
            if model is not None:
                (model if isinstance(model, torch.nn.Module) else model.model).to(dtype)
    return pair


def _tokenizer(config: BenchConfig, pair: ModelPair | None):
    if config.models.tokenizer is not None:
        return load_tokenizer(config.models.tokenizer)
    if pair is not None:
        return pair.tokenizer
    return load_tokenizer(resolve_target(config.models.target)[0])


def _eos_ids(tokenizer, pair: ModelPair | None) -> tuple[int, ...]:
    if pair is not None:
        return tuple(eos_ids(tokenizer, pair.target))
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


def _peer_models(config: BenchConfig, pair: ModelPair, variants: list[Variant]):
    peers = [v for v in variants if v.kind == "peer"]
    if not peers:
        return None
    from verispec.bench.peer import PeerModels

    draft_dir = pair.draft_dir if any(v.peer == "assisted" for v in peers) else None
    if draft_dir is not None and shares_embedding(draft_dir):  # transformers needs a self-contained copy
        import tempfile

        from verispec.train.gguf_draft import export_hf_draft

        draft_dir = export_hf_draft(pair.draft, pair.tokenizer, tempfile.mkdtemp(prefix="verispec-peer-draft-"))
    return PeerModels.load(pair.target_dir, draft_dir, config.models.precision, config.models.device, config.spec)


def _model_args(config: BenchConfig) -> list[str]:
    m, args = config.models, []
    for flag, value in (("--target", m.target), ("--draft", m.draft), ("--device", m.device), ("--backend", m.backend)):
        if value is not None:
            args += [flag, str(value)]
    return args


def _models_section(pair: ModelPair, variants: list[Variant], prompts: list[BenchPrompt], config: BenchConfig) -> dict:
    target = model_facts(pair.target, pair.target_dir)
    draft = model_facts(pair.draft, pair.draft_dir) if pair.draft is not None else None
    longest = max(len(p.prompt_ids) + p.max_tokens for p in prompts)
    memory = {}
    for variant in variants:
        for concurrency in config.offline.concurrency:
            if concurrency == 1 or variant.batchable:
                memory[f"{variant.name}@c{concurrency}"] = memory_model(variant, target, draft, longest, concurrency)
    return {"target": target, "draft": draft, "precision": config.models.precision, "backend": config.models.backend,
            "draft_weights": config.spec.draft_weights, "memory_model": memory}


def memory_model(variant: Variant, target: dict, draft: dict | None, longest: int, concurrency: int) -> dict:
    """Bytes a variant needs by construction: weights (draft included when used), KV for the longest
    request, and the speculative state written each round for drafts that may be rolled back (tree
    branches included). Peer variants hold their own copies of the same weights."""
    uses_draft = variant.needs_draft and draft is not None
    target_kv, draft_kv = target["kv_bytes_per_token"] or 0, (draft["kv_bytes_per_token"] or 0) if uses_draft else 0
    slots = longest + variant.num_drafts + 1
    return {
        "weights_bytes": target["parameter_bytes"] + (draft["parameter_bytes"] if uses_draft else 0),
        "draft_weights_bytes": draft["parameter_bytes"] if uses_draft else 0,
        "kv_cache_bytes": concurrency * slots * (target_kv + draft_kv),
        "speculative_state_bytes": concurrency * variant.num_drafts * (target_kv + draft_kv),
    }


def write_result(result: dict, out_dir: str | Path) -> Path:
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "result.json"
    path.write_text(json.dumps(jsonable(result), indent=1) + "\n")
    return path


def jsonable(value):
    """Strict JSON: non-finite floats become strings ("inf"), tuples lists."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
