"""What the engines use of a model: the ``Model`` protocol and the ``Capabilities`` it declares.

Every model runs forward passes over a cache whose committed length the caller controls
(``new_cache``, ``forward``) and has a ``config`` with ``vocab_size``, ``max_context`` and
``num_hidden_layers``. Beyond that, each class declares what else it can do; ``loading`` checks a
request's method against the declaration once, before anything runs, and names what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.errors import CheckpointError


@dataclass(frozen=True)
class Capabilities:
    trees: bool = False  # verifies (and, as a draft, drafts) a tree in one pass: ``tree_mask`` and ``depths``
    staged_trees: bool = False  # as a draft, feeds a dynamic tree level by level through its cache (``staged``)
    early_exit: bool = False  # runs only its first layers and resumes from them (``num_layers``, ``run_layers``)
    features: bool = False  # hands its final hidden states to a feature drafter (``with_features``)
    vocab_limit: bool = False  # as a draft, scores only its first N ids (``vocab_limit``)
    batching: bool = False  # rows of different lengths in one pass and the fused CPU path: the server's engine


class Model(Protocol):
    config: object  # vocab_size, max_context, num_hidden_layers
    capabilities: Capabilities

    def new_cache(self, batch: int = 1, max_len: int | None = None): ...

    def forward(self, tokens: torch.Tensor, cache, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_only: bool = False, **options) -> torch.Tensor: ...


def check_model(model) -> None:
    """Raise ``CheckpointError`` naming what a model object lacks of the ``Model`` protocol."""
    missing = [name for name in ("config", "capabilities", "new_cache", "forward") if not hasattr(model, name)]
    if missing:
        raise CheckpointError(f"{type(model).__name__} does not implement the Model protocol: missing "
                              f"{', '.join(missing)}")
    if not isinstance(model.capabilities, Capabilities):
        raise CheckpointError(f"{type(model).__name__}.capabilities must be a verispec.models.protocol.Capabilities")
