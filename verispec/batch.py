"""Batched speculative decoding with continuous batching: the server's engine.

Every round drafts for all running sequences at once, verifies all of them in ONE target forward, and
commits each sequence's own accepted length. Sequences join (``add``: prefill, first token) and leave
(finish or ``abort``) between rounds. Active sequences occupy cache rows 0..n-1; when one leaves, the
last row moves into its place, so a forward only ever touches the rows in use.

    engine = BatchEngine(target, draft, SpecConfig(gamma=4), max_batch=8)
    events = engine.add(BatchRequest("a", prompt_ids, SamplingParams(temperature=0), StopRules(max_tokens=32)))
    while engine.active:
        events += engine.step()      # BatchEvent(request_id, tokens, finish_reason, ...)

Drafts per round come from ``gamma_policy``: fixed (``spec.gamma``) or adaptive to the batch size
(``verispec.adaptive.AdaptiveGamma``), which switches speculation off where it no longer pays. The
draft model reads a sequence lazily, when it first drafts for it, so rounds at gamma 0 cost what
plain decoding costs: no draft prefill, no draft catch-up. Before a round that would make it read a
backlog, the policy may refuse the switch (``GammaPolicy.afford``: the reads must repay themselves over the
rows' remaining tokens, or fit an exploration budget).
Chains with a draft model, an EAGLE head (each row's head drafts in turn; the features come from the
batched verification) or n-gram lookup are batched; trees and early exit run in ``SpecEngine``.

A request with ``logprobs`` set gets, for each committed token, the target's raw log-softmax there
(before temperature and truncation; with ``logprobs_mode="processed"`` the log of the distribution the
token was sampled from, after penalties, a grammar's mask, temperature and truncation) and the
``logprobs`` most likely alternatives, read off the logits the round already has: the prefill's for the
first token, then row i of the verification pass for the round's i-th committed token, whether accepted,
recovered or bonus. Exact under speculation.

A request under a grammar or with penalties (``verispec.guide``) has its drafts drawn under that
transform and staged, cut at the first draft the grammar forbids, followed by the tokens the grammar
forces, its rows verified under their transforms, and the guide advanced by what it commits.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import torch

from verispec.adaptive import (AcceptanceCounts, Backlog, FixedGamma, GammaPolicy, check_policy,
                               report_draft_reads)
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.base import common_prefix_length, head_args
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.prediction import PredictionDrafter
from verispec.errors import ContextError, VerispecError
from verispec.grammar import FORCED_DRAFTS
from verispec.guide import Guide, with_point_masses
from verispec.models.eagle import EagleHead
from verispec.models.llama import LlamaForCausalLM
from verispec.sampling import draw_draft, greedy_ids, logits_to_probs, sample_from
from verispec.stats import RequestStats, RoundRecord
from verispec.stopping import Decode, apply_stop_rules
from verispec.verify.chain import ChainResult, verify_chain, verify_chain_greedy

CATCH_UP_ALONE = 16  # a row's draft backlog at least this long is fed alone (see _catch_up_alone)
# TEST-ONLY fault injection: VERISPEC_FAULT, read when a BatchEngine is built, plants one deliberate
# verifier bug so tests/test_audit_endpoint.py can show that `verispec audit --endpoint` catches it.
# Unset (as in all real use) the engine is unchanged: every fault branch below is behind `self.fault`.
#   q_without_temperature  q reported to the verifier is the draft's distribution at temperature 1
#   q_low_precision        q recomputed from the draft's logits rounded to bfloat16 (drawn from float32)
#   bonus_from_draft       after all drafts are accepted, the bonus token is drawn from the draft model
FAULTS = ("q_without_temperature", "q_low_precision", "bonus_from_draft")


@dataclass
class BatchRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopRules = field(default_factory=StopRules)
    seed: int = 0
    logprobs: int | None = None  # None: none; N >= 0: each token's log-probability and the N most likely
    prediction: list[int] | None = None  # predicted output tokens: this row's drafts (verispec.drafters.prediction)


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability (raw or processed: BatchEngine's logprobs_mode), and the most likely
    tokens at its position (best first)."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


LOGPROBS_MODES = ("raw", "processed")
MIN_LOGPROB = -9999.0  # a token the processed distribution excludes (probability 0), as vLLM reports it


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int,
                   probs: torch.Tensor | None = None) -> list[TokenLogprob]:
    """``logits`` (T, V): the target's raw logits whose row i scored ``tokens[i]``; in float32. With
    ``probs`` (T, V), the distributions the tokens were sampled from (penalties, grammar mask,
    temperature, top-k/p, min-p applied; one-hot when greedy): their logs instead, MIN_LOGPROB for 0."""
    if probs is None:
        logprobs = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)  # (T, V)
    else:
        logprobs = torch.log(probs[:len(tokens)].float()).clamp_min(MIN_LOGPROB)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top_n == 0:
        return [TokenLogprob(value) for value in chosen]
    top = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)  # sorted, best first
    return [TokenLogprob(value, tuple(ids), tuple(values))
            for value, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist())]


@dataclass
class BatchEvent:
    request_id: str
    tokens: list[int]  # committed this round (may be empty)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_text_index: int | None = None
    stats: RequestStats | None = None  # set when finished
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Sequence:
    request: BatchRequest
    context: list[int]
    generator: torch.Generator
    stats: RequestStats
    started: float
    last_emit: float
    generated: list[int] = field(default_factory=list)
    draft_seen: list[int] = field(default_factory=list)
    acceptance: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    eagle: EagleDrafter | None = None  # this row's feature drafter (its own head cache), --method eagle
    prediction: PredictionDrafter | None = None  # drafts from the request's predicted output instead


class BatchEngine:
    def __init__(self, target: LlamaForCausalLM, draft: LlamaForCausalLM | None = None,
                 spec: SpecConfig = SpecConfig(), max_batch: int = 64, max_len: int | None = None,
                 decode: Decode | None = None, gamma_policy: GammaPolicy | None = None, eagle: EagleHead | None = None,
                 logprobs_mode: str = "raw"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise VerispecError(f"logprobs mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        if spec.enabled and (spec.method != "chain" or spec.drafter == "early_exit"):
            raise VerispecError("batched decoding supports chains from a draft model, an EAGLE head or n-gram "
                                "lookup; trees and self-speculation run one request at a time (verispec generate)")
        if spec.enabled and spec.drafter == "model" and draft is None:
            raise VerispecError("speculation with a draft model needs --draft")
        if spec.enabled and spec.drafter == "eagle" and eagle is None:
            raise VerispecError("--method eagle needs a head (--eagle DIR)")
        self.eagle = eagle if spec.enabled and spec.drafter == "eagle" else None
        self.target, self.spec, self.decode = target, spec, decode
        self.draft = draft if spec.enabled and spec.drafter == "model" else None
        self.head = head_args(spec.draft_vocab)  # the draft's logits: its first ids only, if limited
        self.ngram = NgramDrafter(spec.ngram_max, spec.ngram_min) if spec.enabled and spec.drafter == "ngram" else None
        self.max_len = max_len or target.config.max_context
        self.cache = target.new_cache(max_batch, self.max_len)
        self.draft_cache = self.draft.new_cache(max_batch, self.max_len) if self.draft is not None else None
        self.max_batch = max_batch
        self.gamma_policy = gamma_policy or FixedGamma(spec.gamma if spec.enabled else 0)
        check_policy(self.gamma_policy)
        self.rows: list[_Sequence] = []  # row i of the caches holds rows[i]
        self.fault = os.environ.get("VERISPEC_FAULT") or None  # TEST-ONLY, see FAULTS
        if self.fault is not None and self.fault not in FAULTS:
            raise VerispecError(f"VERISPEC_FAULT={self.fault!r} is not a test fault ({', '.join(FAULTS)})")

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def has_capacity(self) -> bool:
        return len(self.rows) < self.max_batch

    # ---- joining and leaving ---------------------------------------------------------------------

    def check(self, request: BatchRequest) -> None:
        """Raise a user error if the request can never run (before queueing it)."""
        if not request.prompt_ids:
            raise VerispecError("the prompt is empty; give at least one token")
        vocab = self.target.config.vocab_size
        if any(not 0 <= token < vocab for token in request.prompt_ids):
            raise VerispecError(f"prompt token ids must be in [0, {vocab}); got an id outside it")
        needed = len(request.prompt_ids) + request.stop.max_tokens
        if needed > self.max_len:
            raise ContextError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.stop.max_tokens}) "
                               f"exceeds the context of {self.max_len} tokens")

    def add(self, request: BatchRequest) -> list[BatchEvent]:
        """Prefill a new sequence into the next free row and emit its first token."""
        self.check(request)
        if not self.has_capacity:
            raise RuntimeError("batch is full; check has_capacity before add")
        started = time.perf_counter()
        row = len(self.rows)
        self.cache.set_length(row, 0)
        view = self.cache.row_view(row)
        # A grammar and penalties (verispec.guide) follow the row's drafts; its drafters see them in the sampling.
        guide = Guide.for_request(request.sampling, request.prompt_ids, self.target.config.vocab_size)
        request = replace(request, sampling=replace(request.sampling, guide=guide))
        sequence = _Sequence(request, list(request.prompt_ids), torch.Generator().manual_seed(request.seed),
                             RequestStats(prompt_tokens=len(request.prompt_ids)), started, started)
        if request.prediction:
            sequence.prediction = PredictionDrafter(request.prediction)
        if self.eagle is not None:  # the head reads the prompt's features from the prefill itself
            logits, features = self.target.forward(torch.tensor([request.prompt_ids]), view, last_only=True,
                                                   with_features=True)
            sequence.eagle = EagleDrafter(self.eagle, self.max_len)
            sequence.eagle.reset()
            sequence.eagle.observe(features[0])
        else:
            logits = self.target.forward(torch.tensor([request.prompt_ids]), view, last_only=True)
        logits = logits[0, -1].cpu()
        view.commit(0, len(request.prompt_ids))
        self.cache.sync_row(row, view)
        sampled = logits if guide is None else guide.mask().apply(logits)
        probs = logits_to_probs(sampled, request.sampling)
        first = sample_from(probs, sequence.generator)
        logprobs = None if request.logprobs is None else token_logprobs(
            logits[None], [first], request.logprobs, probs[None] if self.logprobs_mode == "processed" else None)
        if self.draft is not None:  # the draft reads the prompt when it first drafts for this row
            self.draft_cache.set_length(row, 0)
        self.rows.append(sequence)
        now = time.perf_counter()
        sequence.stats.prefill_s = sequence.stats.ttft_s = now - started
        sequence.stats.token_gaps_s.append(sequence.stats.ttft_s)
        sequence.last_emit = now
        event = self._emit(row, [first], logprobs)
        if event.finished:  # max_tokens 1, or EOS straight away
            event = self._finish(row, event)
        return [event]

    def abort(self, request_id: str) -> BatchEvent | None:
        for row, sequence in enumerate(self.rows):
            if sequence.request.request_id == request_id:
                return self._finish(row, BatchEvent(request_id, [], "abort"))
        return None

    def _finish(self, row: int, event: BatchEvent) -> BatchEvent:
        """Release ``row``; ``event`` (its last, finished one) comes back with the request's stats."""
        sequence, reason = self.rows[row], event.finish_reason
        sequence.stats.finish_reason = reason
        if reason != "abort":
            self.gamma_policy.finished(len(sequence.generated))
        sequence.stats.e2e_s = time.perf_counter() - sequence.started
        last = len(self.rows) - 1
        if row != last:  # keep active rows contiguous: the last row moves into the hole
            self.cache.move_row(last, row)
            if self.draft_cache is not None:
                self.draft_cache.move_row(last, row)
            self.rows[row] = self.rows[last]
        self.rows.pop()
        return replace(event, stats=sequence.stats)

    # ---- one round for every running sequence ------------------------------------------------------

    def step(self) -> list[BatchEvent]:
        if not self.rows:
            return []
        began = time.perf_counter()
        sequences = list(self.rows)  # row order of this round, before anyone leaves
        # Alone in the batch, a request's own acceptance steers gamma; a batch shares one gamma.
        gamma = self.gamma_policy.choose(len(self.rows), self.rows[0].acceptance if len(self.rows) == 1 else None)
        if gamma and self.draft is not None:  # the draft reads what it missed first: is that worth it?
            gamma = self.gamma_policy.afford(len(self.rows), gamma, self._backlog())
        # Rows with a predicted output draft from it (at any gamma, even with speculation off), not the drafter.
        num_drafts = [0 if sequence.prediction else self._drafts_allowed(sequence, gamma) for sequence in self.rows]
        prompts_s, prompts, reads_s, read_tokens = self._catch_up_alone() if max(num_drafts) else (0.0, 0, 0.0, 0)
        drafts, draft_probs = self._propose(num_drafts)
        for row, sequence in enumerate(self.rows):
            if sequence.prediction is not None:
                drafts[row] = sequence.prediction.lookup(
                    sequence.generated, self._drafts_allowed(sequence, sequence.prediction.drafts))
        masks = self._guide(drafts, draft_probs)
        drafted_at = time.perf_counter()
        verdicts, logprobs = self._verify(drafts, draft_probs, num_drafts, masks)
        verified_at = time.perf_counter()
        events = self._commit(verdicts, logprobs, drafted=max(num_drafts) > 0)
        now = time.perf_counter()
        # The policy judges gamma on a round's steady cost: reading a backlog is paid once per switch
        # from gamma 0 (and judged before it, in ``afford``), and counting it would make the first
        # rounds of any gamma look slow. Reading a new request's prompt is a cost of speculating at
        # all: charged to speculation as a whole.
        report_draft_reads(self.gamma_policy, len(verdicts), prompts_s, read_tokens, reads_s, prompts)
        # (a grammar's forced drafts are free: the policy judges the drafter's own)
        self.gamma_policy.observe(len(verdicts), gamma, now - began - reads_s,
                                  [min(v.num_accepted, k) for v, k in zip(verdicts, num_drafts)], num_drafts)
        self._record(sequences, events, verdicts, [len(d) for d in drafts],
                     (drafted_at - began, verified_at - drafted_at, now - verified_at))
        return [e for e in events if e.tokens or e.finished]

    def _backlog(self) -> Backlog:
        unread = sum(max(0, len(s.context) - len(s.draft_seen) - 1) for s in self.rows)
        remaining = sum(s.request.stop.max_tokens - len(s.generated) for s in self.rows)
        return Backlog(unread, remaining)

    def _drafts_allowed(self, sequence: _Sequence, gamma: int) -> int:
        remaining = sequence.request.stop.max_tokens - len(sequence.generated)
        room = self.max_len - len(sequence.context) - 1
        return max(0, min(gamma, remaining - 1, room))

    def _propose(self, num_drafts: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts per row (lists of ids) and, for sampled model drafts, their q (k, V)."""
        most = max(num_drafts)
        if most == 0:
            return [[] for _ in self.rows], [None] * len(self.rows)
        if self.ngram is not None:
            return [self.ngram.lookup(s.context, k) for s, k in zip(self.rows, num_drafts)], [None] * len(self.rows)
        if self.eagle is not None:  # each row's head drafts in turn (a head step is a fraction of a target step)
            proposals = [s.eagle.propose(s.context, k, s.request.sampling, s.generator) if k else None
                         for s, k in zip(self.rows, num_drafts)]
            return ([p.tokens.tolist() if p is not None else [] for p in proposals],
                    [p.probs if p is not None else None for p in proposals])
        view = self.draft_cache.prefix_view(len(self.rows))
        unseen = [s.context[len(s.draft_seen):] for s in self.rows]
        width = max(len(u) for u in unseen)
        fed = torch.tensor([u + [u[-1]] * (width - len(u)) for u in unseen])  # pad at the end (never committed)
        ends = torch.tensor([len(u) - 1 for u in unseen])
        if hasattr(self.draft, "run_layers") and len(unseen) == 1:  # one row: its pass in one native call
            last = self.draft.forward(fed, view, last_only=True, **self.head)[:, -1].cpu()  # (1, V)
        elif hasattr(self.draft, "run_layers"):  # native: the LM head only at each row's last fed token
            with torch.inference_mode():
                config = self.draft.config
                hidden = self.draft.run_layers(self.draft.embed(fed), view, 0, config.num_hidden_layers)
                last = self.draft.logits(hidden[torch.arange(len(unseen)), ends.to(hidden.device)],
                                         **self.head).cpu()  # (B, V)
        else:
            last = self.draft.forward(fed, view, **self.head).cpu()[torch.arange(len(unseen)), ends]  # (B, V)
        for row, tokens in enumerate(unseen):
            view.commit(row, len(tokens))
            self.rows[row].draft_seen.extend(tokens)
        drafts: list[list[int]] = [[] for _ in self.rows]
        probs: list[list[torch.Tensor]] = [[] for _ in self.rows]
        for step in range(most):
            if step:
                last = self.draft.forward(torch.tensor([[d[-1]] for d in drafts]), view, **self.head)[:, -1].cpu()
                for row, sequence in enumerate(self.rows):
                    view.commit(row, 1)
                    sequence.draft_seen.append(drafts[row][-1])
            greedy = greedy_ids(last) if any(s.request.sampling.greedy for s in self.rows) else None
            for row, sequence in enumerate(self.rows):
                params = sequence.request.sampling
                if step >= num_drafts[row]:  # this row needs no more drafts: pad without using its RNG
                    drafts[row].append(sequence.context[-1])
                elif params.greedy and params.guide is None:  # a point mass on the argmax, all rows' at once
                    drafts[row].append(greedy[row])
                else:
                    token, q = draw_draft(last[row], params, sequence.generator)
                    if self.fault in ("q_without_temperature", "q_low_precision") and q is not None:  # TEST-ONLY
                        q = logits_to_probs(last[row], replace(params, temperature=1.0)) \
                            if self.fault == "q_without_temperature" else logits_to_probs(last[row].bfloat16(), params)
                    drafts[row].append(token)
                    if q is not None:
                        probs[row].append(q)
        self.draft_cache.sync_prefix(view)
        return ([d[:k] for d, k in zip(drafts, num_drafts)],
                [torch.stack(p[:k]) if p and k else None for p, k in zip(probs, num_drafts)])

    def _guide(self, drafts: list[list[int]], draft_probs: list[torch.Tensor | None]
               ) -> list[torch.Tensor | None]:
        """For rows under a grammar: their drafts cut at the first one it forbids (in place) and the masks
        (k + 1, V) of the rows that verify them; None for the other rows."""
        masks: list[torch.Tensor | None] = []
        for row, sequence in enumerate(self.rows):
            guide = sequence.request.sampling.guide
            if guide is None:
                masks.append(None)
                continue
            count = len(drafts[row])
            room = min(FORCED_DRAFTS, sequence.request.stop.max_tokens - len(sequence.generated) - 1 - count,
                       self.max_len - len(sequence.context) - 1 - count)
            allowed, forced, row_masks = guide.round_masks(drafts[row], max(0, room))
            del drafts[row][allowed:]
            if draft_probs[row] is not None:
                draft_probs[row] = draft_probs[row][:allowed] if allowed else None
            draft_probs[row] = with_point_masses(draft_probs[row], forced)  # free drafts after drawn ones
            drafts[row] += forced
            masks.append(row_masks)
        return masks

    def _catch_up_alone(self) -> tuple[float, int, float, int]:
        """Feed the draft, row by row, every row's long backlog but its last token.

        The draft reads a sequence lazily: its prompt, and whatever was committed while the batch ran
        at gamma 0, only once it drafts for it; a batch held at gamma 0 never runs the draft at all.
        A long backlog goes in alone, because the batched catch-up pads every row to the longest.
        Returns the seconds spent on rows the draft had never read (their prompts) and how many
        they were, the seconds in all, and the tokens read."""
        if self.draft is None:
            return 0.0, 0, 0.0, 0
        prompts_s, prompts, total_s, tokens = 0.0, 0, 0.0, 0
        for row, sequence in enumerate(self.rows):
            backlog = sequence.context[len(sequence.draft_seen):-1]
            if len(backlog) < CATCH_UP_ALONE:
                continue
            began, fresh = time.perf_counter(), not sequence.draft_seen
            view = self.draft_cache.row_view(row)
            with torch.inference_mode():
                self.draft.forward(torch.tensor([backlog]), view, last_only=True)
            view.commit(0, len(backlog))
            self.draft_cache.sync_row(row, view)
            sequence.draft_seen.extend(backlog)
            seconds = time.perf_counter() - began
            prompts_s += seconds if fresh else 0.0
            prompts += fresh
            total_s += seconds
            tokens += len(backlog)
        return prompts_s, prompts, total_s, tokens

    def _verify(self, drafts: list[list[int]], draft_probs: list[torch.Tensor | None], num_drafts: list[int],
                masks: list[torch.Tensor | None]) -> tuple[list[ChainResult], list[list[TokenLogprob] | None]]:
        """Each row's verdict, and its committed tokens' logprobs if its request asked (row i of its logits
        scored the round's i-th committed token; raw, before a grammar's mask)."""
        width = max(len(d) for d in drafts) + 1  # a grammar's forced tokens may lengthen a row's drafts
        rows = [[s.context[-1]] + d + [s.context[-1]] * (width - 1 - len(d)) for s, d in zip(self.rows, drafts)]
        view = self.cache.prefix_view(len(self.rows))
        if self.eagle is not None:  # the rows' features ride along for their heads
            logits, features = self.target.forward(torch.tensor(rows), view, with_features=True)
            logits = logits.cpu()
        else:
            logits = self.target.forward(torch.tensor(rows), view).cpu()  # (B, width, V); verified on the CPU
        argmax = greedy_ids(logits)
        verdicts, processed = [], []  # processed: each row's sampling distributions, where reported
        for row, (sequence, tokens) in enumerate(zip(self.rows, drafts)):
            params, k = sequence.request.sampling, len(tokens)
            row_logits = logits[row, :k + 1]
            if params.guide is not None:
                row_logits = masks[row].apply(row_logits)
                params.guide.unstage()
            report = self.logprobs_mode == "processed" and sequence.request.logprobs is not None
            processed.append(logits_to_probs(row_logits, params) if report else None)
            if params.greedy:
                verdicts.append(verify_chain_greedy(
                    tokens, argmax[row][:k + 1] if params.guide is None else greedy_ids(row_logits)))
            else:
                target_probs = processed[-1] if processed[-1] is not None else logits_to_probs(row_logits, params)
                verdicts.append(verify_chain(draft_tokens=torch.tensor(tokens, dtype=torch.long),
                                             draft_probs=draft_probs[row], target_probs=target_probs,
                                             generator=sequence.generator))
                if self.fault == "bonus_from_draft" and verdicts[-1].last_kind == "bonus" and self.draft is not None:
                    verdicts[-1] = self._bonus_from_draft(sequence, tokens, verdicts[-1])  # TEST-ONLY
            view.commit(row, 1 + verdicts[-1].num_accepted)
            if sequence.eagle is not None:
                sequence.eagle.observe(features[row, :1 + verdicts[-1].num_accepted])
        self.cache.sync_prefix(view)
        logprobs = [None if sequence.request.logprobs is None else
                    token_logprobs(logits[row], verdict.tokens, sequence.request.logprobs, processed[row])
                    for row, (sequence, verdict) in enumerate(zip(self.rows, verdicts))]
        return verdicts, logprobs

    def _bonus_from_draft(self, sequence: _Sequence, tokens: list[int], verdict: ChainResult) -> ChainResult:
        """TEST-ONLY fault (VERISPEC_FAULT=bonus_from_draft): the bonus token drawn from the draft model's
        distribution after the accepted drafts (one fresh draft prefill) instead of the target's."""
        ids = sequence.context + tokens
        logits = self.draft.forward(torch.tensor([ids]), self.draft.new_cache(1, len(ids)), last_only=True,
                                    **self.head)[0, -1].cpu()
        bonus = sample_from(logits_to_probs(logits, sequence.request.sampling), sequence.generator)
        return replace(verdict, tokens=verdict.tokens[:-1] + [bonus])

    def _commit(self, verdicts: list[ChainResult], logprobs: list[list[TokenLogprob] | None],
                drafted: bool) -> list[BatchEvent]:
        events = [self._emit(row, verdict.tokens, row_logprobs)
                  for row, (verdict, row_logprobs) in enumerate(zip(verdicts, logprobs))]
        if self.draft_cache is not None and drafted:  # else what the draft saw is still a prefix
            for row, sequence in enumerate(self.rows):
                keep = min(common_prefix_length(sequence.draft_seen, sequence.context), len(sequence.context) - 1)
                del sequence.draft_seen[keep:]
                self.draft_cache.set_length(row, keep)
        # Release finished rows last-to-first so moving rows does not disturb indices still to visit.
        for row in sorted((r for r, e in enumerate(events) if e.finished), reverse=True):
            events[row] = self._finish(row, events[row])
        return events

    def _emit(self, row: int, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> BatchEvent:
        sequence = self.rows[row]
        cut = apply_stop_rules(tokens, sequence.generated, sequence.request.stop, self.decode)
        sequence.generated.extend(cut.kept)
        sequence.context.extend(cut.kept)
        if sequence.request.sampling.guide is not None:
            sequence.request.sampling.guide.advance(cut.kept)
        sequence.stats.generated_tokens = len(sequence.generated)
        return BatchEvent(sequence.request.request_id, cut.kept, cut.finish_reason, cut.stop_text_index,
                          logprobs=None if logprobs is None else logprobs[:len(cut.kept)])

    def _record(self, sequences: list[_Sequence], events: list[BatchEvent], verdicts: list[ChainResult],
                num_drafts: list[int], split: tuple[float, float, float]) -> None:
        """Per-request round records; the round's time split is shared by every row in it."""
        now = time.perf_counter()
        for sequence, event, verdict, drafted in zip(sequences, events, verdicts, num_drafts):
            sequence.acceptance.add(verdict.num_accepted, drafted)
            cut = len(event.tokens) < len(verdict.tokens)
            sequence.stats.rounds.append(RoundRecord(
                drafted=drafted, accepted=verdict.num_accepted, committed=len(event.tokens),
                last_kind="cut" if cut else verdict.last_kind, draft_s=split[0], verify_s=split[1],
                state_s=split[2], tree_nodes=drafted))
            if event.tokens:
                gap = now - sequence.last_emit
                sequence.stats.chunk_gaps_s.append(gap)
                sequence.stats.token_gaps_s.extend([gap] + [0.0] * (len(event.tokens) - 1))
                sequence.last_emit = now
