"""A tensor-parallel frozen target: `FrozenTarget`'s interface with the trunk sharded over a TP group.

Sharding follows the model's own `config.base_model_tp_plan` (transformers' per-architecture plan):
"colwise" linears (q/k/v, gate/up) keep this rank's rows (its attention heads, its KV heads, its
slice of the intermediate), "rowwise" linears (o_proj, down_proj) its columns, and their partial
outputs are all-reduced by our own schedule (`dflash.target_model.tp_overlap`: unsplit, or two batch halves whose
all-reduces hide behind each other's compute, `tensor_parallel.overlap`). Norms (Qwen3's per-head q_norm /
k_norm included), the rotary tables, the embedding and the LM head stay whole on every rank (plan
entries outside the layers, such as a vocab-parallel embedding, are ignored): the draft needs the
full vocabulary, so the embedding and head are plain full tensors.

Three ways to get one (each rank of the group calls the same):
* `TensorParallelTarget(model, layer_ids, group)`   shard an already loaded model in place;
* `TensorParallelTarget.from_pretrained(path, ...)`  build on the meta device and read only this
  rank's slice of each sharded tensor from the checkpoint's safetensors files;
* `TensorParallelTarget.from_config(config, ...)`    random weights of a named shape (benchmarks).

`GroupBatchTarget` runs it once on the concatenation of the group's micro-batches and hands each
rank its own rows, so the draft stays data-parallel over every rank.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.modeling import text_config_of
from dflash.target_model.frozen import (
    SharedHead,
    check_layer_types,
    check_target_accepted,
    checked_layer_ids,
    greedy_labels,
    hf_model_of,
    refuse_packed_rows,
)
from dflash.target_model.offline import safetensors_weight_map
from dflash.target_model.tp_overlap import REDUCED_BIAS, SCHEDULES, run_trunk

# Decoders whose forward is embed -> rotary -> [norm, attention, residual, norm, MLP, residual] * L
# -> norm with the linears below: what `run_trunk` reimplements (Gemma-style embedding scaling, fused
# qkv projections or extra norms are not).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# The plan entries the sharded forward relies on, with the style it implements for each.
_REQUIRED_STYLES = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                    "mlp.down_proj": "rowwise"}
_SPLIT_DIM = {"colwise": 0, "rowwise": 1}  # the weight dimension each style splits
_REPLICATED_STYLES = ("replicated_with_grad_allreduce",)  # per-head norms: whole on every rank


def check_tp_support(config: Any, tp: int) -> dict[str, str]:
    """The validated tensor-parallel plan (`config.base_model_tp_plan`) of a text config at `tp`
    ranks, or a ValueError naming the fix: no plan, an unsupported architecture or plan entry, a
    sliding-window layer, or heads / KV heads / intermediate size not divisible by `tp`."""
    model_type = getattr(config, "model_type", type(config).__name__)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"target architecture {model_type!r} has no tensor-parallel plan (config.base_model_tp_plan): "
                         "run it replicated (tensor_parallel.size: 1) or train from offline features")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"target architecture {model_type!r} is not supported under tensor parallelism (supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}): run it replicated (tensor_parallel.size: 1)")
    for key, style in plan.items():
        if not key.startswith("layers."):  # embedding, final norm: whole on every rank whatever the plan says
            continue
        expected = _REQUIRED_STYLES.get(key.removeprefix("layers.*."))
        if style != expected and style not in _REPLICATED_STYLES:
            raise ValueError(f"tensor-parallel plan entry {key!r}: {style!r} is not supported by dflash's sharded "
                             "target; run it replicated (tensor_parallel.size: 1)")
    missing = [k for k in _REQUIRED_STYLES if f"layers.*.{k}" not in plan]
    if missing:
        raise ValueError(f"the tensor-parallel plan of {model_type!r} does not shard {missing}: run it replicated")
    check_layer_types(config)
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    bad = {k: v for k, v in sizes.items() if tp < 1 or v % tp}
    if bad:
        common = math.gcd(*sizes.values())
        valid = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(f"tensor_parallel.size={tp} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())}: "
                         f"each rank must hold whole attention and KV heads; set tensor_parallel.size to one of {valid}")
    return dict(plan)


def tp_mesh(tp: int, device_type: str) -> DeviceMesh:
    """The (dp x tp) `DeviceMesh` of the whole world, dims named ("dp", "tp"): consecutive ranks form
    a TP group (on one host they share NVLink). Needs an initialised process group."""
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel.size={tp}: launch a multiple of "
                         f"{tp} processes or change tensor_parallel.size")
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def resolve_tp_group(group: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    """The TP process group of a 2-D (dp x tp) mesh (its "tp" dim), a 1-D mesh, or a ProcessGroup."""
    if isinstance(group, DeviceMesh):
        if group.ndim == 1:
            return group.get_group()
        if "tp" not in (group.mesh_dim_names or ()):
            raise ValueError(f"a {group.ndim}-D device mesh needs a dim named 'tp' (it has {group.mesh_dim_names})")
        return group["tp"].get_group()
    return group


def _split(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's 1/tp of `t` along `dim`, in its own storage (so the full tensor can be freed)."""
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size).clone()


