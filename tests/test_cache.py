"""cache.py: KVCache bookkeeping on small tensors: writes land after each row's committed length
without committing, commits and rollbacks move only lengths, ``compact`` keeps an accepted tree path,
and views share storage."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from verispec.cache import KVCache, zeros
from verispec.errors import ContextError

LAYERS, ROWS, SLOTS, HEADS, DIM = 2, 2, 8, 1, 2


def cache() -> KVCache:
    return KVCache(LAYERS, ROWS, SLOTS, HEADS, DIM)


def positions(rows: int, first: float, count: int) -> torch.Tensor:
    """(rows, HEADS, count, DIM) keys whose every entry is row * 100 + first + position."""
    row = torch.arange(rows, dtype=torch.float32)[:, None, None, None] * 100
    pos = torch.arange(count, dtype=torch.float32)[None, None, :, None] + first
    return (row + pos).expand(rows, HEADS, count, DIM).clone()


def slot_values(kv: KVCache, layer: int, row: int) -> list[float]:
    """One number per slot of ``row`` (the first entry of its first head)."""
    return kv.keys[layer, row, 0, :, 0].tolist()


def test_a_new_cache_is_empty_and_shaped_by_layers_rows_heads_slots_and_dims():
    kv = KVCache(3, 4, 16, 2, 8, dtype=torch.bfloat16)
    assert kv.keys.shape == kv.values.shape == (3, 4, 2, 16, 8) and kv.keys.dtype == torch.bfloat16
    assert kv.lengths == [0, 0, 0, 0] and kv.batch == 4 and kv.max_len == 16


def test_check_room_refuses_a_pass_that_would_overflow_the_longest_row():
    kv = cache()
    kv.lengths = [3, 5]
    kv.check_room(3)  # the longest row reaches exactly 8
    with pytest.raises(ContextError, match=r"sequence would reach 9 positions but the cache holds 8; "
                                           r"shorten the prompt or lower max_tokens"):
        kv.check_room(4)


def test_a_write_fills_the_slots_after_the_committed_length_without_committing():
    kv = cache()
    kv.lengths = [2, 2]
    kv.write(1, positions(ROWS, 10, 3), -positions(ROWS, 10, 3))
    assert kv.lengths == [2, 2]
    assert slot_values(kv, 1, 0) == [0, 0, 10, 11, 12, 0, 0, 0]
    assert slot_values(kv, 1, 1) == [0, 0, 110, 111, 112, 0, 0, 0]
    assert kv.values[1, 1, 0, 2:5, 0].tolist() == [-110, -111, -112]
    assert kv.keys[0].abs().sum() == 0  # another layer untouched


def test_a_ragged_write_puts_each_rows_positions_after_its_own_length():
    kv = cache()
    kv.lengths = [1, 4]
    kv.write(0, positions(ROWS, 10, 2), positions(ROWS, 20, 2))
    assert slot_values(kv, 0, 0) == [0, 10, 11, 0, 0, 0, 0, 0]
    assert slot_values(kv, 0, 1) == [0, 0, 0, 0, 110, 111, 0, 0]
    assert kv.values[0, 1, 0, 4:6, 0].tolist() == [120, 121]


def test_view_returns_the_first_slots_of_the_storage_itself():
    kv = cache()
    keys, values = kv.view(1, 3)
    assert keys.shape == values.shape == (ROWS, HEADS, 3, DIM)
    keys[0, 0, 2, 0] = 7.0
    assert kv.keys[1, 0, 0, 2, 0] == 7.0


def test_commit_and_set_length_move_only_the_lengths():
    kv = cache()
    kv.lengths = [5, 0]
    kv.write(0, positions(ROWS, 1, 3), positions(ROWS, 1, 3))
    kv.commit(0, 2)  # two of the three written positions accepted
    assert kv.lengths == [7, 0]
    kv.set_length(0, 3)  # roll back
    assert kv.lengths == [3, 0] and slot_values(kv, 0, 0)[5:8] == [1, 2, 3]  # the contents stay
    kv.set_length(1, SLOTS)
    assert kv.lengths == [3, SLOTS]
    for bad in (-1, SLOTS + 1):
        with pytest.raises(ValueError, match=rf"length {bad} outside \[0, {SLOTS}\]"):
            kv.set_length(0, bad)


def test_compact_moves_an_accepted_path_after_the_prefix_in_every_layer():
    kv = cache()
    kv.lengths = [2, 2]
    for layer in range(LAYERS):
        kv.write(layer, positions(ROWS, 10 * (layer + 1), 5), -positions(ROWS, 10 * (layer + 1), 5))
    kv.compact(0, [3, 5])  # the tree nodes in slots 3 and 5 were accepted
    assert kv.lengths == [4, 2]
    assert slot_values(kv, 0, 0)[2:4] == [11, 13] and slot_values(kv, 1, 0)[2:4] == [21, 23]
    assert kv.values[1, 0, 0, 2:4, 0].tolist() == [-21, -23]
    assert slot_values(kv, 0, 1)[2:7] == [110, 111, 112, 113, 114]  # the other row untouched


def test_compact_of_slots_already_in_place_or_of_nothing_only_commits():
    kv = cache()
    kv.lengths = [2, 2]
    kv.write(0, positions(ROWS, 10, 3), positions(ROWS, 10, 3))
    before = kv.keys.clone()
    kv.compact(0, [2, 3])  # a chain prefix: already contiguous after the prefix
    assert kv.lengths == [4, 2] and torch.equal(kv.keys, before)
    kv.compact(1, [])
    assert kv.lengths == [4, 2] and torch.equal(kv.keys, before)


def test_reset_forgets_every_row():
    kv = cache()
    kv.lengths = [3, 6]
    kv.reset()
    assert kv.lengths == [0, 0]


def test_a_prefix_view_shares_storage_and_syncs_its_lengths_back():
    kv = KVCache(LAYERS, 3, SLOTS, HEADS, DIM)
    kv.lengths = [1, 2, 5]
    view = kv.prefix_view(2)
    assert view.batch == 2 and view.lengths == [1, 2] and view.max_len == SLOTS
    view.write(0, positions(2, 10, 1), positions(2, 10, 1))
    assert slot_values(kv, 0, 0)[1] == 10 and slot_values(kv, 0, 1)[2] == 110  # landed in the cache
    view.commit(1, 1)
    assert kv.lengths == [1, 2, 5]  # not until synced
    kv.sync_prefix(view)
    assert kv.lengths == [1, 3, 5]


def test_a_row_view_writes_into_its_row_and_syncs_its_length_back():
    kv = cache()
    kv.lengths = [4, 1]
    view = kv.row_view(1)
    assert view.batch == 1 and view.lengths == [1]
    view.write(0, positions(1, 30, 2), positions(1, 30, 2))
    view.commit(0, 2)
    assert slot_values(kv, 0, 1)[1:3] == [30, 31] and slot_values(kv, 0, 0) == [0] * SLOTS
    assert kv.lengths == [4, 1]
    kv.sync_row(1, view)
    assert kv.lengths == [4, 3]


def test_move_row_copies_only_the_committed_slots_and_the_length():
    kv = cache()
    kv.write(0, positions(ROWS, 1, 4), positions(ROWS, 1, 4))
    kv.write(1, positions(ROWS, 1, 4), positions(ROWS, 1, 4))
    kv.lengths = [0, 3]
    kv.move_row(1, 0)
    assert kv.lengths == [3, 3]
    assert slot_values(kv, 0, 0)[:4] == [101, 102, 103, 4]  # slot 3 was not committed in row 1
    assert slot_values(kv, 1, 0)[:4] == [101, 102, 103, 4]
    assert kv.values[0, 0, 0, :3, 0].tolist() == [101, 102, 103]


_LAZY_CACHE = """
from verispec.cache import KVCache

