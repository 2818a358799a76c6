"""Offline target features: written equal to the live target's, resumable to the same bytes, refused when
they do not match, read back and padded like the token batches; the trunk-free OfflineTarget."""

from __future__ import annotations

import copy
import json
import shutil
from collections import namedtuple
from pathlib import Path

import datasets
import pytest
import torch
from helpers import make_tiny_target
from transformers import LlamaConfig, LlamaForCausalLM

import dflash.data.features as features_module
import dflash.target_model.offline as offline_module
from dflash.data.feature_data import FeatureCollator, FeatureDataset, check_manifest, read_manifest
from dflash.data.features import MANIFEST, PARTIAL, estimate_bytes, write_features
from dflash.data.loader import Collator
from dflash.data.tokenization import check_token_absent
from dflash.run.state import data_fingerprint
from dflash.target_model.frozen import FrozenTarget
from dflash.target_model.offline import OfflineTarget, load_head_and_embedding

LAYERS = [0, 2]
MAX_LENGTH = 24


@pytest.fixture(scope="module")
def target(target):
    """helpers' tiny target, as the FrozenTarget of LAYERS that writes the features."""
    return FrozenTarget(target, LAYERS)


def make_rows(n: int = 7, seed: int = 0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i in range(n):
        length = 5 + (7 * i) % 23 + (10 if i == 3 else 0)  # row 3 is longer than MAX_LENGTH: cut
        ids.append(torch.randint(0, 120, (length,), generator=g).tolist())
        masks.append([0] * 3 + [1] * (length - 3))
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})


def write(target, tokenizer, out, **kw):
    settings = {"tokenizer": tokenizer, "dtype": "float32", "max_length": MAX_LENGTH, "labels": True,
                "shard_rows": 3, "batch_size": 2, "progress": False}
    settings.update(kw)
    return write_features(target, "tiny", settings.pop("rows", make_rows()), out, **settings)


@pytest.fixture(scope="module")
def written(target, tokenizer, tmp_path_factory):
    return write(target, tokenizer, tmp_path_factory.mktemp("features") / "feats")


def expected_settings(target, tokenizer, **overrides):
    settings = {"target_name": "tiny", "target_config": target.text_config, "layer_ids": LAYERS,
                "dtype": "float32", "tokenizer": tokenizer, "max_length": MAX_LENGTH, "labels": True}
    settings.update(overrides)
    return settings


def test_features_equal_the_live_targets(target, written):
    rows = make_rows()
    data = FeatureDataset(written)
    assert len(data) == len(rows) and data.feature_dim == 2 * target.hidden_size
    for i in range(len(rows)):
        ids = torch.tensor(rows[i]["input_ids"][:MAX_LENGTH])
        feats, greedy = target.features_and_greedy(ids[None])
        row = data[i]
        assert torch.equal(row["input_ids"], ids)
        assert torch.equal(row["loss_mask"], torch.tensor(rows[i]["loss_mask"][:MAX_LENGTH]).bool())
        # written in padded batches of 2: the same values up to the matmul shapes' rounding
        torch.testing.assert_close(row["features"], feats[0], rtol=0, atol=1e-5)
        assert torch.equal(row["labels"], greedy[0])
    header = read_manifest(written)["header"]
    assert header["num_rows"] == len(rows) and header["layer_ids"] == LAYERS and header["labels"]
    assert [s["rows"] for s in read_manifest(written)["shards"]] == [[0, 3], [3, 6], [6, 7]]


def test_features_one_row_at_a_time_are_exactly_the_live_targets(target, tokenizer, tmp_path):
    rows = make_rows()
    data = FeatureDataset(write(target, tokenizer, tmp_path / "single", batch_size=1))
    for i in range(len(rows)):
        ids = torch.tensor(rows[i]["input_ids"][:MAX_LENGTH])
        feats, greedy = target.features_and_greedy(ids[None])
        assert torch.equal(data[i]["features"], feats[0]) and torch.equal(data[i]["labels"], greedy[0])
        assert torch.equal(data[i]["features"], target(ids[None])[0])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_interrupted_write_resumes_to_the_same_bytes(target, tokenizer, written, tmp_path):
    out = tmp_path / "resumed"
    write(target, tokenizer, out, stop_after_shards=1)  # stopped after the first shard
    assert (out / PARTIAL).is_file() and not (out / MANIFEST).exists()
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.safetensors"]

    def crash(k: int) -> None:  # a crash after shard 1 is recorded
        if k == 1:
            raise KeyboardInterrupt

    before = (out / "shard-00000.safetensors").stat().st_mtime_ns
    with pytest.raises(KeyboardInterrupt):
        write(target, tokenizer, out, on_shard=crash)
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == before  # kept, not rewritten
    (out / "shard-00002.safetensors").write_bytes(b"half a shard")  # a torn write of the next shard
    write(target, tokenizer, out)
    got, want = _files(out), _files(written)
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []
    assert write(target, tokenizer, out) == out and _files(out) == _files(written)  # complete: left as is


