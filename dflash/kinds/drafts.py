"""The one rule from a draft config to a draft model, below everything that stores or loads drafts
(checkpoints, resume, export) so that storage needs neither the factory nor the data pipeline."""

from __future__ import annotations

from dflash.kinds.dflash2 import DFlash2DraftModel, is_dflash2
from dflash.kinds.domino import DominoDraftModel, is_domino
from dflash.kinds.dspark import DSparkDraftModel, is_dspark
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel


def draft_model_for_config(cfg: DFlashDraftConfig) -> DFlashDraftModel:
    """A `DominoDraftModel` when the config says `projector_type: domino`, a `DFlash2DraftModel` when it holds
    the DFlash 2 conv / selector keys, a `DSparkDraftModel` when it holds the DSpark head keys, else a DFlash draft."""
    if is_domino(cfg):
        return DominoDraftModel(cfg)
    if is_dspark(cfg):
        return DSparkDraftModel(cfg)
    return DFlash2DraftModel(cfg) if is_dflash2(cfg) else DFlashDraftModel(cfg)
