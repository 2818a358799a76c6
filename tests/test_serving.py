"""Serving an export (dflash.evaluation.serving): the fields vLLM and SGLang read, planted mismatches, the commands."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY_MASK_ID, make_tiny_target
from dflash.cli.main import main
from dflash.domino import DominoDraftModel, DominoHeadConfig
from dflash.evaluation.export import CONFIG_NAME, TRAINER_DRAFT_NAME, export_draft
from dflash.evaluation.serving import (
    ENGINES,
    SERVING_FIELDS,
    SGLANG,
    SILENT_DEFAULTS,
    VLLM,
    check_serving_fields,
    format_serving,
    serving_commands,
)
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.target.frozen import FrozenTarget

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


@pytest.fixture(scope="module")
def exports(target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving")
    return {kind: _export(target, root / kind, domino=kind == "domino") for kind in ("dflash", "domino")}


def _get(config: dict, path: str):
    for key in path.split("."):
        config = config[key]
    return config


# ---- (a) every field the engines read, with the meaning they give it ------------------------------------


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_export_carries_every_field_the_engines_read(exports, kind):
    folder = exports[kind]
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert check_serving_fields(folder) == []
    for field in SERVING_FIELDS:
        if field.domino and kind != "domino":
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
    if kind == "domino":  # the table covers every Domino key the export writes
        domino_keys = {f.path.split(".")[-1] for f in SERVING_FIELDS if f.domino}
        assert domino_keys == set(DominoHeadConfig(1, 1, 1, True).to_extra())


def _has(config: dict, path: str) -> bool:
    try:
        _get(config, path)
    except (KeyError, TypeError):
        return False
    return True


def test_vllm_aux_ids_name_the_input_of_the_layer_after_each_trained_layer(exports, target):
    """What the draft was trained on (`FrozenTarget`: the output of layer i) is exactly what vLLM captures for
    the exported aux ids (aux id j: the hidden state entering decoder layer j)."""
    config = json.loads((exports["dflash"] / CONFIG_NAME).read_text())
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
    "mask token missing": ("dflash", _delete("dflash_config.mask_token_id"), "dflash_config.mask_token_id: missing"),
    "mask token outside the vocabulary": ("dflash", _set("dflash_config.mask_token_id", 128),
                                          "dflash_config.mask_token_id = 128: expected a row"),
    "mask token as text": ("dflash", _set("dflash_config.mask_token_id", "127"),
                           "dflash_config.mask_token_id: '127' is not of JSON type int"),
    "vLLM aux ids without the + 1": ("dflash", _set("eagle_aux_hidden_state_layer_ids", [0, 2]),
                                     "eagle_aux_hidden_state_layer_ids = [0, 2]: expected dflash_config"),
    "vLLM aux ids missing": ("dflash", _delete("eagle_aux_hidden_state_layer_ids"),
                             "eagle_aux_hidden_state_layer_ids: missing"),
    "target layers out of order": ("dflash", _layers([2, 0]), "dflash_config.target_layer_ids = [2, 0]"),
    "target layer past the target's depth": ("dflash", _layers([0, 4]), "dflash_config.target_layer_ids = [0, 4]"),
    "fewer target layers than fc was trained on": ("dflash", _layers([2]), "fc.weight shape (64, 128)"),
    "block of one token": ("dflash", _set("block_size", 1), "block_size = 1: expected >= 2"),
    "nested block size differing": ("dflash", _set("dflash_config.block_size", 8),
                                    "dflash_config.block_size = 8 differs from block_size 16"),
    "causal draft layers": ("dflash", _set("layer_types", ["sliding_attention"] * 2), "layer_types = ['sliding"),
    "causal override": ("dflash", _set("dflash_config.causal", True), "dflash_config.causal = True"),
    "fc switched off": ("dflash", _set("use_aux_hidden_state", False), "use_aux_hidden_state = False"),
    "another architecture": ("dflash", _set("architectures", ["Qwen3ForCausalLM"]), "architectures = ['Qwen3"),
    "another activation": ("dflash", _set("hidden_act", "gelu"), "hidden_act = 'gelu': expected silu"),
    "RoPE bases differing": ("dflash", _set("rope_parameters.rope_theta", 1.0), "rope_parameters = "),
    "Domino prefix SGLang refuses": ("domino", _set("dflash_config.pure_draft_prefix_len", 2),
                                     "dflash_config.pure_draft_prefix_len = 2: expected 1"),
    "Domino shift_label not a bool": ("domino", _set("dflash_config.shift_label", 1),
                                      "dflash_config.shift_label: 1 is not of JSON type bool"),
    "Domino GRU width missing": ("domino", _delete("dflash_config.gru_hidden_dim"),
                                 "dflash_config.gru_hidden_dim: missing"),
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


# ---- (c) the commands -----------------------------------------------------------------------------------


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
    commands = serving_commands(exports["domino"])
    assert set(commands) == {SGLANG} and commands[SGLANG].endswith("--dtype bfloat16")
    text = format_serving(exports["domino"])
    assert "# not servable with vLLM: its DFlash loader has no Domino head" in text
    assert "an older one drops the Domino head silently" in text and "warning" not in text


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
