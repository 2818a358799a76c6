"""`dflash export` writes only where it may, `dflash eval` keeps the reports it did not write, and an export's
weights are checksummed and verified (issues 53 and 54), all through the CLI on a tiny run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from dflash.cli.main import main
from dflash.evaluation.export_folder import CHECKSUM_KEY

EVAL = ["--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu"]


def _train_args(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", f"target={target}", f"data.source={data}", f"output_dir={out}", "device=cpu",
            "draft.mask_token_id=16", "draft.block_size=4", "draft.num_anchors=8", "batch_size=4",
            "data.max_length=64", "data.bucket_multiple=32", "data.eval_size=8", "data.regenerate=false",
            "data.num_workers=0", "log_interval=2", "ce_chunk_size=256", "spec_eval_max_new_tokens=4",
            f"data.cache_dir={out}/cache", *extra]


@pytest.fixture(scope="module")
def run(tiny_target_dir, conversations_file, tmp_path_factory) -> Path:
    """A finished 2-step run with its end-of-run export and that export's eval.json (2 prompts)."""
    out = tmp_path_factory.mktemp("guard") / "run"
    assert main(_train_args(tiny_target_dir, conversations_file, out, "max_steps=2", "spec_eval_prompts=2")) == 0
    assert json.loads((out / "export" / "eval.json").read_text())["num_prompts"] == 2
    return out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_error(err: str, command: str) -> str:
    """The one `dflash COMMAND: error:` line of `err` (and no traceback)."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(f"dflash {command}: error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_the_end_of_run_export_records_the_checksum_of_its_weights(run):
    config = json.loads((run / "export" / "config.json").read_text())
    assert config[CHECKSUM_KEY] == hashlib.sha256((run / "export" / "model.safetensors").read_bytes()).hexdigest()


def test_export_into_a_model_folder_is_refused_and_overwrite_replaces_only_its_own_files(run, tiny_target_dir,
                                                                                          tmp_path, capsys):
    """Issue 53: `dflash export RUN COPY_OF_A_MODEL` replaced the model's config.json and model.safetensors (rc 0)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    before = _snapshot(model)
    assert main(["export", str(run), str(model)]) == 2
    line = _one_error(capsys.readouterr().err, "export")
    assert f"{model} is not a dflash export" in line and "--overwrite" in line
    assert _snapshot(model) == before  # not a byte written
    assert main(["export", str(run), str(model), "--overwrite"]) == 0
    assert "kept: " in capsys.readouterr().err  # says what it left alone
    after = _snapshot(model)
    assert set(after) == set(before)  # nothing deleted, nothing else added
    assert {name for name in before if after[name] != before[name]} == {"config.json", "model.safetensors"}
    assert "dflash_config" in json.loads(after["config.json"])


def test_overwrite_replaces_a_linked_weights_file_without_writing_through_it(run, tmp_path, capsys):
    """A model folder whose files link to shared blobs (an HF cache snapshot): the link is replaced, the blob kept."""
    blob, model = tmp_path / "blob", tmp_path / "snapshot"
    blob.write_bytes(b"the target's weights")
    model.mkdir()
    (model / "model.safetensors").symlink_to(blob)
    assert main(["export", str(run), str(model), "--overwrite"]) == 0
    assert blob.read_bytes() == b"the target's weights"
    assert not (model / "model.safetensors").is_symlink() and (model / "config.json").is_file()


def test_export_into_the_working_folder_or_a_file_is_refused(run, tmp_path, monkeypatch, capsys):
    """Issue 53: `dflash export RUN .` wrote into the working folder."""
    work = tmp_path / "clone"
    work.mkdir()
    (work / "README.md").write_text("a project")
    monkeypatch.chdir(work)
    assert main(["export", str(run), "."]) == 2
    assert "is not a dflash export (it holds README.md)" in _one_error(capsys.readouterr().err, "export")
    assert sorted(os.listdir(work)) == ["README.md"]
    assert main(["export", str(run), "README.md"]) == 2
    assert "is a file, not a folder" in _one_error(capsys.readouterr().err, "export")
    assert (work / "README.md").read_text() == "a project"


def test_export_writes_a_new_or_empty_folder_and_replaces_an_earlier_export(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run), str(empty)]) == 0
    assert main(["export", str(run), str(tmp_path / "new" / "draft")]) == 0
    (empty / "notes.txt").write_text("mine")
    assert main(["export", str(run), str(empty)]) == 0  # an earlier export: replaced in place, notes kept
    assert (empty / "notes.txt").read_text() == "mine"
    report = (run / "export" / "eval.json").read_bytes()
    assert main(["export", str(run), str(run / "export")]) == 0  # the run's own export, written by `dflash train`
    assert (run / "export" / "eval.json").read_bytes() == report  # same weights: its report still holds
    assert "scored the weights this export replaced" not in capsys.readouterr().err


def test_eval_without_out_keeps_the_report_the_run_wrote(run, tmp_path, capsys):
    """Issue 53: `dflash eval --draft RUN` overwrote the run's export/eval.json (4 prompts became 2; summary.json
    still said 4). Without --out a new report goes beside it; --out names a path that is replaced."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    report = (copy / "export" / "eval.json").read_bytes()
    assert main(["eval", "--draft", str(copy), *EVAL]) == 0
    assert f"wrote {copy / 'export' / 'eval-2.json'} (the earlier {copy / 'export' / 'eval.json'} is kept" in \
        capsys.readouterr().err
    assert (copy / "export" / "eval.json").read_bytes() == report
    assert json.loads((copy / "export" / "eval-2.json").read_text())["num_prompts"] == 1
    assert main(["eval", "--draft", str(copy), *EVAL, "--out", str(copy / "export" / "eval-2.json")]) == 0
    assert sorted(p.name for p in (copy / "export").glob("eval*.json")) == ["eval-2.json", "eval.json"]


def _flip_a_weight_byte(folder: Path) -> None:
    """Flip one byte of tensor data in `folder/model.safetensors` (past its header): same size, still loadable."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + 101] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_exported_weights_is_refused_by_eval_and_init_from(run, tiny_target_dir,
                                                                                 conversations_file, tmp_path, capsys):
    """Issue 54: a same-size flip in export/model.safetensors was evaluated silently."""
    export = tmp_path / "export"
    shutil.copytree(run / "export", export)
    _flip_a_weight_byte(export)
    assert main(["eval", "--draft", str(export), *EVAL]) == 2
    line = _one_error(capsys.readouterr().err, "eval")
    assert f"{export / 'model.safetensors'} does not match the sha256 its config.json records" in line
    assert "export the draft again" in line and not (export / "eval-2.json").exists()
    assert main(_train_args(tiny_target_dir, conversations_file, tmp_path / "warm", "max_steps=1",
                            "spec_eval_prompts=0", f"init_from={export}")) == 2
    assert "does not match the sha256" in _one_error(capsys.readouterr().err, "train")


def test_an_export_without_a_checksum_loads_with_a_warning(run, tmp_path, capsys):
    """An export written before the checksum still evaluates, and says its weights are not verified."""
    export = tmp_path / "older"
    shutil.copytree(run / "export", export)
    config = json.loads((export / "config.json").read_text())
    del config[CHECKSUM_KEY]
    (export / "config.json").write_text(json.dumps(config))
    assert main(["eval", "--draft", str(export), *EVAL]) == 0
    assert "records no checksum of model.safetensors" in capsys.readouterr().err
    # not recognised as an earlier export either: a re-export into it needs --overwrite
    assert main(["export", str(run), str(export)]) == 2
    assert "--overwrite" in _one_error(capsys.readouterr().err, "export")
