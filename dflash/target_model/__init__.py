"""The frozen target, in every form a run can hold it: the HF model with its layers captured (`frozen`),
the offline features' stand-in (`offline`), and the tensor-parallel one (`tensor_parallel`, its
overlapped trunk `tp_overlap`, its group and batch sharing `tp_group`, its lockstep decoding `tp_decode`).
Imports nothing from the data, run or evaluation layers.

`from dflash.target_model import FrozenTarget, Target, ...` names the frozen target's pieces and the declared
interface every target implements."""

from dflash.target_model.frozen import (
    CAUSAL_WITHOUT_MASK,
    FrozenTarget,
    LayerCapture,
    SharedHead,
    Target,
    capture_layer_outputs,
    checked_layer_ids,
    greedy_labels,
    hf_model_of,
    resolve_mask_token_id,
)

__all__ = ["CAUSAL_WITHOUT_MASK", "FrozenTarget", "LayerCapture", "SharedHead", "Target", "capture_layer_outputs",
           "checked_layer_ids", "greedy_labels", "hf_model_of", "resolve_mask_token_id"]
