"""The frozen target: hidden-state capture of chosen layers, frozen embedding and LM head, mask token.

Works with any `AutoModelForCausalLM` whose base model returns `hidden_states` (Llama, Qwen2/3,
Mistral, ...). Nothing here is trained: the wrapper puts the model in eval mode, turns off gradients,
and exposes the embedding and LM-head weights for the draft to use as constants.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dflash.attention import dense_document_mask, flex_document_mask, resolve_attention
from dflash.losses import head_logits
from dflash.modeling import compiled_flex_attention, text_config_of


class LayerCapture:
    """Forward hooks that keep the outputs of decoder layers `layer_ids` (the one feature rule).

    A hook stores layer i's output hidden state (the first element when the layer returns a
    tuple); `features()` concatenates the last forward's outputs on the feature axis, in
    `layer_ids` order, and clears them. Used by `FrozenTarget` (training) and by
    `capture_layer_outputs` (serving), so both see the same features.
    """

    def __init__(self, layers: Sequence[nn.Module], layer_ids: Sequence[int]) -> None:
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layer_ids))]

    def _hook(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def features(self) -> torch.Tensor:
        """`[B, T, K*H]` of the last forward, concatenated in `layer_ids` order."""
        feats = torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)
        self.outputs.clear()
        return feats

    def remove(self) -> None:
        """Take the hooks off the layers."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextlib.contextmanager
def capture_layer_outputs(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[LayerCapture]:
    """`LayerCapture` on the decoder layers of an HF causal LM for the duration of the block
    (the features `FrozenTarget` gives, from the unmodified model)."""
    layers = model.get_decoder().layers
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"target_layer_ids {list(layer_ids)} out of range for a target with {len(layers)} layers")
    captured = LayerCapture(layers, layer_ids)
    try:
        yield captured
    finally:
        captured.remove()


