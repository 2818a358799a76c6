"""The published DFlash checkpoint format (DESIGN §5): write, read back, check against a target.

A checkpoint folder holds two files:

`config.json` — a Qwen3 config of the *draft* (`model_type: "qwen3"`, `architectures:
["DFlashDraftModel"]`, hidden_size equal to the target's, layers, heads, kv heads, head_dim,
intermediate_size, rms_norm_eps, vocab_size, rope_theta at top level, max_position_embeddings,
layer_types all "full_attention", silu, no attention bias, untied) plus the DFlash keys
`block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids, ...}`
(variant keys such as Domino's go into `dflash_config` too). `transformers.Qwen3Config` /
`AutoConfig` parse it and keep the extra keys as attributes (tests/test_export.py shows it).

`model.safetensors` — bf16, no prefix, exactly these names and no others:
    fc.weight [H, K*H], hidden_norm.weight [H], norm.weight [H],
    layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight
plus, for a Domino draft (`dflash_config.projector_type: domino` with `emb_dim`, `gru_hidden_dim`,
`pure_draft_prefix_len`, `shift_label`), its head: prefix_gru.weight_ih_l0 [3G, H],
prefix_gru.weight_hh_l0 [3G, G], embed_proj.0.weight [emb_dim, H + G], embed_proj.2.weight [V, emb_dim].
plus, for a DFlash 2 draft (`dflash_config` with `conv_kernel_size`, `conv_group_size`, `selector_rank`,
`selector_top_k` and `block_size`; `architectures: ["DFlash2DraftModel"]`, top-level `is_causal: false`, as
z-lab's published config and SGLang / vLLM read it): layers.{i}.{attention,mlp}_conv.base_kernel [2, T, H],
layers.{i}.{attention,mlp}_conv.kernel_projection.weight [2*T*H/g, H], candidate_selector.hidden_projection.weight
[r, H], and the raw codebooks candidate_selector.{predecessor,successor}_codebook [V, r] (no `.weight`).
No embedding and no LM head: every consumer uses the target's.

A DSpark draft is written in DeepSpec's `Qwen3DSparkModel` shape (`dflash.kinds.dspark`): `architectures:
["Qwen3DSparkModel"]`, top-level `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, `sample_from_anchor: true`, `mask_token_id`, `target_layer_ids` (where DeepSpec
writes them and SGLang's / vLLM's DSpark parsers read them), plus the usual `dflash_config` with `block_size`
(SGLang's DFlash parser, under its DSpark one, reads dflash_config first; the values agree); weights
markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [V, r], confidence_head.proj.weight [1, H + r]
and .bias [1], and, when exported with the target at hand (`target_model`), DeepSpec's copies of the target's
embed_tokens.weight and lm_head.weight [V, H] (SGLang skips them, vLLM shares the target's when absent).

Who reads these names (checked against their public source, not run here): the reference DFlash
code (z-lab/dflash, `dflash/model.py`: a `Qwen3PreTrainedModel` subclass with modules `fc`,
`hidden_norm`, `norm`, `layers.N.{self_attn,mlp,...}` that reads `dflash_config.target_layer_ids`,
`mask_token_id` and `block_size` from the config); SGLang (`python/sglang/srt/models/dflash.py`,
`DFlashDraftModel.load_weights`, which fuses q/k/v and gate/up itself and silently skips unknown
names — so a wrong name there would fail silently, hence the strict key check here); vLLM
(`vllm/model_executor/models/qwen3_dflash.py`, `DFlashQwen3ForCausalLM.load_weights`, which adds
the `model.` prefix itself). The reference's `AutoModel.from_pretrained(..., trust_remote_code=True)`
path additionally needs its modeling file and an `auto_map` entry in the folder; this exporter
writes neither (it ships weights and config, not code).

Three more keys, for readers that need them:
* `eagle_aux_hidden_state_layer_ids` (top level): the same layers in vLLM's convention, where aux id j
  is the hidden state entering decoder layer j (the output of layer j - 1), so it is
  `target_layer_ids` + 1. vLLM's GPU model runner takes this key first; versions that fall back to
  `dflash_config.target_layer_ids` without adding 1 would otherwise read each layer one too early.
* `dflash_config.target`: the target the draft was trained for (`config.target`: "embedded", a hub id
  or a path), which `dflash eval` takes when `--target` is not given.
* `dflash_config.held_out_split`: the data settings that chose the run's held-out conversations
  (`DataSettings.held_out_split`), absent without a held-out split; `dflash eval` decodes those prompts by
  default, so its τ is on the run's own end-of-run evaluation prompts. Serving engines ignore both.
* `dflash_weights_sha256` (top level): the sha256 of `model.safetensors`, verified by `load_exported`; it also
  marks the folder as a dflash export, which `dflash export` may write into again (`export_folder`).

`dflash export` reads a `DFlashTrainer` checkpoint (or run folder) and a `transformers.Trainer`
checkpoint folder: `DFlashHFTrainer`'s (this format plus `TRAINER_DRAFT_NAME`, the draft in its
training dtype, which the export casts again, so the bytes are the folder's own), or a plain
Trainer's (`objective.draft.*` weights, the config in its `dflash-draft/` export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from dflash.config import HELD_OUT_SPLIT_KEYS
from dflash.evaluation.export_folder import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_export_folder,
    verify_weights,
    warn_stale_reports,
    write_export_files,
)
from dflash.kinds.registry import draft_model_for_config, kind_of, kind_of_export
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel, text_config_of
from dflash.run.checkpoint import checkpoint_folder, draft_from_checkpoint, load_checkpoint_draft
from dflash.target_model.frozen import hf_model_of

# In a transformers.Trainer checkpoint of DFlashHFTrainer: the draft's weights in its training dtype (fp32
# master weights by default), published names; what an exact resume loads (the bf16 file is for serving).
TRAINER_DRAFT_NAME = "dflash_draft_state.safetensors"
TRAINER_PREFIX = "objective.draft."  # a plain Trainer checkpoint's draft keys (DFlashTrainingModule.state_dict)
TRAINER_EXPORT_DIR = "dflash-draft"  # DFlashCallback's export inside a plain Trainer checkpoint
_DFLASH_CORE_KEYS = ("mask_token_id", "target_layer_ids")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def expected_weight_names(num_layers: int) -> set[str]:
    """The DESIGN §5 tensor names of a DFlash draft with `num_layers` layers (the backbone every kind shares)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    per_layer = [
        "input_layernorm.weight", "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    for i in range(num_layers):
        names.update(f"layers.{i}.{n}" for n in per_layer)
    return names


def draft_weight_names(cfg: DFlashDraftConfig) -> set[str]:
    """The tensor names of the draft `cfg` describes: the backbone's and what its kind adds (`ExportLayout.weight_names`:
    the Domino head, DFlash 2's convs and selector, the DSpark heads), without a kind's optional target copies."""
    return expected_weight_names(cfg.num_hidden_layers) | kind_of(cfg).export.weight_names(cfg)


def export_config(cfg: DFlashDraftConfig, dtype: torch.dtype = torch.bfloat16, *, target: str | None = None,
                  held_out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `config.json` dict for a draft config (Qwen3 fields + DFlash keys); `target` is recorded as
    `dflash_config.target` and `held_out` (the run's `DataSettings.held_out_split`) as
    `dflash_config.held_out_split` (a config read back from an export keeps its own in `extra`)."""
    dtype_name = _DTYPE_NAMES[dtype]
    n = cfg.num_hidden_layers
    reserved = set(_DFLASH_CORE_KEYS)
    clash = reserved & set(cfg.extra)
    if clash:
        raise ValueError(f"draft.config.extra must not redefine {sorted(clash)} (they come from the config fields)")
    kind = kind_of(cfg)
    return {
        "architectures": [kind.export.architecture],
        **kind.export.config_fields(cfg),  # DFlash 2's is_causal, DeepSpec's top-level DSpark keys
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        # transformers 5 reads RoPE from here; older readers read the top-level rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],  # vLLM's convention (above)
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            # a kind's top-level keys sit there (DSpark's: DeepSpec, SGLang, vLLM); what else a read-back export kept
            # stays, and `mask_token` (the factory's: the tokenizer's text of mask_token_id) is SGLang's dflash_config.mask_token
            **{k: v for k, v in cfg.extra.items() if k not in kind.export.top_level_keys},
            # the kinds whose readers take the block size from dflash_config first (DFlash 2, DSpark)
            **({"block_size": cfg.block_size} if kind.export.nested_block_size else {}),
            **({"target": target} if target else {}),
            **({"held_out_split": held_out} if held_out else {}),
        },
    }


def export_draft(draft: DFlashDraftModel, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                 target: str | None = None, held_out: dict[str, Any] | None = None,
                 target_model: nn.Module | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (weights cast to `dtype`, bf16 by default); `target`:
    the target the draft was trained for, `held_out`: its run's held-out split (`export_config`);
    `target_model` (an HF causal LM or a `FrozenTarget`; a kind with `ExportLayout.target_copies` only, DSpark):
    also write DeepSpec's copies of its embedding and LM head."""
    weights = draft.state_dict()
    if target_model is not None:
        kind = kind_of(draft.config)
        copies = kind.export.target_copies
        if not copies:
            raise ValueError(f"target_model is for DSpark exports (DeepSpec's layout copies the target's embedding and "
                             f"LM head); a {kind.title} export holds the draft's own weights only")
        model = hf_model_of(target_model)
        weights |= dict(zip(copies, (model.get_input_embeddings().weight, model.get_output_embeddings().weight),
                            strict=True))
    return export_state(draft.config, weights, out_dir, dtype=dtype, target=target, held_out=held_out)


def export_state(cfg: DFlashDraftConfig, weights: dict[str, torch.Tensor], out_dir: str | Path, *,
                 dtype: torch.dtype = torch.bfloat16, target: str | None = None,
                 held_out: dict[str, Any] | None = None) -> Path:
    """`export_draft` from a draft config and its weights (published names), e.g. a gathered state dict."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported export dtype {dtype}; use one of {list(_DTYPE_NAMES)}")
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in weights.items()}
    expected = draft_weight_names(cfg)
    copies = set(kind_of(cfg).export.target_copies)
    if copies <= set(state):  # the kind's optional copies of the target's tensors (DeepSpec's DSpark layout)
        expected |= copies
    missing = sorted(expected - set(state))
    extra = sorted(set(state) - expected)
    if missing or extra:  # the trainer's names must be the published ones: never write a wrong file
        raise ValueError(f"draft parameters do not match the published names: missing {missing}, unexpected {extra}")
    return write_export_files(state, export_config(cfg, dtype, target=target, held_out=held_out), Path(out_dir))


def trained_target(draft_dir: str | Path) -> str | None:
    """The target an exported draft was trained for (`dflash_config.target`), None when not recorded."""
    return _recorded(draft_dir).get("target")


def trained_held_out_split(draft_dir: str | Path) -> dict[str, Any] | None:
    """The held-out split of an exported draft's run (`dflash_config.held_out_split`), None when not recorded."""
    return _recorded(draft_dir).get("held_out_split")


def _recorded(draft_dir: str | Path) -> dict[str, Any]:
    """The `dflash_config` of an export's config.json."""
    return json.loads((Path(draft_dir) / CONFIG_NAME).read_text()).get("dflash_config") or {}


def _draft_of(config_dir: Path, weights: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A draft built from `config_dir/config.json` with `weights` (published names) loaded strictly."""
    model = draft_model_for_config(draft_config_from_json(json.loads((config_dir / CONFIG_NAME).read_text())))
    model.load_state_dict(weights, strict=True)
    return model


def trainer_checkpoint_draft(folder: str | Path) -> DFlashDraftModel | None:
    """The draft of a `transformers.Trainer` checkpoint folder in its training dtype, or None when `folder`
    is not one: `DFlashHFTrainer`'s (config.json + `TRAINER_DRAFT_NAME`), or a plain Trainer's with
    `DFlashCallback` (`model.safetensors` of `objective.draft.*` keys + `dflash-draft/config.json`)."""
    folder = Path(folder)
    if (folder / TRAINER_DRAFT_NAME).is_file() and (folder / CONFIG_NAME).is_file():
        return _draft_of(folder, load_file(str(folder / TRAINER_DRAFT_NAME)))
    if (folder / WEIGHTS_NAME).is_file() and (folder / TRAINER_EXPORT_DIR / CONFIG_NAME).is_file():
        state = load_file(str(folder / WEIGHTS_NAME))
        if any(k.startswith(TRAINER_PREFIX) for k in state):
            return _draft_of(folder / TRAINER_EXPORT_DIR,
                             {k[len(TRAINER_PREFIX):]: v for k, v in state.items() if k.startswith(TRAINER_PREFIX)})
    return None


def export_checkpoint(path: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """`dflash export PATH OUT`: (the checkpoint read, the export written). PATH is a `transformers.Trainer`
    checkpoint folder, a `DFlashTrainer` checkpoint folder, or a run folder (its newest intact checkpoint);
    the target comes from the folder's own config.json, or the run's config.yaml. Only weights and configs
    are read (no optimizer state). OUT must be new, empty or an earlier export unless `overwrite`
    (`export_folder.check_export_folder`: checked before any weight is read)."""
    path, out = Path(path), Path(out_dir)
    before = check_export_folder(out, overwrite=overwrite)
    folder, written = _export_checkpoint(path, out)
    warn_stale_reports(written, before)
    return folder, written


def _export_checkpoint(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """`export_checkpoint` once its output folder is accepted."""
    draft = trainer_checkpoint_draft(path) if path.is_dir() else None
    if draft is not None:  # its config.json names the target (kept in the draft config's extra keys)
        return path, export_draft(draft, out_dir)
    folder = checkpoint_folder(path)
    draft_state, draft_config = load_checkpoint_draft(folder)
    run_config = folder.parent.parent / "config.yaml"  # RUN/checkpoints/step-N/ -> RUN/config.yaml
    run = (yaml.safe_load(run_config.read_text()) or {}) if run_config.is_file() else {}
    data = run.get("data") or {}  # the whole resolved config (write_run_config): every key is there
    held_out = {k: data[k] for k in HELD_OUT_SPLIT_KEYS} if data.get("eval_size") else None
    draft, trained = draft_from_checkpoint(draft_state, draft_config), run.get("draft") or {}
    # a checkpoint from before the factory recorded its kind's `draft` keys (DSpark's num_anchors) takes them from
    # its run's config.yaml
    extra = draft.config.extra
    extra.update({k: trained[k] for k in kind_of(draft.config).export.run_keys if k not in extra and k in trained})
    return folder, export_draft(draft, out_dir, target=run.get("target"), held_out=held_out)


def draft_config_from_json(data: dict[str, Any]) -> DFlashDraftConfig:
    """A `DFlashDraftConfig` from an exported (or published) `config.json` dict.

    Refuses what this draft model cannot run faithfully (sliding-window layers, attention bias,
    another activation) instead of loading it into a model that would compute something else.
    """
    dflash = dict(data.get("dflash_config") or {})
    top = kind_of_export(data).export.extra_from_config(data)  # a kind's keys at the top level (DSpark's); {} for the others
    if top:  # DeepSpec's shape has no dflash_config: its mask token and layer ids sit at the top level too
        dflash = {**{k: data[k] for k in _DFLASH_CORE_KEYS if k in data}, **dflash}
    missing = [k for k in _DFLASH_CORE_KEYS if k not in dflash] + [
        k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in data]
    if missing:
        raise ValueError(f"config.json is not a DFlash draft config: missing {missing}")
    problems = []
    if any(t != "full_attention" for t in data.get("layer_types") or []):
        problems.append(f"layer_types {data['layer_types']} (only full_attention is supported)")
    if data.get("attention_bias"):
        problems.append("attention_bias true")
    if data.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {data['hidden_act']!r}")
    if problems:
        raise ValueError("unsupported DFlash draft config: " + "; ".join(problems))
    rope = data.get("rope_parameters") or {}
    heads = data.get("num_attention_heads", 8)
    n_layers = data["num_hidden_layers"]
    block_size = data.get("block_size", dflash.get("block_size", 16))
    extra = {k: v for k, v in dflash.items() if k not in _DFLASH_CORE_KEYS and k != "block_size"} | top
    return DFlashDraftConfig(
        hidden_size=data["hidden_size"],
        vocab_size=data["vocab_size"],
        num_target_layers=data.get("num_target_layers", n_layers),
        target_layer_ids=list(dflash["target_layer_ids"]),
        mask_token_id=dflash["mask_token_id"],
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim") or data["hidden_size"] // heads,
        intermediate_size=data.get("intermediate_size", 1536),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        rope_theta=float(data.get("rope_theta") or rope.get("rope_theta") or 10_000.0),
        max_position_embeddings=data.get("max_position_embeddings", 32768),
        block_size=block_size,
        extra=extra,
    )


def exported_folder(path: str | Path) -> Path:
    """`path` if it holds an exported draft, a run folder's `export/`, else a FileNotFoundError saying what it
    is instead (missing, a checkpoint or a run folder without an export, or something else) and what to pass."""
    folder = Path(path)
    if (folder / CONFIG_NAME).is_file() and (folder / WEIGHTS_NAME).is_file():
        return folder
    if (folder / "export" / CONFIG_NAME).is_file() and (folder / "export" / WEIGHTS_NAME).is_file():
        return folder / "export"  # a run folder: its export, as `dflash export` takes a run folder's checkpoint
    if not folder.exists():
        raise FileNotFoundError(f"{folder} does not exist; pass an exported draft folder (a run's export/)")
    if (folder / "draft.safetensors").is_file() or (folder / "checkpoints").is_dir():
        raise FileNotFoundError(f"{folder} is a training checkpoint or a run folder without an export, not an "
                                f"exported draft: write one with `dflash export {folder} OUT_DIR`")
    raise FileNotFoundError(f"{folder} is not an exported DFlash draft (needs {CONFIG_NAME} and {WEIGHTS_NAME})")


def load_exported(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype = torch.float32,
                  *, target_model: nn.Module | None = None) -> DFlashDraftModel:
    """Read an exported folder back into a draft (eval mode, on `device`, in `dtype`): the model of the kind its
    config describes (`kind_of`: Domino when `dflash_config.projector_type` is `domino`, DFlash 2 when it holds the
    DFlash 2 keys, ...), else a `DFlashDraftModel`.

    The tensor names must be exactly the model's (the error lists missing and unexpected names);
    shapes must match the config; then the weights file must match the checksum config.json records
    (`export_folder.verify_weights`: an older export without one loads with a warning). With `target_model`,
    `check_compatible` runs first.
    """
    folder = exported_folder(path)
    config = json.loads((folder / CONFIG_NAME).read_text())
    cfg = draft_config_from_json(config)
    if target_model is not None:
        check_compatible(cfg, target_model)
    model = draft_model_for_config(cfg)
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    try:
        with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
            names = set(f.keys())
            # an export may hold copies of the target's embedding and LM head (DeepSpec's DSpark layout): not the draft's
            names -= set(kind_of(cfg).export.target_copies)
            missing, unexpected = sorted(set(wanted) - names), sorted(names - set(wanted))
            if not (missing or unexpected):
                state = {name: f.get_tensor(name) for name in names}
    except Exception as e:  # safetensors' own error type names no file: say which, and that it is damaged
        raise ValueError(f"{folder / WEIGHTS_NAME} cannot be read ({e}): the file is damaged or truncated; "
                         "export the draft again") from None
    if missing or unexpected:
        raise ValueError(f"{folder / WEIGHTS_NAME} does not match the DFlash draft of its config.json: "
                         f"missing {missing}, unexpected {unexpected}")
    bad = [f"{n}: file {tuple(t.shape)} vs config {wanted[n]}" for n, t in state.items() if tuple(t.shape) != wanted[n]]
    if bad:
        raise ValueError("tensor shapes do not match config.json: " + "; ".join(bad))
    # a file of the right names and shapes may still have changed since export: a flipped byte is refused, not run
    verify_weights(folder, config)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def check_compatible(draft_config: DFlashDraftConfig, target_model: nn.Module) -> None:
    """Raise a ValueError naming every way the target does not fit the draft.

    Checks hidden size, the target's layer count against `num_target_layers`, `target_layer_ids`
    in range, embedding rows (and LM-head rows) against `vocab_size`, and the mask token's row.
    Accepts an HF causal LM or a `FrozenTarget`.
    """
    model = hf_model_of(target_model)
    cfg = model.config
    text = text_config_of(cfg)
    layers = text.num_hidden_layers
    emb_rows, emb_dim = model.get_input_embeddings().weight.shape
    head = model.get_output_embeddings()
    problems = []
    if text.hidden_size != draft_config.hidden_size or emb_dim != draft_config.hidden_size:
        problems.append(f"hidden size: draft {draft_config.hidden_size}, target {text.hidden_size}")
    if layers != draft_config.num_target_layers:
        problems.append(f"number of layers: draft was trained on a target with num_target_layers="
                        f"{draft_config.num_target_layers}, this target has {layers}")
    out_of_range = [i for i in draft_config.target_layer_ids if not 0 <= i < layers]
    if out_of_range:
        problems.append(f"target_layer_ids {out_of_range} out of range for {layers} layers")
    if emb_rows != draft_config.vocab_size:
        problems.append(f"vocab/embedding rows: draft vocab_size {draft_config.vocab_size}, "
                        f"target embedding has {emb_rows} rows")
    if head is not None and head.weight.shape[0] != draft_config.vocab_size:
        problems.append(f"LM head rows: draft vocab_size {draft_config.vocab_size}, target head has {head.weight.shape[0]}")
    if not 0 <= draft_config.mask_token_id < emb_rows:
        problems.append(f"mask_token_id {draft_config.mask_token_id} is not a row of the target's embedding ({emb_rows})")
    if problems:
        raise ValueError("draft and target are incompatible:\n  " + "\n  ".join(problems))