def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024

before = rss_mb()
cache = KVCache(4, 2, 8192, 4, 64)  # keys and values 2 x 64 MiB
allocated = rss_mb()
assert cache.keys.abs().max().item() == 0 and cache.values.abs().max().item() == 0
cache.keys.fill_(1.0)
written = rss_mb()
print(allocated - before, written - before)
"""


def test_a_large_cache_is_zeros_that_take_memory_only_where_written():
    # a fresh process: the RSS of the suite's own process moves with other tests' allocations
    done = subprocess.run([sys.executable, "-c", _LAZY_CACHE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    allocated, written = map(float, done.stdout.split())
    assert allocated < 8  # 128 MiB of zeros, none resident (reading them maps the shared zero page)
    assert written > 56  # writing the keys makes their 64 MiB resident: the measurement can see growth


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lazy_zeros_are_ordinary_writable_tensors(dtype):
    small, large = zeros((2, 3), dtype, "cpu"), zeros((64, 64, 64, 2), dtype, "cpu")  # 2 KiB and >= 1 MiB
    for tensor, shape in ((small, (2, 3)), (large, (64, 64, 64, 2))):
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape and tensor.is_contiguous()
        assert not tensor.any()
        tensor[-1, -1] = 2.5
        assert tensor[-1, -1].float().min().item() == 2.5 and tensor.float().sum().item() == 2.5 * tensor[-1, -1].numel()
