"""An EAGLE head drafting chains for every row of a batch at once, in one head cache of its own: the batched
form of ``verispec.drafters.eagle.EagleDrafter`` (same pairs, same positions, same draws).

Each row's committed tokens arrive with their target features (``observe``, kept on the row until the head
pairs them). A round feeds every row's unpaired pairs in one padded pass (a long backlog, a new row's
prompt, goes in alone first: ``catch_up_alone``), then one batched step of the head per draft position, the
drafted pairs staged after each row's committed ones and dropped once drafted.
"""

from __future__ import annotations

import time

import torch

from verispec.adaptive import Backlog
from verispec.batch.draft import CATCH_UP_ALONE
from verispec.batch.requests import Row
from verispec.errors import VerispecError
from verispec.models.eagle import EagleHead
from verispec.sampling import draw_draft


class BatchedEagle:
    def __init__(self, head: EagleHead, max_batch: int, cache_len: int):
        self.head = head
        self.cache = head.body.new_cache(max_batch, cache_len)

    # ---- rows joining, moving, and their features ------------------------------------------------------

    def join(self, row: int) -> None:
        self.cache.set_length(row, 0)

    def move_row(self, source: int, target: int) -> None:
        self.cache.move_row(source, target)

    @staticmethod
    def observe(sequence: Row, features: torch.Tensor) -> None:
        """Features (n, H) of the row's next n committed tokens, in order (the prefill's: the prompt's)."""
        sequence.features.append(features.detach().reshape(-1, features.shape[-1]))

    def backlog(self, rows: list[Row]) -> Backlog:
        unread = sum(sum(f.shape[0] for f in r.features) for r in rows)
        return Backlog(unread, sum(r.remaining for r in rows))

    # ---- the head's passes -------------------------------------------------------------------------------

    def _unpaired(self, sequence: Row) -> tuple[torch.Tensor, list[int]]:
        features = torch.cat(sequence.features) if len(sequence.features) > 1 else sequence.features[0]
        tokens = sequence.context[sequence.paired + 1:]
        if len(tokens) != features.shape[0]:
            raise RuntimeError(f"the EAGLE head holds {sequence.paired} pairs and got {features.shape[0]} new "
                               f"features for a context of {len(sequence.context)} tokens")
        return features, tokens

    def _paired(self, sequence: Row, count: int) -> None:
        sequence.paired += count
        sequence.features = []

    @torch.inference_mode()
    def catch_up_alone(self, rows: list[Row]) -> tuple[float, int, float, int]:
        """Pair, row by row, every row's long backlog of features but its last pair (the batched catch-up
        pads every row to the longest). Returns the seconds spent on rows the head had never read (their
        prompts) and how many they were, the seconds in all, and the pairs read."""
        prompts_s, prompts, total_s, pairs = 0.0, 0, 0.0, 0
        for row, sequence in enumerate(rows):
            if not sequence.features or sum(f.shape[0] for f in sequence.features) - 1 < CATCH_UP_ALONE:
                continue
            began, fresh = time.perf_counter(), sequence.paired == 0
            features, tokens = self._unpaired(sequence)
            view = self.cache.row_view(row)
            self.head.step(features[None, :-1], torch.tensor([tokens[:-1]]), view)
            view.commit(0, len(tokens) - 1)
            self.cache.sync_row(row, view)
            self._paired(sequence, len(tokens) - 1)
            sequence.features = [features[-1:]]
            seconds = time.perf_counter() - began
            prompts_s += seconds if fresh else 0.0
            prompts += fresh
            total_s += seconds
            pairs += len(tokens) - 1
        return prompts_s, prompts, total_s, pairs

    @torch.inference_mode()
    def propose(self, rows: list[Row], num_drafts: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts per row (lists of ids) and, for sampled drafts, their q (k, V)."""
        view = self.cache.prefix_view(len(rows))
        unpaired = [self._unpaired(s) for s in rows]
        width = max(len(tokens) for _, tokens in unpaired)
        features = torch.zeros(len(rows), width, self.head.body.config.hidden_size)
        fed = torch.zeros(len(rows), width, dtype=torch.long)
        for row, (rows_features, tokens) in enumerate(unpaired):  # padding after a row's pairs is never read
            features[row, :len(tokens)] = rows_features
            fed[row, :len(tokens)] = torch.tensor(tokens)
        predicted = self.head.step(features, fed, view)
        normed = predicted[torch.arange(len(rows)), torch.tensor([len(t) - 1 for _, t in unpaired])]  # (B, H)
        for row, (sequence, (_, tokens)) in enumerate(zip(rows, unpaired)):
            view.commit(row, len(tokens))
            self._paired(sequence, len(tokens))
        bases = list(view.lengths)
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        most = max(num_drafts)
        for step in range(most):
            logits = self.head.body.head_logits(normed, self.head.draft_vocab).cpu()  # (B, V)
            for row, sequence in enumerate(rows):
                if step >= num_drafts[row]:  # this row needs no more drafts: pad without using its RNG
                    drafts[row].append(sequence.context[-1])
                    continue
                token, q = draw_draft(logits[row], sequence.request.sampling, sequence.generator)
                drafts[row].append(token)
                if q is not None:
                    probs[row].append(q)
            if step + 1 < most:
                normed = self.head.step(normed[:, None], torch.tensor([[d[-1]] for d in drafts]), view)[:, 0]
                for row in range(len(rows)):
                    view.commit(row, 1)
        for row, base in enumerate(bases):  # drop the staged pairs: only committed tokens stay paired
            view.set_length(row, base)
        self.cache.sync_prefix(view)
        return ([d[:k] for d, k in zip(drafts, num_drafts)],
                [torch.stack(p[:k]) if p and k else None for p, k in zip(probs, num_drafts)])

    def after_commit(self, rows: list[Row]) -> None:
        """Nothing to roll back: drafted pairs were dropped within ``propose``."""

    def bonus_from_draft(self, sequence: Row, tokens: list[int], verdict):
        raise VerispecError("the bonus_from_draft test fault is built for the draft model's chains")
