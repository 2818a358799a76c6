"""Serving an export: the vLLM and SGLang launch commands, and the config fields their loaders read.

Written from the engines' public source (read, not run here; `ENGINES`). A wrong value in these fields
rarely fails: the draft loads, training metrics were fine, serving acceptance is near zero (vLLM
#56792, vllm-ascend #11374). `serving_fields` declares each field with the meaning the engines give
it, `check_serving_fields` checks an export against them, `dflash export` prints `format_serving`.

Block size: both engines draft one trained block per step (the last verified token, then the masks)
and propose block_size - 1 tokens: vLLM takes that count (`num_speculative_tokens`, never read from
the config), SGLang the block size (`--speculative-num-draft-tokens`, else the config's `block_size`).

What differs by draft kind is the kind's record (`dflash.kinds.record.DraftKind`, its "export and serving" group),
found from the export's config.json (`kind_of_export`); the engine facts behind each are cited in the kind's module:
its architecture, method, counts (`DraftKind.proposals_per_block`), extra flags, fields (`Serving.fields`),
tensors built from them (`built_shapes`), notes, and the sources checked (`engines_of`). Domino
(`dflash_config.projector_type: domino`) has no vLLM command (`dflash.kinds.domino.VLLM_DOMINO`) and its SGLang
command sets `domino.DOMINO_POOL_FLAG`; head tensors under a config without `projector_type: domino` are reported
(`Serving.stray_weights`). DFlash 2 (`DFlash2DraftModel`) rides both engines' DFlash path with the DFlash counts;
DSpark (`Qwen3DSparkModel`) has its own method and every slot proposes (vLLM num_speculative_tokens = block_size,
SGLang verifies block_size + 1).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dflash.evaluation.export import CONFIG_NAME, WEIGHTS_NAME, exported_folder
from dflash.kinds.record import DEEPSPEC, SGLANG, VLLM, DraftKind, ServingField
from dflash.kinds.registry import KINDS, kind_of_export

# Engine -> (name, the source the commands and SERVING_FIELDS were read from). Files: vLLM
# model_executor/models/qwen3_dflash.py @036a00d1, v1/spec_decode/dflash.py @01046b9a, config/speculative.py
# @002e77c1, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @0cfdd2e1 (method dflash: in 0.18.2 already); SGLang
# srt/models/dflash.py @7f151c5e, speculative/dflash_utils.py @00731f0b, speculative/dflash_worker.py
# @0468412f, arg_groups/speculative_hook.py @004c82e0, speculative/domino_utils.py @04d4c1ae. A kind whose engines
# read other sources names them (`Serving.vllm_source` / `sglang_source`, `engines_of`).
ENGINES: dict[str, tuple[str, str]] = {
    VLLM: ("vLLM", "vllm-project/vllm main @036a00d1, the v0.29.0 DFlash loader"),
    SGLANG: ("SGLang", "sgl-project/sglang main @7f151c5e; Domino: domino_utils.py @04d4c1ae"),
}
READERS = {VLLM: "vLLM", SGLANG: "SGLang", DEEPSPEC: "DeepSpec"}  # who reads a field (`ServingField.read_by`)
TARGET_PLACEHOLDER = '"$TARGET"'  # a shell variable: the command stays pasteable, the note says what to set


def _tli(c: dict[str, Any]) -> list[int]:
    return c["dflash_config"]["target_layer_ids"]


# The fields every export carries, whatever its kind (`serving_fields` adds the architecture and the kind's own).
SERVING_FIELDS: tuple[ServingField, ...] = (
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
                 "map); SGLang's Domino head output size; DFlash 2 codebook and DSpark Markov rows"),
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
                 "--speculative-num-draft-tokens (DSpark: its gamma, + 1); vLLM does not read it",
                 ">= 2 (one proposal at least)", lambda v, c: v >= 2, read_by=(SGLANG,)),
    ServingField("num_target_layers", int, "target depth the draft was trained on: SGLang's range check of "
                 "target_layer_ids", read_by=(SGLANG,)),
    ServingField("eagle_aux_hidden_state_layer_ids", list, "vLLM's captured layers: aux id j = the hidden state "
                 "entering target layer j; taken before dflash_config.target_layer_ids; len x hidden = fc input",
                 "dflash_config.target_layer_ids + 1", lambda v, c: v == [i + 1 for i in _tli(c)], read_by=(VLLM,)),
    ServingField("dflash_config.mask_token_id", int, "token whose target embedding fills the masked block slots "
                 "(vLLM parallel_drafting_token_id; SGLang refuses ids >= the target vocab)",
                 "a row of the vocabulary (0 <= id < vocab_size)", lambda v, c: 0 <= v < c["vocab_size"]),
    ServingField("dflash_config.mask_token", str, "the mask token's text: SGLang's DFlash worker refuses one the "
                 "target tokenizer maps to another id than mask_token_id (dflash_worker.py @0468412f), an older one "
                 "takes the mask row from it alone (default <|MASK|>: row 151,669 of a Qwen3 target, not the trained "
                 "one); exports before it was written lack it", "a non-empty string", lambda v, c: bool(v),
                 read_by=(SGLANG,), optional=True),
    ServingField("dflash_config.target_layer_ids", list, "target layers whose output (HF hidden_states[i + 1]) "
                 "feeds fc, concatenated in this order; SGLang reads it (and captures before layer i + 1), vLLM "
                 "falls back to it (+ 1) without eagle_aux_hidden_state_layer_ids",
                 "non-empty, ascending (engines concatenate captures in layer order), < num_target_layers",
                 lambda v, c: bool(v) and v == sorted(set(v)) and 0 <= v[0] and v[-1] < c["num_target_layers"]),
)
# Written by the kinds whose readers take the block size from dflash_config first (`ExportLayout.nested_block_size`).
NESTED_BLOCK_SIZE = ServingField("dflash_config.block_size", int, "read before block_size: DFlash 2's conv block "
                                 "(SGLang, until --speculative-num-draft-tokens overrides it), DSpark's gamma (the "
                                 "proposals of one block)", ">= 2", lambda v, c: v >= 2, read_by=(SGLANG,))


def serving_fields(kind: DraftKind) -> tuple[ServingField, ...]:
    """The config.json fields the engines read from an export of `kind`: its architecture, every export's
    (`SERVING_FIELDS`), `dflash_config.block_size` where it writes one, then its own (`Serving.fields`)."""
    architecture = ServingField("architectures", list, kind.serving.architecture_meaning, f"to name {kind.export.architecture}",
                                lambda v, c: kind.export.architecture in v)
    return (architecture, *SERVING_FIELDS, *((NESTED_BLOCK_SIZE,) if kind.export.nested_block_size else ()), *kind.serving.fields)


# Keys the export leaves out because the engines' defaults are its meaning; set otherwise, they silently
# change what is computed (non-causal attention, no SWA, fc on, rotate-half RoPE, one block size; DSpark: the
# anchor proposes (vLLM's 1 + N layout otherwise), DeepSpec's slots (speculators' one-early slots otherwise)).
SILENT_DEFAULTS: dict[str, Any] = {
    "is_causal": False, "dflash_config.causal": False, "dflash_config.use_swa": False,
    "use_aux_hidden_state": True, "dflash_config.use_aux_hidden_state": True,
    "is_neox_style": True, "rope_is_neox_style": True,
    "sample_from_anchor": True, "dspark_bonus_anchor": False, "speculators_model_type": None,
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


def engines_of(kind: DraftKind) -> dict[str, tuple[str, str]]:
    """Engine -> (name, the source checked) for an export of `kind`: `ENGINES`, with the kind's own sources where it
    names them."""
    return {VLLM: (ENGINES[VLLM][0], kind.serving.vllm_source or ENGINES[VLLM][1]),
            SGLANG: (ENGINES[SGLANG][0], kind.serving.sglang_source or ENGINES[SGLANG][1])}


def check_serving_fields(export_dir: str | Path) -> list[str]:
    """Every way the export differs from what the engines' loaders read (empty: none): its config.json fields
    (`serving_fields`, `SILENT_DEFAULTS`) and the shapes of the tensors they build from them (`_built_shapes`)."""
    folder, config = _read(export_dir)
    kind = kind_of_export(config)
    problems, fields = [], serving_fields(kind)
    for field in fields:
        value, readers = _get(config, field.path), "/".join(READERS[e] for e in field.read_by)
        if value is _MISSING and field.optional:
            continue
        if value is _MISSING:
            problems.append(f"{field.path}: missing ({readers} read it: {field.meaning})")
        elif not isinstance(value, field.kind) or (field.kind is int and isinstance(value, bool)):
            problems.append(f"{field.path}: {value!r} is not of JSON type {getattr(field.kind, '__name__', 'number')}")
        elif field.ok is not None and not _holds(field.ok, value, config):
            problems.append(f"{field.path} = {value!r}: expected {field.expect} ({readers}: {field.meaning})")
    fields_ok = not problems  # the built shapes below come from these fields
    for path, default in SILENT_DEFAULTS.items():
        value = _get(config, path)
        if value is not _MISSING and value != default and path not in {f.path for f in fields}:
            problems.append(f"{path} = {value!r}: the draft was trained with {default!r} (leave it out)")
    nested = _get(config, "dflash_config.block_size")  # SGLang reads this one first
    if nested is not _MISSING and nested != config.get("block_size"):
        problems.append(f"dflash_config.block_size = {nested!r} differs from block_size {config.get('block_size')!r}")
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    for other in KINDS:  # another kind's head under this config: the engines pick a head by the config alone
        if other is not kind and (stray := other.serving.stray_weights(config, set(shapes))) is not None:
            problems.append(f"{WEIGHTS_NAME} holds {stray}")
    for name, (want, why) in (_built_shapes(config, kind) if fields_ok else {}).items():
        got = shapes.get(name)
        if name == "fc.weight" and got != want:
            problems.append(f"fc.weight shape {got}: both engines build fc as {want} (len(target_layer_ids) x hidden)")
        elif got is None:
            problems.append(f"{name}: missing from {WEIGHTS_NAME} (both engines build it as {want}: {why}; "
                            "neither refuses a file without it)")
        elif got != want:
            problems.append(f"{name} shape {got}: both engines build it as {want} ({why})")
    return problems


def _built_shapes(config: dict[str, Any], kind: DraftKind) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor -> (the shape the engines build it with from config.json, from what): fc, and the kind's tensors
    that the engines load without checking that the file has them (`Serving.built_shapes`)."""
    try:
        h = config["hidden_size"]
        return {"fc.weight": ((h, len(_tli(config)) * h), "len(target_layer_ids) x hidden"), **kind.serving.built_shapes(config)}
    except (KeyError, TypeError):  # a field the fields do not cover is broken: nothing to compare with
        return {}


