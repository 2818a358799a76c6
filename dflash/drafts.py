"""The one rule from a draft config to a draft model, below everything that stores or loads drafts
(checkpoints, resume, export) so that storage needs neither the factory nor the data pipeline."""

from __future__ import annotations

from dflash.domino import DominoDraftModel, is_domino
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel


def draft_model_for_config(cfg: DFlashDraftConfig) -> DFlashDraftModel:
    """A `DominoDraftModel` when the config says `projector_type: domino`, else a DFlash draft."""
    return DominoDraftModel(cfg) if is_domino(cfg) else DFlashDraftModel(cfg)