def test_settings_of_an_unfinished_run_must_match(target, tokenizer, tmp_path):
    out = tmp_path / "other"
    write(target, tokenizer, out, stop_after_shards=1)
    with pytest.raises(ValueError, match="max_length"):
        write(target, tokenizer, out, max_length=MAX_LENGTH - 4)


def test_a_matching_folder_passes(target, tokenizer, written):
    manifest = check_manifest(written, **expected_settings(target, tokenizer), target=target)
    assert manifest["header"]["feature_dim"] == 2 * target.hidden_size
    check_manifest(written, **expected_settings(target, tokenizer, labels=False))  # labels not needed: fine


def _other_tokenizer(tokenizer):
    other = copy.deepcopy(tokenizer)
    other.chat_template = "{{ messages }}"
    return other


@pytest.mark.parametrize("what, overrides, expected", [
    ("target", {"target_name": "other"}, "another target: expected 'other', found 'tiny'"),
    ("config", {"target_config": make_tiny_target(num_layers=3).config}, "another target config"),
    ("layer ids", {"layer_ids": [0, 1]}, "layer ids: expected [0, 1], found [0, 2]"),
    ("dtype", {"dtype": torch.bfloat16}, "dtype: expected bfloat16, found float32"),
    ("max length", {"max_length": 32}, "max length: expected 32, found 24"),
    ("tokenizer", {"tokenizer": "other"}, "another tokenizer: expected fingerprint"),
])
def test_mismatched_settings_are_refused(target, tokenizer, written, what, overrides, expected):
    other = overrides.pop("tokenizer", None) == "other"
    settings = expected_settings(target, tokenizer, **overrides)
    if other:
        settings["tokenizer"] = _other_tokenizer(tokenizer)
    with pytest.raises(ValueError, match="dflash features CONFIG") as info:
        check_manifest(written, **settings)
    assert expected in str(info.value)


def test_other_weights_and_missing_labels_are_refused(target, tokenizer, written, tmp_path):
    other = FrozenTarget(make_tiny_target(seed=1), LAYERS)
    with pytest.raises(ValueError, match=r"embedding / LM head"):
        check_manifest(written, **expected_settings(target, tokenizer), target=other)
    out = write(target, tokenizer, tmp_path / "nolabels", labels=False)
    with pytest.raises(ValueError, match="expected labels included, found no labels"):
        check_manifest(out, **expected_settings(target, tokenizer))
    assert "labels" not in FeatureDataset(out)[0]


@pytest.mark.parametrize("damage, expected", [
    ("missing", "shard-00001.safetensors is missing"),
    ("truncated", "is truncated or changed: expected"),
    ("corrupted", "is corrupted: expected sha256"),
    ("unfinished", "an unfinished feature run"),
])
def test_damaged_shards_are_refused(target, tokenizer, written, tmp_path, damage, expected):
    out = tmp_path / "copy"
    shutil.copytree(written, out)
    shard = out / "shard-00001.safetensors"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "corrupted":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        (out / MANIFEST).rename(out / PARTIAL)
    with pytest.raises(ValueError, match="dflash features CONFIG") as info:
        check_manifest(out, **expected_settings(target, tokenizer))
    assert expected in str(info.value)


