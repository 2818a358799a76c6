"""Serving an export: the vLLM and SGLang launch commands, and the config fields their loaders read.

Written from the engines' public source (read, not run here; `ENGINES`). A wrong value in these fields
rarely fails: the draft loads, training metrics were fine, serving acceptance is near zero (vLLM
#56792, vllm-ascend #11374). `SERVING_FIELDS` declares each field with the meaning the engines give
it, `check_serving_fields` checks an export against them, `dflash export` prints `format_serving`.

Block size: both engines draft one trained block per step (the last verified token, then the masks)
and propose block_size - 1 tokens: vLLM takes that count (`num_speculative_tokens`, never read from
the config), SGLang the block size (`--speculative-num-draft-tokens`, else the config's `block_size`).

Domino (`dflash_config.projector_type: domino`): no vLLM command. vLLM main has no Domino head: its DFlash loader
(`qwen3_dflash.py` @036a00d1) loads `prefix_gru.*` / `embed_proj.*` as `model.*` and `AutoWeightsLoader` refuses them
("no module or parameter named"), and `"method": "dflash"` builds the plain `DFlashSpeculator` (@01af92e1, @00746147).
vLLM's `docs/features/speculative_decoding/dflash.md` @331c781e, which says vLLM loads Domino drafts, comes from PR
#47627, closed unmerged (`VLLM_DOMINO`). SGLang builds with `speculative/domino_utils.py` read the head (strict
`prefix_gru.*` / `embed_proj.*` loading, bf16, `pure_draft_prefix_len` 1); older ones skip unknown tensor names and
would serve the backbone alone. Head tensors under a config without `projector_type: domino` are reported. SGLang's
command sets `DOMINO_POOL_FLAG`: its default candidate pool scores 2048 base-logit candidates, not the vocabulary.

DFlash 2 (`DFlash2DraftModel`) rides both engines' DFlash path (vLLM `"method": "dflash"`, SGLang `DFLASH`), with the
DFlash counts: the convs run over one block, vLLM's of 1 + num_speculative_tokens query tokens, SGLang's of
--speculative-num-draft-tokens, so both must be the trained block. DSpark (`Qwen3DSparkModel`) has its own method
(vLLM `"method": "dspark"`, SGLang `DSPARK`) and every slot proposes: vLLM queries num_speculative_tokens = block_size
slots (the anchor, then masks, each predicting the next token), SGLang verifies gamma + 1 = block_size + 1 tokens.
Their extra fields and tensors are checked too (`FAMILY_ENGINES` names the sources).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dflash.evaluation.export import CONFIG_NAME, WEIGHTS_NAME, exported_folder
from dflash.kinds.dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from dflash.kinds.domino import DOMINO_WEIGHT_NAMES, PROJECTOR_TYPE
from dflash.kinds.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE

VLLM, SGLANG, DEEPSPEC = "vllm", "sglang", "deepspec"  # DeepSpec: DSpark's reference code, a reader, not an engine
DFLASH, DOMINO, DFLASH2, DSPARK = "dflash", "domino", "dflash2", "dspark"  # draft kinds (`draft_kind`)
KINDS = (DFLASH, DOMINO, DFLASH2, DSPARK)
# Engine -> (name, the source the commands and SERVING_FIELDS were read from). Files: vLLM
# model_executor/models/qwen3_dflash.py @036a00d1, v1/spec_decode/dflash.py @01046b9a, config/speculative.py
# @002e77c1, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @0cfdd2e1 (method dflash: in 0.18.2 already); SGLang
# srt/models/dflash.py @7f151c5e, speculative/dflash_utils.py @00731f0b, speculative/dflash_worker.py
# @0468412f, arg_groups/speculative_hook.py @004c82e0, speculative/domino_utils.py @04d4c1ae. Domino on vLLM:
# qwen3_dflash.py @036a00d1, v1/worker/gpu/spec_decode/__init__.py @01af92e1, dflash/speculator.py @47bd6d7c and
# @00746147, config/speculative.py @47bd6d7c: no Domino head, dispatch or method; docs/.../dflash.md @331c781e (PR #47627).
ENGINES: dict[str, tuple[str, str]] = {
    VLLM: ("vLLM", "vllm-project/vllm main @036a00d1, the v0.29.0 DFlash loader"),
    SGLANG: ("SGLang", "sgl-project/sglang main @7f151c5e; Domino: domino_utils.py @04d4c1ae"),
}
# The same for DFlash 2 and DSpark drafts. DSpark: vLLM @47bd6d7c model_executor/models/qwen3_dspark.py,
# v1/worker/gpu/spec_decode/dspark/speculator.py, .../dflash/speculator.py, .../spec_decode/utils.py,
# config/speculative.py (eagle3_utils.py @0cfdd2e1); SGLang @37e23874 srt/models/dspark.py, speculative/dspark_components/
# dspark_config.py @01f47623, arg_groups/speculative_hook.py @004c82e0, speculative/dflash_utils.py @00731f0b. DFlash 2:
# vLLM model_executor/models/qwen3_dflash2.py and v1/worker/gpu/spec_decode/dflash2/speculator.py @030da624 (PR
# #52816; the index holds no copy at @47bd6d7c); SGLang srt/models/dflash.py `DFlash2DraftModel` (PR #35371, a
# stored version the index names no commit of), dflash_utils.py @00731f0b, speculative/dflash_worker_v2.py @0057abea.
FAMILY_ENGINES: dict[str, dict[str, tuple[str, str]]] = {
    DOMINO: {VLLM: ("vLLM", "vllm-project/vllm qwen3_dflash.py @036a00d1, dflash/speculator.py @47bd6d7c and "
                            "@00746147: no Domino head"),
             SGLANG: ENGINES[SGLANG]},
    DFLASH2: {VLLM: ("vLLM", "vllm-project/vllm qwen3_dflash2.py + dflash2/speculator.py @030da624, PR #52816"),
              SGLANG: ("SGLang", "sgl-project/sglang DFlash2DraftModel, PR #35371: dflash_utils.py @00731f0b, "
                                 "dflash_worker_v2.py @0057abea")},
    DSPARK: {VLLM: ("vLLM", "vllm-project/vllm @47bd6d7c: qwen3_dspark.py, dspark/speculator.py, config/speculative.py"),
             SGLANG: ("SGLang", "sgl-project/sglang @37e23874: models/dspark.py; dspark_config.py @01f47623, "
                                "speculative_hook.py @004c82e0")},
}
# Why vLLM gets no Domino line (module doc): what vLLM main lacks, and where the doc saying otherwise comes from.
VLLM_DOMINO = ("vLLM main has no Domino head: qwen3_dflash.py @036a00d1 loads prefix_gru.* / embed_proj.* as model.* "
               "and AutoWeightsLoader refuses them; dflash.md @331c781e (Domino under method dflash) is from PR #47627, "
               "closed unmerged")
BOTH = (VLLM, SGLANG)
READERS = {VLLM: "vLLM", SGLANG: "SGLang", DEEPSPEC: "DeepSpec"}  # who reads a field (`ServingField.read_by`)
# SGLang's Domino default scores a block-shared top-2048 pool of base logits, not the vocabulary the draft was trained
# over: on the same 10 prompts it lowered tau 4.331 -> 4.032 (issue 50), so the command asks for the full vocabulary.
DOMINO_POOL_FLAG = "--speculative-domino-candidate-pool-size 0"
TARGET_PLACEHOLDER = '"$TARGET"'  # a shell variable: the command stays pasteable, the note says what to set


@dataclass(frozen=True)
class ServingField:
    """One config.json field an engine's loader reads: `path` (dotted), its JSON type, the meaning the
    engines give it, the value rule (`ok`, described by `expect`), which engines read it (`READERS`), for which
    draft kinds (`KINDS`), and whether an export may leave it out (`optional`: checked only when present)."""

    path: str
    kind: type | tuple[type, ...]
    meaning: str
    expect: str = "positive"
    ok: Callable[[Any, dict[str, Any]], bool] | None = lambda v, c: v > 0
    read_by: tuple[str, ...] = BOTH
    kinds: tuple[str, ...] = KINDS
    optional: bool = False


def _tli(c: dict[str, Any]) -> list[int]:
    return c["dflash_config"]["target_layer_ids"]


def _arch(name: str, *kinds: str, meaning: str) -> ServingField:
    return ServingField("architectures", list, meaning, f"to name {name}", lambda v, c: name in v, kinds=kinds)


SERVING_FIELDS: tuple[ServingField, ...] = (
    _arch("DFlashDraftModel", DFLASH, DOMINO, meaning="model class: vLLM's registry maps DFlashDraftModel to "
          "qwen3_dflash.DFlashQwen3ForCausalLM; SGLang's EntryClass of models/dflash.py"),
    _arch(DFLASH2_ARCHITECTURE, DFLASH2, meaning="model class: vLLM's registry maps it to qwen3_dflash2."
          "DFlash2Qwen3ForCausalLM (and picks DFlash2Speculator, the V2 runner); SGLang's EntryClass of models/dflash.py"),
    _arch(DSPARK_ARCHITECTURE, DSPARK, meaning="model class: vLLM's registry maps it to qwen3_dspark."
          "Qwen3DSparkForCausalLM (and guesses method dspark from it); SGLang's EntryClass of models/dspark.py"),
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
    ServingField("dflash_config.projector_type", str, "domino: the draft carries the Domino correction head "
                 "(SGLang builds with domino_utils.py; vLLM main has none and refuses it)", PROJECTOR_TYPE,
                 lambda v, c: v == PROJECTOR_TYPE, read_by=(SGLANG,), kinds=(DOMINO,)),
    ServingField("dflash_config.shift_label", bool, "which backbone slot proposes token j: slot j (true) or j + 1",
                 ok=None, read_by=(SGLANG,), kinds=(DOMINO,)),
    ServingField("dflash_config.pure_draft_prefix_len", int, "proposals left uncorrected at the block start",
                 "1 (SGLang refuses other values)", lambda v, c: v == 1, read_by=(SGLANG,), kinds=(DOMINO,)),
    ServingField("dflash_config.gru_hidden_dim", int, "width of prefix_gru (the head's causal state)",
                 read_by=(SGLANG,), kinds=(DOMINO,)),
    ServingField("dflash_config.emb_dim", int, "low-rank width of embed_proj", read_by=(SGLANG,), kinds=(DOMINO,)),
    ServingField("dflash_config.block_size", int, "read before block_size: DFlash 2's conv block (SGLang, until "
                 "--speculative-num-draft-tokens overrides it), DSpark's gamma (the proposals of one block)",
                 ">= 2", lambda v, c: v >= 2, read_by=(SGLANG,), kinds=(DFLASH2, DSPARK)),
    ServingField("is_causal", bool, "causality of the draft attention, read before layer_types (both engines): "
                 "false = non-causal over the block, as trained", "false", lambda v, c: v is False, kinds=(DFLASH2,)),
    ServingField("dflash_config.conv_kernel_size", int, "taps T of every attention_conv / mlp_conv (base_kernel "
                 "[2, T, H]); the taps stay inside one block", "in [1, block_size]",
                 lambda v, c: 1 <= v <= c["block_size"], kinds=(DFLASH2,)),
    ServingField("dflash_config.conv_group_size", int, "channels g sharing one dynamic tap coefficient "
                 "(kernel_projection rows 2 T H / g)", "a divisor of hidden_size",
                 lambda v, c: v > 0 and c["hidden_size"] % v == 0, kinds=(DFLASH2,)),
    ServingField("dflash_config.selector_rank", int, "rank r of the candidate selector (codebooks [V, r], "
                 "hidden_projection [r, H])", kinds=(DFLASH2,)),
    ServingField("dflash_config.selector_top_k", int, "candidates per slot: the top-k of the target head's logits",
                 "in [1, vocab_size]", lambda v, c: 1 <= v <= c["vocab_size"], kinds=(DFLASH2,)),
    ServingField("markov_rank", int, "rank r of the Markov head (markov_w1 / markov_w2 [V, r]); both refuse 0",
                 kinds=(DSPARK,)),
    ServingField("markov_head_type", str, "SGLang builds a vanilla, gated or rnn head from it (vLLM only vanilla)",
                 "vanilla", lambda v, c: v == "vanilla", read_by=(SGLANG,), kinds=(DSPARK,)),
    ServingField("confidence_head_with_markov", bool, "confidence head input: [h ; markov_w1[previous]] (true) or h",
                 ok=None, kinds=(DSPARK,)),
    ServingField("enable_confidence_head", bool, "whether confidence_head.proj.* are in the file (SGLang warns when "
                 "absent; it and vLLM load the head only for adaptive verification)", ok=None, read_by=(SGLANG,),
                 kinds=(DSPARK,)),
    ServingField("mask_token_id", int, "SGLang's DSpark parser reads it before dflash_config.mask_token_id, vLLM "
                 "after it", "dflash_config.mask_token_id", lambda v, c: v == c["dflash_config"]["mask_token_id"],
                 kinds=(DSPARK,)),
    ServingField("target_layer_ids", list, "DeepSpec's key: vLLM's last fallback (+ 1) for the captured layers",
                 "dflash_config.target_layer_ids", lambda v, c: v == _tli(c), read_by=(VLLM,), kinds=(DSPARK,)),
    ServingField("num_anchors", int, "anchors per sequence the draft was trained with (draft.num_anchors): DeepSpec's "
                 "Qwen3DSparkModel asserts it (deepspec/modeling/dspark/qwen3/modeling.py @5905deb7); no engine reads "
                 "it", read_by=(DEEPSPEC,), kinds=(DSPARK,)),
)
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


def is_domino_config(config: dict[str, Any]) -> bool:
    return _get(config, "dflash_config.projector_type") == PROJECTOR_TYPE


def is_dflash2_config(config: dict[str, Any]) -> bool:
    """A DFlash 2 export (`architectures: ["DFlash2DraftModel"]`)."""
    return DFLASH2_ARCHITECTURE in (config.get("architectures") or [])


def is_dspark_config(config: dict[str, Any]) -> bool:
    """A DSpark export (`architectures: ["Qwen3DSparkModel"]`, DeepSpec's shape)."""
    return DSPARK_ARCHITECTURE in (config.get("architectures") or [])


def draft_kind(config: dict[str, Any]) -> str:
    """`DSPARK`, `DFLASH2`, `DOMINO` or `DFLASH`: from the architecture, or the head keys under another one (whose
    fields are then checked against the kind the keys say, so a wrong architecture is named as such)."""
    if is_dspark_config(config) or "markov_rank" in config:
        return DSPARK
    if is_dflash2_config(config) or _get(config, "dflash_config.selector_rank") is not _MISSING:
        return DFLASH2
    return DOMINO if is_domino_config(config) else DFLASH


def engines_for(config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Engine -> (name, the source checked) for this export's kind."""
    return FAMILY_ENGINES.get(draft_kind(config), ENGINES)


def check_serving_fields(export_dir: str | Path) -> list[str]:
    """Every way the export differs from what the engines' loaders read (empty: none): its config.json fields
    (`SERVING_FIELDS`, `SILENT_DEFAULTS`) and the shapes of the tensors they build from them (`_built_shapes`)."""
    folder, config = _read(export_dir)
    kind = draft_kind(config)
    problems, fields = [], [f for f in SERVING_FIELDS if kind in f.kinds]
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
    head, projector = sorted(DOMINO_WEIGHT_NAMES & set(shapes)), _get(config, "dflash_config.projector_type")
    if head and kind != DOMINO:  # the engines pick the Domino head by projector_type alone
        problems.append(f"{WEIGHTS_NAME} holds the Domino head ({', '.join(head)}) but dflash_config.projector_type "
                        f"is {'missing' if projector is _MISSING else repr(projector)}, not {PROJECTOR_TYPE!r}: "
                        "SGLang builds no head from it, vLLM main refuses the tensors")
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


def _built_shapes(config: dict[str, Any], kind: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor -> (the shape the engines build it with from config.json, from what): fc, and the DFlash 2 / DSpark
    tensors, which the engines load without checking that the file has them."""
    c = config
    try:
        h, v = c["hidden_size"], c["vocab_size"]
        built = {"fc.weight": ((h, len(_tli(c)) * h), "len(target_layer_ids) x hidden")}
        if kind == DFLASH2:
            d = c["dflash_config"]
            t, r = d["conv_kernel_size"], d["selector_rank"]
            conv = {"base_kernel": ((2, t, h), "2 sides x conv_kernel_size x hidden"),
                    "kernel_projection.weight": ((2 * t * (h // d["conv_group_size"]), h), "2 T H / g x hidden")}
            built |= {f"layers.{i}.{m}.{p}": s for i in range(c["num_hidden_layers"])
                      for m in ("attention_conv", "mlp_conv") for p, s in conv.items()}
            built |= {f"candidate_selector.{b}_codebook": ((v, r), "vocab x selector_rank") for b in ("predecessor",
                                                                                                      "successor")}
            built["candidate_selector.hidden_projection.weight"] = ((r, h), "selector_rank x hidden")
        if kind == DSPARK:
            r = c["markov_rank"]
            built |= {f"markov_head.markov_w{i}.weight": ((v, r), "vocab x markov_rank") for i in (1, 2)}
            if c["enable_confidence_head"]:
                width = h + (r if c["confidence_head_with_markov"] else 0)
                built["confidence_head.proj.weight"] = ((1, width), "1 x (hidden + markov_rank with markov)")
                built["confidence_head.proj.bias"] = ((1,), "one logit")
    except (KeyError, TypeError):  # a field the fields do not cover is broken: nothing to compare with
        return {}
    return built


def _holds(rule: Callable[[Any, dict[str, Any]], bool], value: Any, config: dict[str, Any]) -> bool:
    try:
        return bool(rule(value, config))
    except (KeyError, TypeError, IndexError):  # a field the rule compares with is itself broken (reported too)
        return False


def num_speculative_tokens(block_size: int, kind: str = DFLASH) -> int:
    """vLLM's `num_speculative_tokens` for a draft trained with `block_size`. DFlash (and DFlash 2): block_size - 1;
    DFlashSpeculator queries `1 + num_speculative_tokens` slots per request, the bonus token then that many mask
    tokens: one trained block (DFlash 2's conv block is that 1 + N). DSpark: block_size; DSparkSpeculator queries
    N = num_speculative_tokens slots (the anchor, then N - 1 masks), each proposing the next token."""
    return block_size if kind == DSPARK else block_size - 1


def num_draft_tokens(block_size: int, kind: str = DFLASH) -> int:
    """SGLang's `--speculative-num-draft-tokens`. DFlash (and DFlash 2): block_size itself; DFlashWorker fills
    `block_ids[:, 0]` with the bonus token and the other block_size - 1 slots with the mask, and `_handle_dflash`
    defaults it to the config's `block_size`. DSpark: block_size + 1; `_handle_dspark` requires gamma + 1 (the
    anchor + gamma drafts verified), gamma being the config's block_size."""
    return block_size + 1 if kind == DSPARK else block_size


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
    kind = draft_kind(config)
    target, _ = _target(config)
    block = config.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool):
        raise ValueError(f"{folder / CONFIG_NAME} has no integer block_size ({block!r}): the commands need it")
    # method given explicitly: vLLM guesses "dflash" only from a model path containing "dflash"
    spec = json.dumps({"method": DSPARK if kind == DSPARK else DFLASH, "model": str(folder),
                       "num_speculative_tokens": num_speculative_tokens(block, kind)})
    commands = {VLLM: f"vllm serve {target} --speculative-config {shlex.quote(spec)}",
                SGLANG: f"python -m sglang.launch_server --model-path {target} --speculative-algorithm "
                        f"{'DSPARK' if kind == DSPARK else 'DFLASH'} --speculative-draft-model-path "
                        f"{shlex.quote(str(folder))} --speculative-num-draft-tokens {num_draft_tokens(block, kind)}"}
    if kind == DOMINO:
        del commands[VLLM]
        commands[SGLANG] += " --dtype bfloat16"  # SGLang's Domino runtime requires bf16 (validate_domino_runtime)
        commands[SGLANG] += f" {DOMINO_POOL_FLAG}"  # the vocabulary the draft was trained over (DOMINO_POOL_FLAG)
    return commands


def _notes(config: dict[str, Any], kind: str) -> list[str | None]:
    notes = [_target(config)[1]]
    if kind == DOMINO:
        notes.append("SGLang needs a build with Domino support (python/sglang/srt/speculative/domino_utils.py); "
                     "an older one drops the Domino head silently and serves the backbone alone")
        notes.append(f"{DOMINO_POOL_FLAG}: SGLang's default scores a top-2048 candidate pool of base logits instead of "
                     "the whole vocabulary the draft was trained over; on the same 10 prompts it lowered tau from 4.331 "
                     "to 4.032")
        notes.append("vLLM has Domino only in unmerged PRs (#47627 closed, #48241 open), not checked here: #47627 "
                     "drafts token 0 at step pure_draft_prefix_len and #48241 leaves that step uncorrected, while "
                     "dflash trains every proposal from pure_draft_prefix_len on corrected")
    if kind == DFLASH2:
        notes += ["vLLM needs a build with DFlash 2 (PR #52816: DFlash2DraftModel in its registry, served by the V2 "
                  "model runner it selects for one), SGLang one with PR #35371; an older one refuses the export",
                  "the selector takes its candidates from the target's LM head: vLLM needs it unquantized, SGLang "
                  "dense or of a quantization it can apply; the convs run over one block of the counts above"]
    if kind == DSPARK:
        notes.append("every slot proposes: vLLM drafts num_speculative_tokens = block_size tokens from the anchor "
                     "and block_size - 1 masks, SGLang verifies block_size + 1 (the anchor and block_size drafts)")
        if config.get("enable_confidence_head") is False:
            notes.append("no confidence head: keep SGLANG_RAGGED_VERIFY_MODE=static (the default) and vLLM's "
                         "adaptive_verification off, both of which need one")
    return notes


def format_serving(export_dir: str | Path) -> str:
    """The text `dflash export` prints: per engine one header line (engine, what it was checked against)
    and its command, or why there is none; then notes and any `check_serving_fields` problems."""
    _, config = _read(export_dir)
    kind = draft_kind(config)
    commands = serving_commands(export_dir)
    lines = ["Serve it (block_size {}{}):".format(config.get("block_size"), {DFLASH2: "; a DFlash 2 draft",
                                                                              DSPARK: "; a DSpark draft"}.get(kind, ""))]
    for engine, (name, checked) in engines_for(config).items():
        lines.append(f"# {name} (checked against {checked})")
        lines.append(commands.get(engine) or f"# not servable with {name}: {VLLM_DOMINO}")
    lines += [f"note: {n}" for n in _notes(config, kind) if n]
    lines += [f"warning: {p}" for p in check_serving_fields(export_dir)]
    return "\n".join(lines)
