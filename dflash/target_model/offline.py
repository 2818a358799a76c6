"""The target as a draft trained from offline features sees it: only the frozen embedding and LM head.

`OfflineTarget` has `FrozenTarget`'s interface for everything but the features (`embed`, `embed_weight`,
`lm_head_weight`, `hidden_size`, `vocab_size`, `text_config`, `layer_ids`); its `forward` raises, since
the features come with each batch (`dflash.data.feature_data`). `load_head_and_embedding` reads only those two
tensors (and the config) from a safetensors checkpoint, a single file or sharded with an index, so the
trunk is never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import hf_hub_download
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.modeling import text_config_of
from dflash.target_model.frozen import SharedHead, checked_layer_ids
from dflash.target_model.loading import target_location

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class OfflineTarget(SharedHead, nn.Module):
    """A frozen target without its trunk: embedding `[V, H]` and LM head `[V, H]` (the same tensor when tied);
    `SharedHead` derives the rest from them and the text config."""

    # No HF model: what needs one (regeneration, speculative decoding) cannot run on this target.
    model = None

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, text_config: Any,
                 layer_ids: list[int]) -> None:
        super().__init__()
        if embed_weight.shape[1] != text_config.hidden_size or lm_head_weight.shape[1] != text_config.hidden_size:
            raise ValueError(f"embedding {tuple(embed_weight.shape)} / LM head {tuple(lm_head_weight.shape)} do not "
                             f"match the config's hidden_size {text_config.hidden_size}")
        self.num_layers = text_config.num_hidden_layers
        self.layer_ids = checked_layer_ids(layer_ids, self.num_layers)
        self._text_config = text_config
        self.register_buffer("_embed", embed_weight.detach(), persistent=False)
        tied = lm_head_weight is embed_weight
        self.register_buffer("_head", self._embed if tied else lm_head_weight.detach(), persistent=False)

    def train(self, mode: bool = True) -> OfflineTarget:  # frozen, like FrozenTarget
        return super().train(False)

    @property
    def text_config(self) -> Any:
        return self._text_config

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._embed

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("OfflineTarget has no trunk: training from offline features takes the target's features "
                           "from each batch (batch['features'], dflash.data.feature_data); run the real target "
                           "(FrozenTarget) to compute them")

    features = forward

    def features_and_greedy(self, input_ids: torch.Tensor, chunk: int = 1024, *,
                            position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("OfflineTarget has no trunk: the target's greedy labels come from the feature files "
                           "(written with labels=True, batch['labels'])")

    @classmethod
    def from_model(cls, model: Any, layer_ids: list[int]) -> OfflineTarget:
        """The embedding and LM head of an HF causal LM already in memory (notebooks, tests); the trunk is
        not used (nor kept: only the two weight tensors are referenced)."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        config = text_config_of(model.config)
        return cls(embed, embed if head is None else head.weight, config, layer_ids)

    @classmethod
    def from_pretrained(cls, model_path_or_id: str, layer_ids: list[int], dtype: torch.dtype) -> OfflineTarget:
        """The embedding and LM head of a checkpoint (`load_head_and_embedding`), nothing else."""
        embed, head, config = load_head_and_embedding(model_path_or_id, dtype)
        text = text_config_of(config)
        return cls(embed, head, text, layer_ids)


def safetensors_weight_map(location: str | Path) -> tuple[Path, dict[str, str]]:
    """(folder, tensor name -> safetensors file name) of an HF checkpoint: a folder, or a hub id read from the
    local cache / hub through `huggingface_hub` (only the index, or the single file's header, is read).
    The one reader of a checkpoint's layout: the offline target and the sharded (tensor-parallel) load."""
    folder = Path(location).expanduser()
    if not folder.is_dir():
        try:
            folder = Path(hf_hub_download(str(location), _INDEX)).parent
        except Exception:  # no index on the hub: a single-file checkpoint
            folder = Path(hf_hub_download(str(location), _SINGLE)).parent
    if (folder / _INDEX).is_file():
        return folder, json.loads((folder / _INDEX).read_text())["weight_map"]
    if (folder / _SINGLE).is_file():
        with safe_open(str(folder / _SINGLE), framework="pt") as f:
            return folder, dict.fromkeys(f.keys(), _SINGLE)
    raise FileNotFoundError(f"{folder} holds no safetensors checkpoint ({_SINGLE} or {_INDEX}): dflash reads "
                            "the target's tensors from safetensors files only")


def _module_weight_names(config: Any) -> tuple[str, str | None, bool]:
    """(embedding weight name, LM head weight name, tied?) of the model class of `config`, found on a meta
    copy (no memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is None or head.weight is embed.weight
    return f"{names[id(embed)]}.weight", (None if head is None else f"{names[id(head)]}.weight"), tied


def _find_key(keys: list[str], name: str) -> str | None:
    """`name` among the checkpoint's keys, else the one key ending like it (checkpoints saved with another
    prefix, e.g. `language_model.` in multimodal models)."""
    if name in keys:
        return name
    tail = ".".join(name.split(".")[-2:])
    matches = [k for k in keys if k == tail or k.endswith("." + tail)]
    return matches[0] if len(matches) == 1 else None


def load_head_and_embedding(model_path_or_id: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(embedding `[V, H]`, LM head `[V, H]`, HF config) of a safetensors checkpoint (`config.target`:
    "embedded", a folder or a hub id), reading only those tensors: from the one file that holds each (the
    index says which) through `safe_open`, never the trunk. Tied embeddings (the config says so, or the
    checkpoint has no head) give the same tensor twice."""
    location = target_location(model_path_or_id)
    config = AutoConfig.from_pretrained(location)
    folder, weight_map = safetensors_weight_map(location)
    embed_name, head_name, tied = _module_weight_names(config)
    keys = list(weight_map)
    embed_key = _find_key(keys, embed_name)
    if embed_key is None:
        raise ValueError(f"{model_path_or_id}: no embedding {embed_name!r} in the checkpoint")
    head_key = None if tied or head_name is None else _find_key(keys, head_name)

    def read(key: str) -> torch.Tensor:
        with safe_open(str(folder / weight_map[key]), framework="pt") as f:
            return f.get_tensor(key).to(dtype)

    embed = read(embed_key)
    head = embed if head_key is None else read(head_key)
    return embed, head, config
