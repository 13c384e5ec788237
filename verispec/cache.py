"""Preallocated KV cache whose contents always follow the committed path.

Shape letters: L layers, B batch rows, Hkv key/value heads, S slots, D head dim,
T new positions.

Each row b owns ``lengths[b]`` committed slots. A forward pass writes its T new positions into the slots
right after the committed ones (slot ``lengths[b] + j`` for new position j) *without* committing them;
the caller then decides how many of them become committed:

    cache.lengths == [5]
    model.forward([[a, x1, x2, x3]], cache)     # writes slots 5..8, still lengths == [5]
    cache.commit(0, 2)                          # a and x1 accepted: lengths == [7]

Rolling back is therefore just not committing (or ``set_length``); nothing after ``lengths[b]`` is ever
attended to by a later forward, because the model masks every slot at or beyond the committed length
that is not one of the current pass's own positions. ``compact`` moves an accepted tree path, scattered
over the flattened tree's slots, into the contiguous slots after the prefix.
"""

from __future__ import annotations

import math
import mmap
import warnings

import torch

from verispec.errors import ContextError

LAZY_BYTES = 1 << 20  # smaller caches: torch.zeros


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor whose CPU pages are touched only when written: an anonymous mapping is zero pages
    the kernel supplies on first write, where ``torch.zeros`` writes every byte up front. A cache sized
    for the model's whole context (SmolLM2: 8,192 positions, ~377 MB a row) then costs memory and time
    only for the positions a request reaches. Small pages: a huge page would zero 2 MB at a (layer,
    head)'s first token."""
    size = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or size < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    with warnings.catch_warnings():  # torch warns that the buffer is not read-only: it is ours alone
        warnings.simplefilter("ignore")
        return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)


class KVCache:
    """Keys and values for L layers, B rows and up to ``max_len`` positions per row."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, batch, kv_heads, max_len, head_dim)  # (L, B, Hkv, S, D)
        self.keys = zeros(shape, dtype, device)
        self.values = zeros(shape, dtype, device)
        self.lengths = [0] * batch
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def check_room(self, num_new: int) -> None:
        """Raise ContextError if writing ``num_new`` positions would overflow any row."""
        longest = max(self.lengths) + num_new
        if longest > self.max_len:
            raise ContextError(
                f"sequence would reach {longest} positions but the cache holds {self.max_len}; "
                "shorten the prompt or lower max_tokens")

    def write(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """Store the pass's new keys/values (B, Hkv, T, D) in the slots after each row's length."""
        num_new = new_keys.shape[2]
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            self.keys[layer, :, :, start:start + num_new] = new_keys
            self.values[layer, :, :, start:start + num_new] = new_values
            return
        # Ragged rows: scatter each row's T positions after its own length in one indexed write.
        device = self.keys.device
        rows = torch.arange(self.batch, device=device)[:, None]  # (B, 1)
        slots = torch.tensor(self.lengths, device=device)[:, None] + torch.arange(num_new, device=device)  # (B, T)
        self.keys[layer][rows, :, slots] = new_keys.transpose(1, 2)  # (B, T, Hkv, D)
        self.values[layer][rows, :, slots] = new_values.transpose(1, 2)

    def view(self, layer: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first ``num_slots`` slots: each (B, Hkv, num_slots, D)."""
        return self.keys[layer, :, :, :num_slots], self.values[layer, :, :, :num_slots]

    def commit(self, row: int, num_new: int) -> None:
        """Make the first ``num_new`` positions written by the last pass part of row's prefix."""
        self.lengths[row] += num_new

    def set_length(self, row: int, length: int) -> None:
        """Roll row back (or forward over already written slots) to ``length`` committed slots."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self.lengths[row] = length

    def compact(self, row: int, source_slots: list[int]) -> None:
        """Copy the KV at ``source_slots`` (absolute, ascending) to the slots after row's prefix and
        commit them. Used after tree verification: the accepted path's nodes are scattered over the
        flattened tree, and only they may stay visible."""
        start = self.lengths[row]
        if source_slots and source_slots != list(range(start, start + len(source_slots))):
            index = torch.tensor(source_slots, device=self.keys.device)
            self.keys[:, row, :, start:start + len(source_slots)] = self.keys[:, row, :, index]
            self.values[:, row, :, start:start + len(source_slots)] = self.values[:, row, :, index]
        self.lengths[row] = start + len(source_slots)

    def reset(self) -> None:
        self.lengths = [0] * self.batch

    def prefix_view(self, num_rows: int) -> "KVCache":
        """A cache over rows 0..num_rows-1 sharing this cache's storage, so a forward over the active
        rows of a batch touches nothing else; ``sync_prefix`` copies its lengths back."""
        view = KVCache.__new__(KVCache)
        view.keys, view.values = self.keys[:, :num_rows], self.values[:, :num_rows]
        view.lengths, view.max_len = list(self.lengths[:num_rows]), self.max_len
        return view

    def sync_prefix(self, view: "KVCache") -> None:
        self.lengths[:view.batch] = view.lengths

    def move_row(self, source: int, target: int) -> None:
        """Copy row ``source``'s committed KV and length into row ``target`` (batch compaction)."""
        length = self.lengths[source]
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]
        self.lengths[target] = length

    def row_view(self, row: int) -> "KVCache":
        """A one-row cache sharing this cache's storage (writes land in ``row``); commit through it,
        then ``sync_row`` copies its length back. Used to prefill one sequence of a batch."""
        view = KVCache.__new__(KVCache)
        view.keys, view.values = self.keys[:, row:row + 1], self.values[:, row:row + 1]
        view.lengths, view.max_len = [self.lengths[row]], self.max_len
        return view

    def sync_row(self, row: int, view: "KVCache") -> None:
        self.lengths[row] = view.lengths[0]
