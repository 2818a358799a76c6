"""A `datasets` save_to_disk folder, and a hub dataset already in the local cache, as `data.source` (issue 53):
read as datasets and through the same row checks as files, through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest

from dflash.cli.main import main


def _rows(data: Path) -> list[dict]:
    return [json.loads(line) for line in data.read_text().splitlines()]


def _args(target: Path, source: Path | str, out: Path, *extra: str) -> list[str]:
    return ["train", f"target={target}", f"data.source={source}", f"output_dir={out}", "device=cpu",
            "draft.mask_token_id=16", "draft.block_size=4", "draft.num_anchors=8", "batch_size=4",
            "data.max_length=64", "data.bucket_multiple=32", "data.eval_size=8", "data.regenerate=false",
            "data.num_workers=0", "spec_eval_prompts=0", "export_on_finish=false", f"data.cache_dir={out}/cache",
            *extra]


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("dflash train: error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_saved_dataset_trains_with_its_bad_rows_counted(tiny_target_dir, conversations_file, tmp_path, capsys):
    """Issue 53: a `Dataset.save_to_disk` folder failed as "38 malformed JSON lines (dataset_info.json)"."""
    rows = _rows(conversations_file) + [{"messages": [{"role": "user", "content": "a question left unanswered"}]}]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    capsys.readouterr()
    assert main(_args(tiny_target_dir, saved, tmp_path / "dry", "--dry-run")) == 0
    captured = capsys.readouterr()
    assert "of 40 in the source" in captured.out  # the dry run counts the dataset's conversations
    assert f"{saved}: 40 conversations from 41 rows; skipped 1: 1 no assistant turn (first: {saved} row 40)" in \
        captured.err  # the row checks of every source
    assert main(_args(tiny_target_dir, saved, tmp_path / "run", "max_steps=1")) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1


def test_a_saved_dataset_dict_gives_the_configured_split(tiny_target_dir, conversations_file, tmp_path, capsys):
    rows = _rows(conversations_file)
    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:10]),
                          "test": datasets.Dataset.from_list(rows[10:])}).save_to_disk(str(saved))
    assert main(_args(tiny_target_dir, saved, tmp_path / "dry", "data.split=test", "--dry-run")) == 0
    assert "of 30 in the source" in capsys.readouterr().out
    assert main(_args(tiny_target_dir, saved, tmp_path / "dry", "data.split=validation", "--dry-run")) == 2
    assert (f"{saved} is a saved DatasetDict without a 'validation' split (it holds test, train); choose one with "
            "data.split") in _one_error(capsys.readouterr().err)


def test_a_saved_dataset_inside_a_data_folder_is_named(tiny_target_dir, conversations_file, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(conversations_file, folder / "chats.jsonl")
    datasets.Dataset.from_list(_rows(conversations_file)).save_to_disk(str(folder / "saved"))
    assert main(_args(tiny_target_dir, folder, tmp_path / "dry", "--dry-run")) == 2
    line = _one_error(capsys.readouterr().err)
    assert f"{folder / 'saved'} inside {folder} is a dataset saved with datasets' save_to_disk" in line
    assert f"data.source={folder / 'saved'}" in line


def _cache_as_hub_dataset(data: Path, cache: Path, repo: str) -> None:
    """Put `data` into `cache` where `datasets` keeps a hub dataset `repo` it has downloaded and prepared
    (`OWNER___NAME/default/0.0.0/HASH/NAME-train.arrow`), as a first online load leaves it."""
    built = datasets.load_dataset("json", data_files={"train": str(data)}, split="train",
                                  cache_dir=str(cache / "build"))
    source = Path(built.cache_files[0]["filename"]).parent
    owner, name = repo.split("/")
    prepared = cache / f"{owner}___{name}" / "default" / "0.0.0" / source.name
    shutil.copytree(source, prepared)
    (prepared / "json-train.arrow").rename(prepared / f"{name}-train.arrow")


def test_a_hub_dataset_in_the_local_cache_trains_offline(tiny_target_dir, conversations_file, tmp_path, monkeypatch,
                                                         capsys):
    """A hub name already downloaded is read from datasets' cache with HF_DATASETS_OFFLINE=1 (conftest sets it);
    one that is not says what to do instead."""
    cache = tmp_path / "hf-datasets"
    _cache_as_hub_dataset(conversations_file, cache, "someone/chats")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    assert main(_args(tiny_target_dir, "someone/chats", tmp_path / "run", "max_steps=1")) == 0, \
        capsys.readouterr().err[-2000:]
    assert "someone/chats: 40 conversations from 40 rows" in capsys.readouterr().err
    assert main(_args(tiny_target_dir, "someone/not-cached", tmp_path / "other", "max_steps=1")) == 2
    line = _one_error(capsys.readouterr().err)
    assert "cannot load 'someone/not-cached'" in line and "save_to_disk folder" in line


@pytest.mark.parametrize("damage", ["state.json", "data-00000-of-00001.arrow"])
def test_a_damaged_saved_dataset_is_named(tiny_target_dir, conversations_file, tmp_path, damage, capsys):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(_rows(conversations_file)).save_to_disk(str(saved))
    (saved / damage).write_bytes(b"{not what datasets wrote")
    assert main(_args(tiny_target_dir, saved, tmp_path / "dry", "--dry-run")) == 2
    assert f"cannot read {saved}, a dataset saved with datasets' save_to_disk" in _one_error(capsys.readouterr().err)
