"""The peer: transformers' own ``generate`` on the same checkpoints, prompts and stop rules.

Three variants: plain decoding, assisted generation with the draft model (``assistant_model``), and
prompt-lookup decoding (``prompt_lookup_num_tokens``), each drafting ``budget - 1`` tokens per round.
A streamer timestamps every chunk ``generate`` emits (one per target forward), so TTFT, inter-token and
chunk gaps are measured the same way as ours. ``generate`` cannot cut a round at a stop string or EOS the
way our engine does, so its output is cut afterwards with the same ``apply_stop_rules``; for greedy
decoding the kept tokens must then equal ours token for token.

    peer = PeerModels.load(target_dir, draft_dir, "float32", "cpu", spec_settings)
    runner = PeerRunner(peer, variant, sampling, timeout_s=60, decode=decode)
    records = runner.run(jobs, concurrency=1)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.bench.config import SpecSettings, Variant
from verispec.bench.offline import Job, fail_record, finish_record, _log_failure
from verispec.bench.records import RequestRecord
from verispec.config import SamplingParams
from verispec.errors import VerispecError
from verispec.stopping import apply_stop_rules


@dataclass
class PeerModels:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    settings: dict  # what was set on the assistant's generation config (recorded)

    @classmethod
    def load(cls, target_dir: Path, draft_dir: Path | None, precision: str, device: str,
             spec: SpecSettings) -> "PeerModels":
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generation-config chatter would interleave with the progress bar
        hf_logging.disable_progress_bar()
        dtype = getattr(torch, precision)

        def load(path: Path) -> torch.nn.Module:
            try:
                if Path(path).suffix.lower() == ".gguf":  # transformers dequantizes the file itself
                    return AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                                                dtype=dtype).to(device).eval()
                return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
            except Exception as err:
                raise VerispecError(f"transformers cannot load {str(path)!r} for the peer comparison: {err}") from None

        target = load(target_dir)
        draft = load(draft_dir) if draft_dir is not None else None
        settings = {"num_assistant_tokens": spec.budget - 1,
                    "num_assistant_tokens_schedule": spec.hf_assistant_schedule,
                    "assistant_confidence_threshold": spec.hf_assistant_confidence_threshold,
                    "prompt_lookup_num_tokens": spec.budget - 1, "max_matching_ngram_size": spec.ngram_max}
        if draft is not None:
            draft.generation_config.num_assistant_tokens = spec.budget - 1
            draft.generation_config.num_assistant_tokens_schedule = spec.hf_assistant_schedule
            draft.generation_config.assistant_confidence_threshold = spec.hf_assistant_confidence_threshold
        return cls(target, draft, settings)


class ChunkTimes:
    """A transformers streamer that records when each chunk of new tokens arrives (the prompt, put
    first, is skipped)."""

    def __init__(self):
        self.times: list[float] = []
        self.sizes: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


class PeerRunner:
    def __init__(self, models: PeerModels, variant: Variant, sampling: SamplingParams, timeout_s: float, decode):
        if variant.peer == "assisted" and models.draft is None:
            raise VerispecError("hf_assisted needs a draft model; pass --draft or drop the variant")
        self.models, self.variant, self.sampling = models, variant, sampling
        self.timeout_s, self.decode = timeout_s, decode

    def run(self, jobs: list[Job], concurrency: int) -> list[RequestRecord]:
        if concurrency != 1:
            raise VerispecError("the transformers peer runs one request at a time")
        return [self._run_one(job) for job in jobs]

    def _kwargs(self, job: Job) -> dict:
        stop, sampling = job.stop, self.sampling
        eos = list(stop.eos_ids)
        kwargs = dict(max_new_tokens=stop.max_tokens, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                      do_sample=not sampling.greedy, max_time=self.timeout_s)
        if stop.ignore_eos:
            kwargs["min_new_tokens"] = stop.max_tokens
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,  # top_k 0: off
                          min_p=sampling.min_p or None)
        if self.variant.peer == "assisted":
            kwargs["assistant_model"] = self.models.draft
        elif self.variant.peer == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = self.models.settings["prompt_lookup_num_tokens"]
            kwargs["max_matching_ngram_size"] = self.models.settings["max_matching_ngram_size"]
        return kwargs

    def _run_one(self, job: Job) -> RequestRecord:
        record = job.new_record(self.variant.name)
        streamer = ChunkTimes()
        ids = torch.tensor([list(job.prompt.prompt_ids)], device=self.models.target.device)
        torch.manual_seed(job.seed)
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.models.target.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                                                  **self._kwargs(job))
        except Exception as err:  # recorded as a failed request, never dropped
            _log_failure(err)
            return fail_record(record, "error", f"{type(err).__name__}: {err}", time.perf_counter() - began)
        elapsed = time.perf_counter() - began
        generated = out[0, ids.shape[1]:].tolist()
        cut = apply_stop_rules(generated, [], job.stop, self.decode)
        if cut.finish_reason is None and elapsed >= self.timeout_s:
            return fail_record(record, "timeout", f"no finish within {self.timeout_s:g} s", elapsed)
        _fill_timing(record, streamer, began, elapsed, len(cut.kept))
        return finish_record(record, job, cut.kept, cut.finish_reason or "length", cut.stop_text_index, self.decode)


def _fill_timing(record: RequestRecord, streamer: ChunkTimes, began: float, elapsed: float, kept: int) -> None:
    """Timing from the streamer, counting only chunks (and tokens) up to the stop cut."""
    record.output_tokens, record.e2e_s = kept, elapsed
    times, sizes, seen = [], [], 0
    for t, n in zip(streamer.times, streamer.sizes):
        if seen >= kept:
            break
        times.append(t)
        sizes.append(min(n, kept - seen))
        seen += sizes[-1]
    if not times:
        return
    record.ttft_s = times[0] - began
    record.chunk_gaps_s = [b - a for a, b in zip(times, times[1:])]
    record.token_gaps_s = [0.0] * (sizes[0] - 1)
    for gap, n in zip(record.chunk_gaps_s, sizes[1:]):
        record.token_gaps_s += [gap] + [0.0] * (n - 1)
    record.rounds = len(times)  # target forward passes that emitted tokens, the first one included
    record.committed = kept
