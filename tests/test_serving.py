"""Serving an export (dflash.evaluation.serving): the fields vLLM and SGLang read, planted mismatches, the commands;
for DFlash, Domino, DFlash 2 and DSpark drafts."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from helpers import DFLASH2_HEAD, DOMINO_HEAD, TINY_MASK_ID, make_chat_target, make_tiny_target, tiny_config
from safetensors.torch import load_file, save_file

from dflash.cli.main import main
from dflash.embedded import EMBEDDED_MASK_TOKEN, EMBEDDED_MASK_TOKEN_TEXT
from dflash.evaluation.export import CONFIG_NAME, TRAINER_DRAFT_NAME, WEIGHTS_NAME, export_draft, load_exported
from dflash.evaluation.serving import (
    ENGINES,
    SERVING_FIELDS,
    SGLANG,
    SILENT_DEFAULTS,
    VLLM,
    check_serving_fields,
    engines_of,
    format_serving,
    num_draft_tokens,
    num_speculative_tokens,
    serving_commands,
    serving_fields,
)
from dflash.factory import build_draft
from dflash.kinds.dflash2 import DFlash2HeadConfig
from dflash.kinds.domino import DOMINO_POOL_FLAG, VLLM_DOMINO, DominoDraftModel, DominoHeadConfig
from dflash.kinds.dspark import DSparkHeadConfig
from dflash.kinds.record import DraftKind
from dflash.kinds.registry import DFLASH, DFLASH2, DOMINO, DSPARK, kind_of, kind_of_export
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.target_model.frozen import FrozenTarget

HUB_TARGET = "Qwen/Qwen3-8B"


@pytest.fixture(scope="module")
def target():
    return make_tiny_target()


def _draft(target, block_size: int = 16, domino: bool = False) -> DFlashDraftModel:
    extra = DominoHeadConfig(emb_dim=16, gru_hidden_dim=8, pure_draft_prefix_len=1, shift_label=True).to_extra()
    cfg = DFlashDraftConfig.for_target(target.config, mask_token_id=TINY_MASK_ID, num_hidden_layers=2,
                                       block_size=block_size, extra=extra if domino else {})
    torch.manual_seed(0)
    return (DominoDraftModel if domino else DFlashDraftModel)(cfg)


def _export(target, folder: Path, *, block_size: int = 16, domino: bool = False, trained_on: str = HUB_TARGET) -> Path:
    return export_draft(_draft(target, block_size, domino), folder, target=trained_on)


FAMILY = {DFLASH2: DFLASH2_HEAD, DSPARK: {"draft__kind": "dspark", "dspark__markov_rank": 8}}  # blocks of 4


def _family_export(target, kind: DraftKind, folder: Path, *, with_target_copies: bool = True) -> Path:
    """A tiny DFlash 2 or DSpark draft (tests/test_dflash2.py, tests/test_dspark.py), exported; a DSpark one with
    DeepSpec's copies of the target's embedding and LM head unless `with_target_copies` is false."""
    torch.manual_seed(0)
    draft = build_draft(tiny_config(**FAMILY[kind]), target, None)
    copies = target if kind == DSPARK and with_target_copies else None
    return export_draft(draft, folder, target=HUB_TARGET, target_model=copies)


@pytest.fixture(scope="module")
def exports(target, tmp_path_factory) -> dict[DraftKind, Path]:
    root = tmp_path_factory.mktemp("serving")
    return {**{kind: _export(target, root / kind.name, domino=kind == DOMINO) for kind in (DFLASH, DOMINO)},
            **{kind: _family_export(target, kind, root / kind.name) for kind in FAMILY}}


def _get(config: dict, path: str):
    for key in path.split("."):
        config = config[key]
    return config


# ---- (a) every field the engines read, with the meaning they give it ------------------------------------


@pytest.mark.parametrize("kind", [DFLASH, DOMINO], ids=lambda kind: kind.name)
def test_export_carries_every_field_the_engines_read(exports, kind):
    folder = exports[kind]
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert check_serving_fields(folder) == []
    for field in serving_fields(kind):
        if field.optional and not _has(config, field.path):
            continue
        value = _get(config, field.path)  # KeyError: the export lacks a field a loader reads
        assert isinstance(value, field.kind) and not (field.kind is int and isinstance(value, bool)), field.path
        assert field.ok is None or field.ok(value, config), f"{field.path} = {value!r}: {field.expect}"
        assert field.read_by and set(field.read_by) <= set(ENGINES), field.path
    ids = config["dflash_config"]["target_layer_ids"]
    # The meanings, spelled out once more by hand: vLLM's aux ids are the next layer's input, the mask is a
    # row of the shared vocabulary, the block is non-causal and one block is the verified token + proposals.
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
    assert 0 <= config["dflash_config"]["mask_token_id"] == TINY_MASK_ID < config["vocab_size"] == 128
    assert config["layer_types"] == ["full_attention"] * config["num_hidden_layers"]
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 16 and config["hidden_act"] == "silu" and config["attention_bias"] is False
    assert not any(_has(config, path) for path in SILENT_DEFAULTS)  # engines' defaults = the trained draft
    if kind == DOMINO:  # the table covers every Domino key the export writes
        domino_keys = {f.path.split(".")[-1] for f in DOMINO.serving.fields}
        assert domino_keys == set(DominoHeadConfig(1, 1, 1, True).to_extra())


@pytest.mark.parametrize("kind", list(FAMILY), ids=lambda kind: kind.name)
def test_dflash2_and_dspark_exports_carry_what_their_loaders_read(exports, kind):
    folder = exports[kind]
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert kind_of_export(config) == kind and check_serving_fields(folder) == []
    fields = serving_fields(kind)
    for field in (f for f in fields if not (f.optional and not _has(config, f.path))):
        value = _get(config, field.path)
        assert isinstance(value, field.kind) and not (field.kind is int and isinstance(value, bool)), field.path
        assert field.ok is None or field.ok(value, config), f"{field.path} = {value!r}: {field.expect}"
    # The table covers every head key the export writes, where the engines read it (DFlash 2: under dflash_config;
    # DSpark: top level, as DeepSpec writes and both DSpark parsers read).
    heads = {DFLASH2: {f"dflash_config.{k}" for k in DFlash2HeadConfig(1, 1, 1, 1).to_extra()},
             DSPARK: set(DSparkHeadConfig(1, "vanilla", True, True).to_extra())}
    assert heads[kind] <= {f.path for f in fields}
    # Both kinds keep one block size at both places SGLang looks, and the DFlash keys at DFlash's places.
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    if kind == DSPARK:  # DeepSpec's top-level copies agree with dflash_config (SGLang and vLLM read them in turn)
        assert (config["mask_token_id"], config["target_layer_ids"]) == (
            config["dflash_config"]["mask_token_id"], config["dflash_config"]["target_layer_ids"])
        assert config["sample_from_anchor"] is True and "dspark_bonus_anchor" not in config
        # DeepSpec's Qwen3DSparkModel asserts a top-level num_anchors: the anchors the draft was trained with
        assert config["num_anchors"] == tiny_config().draft.num_anchors == 8 and "num_anchors" not in config["dflash_config"]
    else:
        assert config["is_causal"] is False


def _has(config: dict, path: str) -> bool:
    try:
        _get(config, path)
    except (KeyError, TypeError):
        return False
    return True


def test_vllm_aux_ids_name_the_input_of_the_layer_after_each_trained_layer(exports, target):
    """What the draft was trained on (`FrozenTarget`: the output of layer i) is exactly what vLLM captures for
    the exported aux ids (aux id j: the hidden state entering decoder layer j)."""
    config = json.loads((exports[DFLASH] / CONFIG_NAME).read_text())
    ids, aux = config["dflash_config"]["target_layer_ids"], config["eagle_aux_hidden_state_layer_ids"]
    entering: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda m, args, kwargs, j=j: entering.__setitem__(j, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for j, layer in enumerate(target.model.layers)]
    tokens = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            target(tokens)
            features = FrozenTarget(target, ids)(tokens)
    finally:
        for h in hooks:
            h.remove()
    assert ids == [0, 2]  # both aux ids are layers of the 4-layer target
    torch.testing.assert_close(features, torch.cat([entering[j] for j in aux], dim=-1))


# ---- (b) planted mismatches: each one is named ---------------------------------------------------------


def _set(path: str, value):
    def plant(c: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            c = c[key]
        c[last] = value
    return plant


def _delete(path: str):
    def plant(c: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            c = c[key]
        del c[last]
    return plant


def _layers(ids: list[int]):
    def plant(c: dict) -> None:
        c["dflash_config"]["target_layer_ids"] = ids
        c["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    return plant


PLANTED = {  # case: (kind, plant, the start of the one problem reported)
    "mask token missing": (DFLASH, _delete("dflash_config.mask_token_id"), "dflash_config.mask_token_id: missing"),
    "mask token outside the vocabulary": (DFLASH, _set("dflash_config.mask_token_id", 128),
                                          "dflash_config.mask_token_id = 128: expected a row"),
    "mask token as text": (DFLASH, _set("dflash_config.mask_token_id", "127"),
                           "dflash_config.mask_token_id: '127' is not of JSON type int"),
    # SGLang's mask token text: optional (exports before it lack it), a non-empty string when present
    "mask token text as an id": (DFLASH, _set("dflash_config.mask_token", 127),
                                 "dflash_config.mask_token: 127 is not of JSON type str"),
    "mask token text empty": (DOMINO, _set("dflash_config.mask_token", ""),
                              "dflash_config.mask_token = '': expected a non-empty string (SGLang: "),
    "vLLM aux ids without the + 1": (DFLASH, _set("eagle_aux_hidden_state_layer_ids", [0, 2]),
                                     "eagle_aux_hidden_state_layer_ids = [0, 2]: expected dflash_config"),
    "vLLM aux ids missing": (DFLASH, _delete("eagle_aux_hidden_state_layer_ids"),
                             "eagle_aux_hidden_state_layer_ids: missing"),
    "target layers out of order": (DFLASH, _layers([2, 0]), "dflash_config.target_layer_ids = [2, 0]"),
    "target layer past the target's depth": (DFLASH, _layers([0, 4]), "dflash_config.target_layer_ids = [0, 4]"),
    "fewer target layers than fc was trained on": (DFLASH, _layers([2]), "fc.weight shape (64, 128)"),
    "block of one token": (DFLASH, _set("block_size", 1), "block_size = 1: expected >= 2"),
    "nested block size differing": (DFLASH, _set("dflash_config.block_size", 8),
                                    "dflash_config.block_size = 8 differs from block_size 16"),
    "causal draft layers": (DFLASH, _set("layer_types", ["sliding_attention"] * 2), "layer_types = ['sliding"),
    "causal override": (DFLASH, _set("dflash_config.causal", True), "dflash_config.causal = True"),
    "fc switched off": (DFLASH, _set("use_aux_hidden_state", False), "use_aux_hidden_state = False"),
    "another architecture": (DFLASH, _set("architectures", ["Qwen3ForCausalLM"]), "architectures = ['Qwen3"),
    "another activation": (DFLASH, _set("hidden_act", "gelu"), "hidden_act = 'gelu': expected silu"),
    "RoPE bases differing": (DFLASH, _set("rope_parameters.rope_theta", 1.0), "rope_parameters = "),
    "Domino prefix SGLang refuses": (DOMINO, _set("dflash_config.pure_draft_prefix_len", 2),
                                     "dflash_config.pure_draft_prefix_len = 2: expected 1"),
    "Domino shift_label not a bool": (DOMINO, _set("dflash_config.shift_label", 1),
                                      "dflash_config.shift_label: 1 is not of JSON type bool"),
    "Domino GRU width missing": (DOMINO, _delete("dflash_config.gru_hidden_dim"),
                                 "dflash_config.gru_hidden_dim: missing"),
    # The head's tensors under a config that does not name it: read as a DFlash draft, which vLLM would be given
    "Domino head without its projector_type": (DOMINO, _delete("dflash_config.projector_type"),
                                               "model.safetensors holds the Domino head (embed_proj.0.weight, "
                                               "embed_proj.2.weight, prefix_gru.weight_hh_l0, prefix_gru.weight_ih_l0) "
                                               "but dflash_config.projector_type is missing"),
    "Domino head under another projector_type": (DOMINO, _set("dflash_config.projector_type", "Domino"),
                                                 "model.safetensors holds the Domino head"),
    # DFlash 2: the conv and selector keys both engines read under dflash_config, and its explicit non-causality
    "DFlash 2 selector rank missing": (DFLASH2, _delete("dflash_config.selector_rank"),
                                       "dflash_config.selector_rank: missing"),
    "DFlash 2 conv wider than the block": (DFLASH2, _set("dflash_config.conv_kernel_size", 5),
                                           "dflash_config.conv_kernel_size = 5: expected in [1, block_size]"),
    "DFlash 2 conv groups not dividing hidden": (DFLASH2, _set("dflash_config.conv_group_size", 5),
                                                 "dflash_config.conv_group_size = 5: expected a divisor"),
    "DFlash 2 more candidates than tokens": (DFLASH2, _set("dflash_config.selector_top_k", 129),
                                             "dflash_config.selector_top_k = 129"),
    "DFlash 2 causality missing": (DFLASH2, _delete("is_causal"), "is_causal: missing"),
    "DFlash 2 made causal": (DFLASH2, _set("is_causal", True), "is_causal = True: expected false"),
    "DFlash 2 nested block differing": (DFLASH2, _set("dflash_config.block_size", 8),
                                        "dflash_config.block_size = 8 differs from block_size 4"),
    "DFlash 2 under the DFlash name": (DFLASH2, _set("architectures", ["DFlashDraftModel"]),
                                       "architectures = ['DFlashDraftModel']: expected to name DFlash2DraftModel"),
    # DSpark: its top-level head keys, DeepSpec's top-level copies and the layout keys vLLM / SGLang switch on
    "DSpark Markov rank missing": (DSPARK, _delete("markov_rank"), "markov_rank: missing"),
    "DSpark without DeepSpec's num_anchors": (DSPARK, _delete("num_anchors"),
                                              "num_anchors: missing (DeepSpec read it: anchors per sequence"),
    "DSpark num_anchors as text": (DSPARK, _set("num_anchors", "8"), "num_anchors: '8' is not of JSON type int"),
    "DSpark Markov rank zero": (DSPARK, _set("markov_rank", 0), "markov_rank = 0: expected positive"),
    "DSpark gated head": (DSPARK, _set("markov_head_type", "gated"), "markov_head_type = 'gated': expected vanilla"),
    "DSpark top-level mask differing": (DSPARK, _set("mask_token_id", 5),
                                        "mask_token_id = 5: expected dflash_config.mask_token_id"),
    "DSpark top-level layers differing": (DSPARK, _set("target_layer_ids", [1, 2]),
                                          "target_layer_ids = [1, 2]: expected dflash_config.target_layer_ids"),
    "DSpark with vLLM's bonus-anchor layout": (DSPARK, _set("dspark_bonus_anchor", True),
                                               "dspark_bonus_anchor = True: the draft was trained with False"),
    "DSpark in the speculators layout": (DSPARK, _set("speculators_model_type", "dspark"),
                                         "speculators_model_type = 'dspark'"),
    "DSpark under the DeepSeek-V4 class name": (DSPARK, _set("architectures", ["DSparkDraftModel"]),
                                                "architectures = ['DSparkDraftModel']: expected to name Qwen3DSpark"),
    "DSpark nested block differing": (DSPARK, _set("dflash_config.block_size", 7),
                                      "dflash_config.block_size = 7 differs from block_size 4"),
    "DSpark confidence head without its Markov input": (DSPARK, _set("confidence_head_with_markov", False),
                                                        "confidence_head.proj.weight shape (1, 72): both engines "
                                                        "build it as (1, 64)"),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_check_serving_fields_names_each_planted_mismatch(exports, tmp_path, case):
    kind, plant, expected = PLANTED[case]
    folder = Path(shutil.copytree(exports[kind], tmp_path / "export"))
    config = json.loads((folder / CONFIG_NAME).read_text())
    plant(config)
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    problems = check_serving_fields(folder)
    assert len(problems) == 1 and problems[0].startswith(expected), problems
    assert f"warning: {problems[0]}" in format_serving(folder).splitlines()  # `dflash export` prints it


# Tensors the engines build from the config and load without checking the file has them (SGLang skips unknown
# names; vLLM's AutoWeightsLoader leaves an absent parameter as allocated): a missing or reshaped one is named.
PLANTED_TENSORS = {  # case: (kind, tensor, None to drop it or the shape to write, the start of the one problem)
    "DFlash 2 successor codebook missing": (DFLASH2, "candidate_selector.successor_codebook", None,
                                            "candidate_selector.successor_codebook: missing from model.safetensors"),
    "DFlash 2 conv of the last layer missing": (DFLASH2, "layers.1.mlp_conv.base_kernel", None,
                                                "layers.1.mlp_conv.base_kernel: missing"),
    "DFlash 2 conv with another tap count": (DFLASH2, "layers.0.attention_conv.base_kernel", (2, 3, 64),
                                             "layers.0.attention_conv.base_kernel shape (2, 3, 64): both engines "
                                             "build it as (2, 2, 64)"),
    "DSpark Markov projection missing": (DSPARK, "markov_head.markov_w2.weight", None,
                                         "markov_head.markov_w2.weight: missing"),
    "DSpark confidence bias missing": (DSPARK, "confidence_head.proj.bias", None, "confidence_head.proj.bias: missing"),
    "DSpark Markov table of another rank": (DSPARK, "markov_head.markov_w1.weight", (128, 4),
                                            "markov_head.markov_w1.weight shape (128, 4): both engines build it as "
                                            "(128, 8)"),
}


@pytest.mark.parametrize("case", list(PLANTED_TENSORS))
def test_check_serving_fields_names_each_planted_tensor(exports, tmp_path, case):
    kind, name, shape, expected = PLANTED_TENSORS[case]
    folder = Path(shutil.copytree(exports[kind], tmp_path / "export"))
    state = load_file(str(folder / WEIGHTS_NAME))
    if shape is None:
        del state[name]
    else:
        state[name] = torch.zeros(shape, dtype=state[name].dtype)
    save_file(state, str(folder / WEIGHTS_NAME))
    problems = check_serving_fields(folder)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


# ---- (c) the commands -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [DFLASH, DOMINO, DFLASH2, DSPARK], ids=lambda kind: kind.name)
def test_the_commands_read_the_kind_and_counts_of_the_draft_the_export_loads_as(exports, kind):
    """The commands are worked out from config.json alone (`kind_of_export`, `DraftKind.proposals_per_block`): both
    must be what the export loads as (`kind_of` of its draft config, the draft's own `proposals_per_block`)."""
    config = json.loads((exports[kind] / CONFIG_NAME).read_text())
    draft, block = load_exported(exports[kind]), config["block_size"]
    assert kind_of_export(config) is kind_of(draft.config) is kind and isinstance(draft, kind.model)
    assert num_speculative_tokens(block, kind) == num_draft_tokens(block, kind) - 1 == draft.proposals_per_block(block)


@pytest.mark.parametrize("block_size", [8, 16])
def test_commands_name_the_folder_and_the_block(target, tmp_path, block_size):
    folder = _export(target, tmp_path / "export", block_size=block_size)
    commands = serving_commands(folder)
    vllm, sglang = shlex.split(commands[VLLM]), shlex.split(commands[SGLANG])
    assert vllm[:3] == ["vllm", "serve", HUB_TARGET] and vllm[3] == "--speculative-config" and len(vllm) == 5
    # vLLM queries 1 + num_speculative_tokens slots (the verified token, then the masks): one trained block.
    assert json.loads(vllm[4]) == {"method": "dflash", "model": str(folder.resolve()),
                                   "num_speculative_tokens": block_size - 1}
    flags = dict(zip(sglang[3::2], sglang[4::2], strict=True))
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    assert flags == {"--model-path": HUB_TARGET, "--speculative-algorithm": "DFLASH",
                     "--speculative-draft-model-path": str(folder.resolve()),
                     "--speculative-num-draft-tokens": str(block_size)}  # SGLang counts the whole block


def test_domino_gets_no_vllm_command_and_a_bf16_sglang_one(exports):
    commands = serving_commands(exports[DOMINO])
    assert set(commands) == {SGLANG}
    flags = dict(zip(*[iter(shlex.split(commands[SGLANG])[3:])] * 2, strict=True))
    # bf16 (SGLang's Domino runtime requires it), and the full vocabulary: SGLang's default top-2048 candidate pool
    # lowered tau 4.331 -> 4.032 on the same 10 prompts, and the note says so
    assert flags["--dtype"] == "bfloat16" and flags["--speculative-domino-candidate-pool-size"] == "0"
    assert DOMINO_POOL_FLAG == "--speculative-domino-candidate-pool-size 0"
    lines = format_serving(exports[DOMINO]).splitlines()
    # vLLM main has no Domino head (its doc claiming one is from the unmerged PR #47627): under a header naming
    # the vLLM sources checked, a line saying why, with the loader's commit; SGLang's command under its own header.
    name, checked = engines_of(DOMINO)[VLLM]
    header = lines.index(f"# {name} (checked against {checked})")
    assert "@036a00d1" in checked and "no Domino head" in checked
    assert lines[header + 1] == f"# not servable with vLLM: {VLLM_DOMINO}"
    assert all(s in VLLM_DOMINO for s in ("qwen3_dflash.py @036a00d1", "prefix_gru", "@331c781e", "PR #47627"))
    assert lines[lines.index(f"# SGLang (checked against {ENGINES[SGLANG][1]})") + 1] == commands[SGLANG]
    assert not any(line.startswith("vllm serve") for line in lines)
    notes = [line for line in lines if line.startswith("note: ")]
    assert any("an older one drops the Domino head silently" in n for n in notes)
    assert any("unmerged PRs (#47627 closed, #48241 open)" in n for n in notes)
    assert any(n.startswith(f"note: {DOMINO_POOL_FLAG}: ") and "4.331 to 4.032" in n and "top-2048" in n for n in notes)
    assert not any(line.startswith("warning") for line in lines)
    # and the table claims no vLLM reader for a Domino key
    assert not any(VLLM in f.read_by for f in DOMINO.serving.fields)


# What each engine's count means for the kind: DFlash 2 queries one trained block like DFlash (the bonus token, then
# block_size - 1 masks; its convs run over exactly that block), DSpark proposes from every slot (vLLM: N slots, the
# anchor and N - 1 masks, N = block_size; SGLang: gamma = block_size drafts plus the anchor verified).
FAMILY_LINES = {  # kind: (vLLM method, num_speculative_tokens, SGLang algorithm, --speculative-num-draft-tokens)
    DFLASH2: ("dflash", 3, "DFLASH", "4"),
    DSPARK: ("dspark", 4, "DSPARK", "5"),
}


@pytest.mark.parametrize("kind", list(FAMILY), ids=lambda kind: kind.name)
def test_dflash2_and_dspark_commands_carry_their_method_and_count(exports, target, tmp_path, kind):
    method, n_spec, algorithm, n_draft = FAMILY_LINES[kind]
    folder = exports[kind]
    commands = serving_commands(folder)
    vllm, sglang = shlex.split(commands[VLLM]), shlex.split(commands[SGLANG])
    assert vllm[:4] == ["vllm", "serve", HUB_TARGET, "--speculative-config"] and len(vllm) == 5
    assert json.loads(vllm[4]) == {"method": method, "model": str(folder.resolve()), "num_speculative_tokens": n_spec}
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    assert dict(zip(sglang[3::2], sglang[4::2], strict=True)) == {
        "--model-path": HUB_TARGET, "--speculative-algorithm": algorithm,
        "--speculative-draft-model-path": str(folder.resolve()), "--speculative-num-draft-tokens": n_draft}
    assert (num_speculative_tokens(4, kind), str(num_draft_tokens(4, kind))) == (n_spec, n_draft)
    # `dflash export` prints each line under a header naming the engine source checked for this kind
    lines = format_serving(folder).splitlines()
    for engine, (name, checked) in engines_of(kind).items():
        assert lines[lines.index(f"# {name} (checked against {checked})") + 1] == commands[engine]
    assert not any(line.startswith("warning") for line in lines) and "not servable" not in "\n".join(lines)
    assert engines_of(kind) != ENGINES  # not the DFlash loaders' header
    if kind == DSPARK:  # also without DeepSpec's target copies (SGLang skips them; vLLM shares the target's)
        plain = _family_export(target, kind, tmp_path / "plain", with_target_copies=False)
        assert check_serving_fields(plain) == [] and json.loads(shlex.split(serving_commands(plain)[VLLM])[4])[
            "num_speculative_tokens"] == 4
        assert "SGLang verifies block_size + 1" in "\n".join(lines)
    else:
        assert any("V2 model runner" in line for line in lines if line.startswith("note: "))


@pytest.mark.parametrize("kind", [DFLASH, DOMINO, DFLASH2, DSPARK], ids=lambda kind: kind.name)
def test_every_kind_names_sglang_the_text_of_its_mask_token(tokenizer, tmp_path, kind):
    """SGLang's DFlash worker resolves the mask by `dflash_config.mask_token` (default <|MASK|>: row 151,669 of a
    Qwen3 target, not the trained one, for an older worker that reads the text alone): each kind's export writes the
    target tokenizer's text of the trained id, which the tokenizer's vocabulary (SGLang's lookup) maps back to it, and
    the serving check reads it where SGLang does."""
    heads = {DFLASH: {}, DOMINO: DOMINO_HEAD, **FAMILY}[kind]
    draft = build_draft(tiny_config(**heads, draft__mask_token_id=EMBEDDED_MASK_TOKEN),
                        make_chat_target(tokenizer, num_layers=4), tokenizer)  # 4 layers: distinct default layer ids
    folder = export_draft(draft, tmp_path / kind.name, target="embedded")
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert kind_of_export(config) == kind and config["dflash_config"]["mask_token"] == EMBEDDED_MASK_TOKEN_TEXT
    assert tokenizer.get_vocab()[config["dflash_config"]["mask_token"]] == config["dflash_config"]["mask_token_id"]
    assert check_serving_fields(folder) == []
    field = next(f for f in serving_fields(kind) if f.path == "dflash_config.mask_token")  # StopIteration: not read
    assert field in SERVING_FIELDS and field.read_by == (SGLANG,) and field.optional  # exports before it still pass


def test_a_dspark_draft_without_confidence_head_is_served_with_a_note(target, tmp_path):
    torch.manual_seed(0)
    draft = build_draft(tiny_config(**FAMILY[DSPARK], dspark__enable_confidence_head=False), target, None)
    folder = export_draft(draft, tmp_path / "export", target=HUB_TARGET)
    assert check_serving_fields(folder) == [] and set(serving_commands(folder)) == {VLLM, SGLANG}
    assert "note: no confidence head: keep SGLANG_RAGGED_VERIFY_MODE=static" in format_serving(folder)


def test_targets_the_engines_cannot_load_as_recorded_become_a_variable(target, tmp_path, monkeypatch):
    local = tmp_path / "my target"
    local.mkdir()
    monkeypatch.chdir(tmp_path)
    folder = _export(target, tmp_path / "a", trained_on="my target")  # a relative path: made absolute, quoted
    assert shlex.split(serving_commands(folder)[VLLM])[2] == str(local.resolve())
    for trained_on, hint in (("embedded", "embedded_target_dir"), ("", "does not name its target")):
        folder = _export(target, tmp_path / f"b{trained_on}", trained_on=trained_on or None)
        assert all('"$TARGET"' in c for c in serving_commands(folder).values())
        assert hint in format_serving(folder)


# ---- (d) `dflash export` prints them --------------------------------------------------------------------


def test_dflash_export_prints_the_commands_for_its_folder(target, tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint-7"  # a DFlashHFTrainer checkpoint: config.json + the training weights
    draft = _draft(target)
    export_draft(draft, checkpoint, target=HUB_TARGET)
    save_file(draft.state_dict(), str(checkpoint / TRAINER_DRAFT_NAME))
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = serving_commands(tmp_path / "out")
    for engine, (name, checked) in ENGINES.items():
        header = lines.index(f"# {name} (checked against {checked})")
        assert lines[header + 1] == commands[engine]  # one pasteable line under its header
    assert str((tmp_path / "out").resolve()) in commands[VLLM] and not any(line.startswith("warning") for line in lines)
