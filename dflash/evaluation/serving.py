"""Serving an export: the vLLM and SGLang launch commands, and the config fields their loaders read.

Written from the engines' public source (read, not run here; `ENGINES`). A wrong value in these fields
rarely fails: the draft loads, training metrics were fine, serving acceptance is near zero (vLLM
#56792, vllm-ascend #11374). `SERVING_FIELDS` declares each field with the meaning the engines give
it, `check_serving_fields` checks an export against them, `dflash export` prints `format_serving`.

Block size: both engines draft one trained block per step (the last verified token, then the masks)
and propose block_size - 1 tokens: vLLM takes that count (`num_speculative_tokens`, never read from
the config), SGLang the block size (`--speculative-num-draft-tokens`, else the config's `block_size`).

Domino (`dflash_config.projector_type: domino`): vLLM's DFlash loader has no Domino head and refuses
the extra tensors (`AutoWeightsLoader`: "no module or parameter named"): no vLLM command. SGLang builds
with `speculative/domino_utils.py` read the head (strict `prefix_gru.*` / `embed_proj.*` loading, bf16,
`pure_draft_prefix_len` 1); older ones skip unknown tensor names and would serve the backbone alone.

DFlash 2 and DSpark exports get no command: their loaders (SGLang `DFlash2DraftModel` / `models/dspark.py`, vLLM
`qwen3_dflash2.py` / `qwen3_dspark.py`) were not checked here, so `dflash export` prints a note instead.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dflash.domino import PROJECTOR_TYPE
from dflash.evaluation.export import CONFIG_NAME, WEIGHTS_NAME, exported_folder

VLLM, SGLANG = "vllm", "sglang"
# Engine -> (name, the source the commands and SERVING_FIELDS were read from). Files: vLLM
# model_executor/models/qwen3_dflash.py @036a00d1, v1/spec_decode/dflash.py @01046b9a, config/speculative.py
# @002e77c1, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @0cfdd2e1 (method dflash: in 0.18.2 already); SGLang
# srt/models/dflash.py @7f151c5e, speculative/dflash_utils.py @00731f0b, speculative/dflash_worker.py
# @0468412f, arg_groups/speculative_hook.py @004c82e0, speculative/domino_utils.py @04d4c1ae.
ENGINES: dict[str, tuple[str, str]] = {
    VLLM: ("vLLM", "vllm-project/vllm main @036a00d1, the v0.29.0 DFlash loader"),
    SGLANG: ("SGLang", "sgl-project/sglang main @7f151c5e; Domino: domino_utils.py @04d4c1ae"),
}
BOTH = (VLLM, SGLANG)
TARGET_PLACEHOLDER = '"$TARGET"'  # a shell variable: the command stays pasteable, the note says what to set


@dataclass(frozen=True)
class ServingField:
    """One config.json field an engine's loader reads: `path` (dotted), its JSON type, the meaning the
    engines give it, the value rule (`ok`, described by `expect`) and which engines read it."""

    path: str
    kind: type | tuple[type, ...]
    meaning: str
    expect: str = "positive"
    ok: Callable[[Any, dict[str, Any]], bool] | None = lambda v, c: v > 0
    read_by: tuple[str, ...] = BOTH
    domino: bool = False  # read only for a Domino draft (SGLang)


def _tli(c: dict[str, Any]) -> list[int]:
    return c["dflash_config"]["target_layer_ids"]


SERVING_FIELDS: tuple[ServingField, ...] = (
    ServingField("architectures", list, "model class: vLLM's registry maps DFlashDraftModel to qwen3_dflash."
                 "DFlashQwen3ForCausalLM; SGLang's EntryClass of models/dflash.py", "to name DFlashDraftModel",
                 lambda v, c: "DFlashDraftModel" in v),
    ServingField("model_type", str, "the transformers config class both parse config.json with (Qwen3Config)",
                 expect="qwen3", ok=lambda v, c: v == "qwen3"),
    ServingField("hidden_size", int, "draft width = the target's: fc output, target embedding and LM head rows"),
    ServingField("num_hidden_layers", int, "draft decoder layers (and draft KV-cache layers)"),
    ServingField("num_attention_heads", int, "query heads of the draft attention"),
    ServingField("num_key_value_heads", int, "KV heads of the draft attention"),
    ServingField("head_dim", int, "per-head width (q_norm / k_norm size, RoPE dim)"),
    ServingField("intermediate_size", int, "MLP width (SGLang refuses <= 0)"),
    ServingField("rms_norm_eps", (int, float), "eps of every draft RMSNorm (hidden_norm, norm, layer norms)"),
    ServingField("vocab_size", int, "= the target's vocabulary: vLLM's draft_vocab_size (another size expects a d2t "
                 "map); SGLang's Domino head output size"),
    ServingField("rope_theta", (int, float), "RoPE base (SGLang get_rope_config; vLLM's default when "
                 "rope_parameters lacks it)"),
    ServingField("rope_parameters", dict, "RoPE of the draft's own q/k (vLLM get_rope(rope_parameters))",
                 "rope_theta equal to the top-level rope_theta", lambda v, c: v.get("rope_theta") == c["rope_theta"],
                 read_by=(VLLM,)),
    ServingField("max_position_embeddings", int, "rotary cache length; vLLM serves the draft up to min(this, the "
                 "target's max_model_len)"),
    ServingField("hidden_act", str, "MLP activation (SGLang refuses all but silu)", "silu", lambda v, c: v == "silu"),
    ServingField("attention_bias", bool, "q/k/v/o biases (the export has none)", "false", lambda v, c: v is False),
    ServingField("layer_types", list, "all full_attention = non-causal draft attention over the block (vLLM "
                 "_resolve_layer_attention; SGLang AttentionType.ENCODER_ONLY); sliding_attention = causal + SWA",
                 "one full_attention per draft layer",
                 lambda v, c: v == ["full_attention"] * c["num_hidden_layers"]),
    ServingField("block_size", int, "trained block: the verified token + block_size - 1 masks; SGLang's default "
                 "--speculative-num-draft-tokens; vLLM does not read it (num_speculative_tokens = block_size - 1)",
                 ">= 2 (one proposal at least)", lambda v, c: v >= 2, read_by=(SGLANG,)),
    ServingField("num_target_layers", int, "target depth the draft was trained on: SGLang's range check of "
                 "target_layer_ids", read_by=(SGLANG,)),
    ServingField("eagle_aux_hidden_state_layer_ids", list, "vLLM's captured layers: aux id j = the hidden state "
                 "entering target layer j; taken before dflash_config.target_layer_ids; len x hidden = fc input",
                 "dflash_config.target_layer_ids + 1", lambda v, c: v == [i + 1 for i in _tli(c)], read_by=(VLLM,)),
    ServingField("dflash_config.mask_token_id", int, "token whose target embedding fills the masked block slots "
                 "(vLLM parallel_drafting_token_id; SGLang refuses ids >= the target vocab)",
                 "a row of the vocabulary (0 <= id < vocab_size)", lambda v, c: 0 <= v < c["vocab_size"]),
    ServingField("dflash_config.target_layer_ids", list, "target layers whose output (HF hidden_states[i + 1]) "
                 "feeds fc, concatenated in this order; SGLang reads it (and captures before layer i + 1), vLLM "
                 "falls back to it (+ 1) without eagle_aux_hidden_state_layer_ids",
                 "non-empty, ascending (engines concatenate captures in layer order), < num_target_layers",
                 lambda v, c: bool(v) and v == sorted(set(v)) and 0 <= v[0] and v[-1] < c["num_target_layers"]),
    ServingField("dflash_config.projector_type", str, "domino: the draft carries the Domino correction head "
                 "(SGLang builds with domino_utils.py; vLLM refuses)", PROJECTOR_TYPE,
                 lambda v, c: v == PROJECTOR_TYPE, read_by=(SGLANG,), domino=True),
    ServingField("dflash_config.shift_label", bool, "which backbone slot proposes token j: slot j (true) or j + 1",
                 ok=None, read_by=(SGLANG,), domino=True),
    ServingField("dflash_config.pure_draft_prefix_len", int, "proposals left uncorrected at the block start",
                 "1 (SGLang refuses other values)", lambda v, c: v == 1, read_by=(SGLANG,), domino=True),
    ServingField("dflash_config.gru_hidden_dim", int, "width of prefix_gru (the head's causal state)",
                 read_by=(SGLANG,), domino=True),
    ServingField("dflash_config.emb_dim", int, "low-rank width of embed_proj", read_by=(SGLANG,), domino=True),
)
# Keys the export leaves out because the engines' defaults are its meaning; set otherwise, they silently
# change what is computed (non-causal attention, no SWA, fc on, rotate-half RoPE, one block size).
SILENT_DEFAULTS: dict[str, Any] = {
    "is_causal": False, "dflash_config.causal": False, "dflash_config.use_swa": False,
    "use_aux_hidden_state": True, "dflash_config.use_aux_hidden_state": True,
    "is_neox_style": True, "rope_is_neox_style": True,
}
_MISSING = object()


def _get(config: dict[str, Any], path: str) -> Any:
    value: Any = config
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _read(export_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    folder = exported_folder(export_dir)
    return folder.resolve(), json.loads((folder / CONFIG_NAME).read_text())


def is_domino_config(config: dict[str, Any]) -> bool:
    return _get(config, "dflash_config.projector_type") == PROJECTOR_TYPE


def is_dflash2_config(config: dict[str, Any]) -> bool:
    """A DFlash 2 export (`architectures: ["DFlash2DraftModel"]`): its loaders (SGLang's `DFlash2DraftModel`,
    PR #35371; vLLM's `qwen3_dflash2.py`, PR #52816) were not read for this table, so no command is given."""
    return "DFlash2DraftModel" in (config.get("architectures") or [])


def is_dspark_config(config: dict[str, Any]) -> bool:
    """A DSpark export (`architectures: ["Qwen3DSparkModel"]`, DeepSpec's shape): its loaders (SGLang's
    `models/dspark.py`, vLLM's `qwen3_dspark.py`) were not checked for this table, so no command is given."""
    return "Qwen3DSparkModel" in (config.get("architectures") or [])


def check_serving_fields(export_dir: str | Path) -> list[str]:
    """Every way the export's config.json differs from what the engines' loaders read (empty: none)."""
    folder, config = _read(export_dir)
    domino = is_domino_config(config)
    problems = []
    for field in SERVING_FIELDS:
        if field.domino and not domino:
            continue
        value, readers = _get(config, field.path), "/".join(ENGINES[e][0] for e in field.read_by)
        if value is _MISSING:
            problems.append(f"{field.path}: missing ({readers} read it: {field.meaning})")
        elif not isinstance(value, field.kind) or (field.kind is int and isinstance(value, bool)):
            problems.append(f"{field.path}: {value!r} is not of JSON type {getattr(field.kind, '__name__', 'number')}")
        elif field.ok is not None and not _holds(field.ok, value, config):
            problems.append(f"{field.path} = {value!r}: expected {field.expect} ({readers}: {field.meaning})")
    for path, default in SILENT_DEFAULTS.items():
        value = _get(config, path)
        if value is not _MISSING and value != default:
            problems.append(f"{path} = {value!r}: the draft was trained with {default!r} (leave it out)")
    nested = _get(config, "dflash_config.block_size")  # SGLang reads this one first
    if nested is not _MISSING and nested != config.get("block_size"):
        problems.append(f"dflash_config.block_size = {nested!r} differs from block_size {config.get('block_size')!r}")
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
        fc = tuple(f.get_slice("fc.weight").get_shape()) if "fc.weight" in f.keys() else None
    try:
        want = (config["hidden_size"], len(_tli(config)) * config["hidden_size"])
    except (KeyError, TypeError):
        want = None
    if want is not None and fc != want:
        problems.append(f"fc.weight shape {fc}: both engines build fc as {want} (len(target_layer_ids) x hidden)")
    return problems


def _holds(rule: Callable[[Any, dict[str, Any]], bool], value: Any, config: dict[str, Any]) -> bool:
    try:
        return bool(rule(value, config))
    except (KeyError, TypeError, IndexError):  # a field the rule compares with is itself broken (reported too)
        return False


def num_speculative_tokens(block_size: int) -> int:
    """vLLM's `num_speculative_tokens` for a draft trained with `block_size`: block_size - 1. vLLM's
    DFlashProposer (v1/spec_decode/dflash.py) queries `num_query_per_req = 1 + num_speculative_tokens`
    slots per request, the bonus token then `num_speculative_tokens` mask tokens: one trained block."""
    return block_size - 1


def num_draft_tokens(block_size: int) -> int:
    """SGLang's `--speculative-num-draft-tokens`: block_size itself. DFlashWorker (speculative/dflash_worker.py)
    fills `block_ids[:, 0]` with the bonus token and the other block_size - 1 slots with the mask, and
    `_handle_dflash` (arg_groups/speculative_hook.py) defaults it to the config's `block_size`."""
    return block_size


def _target(config: dict[str, Any]) -> tuple[str, str | None]:
    """The target argument of the commands, and a note when it is a placeholder."""
    target = _get(config, "dflash_config.target")
    if target == "embedded":
        return TARGET_PLACEHOLDER, ("the target is the embedded SmolLM2 (a GGUF the engines do not load): set "
                                    "TARGET=$(python -c 'from dflash.embedded import embedded_target_dir as d; "
                                    "print(d())') (its converted HF folder) first")
    if not isinstance(target, str) or not target:
        return TARGET_PLACEHOLDER, "the export does not name its target: set TARGET to the HF id or folder trained on"
    return shlex.quote(str(Path(target).resolve()) if Path(target).exists() else target), None


def serving_commands(export_dir: str | Path) -> dict[str, str]:
    """Engine -> a one-line launch command serving the export with its target; an engine that cannot serve
    the export faithfully (vLLM for a Domino draft) has no entry. The target is `dflash_config.target`."""
    folder, config = _read(export_dir)
    if is_dflash2_config(config) or is_dspark_config(config):
        return {}
    target, _ = _target(config)
    block = config.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool):
        raise ValueError(f"{folder / CONFIG_NAME} has no integer block_size ({block!r}): the commands need it")
    spec = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": num_speculative_tokens(block)})
    commands = {SGLANG: f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                        f"--speculative-draft-model-path {shlex.quote(str(folder))} "
                        f"--speculative-num-draft-tokens {num_draft_tokens(block)}"}
    if is_domino_config(config):
        commands[SGLANG] += " --dtype bfloat16"  # SGLang's Domino runtime requires bf16 (validate_domino_runtime)
    else:
        # method given explicitly: vLLM guesses "dflash" only from a model path containing "dflash"
        commands = {VLLM: f"vllm serve {target} --speculative-config {shlex.quote(spec)}", **commands}
    return commands


