"""Held-out evaluation: loss per workload, per early-exit layer, and how well a drafter matches the target.

    windows = heldout_windows(encode_batch, "math", seq_len=256, num_windows=48)   # (48, 257)
    evaluate_layers(model, windows, micro_batch=16)["exit4"]  # {"loss": ..., "expected_acceptance_t1": ...}

For a drafter distribution q against the target's p at the same position, ``sum(min(p, q))`` is the
probability that one sampled draft token is accepted at temperature 1 (Leviathan et al., 2.3);
``greedy_agreement`` is the share of positions where both argmaxes agree (acceptance at temperature 0).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from verispec.models.llama import LlamaForCausalLM
from verispec.train.corpus import Workload, load_workload
from verispec.train.losses import exit_logits
from verispec.train.token_stream import EncodeBatch


def heldout_windows(encode_batch: EncodeBatch, name: Workload, seq_len: int, num_windows: int,
                    eos_id: int = 0) -> torch.Tensor:
    """The first ``num_windows`` non-overlapping (T + 1)-token windows of the held-out documents (fewer
    if the split is shorter), documents in their fixed order separated by EOS."""
    needed = num_windows * (seq_len + 1)
    tokens: list[int] = []
    documents = load_workload(name, "heldout")
    for start in range(0, len(documents), 64):
        for ids in encode_batch(documents[start:start + 64]):
            tokens.extend(ids + [eos_id])
        if len(tokens) >= needed:
            break
    usable = min(len(tokens), needed) // (seq_len + 1) * (seq_len + 1)
    return torch.from_numpy(np.asarray(tokens[:usable], dtype=np.int64).reshape(-1, seq_len + 1))


class _Agreement:
    """Running means of loss, expected acceptance and greedy agreement for one drafter."""

    def __init__(self) -> None:
        self.loss_sum = self.accept_sum = self.agree_sum = 0.0
        self.count = 0

    def add(self, log_probs: torch.Tensor, labels: torch.Tensor, target_probs: torch.Tensor | None) -> None:
        self.loss_sum += F.nll_loss(log_probs.reshape(-1, log_probs.shape[-1]), labels.reshape(-1),
                                    reduction="sum").item()
        if target_probs is not None:
            self.accept_sum += torch.minimum(log_probs.exp(), target_probs).sum(-1).sum().item()
            self.agree_sum += (log_probs.argmax(-1) == target_probs.argmax(-1)).sum().item()
        self.count += labels.numel()

    def result(self, with_target: bool) -> dict[str, float]:
        loss = self.loss_sum / max(self.count, 1)
        out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": self.count}
        if with_target:
            out["expected_acceptance_t1"] = self.accept_sum / max(self.count, 1)
            out["greedy_agreement"] = self.agree_sum / max(self.count, 1)
        return out


@torch.no_grad()
def evaluate_layers(model: LlamaForCausalLM, windows: torch.Tensor, micro_batch: int,
                    exit_layers: list[int] | None = None) -> dict[str, dict[str, float]]:
    """Held-out loss of the full model ("final") and of each early exit ("exit3", ...), with each exit's
    acceptance statistics as a drafter for the full model (self-speculation)."""
    model.eval()
    if exit_layers is None:
        exit_layers = list(range(1, model.config.num_hidden_layers))
    final = _Agreement()
    exits = {e: _Agreement() for e in exit_layers}
    for start in range(0, windows.shape[0], micro_batch):
        batch = windows[start:start + micro_batch]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits, hidden = model.train_forward(inputs, exit_layers=exit_layers)
        final_log_probs = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
        final.add(final_log_probs, labels, None)
        final_probs = final_log_probs.exp()
        for exit_layer, stats in exits.items():
            stats.add(F.log_softmax(exit_logits(model, hidden[exit_layer]).float(), dim=-1), labels, final_probs)
    report = {"final": final.result(with_target=False)}
    report.update({f"exit{e}": stats.result(with_target=True) for e, stats in exits.items()})
    return report


@torch.no_grad()
def evaluate_draft(draft: LlamaForCausalLM, target: LlamaForCausalLM, windows: torch.Tensor,
                   micro_batch: int) -> dict[str, float]:
    """Held-out loss of the draft and its acceptance statistics against the target."""
    draft.eval()
    target.eval()
    stats = _Agreement()
    for start in range(0, windows.shape[0], micro_batch):
        batch = windows[start:start + micro_batch]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        target_probs = F.softmax(target.train_forward(inputs)[0].float(), dim=-1)
        stats.add(F.log_softmax(draft.train_forward(inputs)[0].float(), dim=-1), labels, target_probs)
    return stats.result(with_target=True)
