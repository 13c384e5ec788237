"""A draft model drafting chains for every row of a batch at once, in one cache of its own.

The draft reads a sequence lazily: its prompt, and whatever was committed while the batch ran at gamma 0,
only once it drafts for it; a batch held at gamma 0 never runs the draft at all. Each round feeds every
row's unseen tokens in one padded pass (a long backlog goes in alone first: ``catch_up_alone``), then one
batched step per draft position.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from verispec.adaptive import Backlog
from verispec.batch.requests import Row
from verispec.drafters.base import common_prefix_length, head_args
from verispec.models.llama import LlamaForCausalLM
from verispec.sampling import draw_draft, greedy_ids, logits_to_probs, sample_from
from verispec.verify.chain import ChainResult

CATCH_UP_ALONE = 16  # a row's draft backlog at least this long is fed alone (see catch_up_alone)


class BatchedDraft:
    def __init__(self, model: LlamaForCausalLM, max_batch: int, cache_len: int, vocab_limit: int | None,
                 fault: str | None = None):
        self.model, self.head, self.fault = model, head_args(vocab_limit), fault
        self.cache = model.new_cache(max_batch, cache_len)

    def backlog(self, rows: list[Row]) -> Backlog:
        unread = sum(max(0, len(r.context) - len(r.draft_seen) - 1) for r in rows)
        return Backlog(unread, sum(r.remaining for r in rows))

    def join(self, row: int) -> None:
        """A new sequence in ``row``: the draft reads its prompt when it first drafts for it."""
        self.cache.set_length(row, 0)

    def move_row(self, source: int, target: int) -> None:
        self.cache.move_row(source, target)

    def catch_up_alone(self, rows: list[Row]) -> tuple[float, int, float, int]:
        """Feed the draft, row by row, every row's long backlog but its last token (the batched catch-up
        pads every row to the longest). Returns the seconds spent on rows the draft had never read (their
        prompts) and how many they were, the seconds in all, and the tokens read."""
        prompts_s, prompts, total_s, tokens = 0.0, 0, 0.0, 0
        for row, sequence in enumerate(rows):
            backlog = sequence.context[len(sequence.draft_seen):-1]
            if len(backlog) < CATCH_UP_ALONE:
                continue
            began, fresh = time.perf_counter(), not sequence.draft_seen
            view = self.cache.row_view(row)
            with torch.inference_mode():
                self.model.forward(torch.tensor([backlog]), view, last_only=True)
            view.commit(0, len(backlog))
            self.cache.sync_row(row, view)
            sequence.draft_seen.extend(backlog)
            seconds = time.perf_counter() - began
            prompts_s += seconds if fresh else 0.0
            prompts += fresh
            total_s += seconds
            tokens += len(backlog)
        return prompts_s, prompts, total_s, tokens

    def propose(self, rows: list[Row], num_drafts: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts per row (lists of ids) and, for sampled drafts, their q (k, V)."""
        most = max(num_drafts)
        view = self.cache.prefix_view(len(rows))
        last = self._read_unseen(rows, view)
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for step in range(most):
            if step:
                last = self.model.forward(torch.tensor([[d[-1]] for d in drafts]), view, **self.head)[:, -1].cpu()
                for row, sequence in enumerate(rows):
                    view.commit(row, 1)
                    sequence.draft_seen.append(drafts[row][-1])
            greedy = greedy_ids(last) if any(s.request.sampling.greedy for s in rows) else None
            for row, sequence in enumerate(rows):
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
        self.cache.sync_prefix(view)
        return ([d[:k] for d, k in zip(drafts, num_drafts)],
                [torch.stack(p[:k]) if p and k else None for p, k in zip(probs, num_drafts)])

    def _read_unseen(self, rows: list[Row], view) -> torch.Tensor:
        """Feed every row's unseen committed tokens (padded at the end, never committed); the logits (B, V)
        after each row's last one."""
        unseen = [s.context[len(s.draft_seen):] for s in rows]
        width = max(len(u) for u in unseen)
        fed = torch.tensor([u + [u[-1]] * (width - len(u)) for u in unseen])
        ends = torch.tensor([len(u) - 1 for u in unseen])
        model = self.model
        if hasattr(model, "run_layers") and len(unseen) == 1:  # one row: its pass in one native call
            last = model.forward(fed, view, last_only=True, **self.head)[:, -1].cpu()  # (1, V)
        elif hasattr(model, "run_layers"):  # native: the LM head only at each row's last fed token
            with torch.inference_mode():
                hidden = model.run_layers(model.embed(fed), view, 0, model.config.num_hidden_layers)
                last = model.logits(hidden[torch.arange(len(unseen)), ends.to(hidden.device)], **self.head).cpu()
        else:
            last = model.forward(fed, view, **self.head).cpu()[torch.arange(len(unseen)), ends]  # (B, V)
        for row, tokens in enumerate(unseen):
            view.commit(row, len(tokens))
            rows[row].draft_seen.extend(tokens)
        return last

    def after_commit(self, rows: list[Row]) -> None:
        """Keep, per row, only the KV of drafts that were committed (never the last committed token)."""
        for row, sequence in enumerate(rows):
            keep = min(common_prefix_length(sequence.draft_seen, sequence.context), len(sequence.context) - 1)
            del sequence.draft_seen[keep:]
            self.cache.set_length(row, keep)

    def bonus_from_draft(self, sequence: Row, tokens: list[int], verdict: ChainResult) -> ChainResult:
        """TEST-ONLY fault (VERISPEC_FAULT=bonus_from_draft): the bonus token drawn from the draft model's
        distribution after the accepted drafts (one fresh draft prefill) instead of the target's."""
        ids = sequence.context + tokens
        logits = self.model.forward(torch.tensor([ids]), self.model.new_cache(1, len(ids)), last_only=True,
                                    **self.head)[0, -1].cpu()
        bonus = sample_from(logits_to_probs(logits, sequence.request.sampling), sequence.generator)
        return replace(verdict, tokens=verdict.tokens[:-1] + [bonus])