def format_serving(export_dir: str | Path) -> str:
    """The text `dflash export` prints: per engine one header line (engine, what it was checked against)
    and its command, or why there is none; then notes and any `check_serving_fields` problems."""
    _, config = _read(export_dir)
    if is_dflash2_config(config):  # nothing printed that was not checked against the engines' loaders
        return ("Serving (block_size {}): a DFlash 2 draft. Its launch lines are not checked against the engines' "
                "DFlash 2 loaders yet (SGLang DFlash2DraftModel, vLLM qwen3_dflash2.py); vLLM's "
                "num_speculative_tokens would be block_size - 1.".format(config.get("block_size")))
    if is_dspark_config(config):
        return ("Serving (block_size {}): a DSpark draft (DeepSpec's Qwen3DSparkModel shape). Its launch lines are not "
                "checked against the engines' DSpark loaders yet (SGLang models/dspark.py, vLLM qwen3_dspark.py); every "
                "slot proposes, so one block verifies block_size drafts (SGLang's dspark_config.py: "
                "speculative_num_draft_tokens = block_size + 1).".format(config.get("block_size")))
    commands = serving_commands(export_dir)
    lines = ["Serve it (block_size {}):".format(config.get("block_size"))]
    for engine, (name, checked) in ENGINES.items():
        lines.append(f"# {name} (checked against {checked})")
        lines.append(commands.get(engine) or f"# not servable with {name}: its DFlash loader has no Domino head "
                     "(prefix_gru/embed_proj) and refuses the export")
    notes = [_target(config)[1]]
    if is_domino_config(config):
        notes.append("SGLang needs a build with Domino support (python/sglang/srt/speculative/domino_utils.py); "
                     "an older one drops the Domino head silently and serves the backbone alone")
    lines += [f"note: {n}" for n in notes if n]
    lines += [f"warning: {p}" for p in check_serving_fields(export_dir)]
    return "\n".join(lines)
