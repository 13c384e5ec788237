"""Training losses: LayerSkip (layer dropout + early-exit loss) for the target, distillation for the draft.

LayerSkip (Elhoushi et al., 2024) trains the early layers to be usable drafters for self-speculation:

    >>> layer_dropout_rates(num_layers=3, max_dropout=0.2)
    [0.0, 0.1, 0.2]
    >>> exit_layers_for(micro_step=9, num_layers=8, count=2)  # rotates through exits 1..7
    [5, 6]
    >>> exit_loss_weight(exit_layer=7, num_layers=8, scale=0.5)
    0.5

Shapes: B batch, T positions, V vocabulary, H hidden size, L layers.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from verispec.models.llama import LlamaForCausalLM
from verispec.train.recipes import LayerSkipConfig


def layer_dropout_rates(num_layers: int, max_dropout: float) -> list[float]:
    """Skip probability per layer, 0 at layer 0 rising linearly to ``max_dropout`` at layer L-1."""
    return [max_dropout * index / max(num_layers - 1, 1) for index in range(num_layers)]


def sample_skipped_layers(rates: list[float], rng: random.Random) -> frozenset[int]:
    """Layers to bypass for one whole micro-batch."""
    return frozenset(index for index, rate in enumerate(rates) if rng.random() < rate)


def exit_layers_for(micro_step: int, num_layers: int, count: int) -> list[int]:
    """The ``count`` exits trained at this micro-step: a rotation over 1..L-1 (every exit gets its turn)."""
    num_exits = num_layers - 1
    if num_exits <= 0 or count <= 0:
        return []
    first = (micro_step * count) % num_exits
    return sorted({1 + (first + offset) % num_exits for offset in range(min(count, num_exits))})


def exit_loss_weight(exit_layer: int, num_layers: int, scale: float) -> float:
    return scale * exit_layer / max(num_layers - 1, 1)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def exit_logits(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) from a hidden state (B, T, H) taken after an early layer: shared norm + head."""
    return model.lm_head(model.model.norm(hidden))


def layerskip_loss(model: LlamaForCausalLM, tokens: torch.Tensor, config: LayerSkipConfig,
                   micro_step: int, rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
    """Final loss + weighted early-exit losses on one micro-batch of windows ``tokens`` (B, T + 1)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    num_layers = model.config.num_hidden_layers
    skipped = sample_skipped_layers(layer_dropout_rates(num_layers, config.max_dropout), rng)
    exits = exit_layers_for(micro_step, num_layers, config.exits_per_micro_batch)
    logits, hidden = model.train_forward(inputs, skip_layers=skipped, exit_layers=exits)
    final_loss = next_token_loss(logits, labels)
    total = final_loss
    scalars = {"final_loss": final_loss.item(), "layers_skipped": float(len(skipped))}
    for exit_layer in exits:
        exit_loss = next_token_loss(exit_logits(model, hidden[exit_layer]), labels)
        total = total + exit_loss_weight(exit_layer, num_layers, config.exit_loss_scale) * exit_loss
        scalars[f"exit{exit_layer}_loss"] = exit_loss.item()
    return total, scalars


def distillation_loss(draft: LlamaForCausalLM, teacher: LlamaForCausalLM, tokens: torch.Tensor,
                      ce_weight: float, argmax_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """``(1 - ce_weight) * KL(target || draft) + ce_weight * CE + argmax_weight * CE(target's argmax)``
    at temperature 1 on windows (B, T + 1).

    The teacher runs in eval mode without gradients and without layer dropout: the draft learns the
    distribution the target will actually verify against. The argmax term puts extra weight on the one
    token greedy verification accepts.
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        teacher_logits, _ = teacher.train_forward(inputs)
        teacher_log_probs = F.log_softmax(teacher_logits.float(), dim=-1)  # (B, T, V)
    draft_logits, _ = draft.train_forward(inputs)
    draft_log_probs = F.log_softmax(draft_logits.float(), dim=-1)
    kl = F.kl_div(draft_log_probs, teacher_log_probs, log_target=True, reduction="none").sum(-1).mean()
    flat = draft_log_probs.reshape(-1, draft_log_probs.shape[-1])  # (B * T, V)
    ce = F.nll_loss(flat, labels.reshape(-1))
    total = (1 - ce_weight) * kl + ce_weight * ce
    scalars = {"kl": kl.item(), "ce": ce.item()}
    if argmax_weight > 0:
        argmax_ce = F.nll_loss(flat, teacher_log_probs.argmax(dim=-1).reshape(-1))
        total = total + argmax_weight * argmax_ce
        scalars["argmax_ce"] = argmax_ce.item()
    return total, scalars
