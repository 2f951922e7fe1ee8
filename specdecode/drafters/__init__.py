"""Drafting methods, one per module, all behind the protocol in base.py. Importing this package registers them."""

from specdecode.drafters import draft_model, ngram, none  # noqa: F401 - imported to register the drafters
from specdecode.drafters.base import DRAFTERS, DraftProposal, Drafter, DrafterContext, SequenceState, build_drafter

__all__ = ["DRAFTERS", "DraftProposal", "Drafter", "DrafterContext", "SequenceState", "build_drafter"]
