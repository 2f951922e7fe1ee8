"""Drafting methods, one per module, all behind the protocol in base.py. Importing this package registers them."""

from specdecode.drafters import auto, dflash, draft_model, dspark, eagle3, mtp, ngram, none, recycle, suffix  # noqa: F401 - imported to register the drafters
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.combination import build_drafter
from specdecode.drafters.registry import DRAFTERS, needs_draft_files, needs_draft_model

__all__ = ["DRAFTERS", "Drafter", "DrafterCaps", "DrafterResources", "build_drafter", "needs_draft_files",
           "needs_draft_model"]
