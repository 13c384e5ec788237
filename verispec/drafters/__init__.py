"""Drafters propose candidate tokens; see base.Drafter for the interface every drafter implements."""

from verispec.drafters.base import Drafter, DrafterBase, DraftReads, Proposal, check_drafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.early_exit import EarlyExitDrafter
from verispec.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "DrafterBase", "DraftReads", "Proposal", "check_drafter", "DraftModelDrafter", "EarlyExitDrafter",
           "NgramDrafter"]