def checked_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """`layer_ids` as a list, after refusing an empty list or an id outside the target's `num_layers` layers."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or not layer_ids:
        raise ValueError(f"target_layer_ids {list(layer_ids)} out of range: the target has {num_layers} layers "
                         f"(valid ids 0..{num_layers - 1})")
    return list(layer_ids)


@runtime_checkable
class Target(Protocol):
    """What an objective reads from its frozen target, declared once: `FrozenTarget`, `TensorParallelTarget`,
    `GroupBatchTarget` and `OfflineTarget` implement it (the embedding and head through `SharedHead`)."""

    layer_ids: list[int]  # the target layers whose outputs are the draft's context features

    @property
    def text_config(self) -> Any: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    @property
    def vocab_size(self) -> int: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """`[B, S]` token ids -> `[B, S, H]` frozen embeddings."""

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, S]` ids -> the features `[B, S, K*H]` of the K layers in `layer_ids` (no grad). `position_ids`
        `[B, S]`: packed rows, positions restarting per document and attention inside each (`data.packing`)."""

    def features_and_greedy(self, input_ids: torch.Tensor, chunk: int = 1024, *,
                            position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The features and the target's greedy next tokens `[B, S]` (`data.labels: target`)."""


def refuse_packed_rows(position_ids: torch.Tensor | None, target: str) -> None:
    """For targets that run whole rows only: packed rows (`position_ids`) are refused, naming the target. The run's
    configuration is refused before this point (`data.packing` with offline features or a tensor-parallel target);
    this is the direct caller's error."""
    if position_ids is not None:
        raise ValueError(f"{target} does not run packed rows (data.packing): set data.packing=false")


def check_layer_types(text_config: Any) -> None:
    """Refuse a target config with sliding-window layers (read before any weight: the tensor-parallel
    plan's check calls it too): their windowed mask cannot be expressed without a mask tensor."""
    if "sliding_attention" in (getattr(text_config, "layer_types", None) or []):
        raise ValueError("targets with sliding-window layers are not supported yet: their windowed mask "
                         "cannot be expressed without a mask tensor")


def check_target_accepted(model: nn.Module) -> None:
    """The rules for a target model, whole or sharded (`FrozenTarget`, the tensor-parallel targets): an
    attention implementation that is causal without a mask tensor (the truncated trunk builds none),
    no sliding-window layer (its window needs one), no LM-head bias (the draft reuses the head's weight)."""
    decoder_config = model.get_decoder().config
    impl = decoder_config._attn_implementation
    if impl not in CAUSAL_WITHOUT_MASK:
        raise ValueError(f"target attention implementation {impl!r} is not supported for feature capture: load the "
                         "target with attn_implementation='sdpa' (or a flash-attention implementation)")
    check_layer_types(decoder_config)
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError("targets whose LM head has a bias are not supported (the draft reuses the head's weight)")


def hf_model_of(model: nn.Module) -> nn.Module:
    """The HF causal LM behind a target that wraps one (`FrozenTarget`, the tensor-parallel targets: their
    `.model`), or `model` itself when it is the HF model: the one rule for code that accepts either."""
    inner = getattr(model, "model", None) if isinstance(model, SharedHead) else None
    return inner if isinstance(inner, nn.Module) else model


class SharedHead:
    """What a draft reads off its target: the text config, the frozen embedding and the LM head, by default
    off the target's HF causal LM (`self.model`). Shared by `FrozenTarget`, the tensor-parallel targets
    (whose embedding and head are whole on every rank) and `OfflineTarget` (which has no model and
    overrides the three sources)."""

    model: nn.Module

    @property
    def text_config(self) -> Any:
        return text_config_of(self.model.config)

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def embed_weight(self) -> torch.Tensor:
        """`[V, H]` frozen input embedding table."""
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[V, H]` frozen LM head (tied or not)."""
        return self.model.get_output_embeddings().weight

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table (may exceed the tokenizer's vocabulary, e.g. padded tables)."""
        return self.embed_weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_weight)


class FrozenTarget(SharedHead, nn.Module):
    """A frozen causal LM seen through the features the draft needs.

    `features(input_ids)` returns `[B, S, K*H]`: the output of decoder layer i (HF's
    `hidden_states[i + 1]`) for each i in `layer_ids`, concatenated on the feature axis.

    Only layers 0..max(layer_ids) run: the features come from forward hooks on a truncated view of
    the decoder (sharing its weights), so the layers above the last feature and the LM head cost
    nothing. (HF reports `hidden_states[L]` after the final norm; a hook on the last layer gives the
    pre-norm output, which is what "output of decoder layer i" means for every i.)
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], attention: str = "auto") -> None:
        """`attention`: how packed rows' document mask is applied (`draft.attention`: "auto" is flex on a GPU)."""
        super().__init__()
        check_target_accepted(model)
        self.attention = attention
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.num_layers = self.text_config.num_hidden_layers
        self.layer_ids = checked_layer_ids(layer_ids, self.num_layers)
        self._trunk = _truncated_decoder(model.get_decoder(), max(self.layer_ids) + 1)
        self._full: nn.Module | None = None  # all layers, built on first use of features_and_last_hidden
        # The full decoder shares the trunk's layer modules, so these hooks fire in both.
        self._capture = LayerCapture(self._trunk.layers, self.layer_ids)

    def train(self, mode: bool = True) -> FrozenTarget:  # the target never leaves eval mode
        return super().train(False)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenated features `[B, S, K*H]` of right-padded `input_ids` `[B, S]`.

        No attention mask is passed: the model is causal and padding sits at the end, so every real
        position is exact, and HF's padding-mask path would read the mask back to the host (a sync).
        Packed rows (`position_ids` `[B, S]` restarting per document) get a document mask built on the device
        (`document_attention`): no host read either.
        """
        self._trunk(input_ids=input_ids, use_cache=False, **document_attention(position_ids, self.attention))
        return self._capture.features()

    @torch.no_grad()
    def features_and_last_hidden(self, input_ids: torch.Tensor,
                                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features `[B, S, K*H]` and the final-normed last hidden state `[B, S, H]` from one run of every
        layer (the same hooks give the features). DSpark's L1 term and `data.labels: target` read it."""
        if self._full is None:
            self._full = _truncated_decoder(self.model.get_decoder(), self.num_layers)
        mask = document_attention(position_ids, self.attention)
        last = self._full(input_ids=input_ids, use_cache=False, **mask).last_hidden_state
        return self._capture.features(), last

    @torch.no_grad()
    def features_and_greedy(self, input_ids: torch.Tensor, chunk: int = 1024, *,
                            position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and the target's own greedy next-token labels `[B, S]` (for `data.labels: target`).

        `labels[:, p]` = argmax of the target's logits at p - 1 (position 0 keeps its token). Runs all
        layers and the LM head, in sequence chunks so `[B, S, V]` logits never exist at once. (In a packed
        row the label at a document's first position comes from the previous document: no block reads it.)
        """
        features, last = self.features_and_last_hidden(input_ids, position_ids)
        return features, greedy_labels(input_ids, last, self.lm_head_weight, chunk)

    features = forward


def greedy_labels(input_ids: torch.Tensor, last_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                  chunk: int = 1024) -> torch.Tensor:
    """The target's greedy next-token labels `[B, S]` from its final-normed last hidden state `[B, S, H]`:
    `labels[:, p]` = argmax of the logits at p - 1, position 0 keeps its token. The LM head runs in
    sequence chunks, so `[B, S, V]` logits never exist at once. (`FrozenTarget` and the
    tensor-parallel target share this rule.)"""
    greedy = torch.empty_like(input_ids)
    greedy[:, :1] = input_ids[:, :1]
    for start in range(0, input_ids.shape[1] - 1, chunk):
        end = min(start + chunk, input_ids.shape[1] - 1)
        greedy[:, start + 1 : end + 1] = head_logits(last_hidden[:, start:end], lm_head_weight).argmax(dim=-1)
    return greedy


# Attention implementations that treat "no mask" as causal (is_causal=True kernels).
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")
# A name registered with transformers' AttentionInterface but not with its mask functions: a decoder
# whose config carries it skips mask construction (returns None), which otherwise reads the position
# ids back to the host to detect packed sequences -- a sync in every step. Its function is
# `_document_or_inner_attention`.
_NO_MASK_IMPL = "dflash_causal_no_mask"


def document_attention(position_ids: torch.Tensor | None, attention: str = "auto") -> dict[str, Any]:
    """The keyword arguments that make a truncated decoder (`_truncated_decoder`) run packed rows: positions
    restarting per document and a mask confining attention to each document, built on the device from the
    positions (`attention` "flex", "auto" on a GPU: a flex `BlockMask`; else the dense boolean mask for SDPA,
    which runs under a dispatch-level sync detector too). {} for unpacked rows.
    transformers returns a 4-D mask as given, before looking for packed sequences (which reads the positions
    back to the host)."""
    if position_ids is None:
        return {}
    flex = resolve_attention(attention, position_ids.device) == "flex"
    mask = flex_document_mask(position_ids) if flex else dense_document_mask(position_ids)
    return {"position_ids": position_ids, "attention_mask": mask}


def _document_or_inner_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The truncated decoder's attention: a flex `BlockMask` (packed rows on a GPU) runs flex attention, anything
    else (no mask: causal; the dense document mask) the layer's own implementation (`dflash_inner_attention`)."""
    if isinstance(attention_mask, BlockMask):
        scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
        out = compiled_flex_attention()(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    inner = ALL_ATTENTION_FUNCTIONS.get(module.config.dflash_inner_attention, sdpa_attention_forward)
    return inner(module, query, key, value, attention_mask, *args, **kwargs)


def _truncated_decoder(decoder: nn.Module, num_layers: int) -> nn.Module:
    """A shallow copy of an HF decoder that runs only its first `num_layers` layers (shared weights).

    The copy's config names `_NO_MASK_IMPL`, so its forward builds no mask; its layers are shallow copies too
    (the same parameters and hooks) whose submodules read that config, so their attention is
    `_document_or_inner_attention`: with no mask the original implementation, causal; with a packed row's
    document mask (`document_attention`) confined to each document.
    """
    AttentionInterface.register(_NO_MASK_IMPL, _document_or_inner_attention)
    trunk = copy.copy(decoder)
    trunk._modules = dict(decoder._modules)  # own module table, so the original keeps all its layers
    trunk.config = copy.deepcopy(decoder.config)
    trunk.config.num_hidden_layers = num_layers
    trunk.config.dflash_inner_attention = decoder.config._attn_implementation
    trunk.config._attn_implementation = _NO_MASK_IMPL
    if getattr(trunk.config, "layer_types", None) is not None:
        trunk.config.layer_types = list(trunk.config.layer_types)[:num_layers]
    trunk.layers = nn.ModuleList(_reading_config(layer, decoder.config, trunk.config)
                                 for layer in list(decoder.layers)[:num_layers])
    return trunk


def _reading_config(module: nn.Module, config: Any, replacement: Any) -> nn.Module:
    """A shallow copy of `module` (the same parameters, buffers and hooks) in which every submodule that reads
    `config` reads `replacement` instead; the original modules are left as they were."""
    clone = copy.copy(module)
    if getattr(module, "config", None) is config:
        clone.config = replacement
    clone._modules = {name: None if child is None else _reading_config(child, config, replacement)
                      for name, child in module._modules.items()}
    return clone


def resolve_mask_token_id(tokenizer: Any, vocab_size: int, requested: int | str | None = None) -> int:
    """The block's mask token: an explicit id or token string, else the tokenizer's mask token.

    Raises a ValueError that says what to set when no usable token exists or the id is not a row of
    the target's embedding table (a draft trained with such an id cannot be served).
    """
    if isinstance(requested, str):
        token_id = tokenizer.convert_tokens_to_ids(requested) if tokenizer is not None else None
        unk = getattr(tokenizer, "unk_token_id", None)
        if token_id is None or (token_id == unk and requested != getattr(tokenizer, "unk_token", None)):
            raise ValueError(f"mask token {requested!r} is not in the tokenizer's vocabulary; "
                             "set draft.mask_token_id to an existing token (id or string)")
        requested = token_id
    if requested is None:
        requested = getattr(tokenizer, "mask_token_id", None)
        if requested is None:
            raise ValueError(
                "the tokenizer defines no mask token: set draft.mask_token_id to the id (or string) of a token "
                "that is a row of the target's embedding table and never appears in the training data "
                "(an unused special or reserved token)"
            )
    if not 0 <= int(requested) < vocab_size:
        raise ValueError(
            f"mask_token_id {requested} is not a row of the target's embedding table (size {vocab_size}); "
            f"choose an id in [0, {vocab_size - 1}]"
        )
    return int(requested)


def mask_token_text(tokenizer: Any, token_id: int) -> str | None:
    """The tokenizer's text of the mask token `token_id` (its vocabulary key, e.g. ``<empty_output>``), None without
    a tokenizer or when the id is an embedding row past the tokenizer's vocabulary (Qwen3 pads its table).

    Exported as `dflash_config.mask_token`: SGLang's DFlash worker (@0468412f) refuses a text the target tokenizer
    maps to another id than `mask_token_id`, and an older one takes the mask row from the text alone (default
    ``<|MASK|>``, added to the tokenizer when absent: row 151,669 of a Qwen3 target, not the trained one)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)  # None: no tokenizer (a test's, a stand-in's)
    text = convert(int(token_id)) if convert is not None else None
    return text if isinstance(text, str) and text else None
