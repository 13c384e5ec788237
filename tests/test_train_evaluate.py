"""Held-out evaluation: windows cut from held-out documents, loss and acceptance against a direct computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from train_helpers import repeating_batch, tiny

from verispec.train import evaluate
from verispec.train.evaluate import evaluate_draft, evaluate_layers, heldout_windows


def test_heldout_windows_join_documents_with_eos_and_drop_the_ragged_end(monkeypatch):
    asked = []

    def documents(name, split):
        asked.append((name, split))
        return ["ab", "cde", "f"]

    monkeypatch.setattr(evaluate, "load_workload", documents)

    def encode(texts):
        return [[ord(c) for c in text] for text in texts]

    assert heldout_windows(encode, "code", seq_len=2, num_windows=2).tolist() == [[97, 98, 0], [99, 100, 101]]
    assert heldout_windows(encode, "code", seq_len=2, num_windows=9, eos_id=7).tolist() == [
        [97, 98, 7], [99, 100, 101], [7, 102, 7]]
    assert heldout_windows(encode, "code", seq_len=4, num_windows=9).shape == (1, 5)
    assert set(asked) == {("code", "heldout")}


def test_a_draft_equal_to_the_target_is_always_accepted_and_its_loss_is_the_cross_entropy():
    model, windows = tiny(seed=2, std=0.3), repeating_batch()
    with torch.no_grad():
        logits = model.train_forward(windows[:, :-1])[0]
    cross_entropy = F.cross_entropy(logits.reshape(-1, 50), windows[:, 1:].reshape(-1)).item()
    report = evaluate_draft(model, model, windows, micro_batch=3)
    assert report["loss"] == pytest.approx(cross_entropy, rel=1e-5)
    assert report["perplexity"] == pytest.approx(torch.tensor(cross_entropy).exp().item(), rel=1e-5)
    assert report["expected_acceptance_t1"] == pytest.approx(1.0, abs=1e-5)
    assert report["greedy_agreement"] == 1.0 and report["tokens"] == windows[:, 1:].numel()


def test_layer_report_names_every_exit_and_does_not_depend_on_the_micro_batch():
    model, windows = tiny(seed=2, std=0.3), repeating_batch()
    whole = evaluate_layers(model, windows, micro_batch=4)
    assert set(whole) == {"final", "exit1", "exit2"} and "greedy_agreement" not in whole["final"]
    assert whole["final"]["loss"] == pytest.approx(evaluate_draft(model, model, windows, 4)["loss"], rel=1e-6)
    split = evaluate_layers(model, windows, micro_batch=1, exit_layers=[2])
    assert set(split) == {"final", "exit2"}
    for key in ("loss", "expected_acceptance_t1", "greedy_agreement"):
        assert split["exit2"][key] == pytest.approx(whole["exit2"][key], rel=1e-5)
    assert 0.0 < whole["exit1"]["expected_acceptance_t1"] < 1.0
