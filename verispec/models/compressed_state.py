"""``CompressedState``, the compressed-attention model's cache: committed raw KV, layer inputs and CSA/HCA
rows of one sequence, and the refresh that commits a pass's accepted path from its ``Scratch``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.errors import ContextError
from verispec.models.compressed_config import CompressedConfig

@dataclass
class Scratch:
    """What one forward pass computed but did not commit: per-node scratch pads."""

    base: int  # committed length when the pass ran
    positions: list[int]  # (T,) position of each new node
    parents: list[int]  # within the pass; -1 = child of the committed prefix
    csa_nodes: list[int]  # nodes whose position completes a CSA block, one new row each
    csa_keys: torch.Tensor  # (L, Hkv, Nb, D), keys already rotated
    csa_values: torch.Tensor
    hca_nodes: list[int]
    hca_keys: torch.Tensor  # (L, Hkv, Nh, D)
    hca_values: torch.Tensor


class CompressedState:
    """One sequence's committed compressed state; the cache-shaped object the engine drives.

    The engine protocol of ``KVCache`` holds: ``lengths``, ``check_room``, ``commit(row, n)`` (the first n
    nodes of the last pass, a chain, become committed), ``compact(row, slots)`` (a tree's accepted path,
    given as absolute slots ``base + node``), ``set_length`` (roll back), ``reset``. Only one row."""

    def __init__(self, config: CompressedConfig, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        layers, kv_heads, head_dim = config.num_hidden_layers, config.kv_heads, config.dim_per_head
        self.config, self.max_len = config, max_len
        self.keys = torch.zeros(layers, kv_heads, max_len, head_dim, dtype=dtype, device=device)  # (L, Hkv, S, D)
        self.values = torch.zeros_like(self.keys)
        self.inputs = torch.zeros(layers, max_len, config.hidden_size, dtype=dtype, device=device)  # (L, S, C)
        self.csa_keys = torch.zeros(layers, kv_heads, max_len // config.block + 1, head_dim, dtype=dtype,
                                    device=device)
        self.csa_values = torch.zeros_like(self.csa_keys)
        hca_rows = max_len // config.hca_block + 1 if config.hca_block else 0
        self.hca_keys = torch.zeros(layers, kv_heads, hca_rows, head_dim, dtype=dtype, device=device)
        self.hca_values = torch.zeros_like(self.hca_keys)
        self.hca_sum = torch.zeros(layers, config.hidden_size, dtype=torch.float32, device=device)  # open HCA block
        self.length = 0
        self.pending: Scratch | None = None
        self.refresh_count = 0  # refreshes run
        self.materialised_count = 0  # of those, paths already in place (no raw KV moved)

    @property
    def lengths(self) -> list[int]:
        return [self.length]

    @property
    def batch(self) -> int:
        return 1

    @property
    def csa_rows(self) -> int:
        return self.length // self.config.block

    @property
    def hca_rows(self) -> int:
        return self.length // self.config.hca_block if self.config.hca_block else 0

    def check_room(self, num_new: int) -> None:
        if self.length + num_new > self.max_len:
            raise ContextError(f"sequence would reach {self.length + num_new} positions but the state holds "
                               f"{self.max_len}; shorten the prompt or lower max_tokens")

    def reset(self) -> None:
        self.length, self.pending = 0, None
        self.hca_sum.zero_()

    def commit(self, row: int, num_new: int) -> None:
        """The first ``num_new`` nodes of the last pass (a causal chain from its first node) are accepted."""
        self.refresh(list(range(num_new)))

    def compact(self, row: int, source_slots: list[int]) -> None:
        """Keep the tree path at absolute ``source_slots`` (``base + node``, root first)."""
        self.refresh([slot - self.length for slot in source_slots])

    def refresh(self, path: list[int]) -> None:
        """Make the pass's nodes ``path`` (root-to-node order) the committed continuation: their raw KV and
        inputs move to positions base.., their completed CSA/HCA rows are appended, the open HCA sum is
        rebuilt. Everything else the pass computed is dropped."""
        scratch, base = self.pending, self.length
        if not path:
            self.pending = None
            return
        if scratch is None or scratch.base != base:
            raise RuntimeError("refresh without a forward pass over the current committed state")
        for depth, node in enumerate(path):
            expected_parent = path[depth - 1] if depth else -1
            if scratch.positions[node] != base + depth or scratch.parents[node] != expected_parent:
                raise RuntimeError(f"nodes {path} are not a root-to-node path of the last pass")
        self.refresh_count += 1
        if path == list(range(len(path))):
            self.materialised_count += 1  # raw KV and inputs already sit at their positions
        else:
            source = torch.tensor(path, device=self.keys.device) + base
            end = base + len(path)
            self.keys[:, :, base:end] = self.keys[:, :, source]
            self.values[:, :, base:end] = self.values[:, :, source]
            self.inputs[:, base:end] = self.inputs[:, source]
        on_path = set(path)
        self._append_rows(scratch.csa_nodes, on_path, scratch.csa_keys, scratch.csa_values,
                          self.csa_keys, self.csa_values, self.config.block)
        if self.config.hca_block:
            self._append_rows(scratch.hca_nodes, on_path, scratch.hca_keys, scratch.hca_values,
                              self.hca_keys, self.hca_values, self.config.hca_block)
        self.length = base + len(path)
        self._rebuild_hca_sum(base)
        self.pending = None

    def set_length(self, row: int, length: int) -> None:
        """Roll back to the first ``length`` committed positions (rows of blocks that end later go)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"a compressed state rolls back only: length {length} outside [0, {self.length}]")
        self.length, self.pending = length, None
        self._rebuild_hca_sum(None)

    def _append_rows(self, nodes, on_path, new_keys, new_values, keys, values, block: int) -> None:
        # Blocks the committed sequence gains; a correct pass has exactly one row per block on the path
        # (the naive tree-mask-only model may have more or fewer, and commits whatever it has).
        first_row = self.length // block
        gained = (self.length + len(on_path)) // block - first_row
        picked = [i for i, node in enumerate(nodes) if node in on_path][:gained]
        if picked:  # path nodes complete blocks in position order, so their rows are contiguous
            index = torch.tensor(picked, device=keys.device)
            keys[:, :, first_row:first_row + len(picked)] = new_keys[:, :, index]
            values[:, :, first_row:first_row + len(picked)] = new_values[:, :, index]

    def _rebuild_hca_sum(self, previous_length: int | None) -> None:
        """Sum of the layer inputs of the open HCA block; incremental when no block closed since
        ``previous_length``."""
        size = self.config.hca_block
        if not size:
            return
        start = self.length - self.length % size
        if previous_length is not None and start <= previous_length:
            self.hca_sum += self.inputs[:, previous_length:self.length].float().sum(1)
        else:
            self.hca_sum = self.inputs[:, start:self.length].float().sum(1)
