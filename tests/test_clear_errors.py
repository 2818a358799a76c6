"""Bad input ends in one clear line (or a counted skip), never a traceback or an errno alone, and an output
that cannot be written fails before the work: the cases of the bad-input drill that still crashed."""

from __future__ import annotations

import json
import resource
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_MASK_ID, make_tiny_target

from dflash.cli.main import main
from dflash.data.features import save_shard
from dflash.data.sources import load_conversations
from dflash.data.tokenization import char_budget, tokenize_conversation
from dflash.evaluation.export import WEIGHTS_NAME, export_draft, exported_folder, load_exported
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.run.checkpoint import save_checkpoint


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    cfg = DFlashDraftConfig.for_target(make_tiny_target().config, mask_token_id=TINY_MASK_ID, num_hidden_layers=1,
                                       block_size=4)
    return export_draft(DFlashDraftModel(cfg), tmp_path_factory.mktemp("export"))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    return line


def test_eval_of_a_missing_or_checkpoint_folder_says_what_it_is(tmp_path, capsys):
    assert main(["eval", "--draft", str(tmp_path / "nope")]) == 2
    line = one_error_line(capsys)
    assert line.endswith("does not exist; pass an exported draft folder (a run's export/)") and "error: 2" not in line
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "draft.safetensors").write_bytes(b"")
    assert main(["eval", "--draft", str(ckpt)]) == 2
    assert "is a training checkpoint or a run folder without an export" in one_error_line(capsys)


def test_eval_takes_a_run_folder_for_its_export(exported, tmp_path):
    """As `dflash export` takes a run folder for its newest checkpoint, `dflash eval` takes one for its export."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    for f in exported.iterdir():
        (run / "export" / f.name).write_bytes(f.read_bytes())
    assert exported_folder(run) == run / "export" and exported_folder(exported) == exported
    assert load_exported(run).state_dict().keys() == load_exported(exported).state_dict().keys()


def test_an_os_error_names_the_file_not_the_errno(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing-run")]) in (2, 4)
    line = one_error_line(capsys)
    assert "missing-run" in line and not line.rstrip().endswith("error: 2")


def test_eval_out_that_cannot_be_written_fails_before_any_work(exported, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    start = time.perf_counter()
    code = main(["eval", "--draft", str(exported), "--target", str(tmp_path / "no-such-target"),
                 "--out", str(blocker / "eval.json")])
    line = one_error_line(capsys)
    assert code == 4 and "a-file" in line and "no-such-target" not in line  # the target was never looked at
    assert time.perf_counter() - start < 5


def test_truncated_exported_weights_are_named(exported, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in exported.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    data = (broken / WEIGHTS_NAME).read_bytes()
    (broken / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors cannot be read .*damaged or truncated; export the draft"):
        load_exported(broken)


def test_export_of_a_checkpoint_whose_config_does_not_fit_its_weights(tmp_path, capsys):
    cfg = DFlashDraftConfig.for_target(make_tiny_target().config, mask_token_id=TINY_MASK_ID, num_hidden_layers=1,
                                       block_size=4)
    draft = DFlashDraftModel(cfg)
    other = {**cfg.to_dict(), "hidden_size": cfg.hidden_size * 2}  # an edited draft_config.json
    save_checkpoint(tmp_path / "run", 4, draft.state_dict(), other, {"step": 4})
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert "draft.safetensors does not fit the checkpoint's draft_config.json: size mismatch for" in line


def test_deeply_nested_json_rows_are_counted_skips(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    path.write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n" + good + "\n")
    rows, report = load_conversations(path)
    assert len(rows) == 2 and report.skipped == {"malformed JSON lines": 1}
    assert "nested too deeply" in report.summary()


class Recorder:
    """A tokenizer that records the length of every text it tokenizes."""

    def __init__(self, tokenizer):
        self.inner, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.inner(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_huge_row_is_cut_to_what_max_length_tokens_can_cover(tokenizer):
    """One 30 MB row took 5 GB to tokenize whole. The text is cut to `char_budget` first, and the first
    max_length tokens and their loss mask are exactly those of the whole text."""
    reply = "The quick brown fox jumps over the lazy dog. " * 20_000  # 900k characters
    chat = [{"role": "user", "content": "Tell me a long story."}, {"role": "assistant", "content": reply}]
    recorder = Recorder(tokenizer)
    row = tokenize_conversation(chat, recorder, max_length=64)
    assert max(recorder.lengths) < char_budget(tokenizer, 64) + 1000 < len(reply)
    whole = tokenize_conversation(chat, tokenizer, max_length=64, max_chars=10**9)
    assert row == whole and row["truncated"]


def test_a_full_disk_while_writing_features_is_an_os_error_naming_the_shard(tmp_path):
    """safetensors reports a refused write with its own error type; `dflash features` turned it into a
    traceback. A file-size limit makes the kernel refuse the write (a full disk gives ENOSPC alike)."""
    shard = tmp_path / "shard-00000.safetensors"
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, previous[1][1]))
    try:
        with pytest.raises(OSError) as info:
            save_shard(shard, {"x": torch.zeros(100_000)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous[1])
        signal.signal(signal.SIGXFSZ, previous[0])
    assert info.value.filename == str(shard) and info.value.strerror == "File too large"
    assert not list(tmp_path.iterdir())  # nothing half-written left