def _holds(rule: Callable[[Any, dict[str, Any]], bool], value: Any, config: dict[str, Any]) -> bool:
    try:
        return bool(rule(value, config))
    except (KeyError, TypeError, IndexError):  # a field the rule compares with is itself broken (reported too)
        return False


def num_speculative_tokens(block_size: int, kind: DraftKind) -> int:
    """vLLM's `num_speculative_tokens` for a draft of `kind` trained with `block_size`: the proposals of one block
    (`DraftKind.proposals_per_block`). DFlash (and DFlash 2): block_size - 1; DFlashSpeculator queries
    `1 + num_speculative_tokens` slots per request, the bonus token then that many mask tokens: one trained block
    (DFlash 2's conv block is that 1 + N). DSpark: block_size; DSparkSpeculator queries N = num_speculative_tokens
    slots (the anchor, then N - 1 masks), each proposing the next token."""
    return kind.proposals_per_block(block_size)


def num_draft_tokens(block_size: int, kind: DraftKind) -> int:
    """SGLang's `--speculative-num-draft-tokens`: the proposals of one block and the token before them. DFlash (and
    DFlash 2): block_size itself; DFlashWorker fills `block_ids[:, 0]` with the bonus token and the other
    block_size - 1 slots with the mask, and `_handle_dflash` defaults it to the config's `block_size`. DSpark:
    block_size + 1; `_handle_dspark` requires gamma + 1 (the anchor + gamma drafts verified), gamma being the
    config's block_size."""
    return kind.proposals_per_block(block_size) + 1


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
    the export faithfully (vLLM for a Domino draft: `Serving.vllm_unservable`) has no entry. The target is
    `dflash_config.target`."""
    folder, config = _read(export_dir)
    kind = kind_of_export(config)
    target, _ = _target(config)
    block = config.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool):
        raise ValueError(f"{folder / CONFIG_NAME} has no integer block_size ({block!r}): the commands need it")
    # method given explicitly: vLLM guesses "dflash" only from a model path containing "dflash"
    spec = json.dumps({"method": kind.serving.vllm_method, "model": str(folder),
                       "num_speculative_tokens": num_speculative_tokens(block, kind)})
    vllm = f"vllm serve {target} --speculative-config {shlex.quote(spec)}"
    sglang = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {kind.serving.sglang_algorithm} "
              f"--speculative-draft-model-path {shlex.quote(str(folder))} --speculative-num-draft-tokens "
              f"{num_draft_tokens(block, kind)}" + "".join(f" {flag}" for flag in kind.serving.sglang_flags))
    return {**({VLLM: vllm} if kind.serving.vllm_unservable is None else {}), SGLANG: sglang}


def format_serving(export_dir: str | Path) -> str:
    """The text `dflash export` prints: per engine one header line (engine, what it was checked against)
    and its command, or why there is none; then notes and any `check_serving_fields` problems."""
    _, config = _read(export_dir)
    kind = kind_of_export(config)
    commands = serving_commands(export_dir)
    lines = ["Serve it (block_size {}{}):".format(config.get("block_size"),
                                                 f"; a {kind.title} draft" if kind.serving.titled else "")]
    for engine, (name, checked) in engines_of(kind).items():
        lines.append(f"# {name} (checked against {checked})")
        lines.append(commands.get(engine) or f"# not servable with {name}: {kind.serving.vllm_unservable}")
    lines += [f"note: {n}" for n in [_target(config)[1], *kind.serving.notes(config)] if n]
    lines += [f"warning: {p}" for p in check_serving_fields(export_dir)]
    return "\n".join(lines)
