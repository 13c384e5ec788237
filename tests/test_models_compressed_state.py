"""models/compressed_state.py: committing a pass's accepted path from its Scratch, by hand-built passes
(no model): raw KV and inputs moved into place, one CSA/HCA row per completed block on the path, the open
HCA sum, rollback, and the refusals. Against a real model's prefill: test_compressed.py."""

import pytest
import torch

from verispec.errors import ContextError
from verispec.models.compressed_config import CompressedConfig
from verispec.models.compressed_state import CompressedState, Scratch

# One layer, one key/value head of 4 dims, hidden 8; CSA blocks of 2, HCA blocks of 4.
CONFIG = CompressedConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, block=2, hca_block=4)


def run_pass(state: CompressedState, parents: list[int], csa_nodes: list[int], hca_nodes: list[int]) -> None:
    """What a forward pass leaves: node i's raw KV and input at slot base + i (all filled with
    100 * base + i), its rows in a Scratch (CSA row j filled with 1000 + node, HCA with 2000 + node)."""
    base, depths = state.length, []
    for node, parent in enumerate(parents):
        depths.append(0 if parent < 0 else depths[parent] + 1)
        state.keys[:, :, base + node] = 100 * base + node
        state.values[:, :, base + node] = -(100 * base + node)
        state.inputs[:, base + node] = 100 * base + node

    def rows(nodes, offset):
        return torch.tensor([float(offset + node) for node in nodes]).view(1, 1, -1, 1).expand(1, 1, -1, 4)
    state.pending = Scratch(base, [base + depth for depth in depths], parents, csa_nodes, rows(csa_nodes, 1000),
                            -rows(csa_nodes, 1000), hca_nodes, rows(hca_nodes, 2000), -rows(hca_nodes, 2000))


def test_a_tree_path_is_moved_into_place_and_only_its_rows_kept():
    state = CompressedState(CONFIG, 16)
    # Tree: 0 -> {1, 2}, 2 -> 3. Nodes 1 and 2 (position 1) each complete the CSA block 0..1.
    run_pass(state, [-1, 0, 0, 2], csa_nodes=[1, 2], hca_nodes=[])
    state.compact(0, [0, 2, 3])  # absolute slots base + node, base 0
    assert state.length == 3 and state.lengths == [3] and state.pending is None
    assert state.keys[0, 0, :3, 0].tolist() == [0, 2, 3] and state.values[0, 0, :3, 0].tolist() == [0, -2, -3]
    assert state.inputs[0, :3, 0].tolist() == [0, 2, 3]
    assert state.csa_rows == 1 and state.csa_keys[0, 0, 0].tolist() == [1002] * 4  # node 2's row, not node 1's
    assert state.csa_values[0, 0, 0].tolist() == [-1002] * 4
    assert state.hca_rows == 0 and state.hca_sum[0].tolist() == [5.0] * 8  # open HCA block: inputs 0 + 2 + 3
    assert (state.refresh_count, state.materialised_count) == (1, 0)


def test_a_chain_commits_in_place_and_closes_blocks():
    state = CompressedState(CONFIG, 16)
    run_pass(state, [-1, 0, 0, 2], csa_nodes=[1, 2], hca_nodes=[])
    state.compact(0, [0, 2, 3])
    # Positions 3 and 4: position 3 closes CSA block 2..3 and HCA block 0..3.
    run_pass(state, [-1, 0], csa_nodes=[0], hca_nodes=[0])
    state.commit(0, 2)
    assert state.length == 5 and (state.refresh_count, state.materialised_count) == (2, 1)
    assert state.keys[0, 0, :5, 0].tolist() == [0, 2, 3, 300, 301]
    assert state.csa_rows == 2 and state.csa_keys[0, 0, :2, 0].tolist() == [1002, 1000]
    assert state.hca_rows == 1 and state.hca_keys[0, 0, 0, 0].item() == 2000
    assert state.hca_sum[0, 0].item() == 301  # the open HCA block holds position 4 alone


def test_rollback_drops_later_blocks_and_rebuilds_the_open_sum():
    state = CompressedState(CONFIG, 16)
    run_pass(state, [-1, 0, 1, 2, 3, 4], csa_nodes=[1, 3, 5], hca_nodes=[3])
    state.commit(0, 6)
    assert (state.csa_rows, state.hca_rows, state.hca_sum[0, 0].item()) == (3, 1, 4 + 5)
    state.set_length(0, 3)
    assert (state.length, state.csa_rows, state.hca_rows, state.hca_sum[0, 0].item()) == (3, 1, 0, 0 + 1 + 2)
    with pytest.raises(ValueError, match=r"a compressed state rolls back only: length 4 outside \[0, 3\]"):
        state.set_length(0, 4)
    state.reset()
    assert state.length == 0 and state.hca_sum.abs().sum() == 0


def test_refresh_refuses_what_is_not_a_path_of_the_last_pass():
    state = CompressedState(CONFIG, 16)
    with pytest.raises(RuntimeError, match="refresh without a forward pass over the current committed state"):
        state.commit(0, 1)
    run_pass(state, [-1, 0, 0], csa_nodes=[1, 2], hca_nodes=[])
    with pytest.raises(RuntimeError, match=r"nodes \[0, 1, 2\] are not a root-to-node path of the last pass"):
        state.compact(0, [0, 1, 2])  # 1 and 2 are siblings
    with pytest.raises(RuntimeError, match=r"nodes \[1\] are not a root-to-node path"):
        state.compact(0, [1])  # does not start at the root
    assert state.length == 0
    state.commit(0, 0)  # nothing accepted: the pass is dropped
    assert state.pending is None and state.refresh_count == 0


def test_room_is_checked_before_a_pass():
    state = CompressedState(CONFIG, 6)
    assert state.batch == 1
    state.check_room(6)
    with pytest.raises(ContextError, match="sequence would reach 7 positions but the state holds 6; shorten the "
                                           "prompt or lower max_tokens"):
        state.check_room(7)
