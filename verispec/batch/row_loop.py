"""A model whose cache holds one sequence (the compressed-attention model, a transformers-backed model),
given the batched interface ``BatchEngine`` drives: each row keeps a one-sequence cache of its own and a
pass over B rows is B passes, one per row, each exactly the pass ``SpecEngine`` would run for that row
alone.

No arithmetic is shared between rows (B rows cost B passes), but such a model gets the whole batched
engine: every method, rows that advance together round by round instead of waiting in a queue, logprobs,
predicted outputs. ``BatchEngine`` wraps a model that does not declare ``Capabilities.batching`` itself:

    target = RowLoop(compressed_model)           # RowLoop.wrap(model) leaves a batching model as it is
    cache = target.new_cache(batch=4, max_len=512)
    logits = target.forward(tokens, cache.prefix_view(4), widths=[5, 3, 5, 1])   # (4, 5, V)
"""

from __future__ import annotations

from dataclasses import replace

import torch


class RowCaches:
    """One cache per row, with ``KVCache``'s row operations. Views share the row caches themselves, so
    syncing a view back is a no-op; moving a row swaps two caches."""

    def __init__(self, caches: list):
        self.caches = caches

    @property
    def batch(self) -> int:
        return len(self.caches)

    @property
    def lengths(self) -> list[int]:
        return [cache.lengths[0] for cache in self.caches]

    def set_length(self, row: int, length: int) -> None:
        self.caches[row].set_length(0, length)

    def commit(self, row: int, num_new: int) -> None:
        self.caches[row].commit(0, num_new)

    def compact(self, row: int, source_slots: list[int]) -> None:
        self.caches[row].compact(0, source_slots)

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()

    def row_view(self, row: int) -> "RowCaches":
        return RowCaches([self.caches[row]])

    def prefix_view(self, num_rows: int) -> "RowCaches":
        return RowCaches(self.caches[:num_rows])

    def sync_row(self, row: int, view: "RowCaches") -> None:
        pass  # the view holds the row's own cache

    def sync_prefix(self, view: "RowCaches") -> None:
        pass

    def move_row(self, source: int, target: int) -> None:
        """Row ``source`` continues as row ``target``; ``target``'s old cache (a finished row's) is free."""
        self.caches[target], self.caches[source] = self.caches[source], self.caches[target]


class RowLoop:
    """``model`` decoding a batch row by row (module docstring). Its ``config`` and capabilities are the
    model's, with ``batching`` declared."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.capabilities = replace(model.capabilities, batching=True)

    @staticmethod
    def wrap(model):
        """``model`` itself where it batches (or is None), else ``RowLoop(model)``."""
        return model if model is None or model.capabilities.batching else RowLoop(model)

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> RowCaches:
        return RowCaches([self.model.new_cache(1, max_len) for _ in range(batch)])

    def forward(self, tokens: torch.Tensor, cache: RowCaches, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_only: bool = False, widths: list[int] | None = None,
                **options) -> torch.Tensor:
        """Logits (B, T, V) for ``tokens`` (B, T), row b's pass over its own cache. ``widths``: how many of
        a row's T positions are its own (the rest, padding, are neither fed nor computed; their logits are
        zero); without it every position is fed, as the batched model would. ``tree_mask`` (B, T, T) and
        ``depths`` (B, T) go to each row as (w, w) and (w,)."""
        batch, width = tokens.shape
        widths = widths or [width] * batch
        rows = []
        for row, (own, used) in enumerate(zip(cache.caches, widths)):
            extra = dict(options)
            if tree_mask is not None:
                extra["tree_mask"] = tree_mask[row, :used, :used]
            if depths is not None:
                extra["depths"] = depths[row, :used]
            rows.append(self.model.forward(tokens[row:row + 1, :used], own, last_only=last_only, **extra))
        if options.get("with_features"):
            logits, features = zip(*rows)
            return _stack(logits, width, last_only), _stack(features, width, last_only)
        return _stack(rows, width, last_only)


def _stack(rows, width: int, last_only: bool) -> torch.Tensor:
    """Rows of (1, w, ...) padded with zeros to (1, width, ...) and stacked to (B, width, ...)."""
    if last_only:
        return torch.cat(rows)
    padded = []
    for row in rows:
        gap = width - row.shape[1]
        padded.append(row if gap == 0 else torch.cat([row, row.new_zeros(1, gap, *row.shape[2:])], dim=1))
    return torch.cat(padded)