def test_too_little_disk_is_refused_with_the_numbers(target, tokenizer, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    tokens = sum(min(len(r), MAX_LENGTH) for r in make_rows()["input_ids"])
    needed = estimate_bytes(tokens, 2 * target.hidden_size, "float32", True)
    with pytest.raises(OSError, match=f"{needed} bytes .* needed .* 1000 bytes .* free"):
        write(target, tokenizer, tmp_path / "full")
    assert not list((tmp_path / "full").glob("shard-*"))


def test_size_per_token(target, written):
    header = read_manifest(written)["header"]
    size = sum(p.stat().st_size for p in written.glob("shard-*"))
    estimate = estimate_bytes(header["num_tokens"], header["feature_dim"], "float32", True)
    assert estimate <= size < estimate + 3 * 1024  # three shard headers and offsets on top
    assert estimate / header["num_tokens"] == 2 * target.hidden_size * 4 + 9


def test_collate_pads_features_to_the_collators_length(written):
    data = FeatureDataset(written)
    collator = Collator(pad_token_id=5, bucket_multiple=8, max_length=MAX_LENGTH, anchor_widths=[2, 4, 8])
    rows = [data[i] for i in (0, 1, 2)]
    batch = FeatureCollator(collator)(rows)
    tokens_only = collator([{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows])
    seq = tokens_only["input_ids"].shape[1]
    assert batch["features"].shape == (3, seq, data.feature_dim) and batch["labels"].shape == (3, seq)
    assert torch.equal(batch["input_ids"], tokens_only["input_ids"])
    assert torch.equal(batch["loss_mask"], tokens_only["loss_mask"])
    assert batch["num_anchors"] == tokens_only["num_anchors"]
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        assert torch.equal(batch["features"][b, :n], row["features"])
        assert not batch["features"][b, n:].any()
        assert torch.equal(batch["labels"][b, :n], row["labels"]) and (batch["labels"][b, n:] == 5).all()
    assert all(v.device.type == "cpu" for v in batch.values() if torch.is_tensor(v))


def _save_llama(path: Path, tied: bool, sharded: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=128, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size="50KB" if sharded else "10GB")
    return model


@pytest.mark.parametrize("tied, sharded", [(False, False), (True, False), (False, True), (True, True)])
def test_offline_target_reads_only_the_embedding_and_head(tmp_path, monkeypatch, tied, sharded):
    model = _save_llama(tmp_path / "model", tied, sharded)
    assert (tmp_path / "model" / "model.safetensors.index.json").is_file() == sharded
    read: list[str] = []
    real_open = offline_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(offline_module, "safe_open", Recording)
    offline = OfflineTarget.from_pretrained(str(tmp_path / "model"), [0, 1], torch.float32)
    assert sorted(read) == (["model.embed_tokens.weight"] if tied else ["lm_head.weight", "model.embed_tokens.weight"])
    live = FrozenTarget(model, [0, 1])
    assert torch.equal(offline.embed_weight, live.embed_weight)
    assert torch.equal(offline.lm_head_weight, live.lm_head_weight)
    assert (offline.lm_head_weight is offline.embed_weight) == tied
    assert offline.hidden_size == live.hidden_size and offline.vocab_size == live.vocab_size
    assert offline.text_config.num_hidden_layers == 2 and offline.layer_ids == [0, 1]
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(offline.embed(ids), live.embed(ids))
    with pytest.raises(RuntimeError, match="no trunk"):
        offline(ids)
    embed, head, config = load_head_and_embedding(str(tmp_path / "model"), torch.bfloat16)
    assert embed.dtype == head.dtype == torch.bfloat16 and config.tie_word_embeddings == tied


def test_feature_rows_load_in_dataloader_workers(written):
    loader = torch.utils.data.DataLoader(FeatureDataset(written), batch_size=3, num_workers=1,
                                         collate_fn=FeatureCollator(Collator(0, 8, MAX_LENGTH)))
    batches = list(loader)
    assert sum(b["input_ids"].shape[0] for b in batches) == 7
    assert json.loads((written / MANIFEST).read_text())["header"]["dtype"] == "float32"



def test_token_checks_read_no_features(written, monkeypatch):
    """The mask-token check and the data fingerprint read a feature row's tokens only (a large corpus's
    features would otherwise be read once more at every start)."""
    data = FeatureDataset(written)
    read: list[str] = []
    shard = data._shard

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def get_slice(self, key):
            read.append(key)
            return self.inner.get_slice(key)

    monkeypatch.setattr(data, "_shard", lambda k: Recording(shard(k)))
    data_fingerprint(data)
    check_token_absent(data, 127, None)
    assert set(read) == {"input_ids", "loss_mask"}
    assert set(data[0]) == {"input_ids", "loss_mask", "features", "labels"} and data[0]["features"].shape[0] == 5
