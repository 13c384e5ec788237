"""Drafters propose candidate tokens; see base.Drafter for the interface every drafter implements."""

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.draft_model import DraftModelDrafter

__all__ = ["Drafter", "Proposal", "DraftModelDrafter"]
