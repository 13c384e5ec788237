"""The speculative decoding loop: propose -> verify -> commit -> record.

    engine = SpecEngine(target, DraftModelDrafter(draft))
    result = engine.generate(prompt_ids, SamplingParams(temperature=0), SpecConfig(gamma=4),
                             StopRules(max_tokens=64, eos_ids=(0,)), seed=1)
    result.tokens, result.stats.summary()["committed_per_round"]

Invariants kept by every round (docs/algorithms.md, "KV state follows the committed path"):
- ``context`` holds every committed token; the target cache holds the KV of all of them but the
  last, which is the previous round's recovered or bonus token (or the first sampled token). It is
  fed, together with the drafts, at the start of the next round.
- Plain decoding is the same loop with zero drafts: the "bonus" token is then a sample from p.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from verispec.adaptive import AcceptanceCounts, GammaPolicy, check_policy, report_draft_reads
from verispec.cache import KVCache
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.base import Drafter, Proposal, check_drafter
from verispec.errors import ContextError, VerispecError
from verispec.grammar import FORCED_DRAFTS
from verispec.guide import Guide, Rows, with_point_masses
from verispec.sampling import greedy_ids, logits_to_probs, sample_from
from verispec.stats import RequestStats, RoundRecord
from verispec.stopping import Decode, apply_stop_rules
from verispec.tree import TokenTree, use_tree
from verispec.verify.chain import ChainResult, verify_chain, verify_chain_greedy
from verispec.verify.tree import TreeResult, verify_tree, verify_tree_greedy


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: RequestStats
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stop_text_index: int | None = None  # where a matched stop string starts in decode(tokens)


class SpecEngine:
    def __init__(self, target, drafter: Drafter | None = None, decode: Decode | None = None,
                 gamma_policy: GammaPolicy | None = None):
        if drafter is not None:
            check_drafter(drafter)
        self.target = target
        self.drafter = drafter
        self.decode = decode
        # Chains: drafts per round come from this policy when set (kept across requests, so an
        # adaptive policy's measurements carry over); otherwise spec.gamma.
        self.gamma_policy = gamma_policy
        if gamma_policy is not None:
            check_policy(gamma_policy)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams = SamplingParams(),
                 spec: SpecConfig = SpecConfig(), stop: StopRules = StopRules(), seed: int = 0) -> GenerationResult:
        generation = self.stream(prompt_ids, sampling, spec, stop, seed)
        for _ in generation:
            pass
        return generation.result

    def stream(self, prompt_ids: list[int], sampling: SamplingParams = SamplingParams(),
               spec: SpecConfig = SpecConfig(), stop: StopRules = StopRules(), seed: int = 0) -> "Generation":
        """An iterator over emitted chunks (lists of token ids); ``.result`` once exhausted."""
        if spec.enabled and self.drafter is None:
            raise VerispecError("speculation is on but no drafter was given; pass a draft model or use --no-spec")
        return Generation(self, list(prompt_ids), sampling, spec, stop, seed)


class Generation:
    """One request's decoding loop. Iterate to run it; each item is the chunk a round emitted."""

    def __init__(self, engine: SpecEngine, prompt_ids: list[int], sampling: SamplingParams,
                 spec: SpecConfig, stop: StopRules, seed: int):
        max_context = engine.target.config.max_context
        if not prompt_ids:
            raise VerispecError("the prompt is empty; give at least one token")
        if len(prompt_ids) + stop.max_tokens > max_context:
            raise ContextError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({stop.max_tokens}) exceeds the "
                               f"model's context of {max_context} tokens; shorten the prompt or lower max_tokens")
        self.engine, self.sampling, self.spec, self.stop = engine, sampling, spec, stop
        self.generator = torch.Generator().manual_seed(seed)
        self.context = list(prompt_ids)
        self.generated: list[int] = []
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))
        self.acceptance = AcceptanceCounts()  # this request's, for the gamma policy
        self.result: GenerationResult | None = None
        self.cache: KVCache = engine.target.new_cache(
            1, min(max_context, len(prompt_ids) + stop.max_tokens + spec.widest_chain + 1))
        self.finish_reason: str | None = None
        self._asked = 0  # drafts the last round asked its drafter for (the gamma policy keys rounds by it)
        self.stop_text_index: int | None = None
        # A feature drafter (EAGLE) reads the target's final features of every committed token, taken
        # from the passes that run anyway: the prefill's and each verification's.
        self.feeds_features = spec.enabled and engine.drafter is not None and engine.drafter.wants_features
        self._round_features: torch.Tensor | None = None  # (K + 1, H) of the last verification
        # A grammar and penalties (verispec.guide), or None; the drafters get it through the sampling.
        self.guide = Guide.for_request(sampling, prompt_ids, engine.target.config.vocab_size)
        self.sampling = replace(sampling, guide=self.guide)
        self._round_masks: Rows | None = None  # the guide's transform of each verified row

    def __iter__(self) -> Iterator[list[int]]:
        start = time.perf_counter()
        drafter = self.engine.drafter
        if drafter is not None:
            drafter.reset()
            if drafter.shares_target_cache:
                drafter.bind(self.cache)
        first = self._prefill()
        self.stats.ttft_s = time.perf_counter() - start
        last_emit = time.perf_counter()
        self.stats.token_gaps_s.append(self.stats.ttft_s)
        chunk = self._emit([first])
        yield chunk
        while self.finish_reason is None:
            record = RoundRecord(drafted=0, accepted=0, committed=0, last_kind="bonus")
            proposal = self._propose(record)
            verdict = self._verify(proposal, record)
            chunk = self._commit(verdict, record)
            now = time.perf_counter()
            self._record(record, chunk, now - last_emit)
            last_emit = now
            if chunk:
                yield chunk
        self.stats.e2e_s = time.perf_counter() - start
        self.stats.finish_reason = self.finish_reason
        if self.engine.gamma_policy is not None and self.spec.method == "chain":
            self.engine.gamma_policy.finished(len(self.generated))
        self.result = GenerationResult(self.generated, self.stats, self.finish_reason, self.stop_text_index)

    # ---- the steps ----------------------------------------------------------------------------------

    def _prefill(self) -> int:
        began = time.perf_counter()
        if self.feeds_features:
            logits, features = self.engine.target.forward(torch.tensor([self.context]), self.cache, last_only=True,
                                                           with_features=True)
            self.engine.drafter.observe(features[0])
        else:
            logits = self.engine.target.forward(torch.tensor([self.context]), self.cache, last_only=True)
        logits = logits.cpu()
        self.cache.commit(0, len(self.context))
        if self.guide is not None:
            logits = self.guide.mask().apply(logits)
        token = sample_from(logits_to_probs(logits[0, -1], self.sampling), self.generator)
        self.stats.prefill_s = time.perf_counter() - began
        return token

    def _propose(self, record: RoundRecord) -> Proposal:
        began = time.perf_counter()
        remaining = self.stop.max_tokens - len(self.generated)
        num_drafts = self._asked = min(self._gamma(), remaining - 1)
        drafter = self.engine.drafter
        if num_drafts <= 0:
            proposal = Proposal(torch.empty(0, dtype=torch.long), None)
        elif self.spec.method == "tree" and use_tree(self.spec.tree_shape, self._cache_room()):
            # A tree's pass writes all its nodes to the cache; near the end of the context the round
            # drafts a chain of what is left instead, verified as exactly.
            proposal = drafter.propose_tree(self.context, self.spec.tree_shape, self._sibling_mode(),
                                            self.sampling, self.generator).capped(remaining)
        else:
            proposal = drafter.propose(self.context, num_drafts, self.sampling, self.generator).capped(remaining)
        if self.guide is not None and proposal.tree is None:
            proposal = self._guide_chain(proposal)
        record.draft_s = time.perf_counter() - began
        record.tree_nodes = proposal.num_drafts
        # Positions a round could accept: K for a chain, the depth for a tree.
        tree = proposal.tree
        record.drafted = int(tree.compile().depths.max()) if tree is not None else proposal.num_drafts
        if record.drafted and drafter is not None:  # the drafter read this round (its figures are the last read's)
            reads = drafter.reads()
            record.draft_read_s = reads.prompt_s + reads.backlog_s
        return proposal

    def _guide_chain(self, proposal: Proposal) -> Proposal:
        """The drafts the grammar allows (cut at the first it forbids: it could never be accepted), then
        the tokens it forces after them as free point-mass drafts (plain decoding too), with the masks of
        the rows that verify them kept for ``_verify``."""
        count = proposal.num_drafts
        room = min(FORCED_DRAFTS, self.stop.max_tokens - len(self.generated) - 1 - count, self._cache_room() - 1 - count)
        if proposal.exit_hidden is not None:  # early exit resumes from its own drafts' hidden states only
            room = 0
        allowed, forced, self._round_masks = self.guide.round_masks(proposal.tokens.tolist(), max(0, room))
        if forced:
            return Proposal(torch.cat([proposal.tokens, torch.tensor(forced, dtype=torch.long)]),
                            with_point_masses(proposal.probs, forced))
        if allowed == count:
            return proposal
        return Proposal(proposal.tokens[:allowed], None if proposal.probs is None else proposal.probs[:allowed],
                        exit_hidden=None if proposal.exit_hidden is None else proposal.exit_hidden[:, :allowed],
                        exit_layer=proposal.exit_layer)

    def _cache_room(self) -> int:
        """Positions the target's cache (and the draft model's, when one drafts) can still take."""
        limit = self.engine.target.config.max_context
        drafter = self.engine.drafter
        if drafter is not None and drafter.max_context is not None:
            limit = min(limit, drafter.max_context)
        return limit - len(self.context)

    def _gamma(self) -> int:
        policy = self.engine.gamma_policy
        if self.spec.method == "chain" and policy is not None:
            return min(policy.choose(1, self.acceptance), self.spec.gamma)
        return self.spec.max_drafts

    def _sibling_mode(self, tree: TokenTree | None = None) -> str:
        point_masses = tree is not None and tree.draft_probs is None
        return "deterministic" if self.sampling.greedy or point_masses else self.spec.sibling_mode

    def _verify(self, proposal: Proposal, record: RoundRecord) -> ChainResult | TreeResult:
        if proposal.tree is not None:
            return self._verify_tree(proposal.tree, record)
        began = time.perf_counter()
        if proposal.exit_hidden is not None:
            logits = self._resume_from_exit(proposal)
        else:
            fed = torch.cat([torch.tensor([self.context[-1]]), proposal.tokens])[None]  # (1, K+1)
            logits = self._target_pass(fed)  # (K+1, V); verified on the CPU
        if self.guide is not None:  # the grammar's mask per row, then the staged drafts rolled back
            logits = self._round_masks.apply(logits)
            self.guide.unstage()
        if self.sampling.greedy:
            verdict = verify_chain_greedy(proposal.tokens.tolist(), greedy_ids(logits))
        else:
            target_probs = logits_to_probs(logits, self.sampling)
            verdict = verify_chain(draft_tokens=proposal.tokens, draft_probs=proposal.probs,
                                   target_probs=target_probs, generator=self.generator)
        record.verify_s = time.perf_counter() - began
        record.accepted = verdict.num_accepted
        record.last_kind = verdict.last_kind
        return verdict

    def _target_pass(self, fed: torch.Tensor, **tree) -> torch.Tensor:
        """The verification pass's logits (T, V) on the CPU; a feature drafter's features kept aside."""
        if not self.feeds_features:
            return self.engine.target.forward(fed, self.cache, **tree)[0].cpu()
        logits, features = self.engine.target.forward(fed, self.cache, with_features=True, **tree)
        self._round_features = features[0]
        return logits[0].cpu()

    @torch.inference_mode()
    def _resume_from_exit(self, proposal: Proposal) -> torch.Tensor:
        """Target logits (K+1, V) reusing early-exit drafting: only x_K runs the first E layers (its
        predecessors' early KV is staged after the prefix); all K+1 positions resume at layer E."""
        target, cache, exit_layer = self.engine.target, self.cache, proposal.exit_layer
        num_drafts, base = proposal.num_drafts, self.cache.lengths[0]
        cache.set_length(0, base + num_drafts)
        try:
            last = target.run_layers(target.embed(proposal.tokens[None, -1:]), cache, 0,
                                     exit_layer, staged=num_drafts)  # (1, 1, H)
        finally:
            cache.set_length(0, base)
        hidden = torch.cat([proposal.exit_hidden, last], dim=1)  # (1, K+1, H)
        upper = target.run_layers(hidden, cache, exit_layer, target.config.num_hidden_layers)
        return target.logits(upper)[0].cpu()

    def _verify_tree(self, tree: TokenTree, record: RoundRecord) -> TreeResult:
        began = time.perf_counter()
        buffers = tree.compile()
        fed = torch.tensor([tree.tokens])  # (1, N+1): the root is the last committed token
        logits = self._target_pass(fed, tree_mask=buffers.ancestor_mask, depths=buffers.depths)  # (N+1, V)
        if self.guide is not None:
            logits = self.guide.tree_masks(tree.parents, tree.tokens).apply(logits)
        if self.sampling.greedy:
            verdict = verify_tree_greedy(tree, greedy_ids(logits))
        else:
            verdict = verify_tree(tree, logits_to_probs(logits, self.sampling), self._sibling_mode(tree),
                                  generator=self.generator)
        record.verify_s = time.perf_counter() - began
        record.accepted = verdict.num_accepted
        record.last_kind = verdict.last_kind
        return verdict

    def _commit(self, verdict: ChainResult | TreeResult, record: RoundRecord) -> list[int]:
        began = time.perf_counter()
        # The fed last token and the accepted drafts now have valid KV; the new last token does not.
        # Refresh: the target state keeps the accepted path only (compressed models also append its
        # completed compressed rows from the verification scratch pads).
        if isinstance(verdict, TreeResult):  # keep only the accepted path: compact it after the prefix
            start, path = self.cache.lengths[0], [0] + verdict.accepted_nodes
            self.cache.compact(0, [start + node for node in path])
        else:
            path = list(range(1 + verdict.num_accepted))
            self.cache.commit(0, len(path))
        if self.feeds_features:  # the features of the fed root and the accepted drafts, now committed
            self.engine.drafter.observe(self._round_features[path])
        record.refresh_s = time.perf_counter() - began
        kept = self._emit(verdict.tokens)
        if self.engine.drafter is not None and self.finish_reason is None:
            self.engine.drafter.commit(self.context)
        record.state_s = time.perf_counter() - began
        record.committed = len(kept)
        if len(kept) < len(verdict.tokens):
            record.last_kind = "cut"
        return kept

    def _record(self, record: RoundRecord, chunk: list[int], gap_s: float) -> None:
        record.other_s = max(0.0, gap_s - record.draft_s - record.verify_s - record.state_s)
        if self.engine.gamma_policy is not None and self.spec.method == "chain":
            # A backlog the draft fed first is not what this round's gamma costs: the policy would
            # blame whichever gamma follows. The prompt's is a cost of speculating at all (charged);
            # both price the draft's reads.
            policy, drafter = self.engine.gamma_policy, self.engine.drafter
            reads = drafter.reads()
            prompt_s = reads.prompt_s if record.drafted else 0.0
            read_tokens = reads.tokens if record.drafted else 0
            report_draft_reads(policy, 1, prompt_s, read_tokens, record.draft_read_s)
            # A lookup drafting past the round's gamma (--lookup-drafts) is that gamma's round.
            policy.observe(1, min(record.drafted, self._asked), record.total_s - record.draft_read_s,
                           [record.accepted], [record.drafted])
            self.acceptance.add(record.accepted, record.drafted)
        self.stats.rounds.append(record)
        if chunk:
            self.stats.chunk_gaps_s.append(gap_s)
            self.stats.token_gaps_s.extend([gap_s] + [0.0] * (len(chunk) - 1))

    # ---- stop rules ----------------------------------------------------------------------------------

    def _emit(self, tokens: list[int]) -> list[int]:
        """Append tokens to the output up to the first stop condition; return those kept."""
        cut = apply_stop_rules(tokens, self.generated, self.stop, self.engine.decode)
        self.generated.extend(cut.kept)
        self.context.extend(cut.kept)
        if self.guide is not None:
            self.guide.advance(cut.kept)
        self.stats.generated_tokens = len(self.generated)
        if cut.finish_reason is not None:
            self.finish_reason = cut.finish_reason
            self.stop_text_index = cut.stop_text_index
        return cut.kept