def shard_model_(model: nn.Module, plan: dict[str, str], rank: int, tp: int) -> dict[str, tuple[str, int | None]]:
    """Replace, in place, each linear of the decoder that `plan` shards by rank's shard; a row-parallel
    bias moves to the buffer `REDUCED_BIAS` (added once after the all-reduce). Works on meta tensors.

    Returns, for every tensor changed, `{name in model: (checkpoint name, split dim or None)}`."""
    base = model.base_model
    prefix = next(name for name, module in model.named_modules() if module is base)
    prefix = f"{prefix}." if prefix else ""
    sources: dict[str, tuple[str, int | None]] = {}
    for name, module in base.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style not in _SPLIT_DIM:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tensor-parallel plan entry for {name!r} is a {type(module).__name__}, not a Linear")
        dim = _SPLIT_DIM[style]
        full = f"{prefix}{name}"
        module.weight = nn.Parameter(_split(module.weight, dim, rank, tp), requires_grad=False)
        module.out_features, module.in_features = module.weight.shape
        sources[f"{full}.weight"] = (f"{full}.weight", dim)
        if module.bias is not None and dim == 0:
            module.bias = nn.Parameter(_split(module.bias, 0, rank, tp), requires_grad=False)
            sources[f"{full}.bias"] = (f"{full}.bias", 0)
        elif module.bias is not None:
            bias = module.bias.detach()
            module.register_parameter("bias", None)
            module.register_buffer(REDUCED_BIAS, bias)
            sources[f"{full}.{REDUCED_BIAS}"] = (f"{full}.bias", None)
    return sources


