"""``BatchEngine``: one round for every running request (see the package docstring, ``verispec.batch``)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Callable

import torch

from verispec.adaptive import Backlog, FixedGamma, GammaPolicy, check_policy, report_draft_reads
from verispec.batch.draft import CATCH_UP_ALONE, BatchedDraft
from verispec.batch.eagle import BatchedEagle
from verispec.batch.row_loop import RowLoop
from verispec.batch.requests import (LOGPROBS_MODES, BatchEvent, BatchRequest, Row, TokenLogprob, check_request,
                                     token_logprobs)
from verispec.batch.rows import RowDrafters, drafter_maker, guide_rows, propose_own, tree_inputs
from verispec.config import SpecConfig
from verispec.drafters.base import Drafter
from verispec.drafters.lookup_first import repeat_finder
from verispec.drafters.prediction import PredictionDrafter
from verispec.errors import VerispecError
from verispec.grammar import FORCED_DRAFTS
from verispec.guide import Guide
from verispec.models.eagle import EagleHead
from verispec.models.llama import LlamaForCausalLM
from verispec.sampling import greedy_ids, logits_to_probs, sample_from
from verispec.stats import RequestStats, RoundRecord
from verispec.stopping import Decode, apply_stop_rules
from verispec.tree import TokenTree
from verispec.verify.chain import ChainResult, verify_chain, verify_chain_greedy
from verispec.verify.tree import TreeResult, verify_tree, verify_tree_greedy

# TEST-ONLY fault injection: VERISPEC_FAULT, read when a BatchEngine is built, plants one deliberate
# verifier bug so tests/test_audit_endpoint.py can show that `verispec audit --endpoint` catches it.
# Unset (as in all real use) the engine is unchanged: every fault branch is behind `self.fault`.
#   q_without_temperature  q reported to the verifier is the draft's distribution at temperature 1
#   q_low_precision        q recomputed from the draft's logits rounded to bfloat16 (drawn from float32)
#   bonus_from_draft       after all drafts are accepted, the bonus token is drawn from the draft model
FAULTS = ("q_without_temperature", "q_low_precision", "bonus_from_draft")
PREDICTION_SLACK = 64  # room past max_len for a round's widest pass (padding rows to the longest)

Verdict = ChainResult | TreeResult


class BatchEngine:
    def __init__(self, target: LlamaForCausalLM, draft: LlamaForCausalLM | None = None,
                 spec: SpecConfig = SpecConfig(), max_batch: int = 64, max_len: int | None = None,
                 decode: Decode | None = None, gamma_policy: GammaPolicy | None = None, eagle: EagleHead | None = None,
                 logprobs_mode: str = "raw", make_drafter: Callable[[], Drafter] | None = None):
        """``make_drafter``: builds one drafter (any object with the ``Drafter`` protocol) per running row,
        instead of the one ``spec.drafter`` names; ``spec`` still says chain or tree, gamma and shape."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise VerispecError(f"logprobs mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        if spec.enabled and make_drafter is None and spec.drafter == "model" and draft is None:
            raise VerispecError("speculation with a draft model needs --draft")
        if spec.enabled and make_drafter is None and spec.drafter == "eagle" and eagle is None:
            raise VerispecError("--method eagle needs a head (--eagle DIR)")
        if gamma_policy is not None and spec.method == "tree":
            raise VerispecError("a gamma policy chooses a chain's length; a tree drafts its shape (drop --adaptive "
                                "or --tree)")
        self.fault = os.environ.get("VERISPEC_FAULT") or None  # TEST-ONLY, see FAULTS
        if self.fault is not None and self.fault not in FAULTS:
            raise VerispecError(f"VERISPEC_FAULT={self.fault!r} is not a test fault ({', '.join(FAULTS)})")
        self.logprobs_mode = logprobs_mode
        target = RowLoop.wrap(target)  # a one-sequence cache: rows run one after another (batch/row_loop.py)
        self.target, self.spec, self.decode = target, spec, decode
        self.max_len = max_len or target.config.max_context
        # Rows are padded to the round's widest; a row near max_len still needs room for that pass.
        cache_len = self.max_len + self._slack(spec)
        self.cache = target.new_cache(max_batch, cache_len)
        batched = spec.enabled and make_drafter is None and spec.drafter in ("model", "eagle") \
            and spec.method == "chain"  # chains of a draft model or an EAGLE head: drafted for all rows at once
        # --lookup: rows whose context repeats draft the repeat; the batched draft drafts for the others
        self.lookup = repeat_finder(spec.lookup) if batched and spec.lookup else None
        self.draft = (BatchedEagle(eagle, max_batch, cache_len) if spec.drafter == "eagle" else BatchedDraft(
            RowLoop.wrap(draft), max_batch, cache_len, spec.draft_vocab, self.fault)) if batched else None
        make_drafter = make_drafter or drafter_maker(spec, target, draft, eagle, cache_len)
        self.own = RowDrafters(make_drafter) if spec.enabled and not batched else None
        if self.own is not None:  # build one now: a drafter that cannot be built fails here, not per request
            self.own.release(self.own.acquire())
        self.feeds_features = isinstance(self.draft, BatchedEagle) or (self.own is not None
                                                                        and self.own.free[0].wants_features)
        self.max_batch = max_batch
        self.gamma_policy = gamma_policy or FixedGamma(spec.gamma if spec.enabled else 0)
        check_policy(self.gamma_policy)
        self.rows: list[Row] = []  # row i of the caches holds rows[i]
        self.refresh_s = 0.0  # this round's time committing the target cache (rows' commit / compact)

    def _observe(self, sequence: Row, features: torch.Tensor) -> None:
        """Committed tokens' target features to the row's feature drafter (its own, or the shared head)."""
        if isinstance(self.draft, BatchedEagle):
            self.draft.observe(sequence, features)
        else:
            sequence.drafter.observe(features)

    @staticmethod
    def _slack(spec: SpecConfig) -> int:
        widest = max(spec.gamma, spec.widest_chain, spec.tree_shape.cache_positions if spec.method == "tree" else 0)
        return widest + FORCED_DRAFTS + CATCH_UP_ALONE + PREDICTION_SLACK + 2

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def has_capacity(self) -> bool:
        return len(self.rows) < self.max_batch

    # ---- joining and leaving ---------------------------------------------------------------------

    def check(self, request: BatchRequest) -> None:
        """Raise a user error if the request can never run (before queueing it)."""
        check_request(request, self.target, self.max_len)

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
        sequence = Row(request, list(request.prompt_ids), torch.Generator().manual_seed(request.seed),
                       RequestStats(prompt_tokens=len(request.prompt_ids)), started, started)
        if request.prediction:
            sequence.prediction = PredictionDrafter(request.prediction)
        if self.own is not None:
            sequence.drafter = self.own.acquire()
        prompt = torch.tensor([request.prompt_ids])
        if self.feeds_features:  # the head reads the prompt's features from the prefill itself
            logits, features = self.target.forward(prompt, view, last_only=True, with_features=True)
            self._observe(sequence, features[0])
        else:
            logits = self.target.forward(prompt, view, last_only=True)
        logits = logits[0, -1].cpu()
        view.commit(0, len(request.prompt_ids))
        self.cache.sync_row(row, view)
        sampled = logits if guide is None else guide.mask().apply(logits)
        probs = logits_to_probs(sampled, request.sampling)
        first = sample_from(probs, sequence.generator)
        logprobs = None if request.logprobs is None else token_logprobs(
            logits[None], [first], request.logprobs, probs[None] if self.logprobs_mode == "processed" else None)
        if self.draft is not None:
            self.draft.join(row)
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
        if sequence.drafter is not None:
            self.own.release(sequence.drafter)
        last = len(self.rows) - 1
        if row != last:  # keep active rows contiguous: the last row moves into the hole
            self.cache.move_row(last, row)
            if self.draft is not None:
                self.draft.move_row(last, row)
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
        gamma = self.spec.max_drafts if self.spec.method == "tree" else min(self.spec.gamma, self.gamma_policy.choose(
            len(self.rows), self.rows[0].acceptance if len(self.rows) == 1 else None))  # --gamma caps, as in SpecEngine
        if gamma and (self.draft is not None or self.own is not None):  # the drafts read what they missed first:
            gamma = self.gamma_policy.afford(len(self.rows), gamma, self._backlog())  # is that worth it?
        # Rows with a predicted output draft from it (at any gamma, even with speculation off), not the drafter.
        num_drafts = [0 if sequence.prediction else self._drafts_allowed(sequence, gamma) for sequence in self.rows]
        trees: list[TokenTree | None] = [None] * len(self.rows)
        reads = (0.0, 0, 0.0, 0)
        repeats = self._repeats(num_drafts)  # --lookup: a row's repeat, drafted instead of the batched draft's
        asked = [0 if repeat else count for count, repeat in zip(num_drafts, repeats)]
        if self.draft is not None and max(asked):
            reads = self.draft.catch_up_alone(self.rows)
            drafts, draft_probs = self.draft.propose(self.rows, asked)
        elif self.own is not None:
            drafts, draft_probs, trees, reads = self._propose_own(num_drafts)
        else:
            drafts, draft_probs = [[] for _ in self.rows], [None] * len(self.rows)
        for row, repeat in enumerate(repeats):
            if repeat:
                drafts[row], draft_probs[row] = repeat, None
        for row, sequence in enumerate(self.rows):
            if sequence.prediction is not None:
                drafts[row] = sequence.prediction.lookup(
                    sequence.generated, self._drafts_allowed(sequence, sequence.prediction.drafts))
        masks = guide_rows(self.rows, drafts, draft_probs, trees, self.max_len)
        drafted_at = time.perf_counter()
        verdicts, logprobs = self._verify(drafts, draft_probs, trees, masks)
        verified_at = time.perf_counter()
        events = self._commit(verdicts, logprobs, drafted=max(num_drafts) > 0)
        now = time.perf_counter()
        # The policy judges gamma on a round's steady cost: reading a backlog is paid once per switch
        # from gamma 0 (and judged before it, in ``afford``), and counting it would make the first
        # rounds of any gamma look slow. Reading a new request's prompt is a cost of speculating at
        # all: charged to speculation as a whole.
        prompts_s, prompts, reads_s, read_tokens = reads
        report_draft_reads(self.gamma_policy, len(verdicts), prompts_s, read_tokens, reads_s, prompts)
        # Positions a round could accept: K for a chain (a lookup's own length), the depth for a tree (a
        # grammar's forced drafts are free: the policy judges the drafter's own).
        depths = [int(t.compile().depths.max()) if t is not None else len(r) or k
                  for t, k, r in zip(trees, num_drafts, repeats)]
        self.gamma_policy.observe(len(verdicts), gamma, now - began - reads_s,
                                  [min(v.num_accepted, k) for v, k in zip(verdicts, depths)], depths)
        positions = [int(t.compile().depths.max()) if t is not None else len(d) for t, d in zip(trees, drafts)]
        refresh = self.refresh_s  # committing the target cache happened inside _verify: count it as state
        self._record(sequences, events, verdicts, positions, [len(d) for d in drafts],
                     (drafted_at - began, verified_at - drafted_at - refresh, now - verified_at + refresh, refresh))
        return [e for e in events if e.tokens or e.finished]

    def _backlog(self) -> Backlog:
        """What the draft (batched) or the rows' own drafters would read before drafting this round."""
        if self.draft is not None:
            return self.draft.backlog(self.rows)
        drafting = [s for s in self.rows if s.prediction is None]
        return Backlog(sum(s.drafter.unread(s.context) for s in drafting), sum(s.remaining for s in drafting))

    def _repeats(self, num_drafts: list[int]) -> list[list[int]]:
        """Per row, what followed an earlier occurrence of its context's last tokens (``--lookup``, for the
        batched draft; each row's own drafter looks up itself), up to its drafts or ``--lookup-drafts``
        (within its remaining tokens and room); [] where none."""
        if self.lookup is None:
            return [[] for _ in self.rows]
        return [self.lookup.lookup(s.context, self._drafts_allowed(s, max(count, self.spec.lookup_drafts)))
                if count else [] for s, count in zip(self.rows, num_drafts)]

    def _drafts_allowed(self, sequence: Row, gamma: int) -> int:
        room = self.max_len - len(sequence.context) - 1
        return max(0, min(gamma, sequence.remaining - 1, room))

    def _propose_own(self, num_drafts: list[int]):
        """Each row's proposal from its own drafter, in row order: drafts, q (sampled chains), trees, and
        what the drafters spent reading committed tokens (``report_draft_reads``'s figures)."""
        drafts, probs, trees = [], [], []
        prompts_s, prompts, reads_s, read_tokens = 0.0, 0, 0.0, 0
        for row, (sequence, count) in enumerate(zip(self.rows, num_drafts)):
            if sequence.prediction is not None:
                drafts.append([]), probs.append(None), trees.append(None)
                continue
            limit = min(self.max_len, sequence.drafter.max_context or self.max_len)
            proposal = propose_own(sequence, self.spec, count, limit - len(sequence.context),
                                   lambda row=row: self.cache.row_view(row))
            drafts.append(proposal.tokens.tolist())
            probs.append(proposal.probs)
            trees.append(proposal.tree)
            if proposal.num_drafts:
                read = sequence.drafter.reads()
                prompts_s += read.prompt_s
                prompts += read.prompt_s > 0
                reads_s += read.prompt_s + read.backlog_s
                read_tokens += read.tokens
        return drafts, probs, trees, (prompts_s, prompts, reads_s, read_tokens)

    def _target_pass(self, drafts: list[list[int]], trees: list[TokenTree | None]):
        """The verification pass over every row: logits (B, W, V) on the CPU, and the final features when a
        feature drafter reads them."""
        roots = [s.context[-1] for s in self.rows]
        if any(t is not None for t in trees):
            fed, tree_mask, depths = tree_inputs(roots, drafts, trees)
            extra = {"tree_mask": tree_mask, "depths": depths}
        else:
            width = max(len(d) for d in drafts) + 1  # a grammar's forced tokens may lengthen a row's drafts
            fed, extra = torch.tensor([[r] + d + [r] * (width - 1 - len(d)) for r, d in zip(roots, drafts)]), {}
        if isinstance(self.target, RowLoop):  # each row's pass feeds only its own positions
            extra["widths"] = [len(t.tokens) if t is not None else 1 + len(d) for d, t in zip(drafts, trees)]
        view = self.cache.prefix_view(len(self.rows))
        if self.feeds_features:
            logits, features = self.target.forward(fed, view, with_features=True, **extra)
            return view, logits.cpu(), features
        return view, self.target.forward(fed, view, **extra).cpu(), None

    def _verify(self, drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                trees: list[TokenTree | None], masks: list) -> tuple[list[Verdict], list[list[TokenLogprob] | None]]:
        """Each row's verdict, and its committed tokens' logprobs if its request asked (read off the rows of
        its logits that scored them; raw, before a grammar's mask)."""
        view, logits, features = self._target_pass(drafts, trees)
        self.refresh_s = 0.0
        argmax = greedy_ids(logits) if trees.count(None) == len(trees) else None
        verdicts, logprobs = [], []
        for row, (sequence, tokens, tree) in enumerate(zip(self.rows, drafts, trees)):
            params = sequence.request.sampling
            size = len(tree.tokens) if tree is not None else len(tokens) + 1
            row_logits = logits[row, :size]
            if params.guide is not None and tree is not None:
                row_logits = params.guide.tree_masks(tree.parents, tree.tokens).apply(row_logits)
            elif params.guide is not None:
                row_logits = masks[row].apply(row_logits)
                params.guide.unstage()
            report = self.logprobs_mode == "processed" and sequence.request.logprobs is not None
            processed = logits_to_probs(row_logits, params) if report else None
            verdict = self._verdict(sequence, tokens, tree, row_logits, processed, draft_probs[row],
                                    argmax[row][:size] if argmax is not None and params.guide is None else None)
            path = [0] + verdict.accepted_nodes if tree is not None else list(range(1 + verdict.num_accepted))
            began = time.perf_counter()
            if tree is not None:  # keep only the accepted path: compact it after the prefix
                view.compact(row, [view.lengths[row] + node for node in path])
            else:
                view.commit(row, len(path))
            self.refresh_s += time.perf_counter() - began
            if self.feeds_features:
                self._observe(sequence, features[row, path])
            verdicts.append(verdict)
            logprobs.append(None if sequence.request.logprobs is None else token_logprobs(
                logits[row, path], verdict.tokens, sequence.request.logprobs,
                None if processed is None else processed[path]))
        self.cache.sync_prefix(view)
        return verdicts, logprobs

    def _verdict(self, sequence: Row, tokens: list[int], tree: TokenTree | None, row_logits: torch.Tensor,
                 processed: torch.Tensor | None, q: torch.Tensor | None, argmax: list[int] | None) -> Verdict:
        params = sequence.request.sampling
        if tree is not None:
            if params.greedy:
                return verify_tree_greedy(tree, greedy_ids(row_logits))
            mode = "deterministic" if tree.draft_probs is None else self.spec.sibling_mode
            target_probs = processed if processed is not None else logits_to_probs(row_logits, params)
            return verify_tree(tree, target_probs, mode, generator=sequence.generator)
        if params.greedy:
            return verify_chain_greedy(tokens, argmax if argmax is not None else greedy_ids(row_logits))
        target_probs = processed if processed is not None else logits_to_probs(row_logits, params)
        verdict = verify_chain(draft_tokens=torch.tensor(tokens, dtype=torch.long), draft_probs=q,
                               target_probs=target_probs, generator=sequence.generator)
        if self.fault == "bonus_from_draft" and verdict.last_kind == "bonus" and self.draft is not None:
            verdict = self.draft.bonus_from_draft(sequence, tokens, verdict)  # TEST-ONLY
        return verdict

    def _commit(self, verdicts: list[Verdict], logprobs: list[list[TokenLogprob] | None],
                drafted: bool) -> list[BatchEvent]:
        events = [self._emit(row, verdict.tokens, row_logprobs)
                  for row, (verdict, row_logprobs) in enumerate(zip(verdicts, logprobs))]
        if self.draft is not None and drafted:  # else what the draft saw is still a prefix
            self.draft.after_commit(self.rows)
        for sequence, event in zip(self.rows, events):
            if sequence.drafter is not None and not event.finished:
                sequence.drafter.commit(sequence.context)
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

    def _record(self, sequences: list[Row], events: list[BatchEvent], verdicts: list[Verdict],
                positions: list[int], nodes: list[int], split: tuple[float, float, float, float]) -> None:
        """Per-request round records (``positions``: drafts a row could accept, a tree's depth; ``nodes``:
        drafts verified); the round's time split is shared by every row in it."""
        now = time.perf_counter()
        for sequence, event, verdict, drafted, count in zip(sequences, events, verdicts, positions, nodes):
            sequence.acceptance.add(verdict.num_accepted, drafted)
            cut = len(event.tokens) < len(verdict.tokens)
            sequence.stats.rounds.append(RoundRecord(
                drafted=drafted, accepted=verdict.num_accepted, committed=len(event.tokens),
                last_kind="cut" if cut else verdict.last_kind, draft_s=split[0], verify_s=split[1],
                state_s=split[2], refresh_s=split[3], tree_nodes=count))
            if event.tokens:
                gap = now - sequence.last_emit
                sequence.stats.chunk_gaps_s.append(gap)
                sequence.stats.token_gaps_s.extend([gap] + [0.0] * (len(event.tokens) - 1))
                sequence.last_emit = now