def _group_rank_size(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _build_sharded(config: Any, group: dist.ProcessGroup, dtype: torch.dtype,
                   device: torch.device) -> tuple[nn.Module, dict[str, tuple[str, int | None]]]:
    """A causal LM of `config` holding only rank's shards (uninitialised, on `device`): built on the
    meta device, sharded there, then allocated, so no rank ever holds the full trunk."""
    rank, tp = _group_rank_size(group)
    plan = check_tp_support(text_config_of(config), tp)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    sources = shard_model_(model, plan, rank, tp)
    model.to_empty(device=device)
    if tied:  # to_empty gives each module its own new parameter
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    decoder = model.get_decoder()
    decoder.rotary_emb = type(decoder.rotary_emb)(config=decoder.config).to(device)  # non-persistent tables
    return model, sources


def _load_shards_(model: nn.Module, folder: Path, sources: dict[str, tuple[str, int | None]], rank: int,
                  tp: int) -> None:
    """Fill `model`'s (sharded) tensors from the safetensors files of `folder`, reading only this
    rank's slice of each split tensor (safetensors slices are read from the memory-mapped file)."""
    folder, weight_map = safetensors_weight_map(folder)
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # tied tensors appear under each name
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    by_file: dict[str, list[tuple[torch.Tensor, str, int | None]]] = {}
    for key, tensor in tensors.items():
        candidates = [sources.get(n, (n, None)) for n in names[key]]
        found = next((c for c in candidates if c[0] in weight_map), None)
        if found is None:
            raise KeyError(f"checkpoint {folder} has no tensor {candidates[0][0]!r}: its names do not match the "
                           "model's modules (a legacy layout?); load it replicated and shard it in place instead")
        by_file.setdefault(weight_map[found[0]], []).append((tensor, *found))
    with torch.no_grad():
        for file, items in by_file.items():
            with safe_open(folder / file, framework="pt", device="cpu") as f:
                for tensor, key, dim in items:
                    piece = f.get_slice(key)
                    index = [slice(None)] * len(piece.get_shape())
                    if dim is not None:
                        size = piece.get_shape()[dim] // tp
                        index[dim] = slice(rank * size, (rank + 1) * size)
                    value = piece[tuple(index)]
                    if tuple(value.shape) != tuple(tensor.shape):
                        raise ValueError(f"{key}: checkpoint slice {tuple(value.shape)} != model {tuple(tensor.shape)}")
                    tensor.copy_(value)


def _refuse_sharded_forward(module: nn.Module, args: Any) -> None:
    raise RuntimeError(f"this {type(module).__name__} is sharded over a tensor-parallel group: its own forward would "
                       "skip the row-parallel all-reduces (wrong outputs); call the TensorParallelTarget instead "
                       "(dflash.target_model.tp_decode.LockstepTarget to decode). HF generate() cannot run it, so with "
                       "tensor_parallel.size > 1 data.regenerate needs the target's replies already cached: run "
                       "`dflash generate` where the whole target fits, or answer the prompts with a serving engine "
                       "and train on that file with data.regenerate: false")


class TensorParallelTarget(SharedHead, nn.Module):
    """A frozen causal LM whose decoder layers are sharded over a TP group (each rank ~1/tp).

    Every rank of the group calls it with the same `input_ids` `[B, S]` (right padded) and gets the
    same result: `forward` gives the features `[B, S, K*H]` (output of decoder layer i for each i in
    `layer_ids`, concatenated, as `FrozenTarget`), `features_and_greedy` also the greedy labels.
    `rows` restricts what is returned (and kept) to a contiguous slice of the batch: the group-batch
    path (`dflash.target_model.tp_group.GroupBatchTarget`).

    `model`: an HF causal LM of a supported architecture, loaded with sdpa or flash attention, whole
    on every rank; its decoder linears are replaced by this rank's shards (the model is no longer
    usable as a whole). `group`: a (dp x tp) `DeviceMesh`, a 1-D mesh or a ProcessGroup.
    `schedule`: "overlap" (`tensor_parallel.overlap` on), "unsplit" (off) or "split" (benchmarks), see
    `dflash.target_model.tp_overlap`; it may be changed between calls.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], group: DeviceMesh | dist.ProcessGroup, *,
                 schedule: str = "overlap", _sharded: bool = False) -> None:
        super().__init__()
        self.group = resolve_tp_group(group)
        self.tp_rank, self.tp_size = _group_rank_size(self.group)
        plan = check_tp_support(text_config_of(model.config), self.tp_size)
        check_target_accepted(model)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown tensor-parallel schedule {schedule!r}; choose one of {SCHEDULES}")
        self.num_layers = text_config_of(model.config).num_hidden_layers
        self.layer_ids = checked_layer_ids(layer_ids, self.num_layers)
        model.eval()
        model.requires_grad_(False)
        if not _sharded:
            shard_model_(model, plan, self.tp_rank, self.tp_size)
        for module in (model, model.get_decoder()):  # their HF forwards would skip the all-reduces
            module.register_forward_pre_hook(_refuse_sharded_forward)
        self.model = model
        self.schedule = schedule

    @classmethod
    def from_config(cls, config: Any, layer_ids: list[int], group: DeviceMesh | dist.ProcessGroup, *,
                    dtype: torch.dtype, device: torch.device, std: float = 0.02, seed: int = 0,
                    schedule: str = "overlap") -> TensorParallelTarget:
        """Random weights of `config`'s shape, built sharded (normal(0, std) matrices, unit norms, zero
        biases). The same `seed` on every rank gives every rank the same embedding and head."""
        tp_group = resolve_tp_group(group)
        model, _ = _build_sharded(config, tp_group, dtype, device)
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if tensor.dim() > 1:
                    tensor.normal_(0.0, std, generator=generator)
                elif name.endswith(".weight"):  # a norm
                    tensor.fill_(1.0)
                elif name.endswith((".bias", REDUCED_BIAS)):
                    tensor.zero_()
        return cls(model, layer_ids, tp_group, schedule=schedule, _sharded=True)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, layer_ids: list[int], group: DeviceMesh | dist.ProcessGroup, *,
                        dtype: torch.dtype, device: torch.device, schedule: str = "overlap") -> TensorParallelTarget:
        """Load an HF checkpoint (local folder or hub id; safetensors) sharded: each rank builds the
        model on the meta device, allocates only its shards, and reads only its slices."""
        folder = Path(name_or_path)
        if not folder.is_dir():  # a hub id: config and safetensors only (once per host: a shared cache)
            folder = Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))
        tp_group = resolve_tp_group(group)
        model, sources = _build_sharded(AutoConfig.from_pretrained(folder), tp_group, dtype, device)
        _load_shards_(model, folder, sources, *_group_rank_size(tp_group))
        return cls(model, layer_ids, tp_group, schedule=schedule, _sharded=True)

    def train(self, mode: bool = True) -> TensorParallelTarget:  # the target never leaves eval mode
        return super().train(False)

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, *, rows: slice | None = None,
                      all_layers: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features `[b, S, K*H]`, final-normed last hidden state `[b, S, H]` or None) of the rows
        `rows` (default all `B`) of `input_ids` `[B, S]`. Runs layers 0..max(layer_ids), or all
        layers and the final norm when `all_layers`."""
        decoder = self.model.get_decoder()
        start, stop, _ = (rows or slice(None)).indices(input_ids.shape[0])
        wanted = set(self.layer_ids)
        kept: dict[int, list[torch.Tensor]] = {i: [] for i in wanted}

        def keep(index: int, first: int, hidden: torch.Tensor) -> None:
            lo, hi = max(start, first), min(stop, first + hidden.shape[0])
            if index in wanted and lo < hi:
                piece = hidden[lo - first : hi - first]
                kept[index].append(piece if piece.shape[0] == hidden.shape[0] else piece.clone())

        hidden = decoder.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        rotary = decoder.rotary_emb(hidden, positions)
        count = self.num_layers if all_layers else max(self.layer_ids) + 1
        finals = run_trunk(decoder.layers[:count], hidden, rotary, self.group, self.schedule, keep)
        feats = torch.cat([torch.cat(kept[i]) if len(kept[i]) > 1 else kept[i][0] for i in self.layer_ids], dim=-1)
        if not all_layers:
            return feats, None
        last = [h[max(start, f) - f : min(stop, f + h.shape[0]) - f] for f, h in finals
                if max(start, f) < min(stop, f + h.shape[0])]
        return feats, decoder.norm(torch.cat(last) if len(last) > 1 else last[0])

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, rows: slice | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenated features `[b, S, K*H]` of right-padded `input_ids` `[B, S]` (rows `rows`); whole rows only."""
        refuse_packed_rows(position_ids, "the tensor-parallel target")
        return self.hidden_states(input_ids, rows=rows)[0]

    @torch.no_grad()
    def features_and_last_hidden(self, input_ids: torch.Tensor, rows: slice | None = None,
                                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features `[b, S, K*H]` and the final-normed last hidden state `[b, S, H]` of rows `rows`, from one
        run of every layer (as `FrozenTarget.features_and_last_hidden`)."""
        refuse_packed_rows(position_ids, "the tensor-parallel target")
        return self.hidden_states(input_ids, rows=rows, all_layers=True)

    @torch.no_grad()
    def features_and_greedy(self, input_ids: torch.Tensor, chunk: int = 1024,
                            rows: slice | None = None, *,
                            position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and the target's greedy next-token labels `[b, S]` of rows `rows` (as
        `FrozenTarget.features_and_greedy`: `labels[:, p]` = argmax of the logits at p - 1, position 0
        keeps its token). The LM head is whole, so only the kept rows' logits are computed."""
        refuse_packed_rows(position_ids, "the tensor-parallel target")
        feats, last = self.features_and_last_hidden(input_ids, rows)
        return feats, greedy_labels(input_ids[rows or slice(None)], last, self.lm_head_weight, chunk)

    features = forward


def target_parameter_bytes(target: nn.Module) -> dict[str, int]:
    """Bytes of parameters and buffers this rank holds for a target's model (`FrozenTarget`,
    `TensorParallelTarget`, `GroupBatchTarget` or an HF causal LM itself, meta tensors included): "layers"
    (the decoder layers: what TP shards), "embedding", "lm_head" (0 when tied to the embedding), "other"
    (final norm, rotary tables), "total"."""
    model = hf_model_of(target)
    decoder = model.get_decoder()

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())

    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    out = {"layers": nbytes([*decoder.layers.parameters(), *decoder.layers.buffers()]),
           "embedding": nbytes([embed]), "lm_head": 0 if head is embed else nbytes([head])}
    out["total"] = nbytes([*model.parameters(), *model.buffers()])
    out["other"] = out["total"] - out["layers"] - out["embedding"] - out["lm_head"]
    return out
