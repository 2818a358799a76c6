"""Reliability round 4 (issue 54, items 4-6), each drill through the CLI where it can be:

- 4: a launch killed (SIGKILL or SIGTERM to its PID) while it tokenizes a large source leaves no process behind;
- 5: the last tracebacks and unclear lines become named errors: a damaged regeneration cache, `init_from` an export
  of another shape, a full disk during the end-of-run export, a signal during the end-of-run evaluation;
- 6: crafted files are refused: a swapped feature shard whose manifest hash was updated, a `trainer_state.pt` whose
  step or data position is out of range, a checkpoint header declaring a tensor the checkpoint's config does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from helpers import chat_file
from test_cli import _args

from dflash.cli.main import main
from dflash.run.checkpoint import damage, find_latest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}


# ---- helpers ------------------------------------------------------------------------------------------------


def big_chat_file(path: Path, rows: int = 2400) -> Path:
    """`rows` two-turn conversations (more than tokenization's `_PARALLEL_ROWS`: tokenized by worker processes)."""
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Question {i}: what is {i} plus {i}? Say it in a sentence or two."},
                {"role": "assistant", "content": f"The answer is {2 * i}. " * (1 + i % 5)},
            ]}) + "\n")
    return path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[1])


def descendants(pid: int) -> set[int]:
    """Every living process below `pid` (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None and stat[0] != "Z":
            parents[int(entry.name)] = stat[1]
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """The processes of `pids` that still run (a zombie has ended: only its exit status is left)."""
    return {pid for pid in pids if (stat := _stat(pid)) is not None and stat[0] != "Z"}


def dflash_process(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m dflash ARGS` in a session of its own (its output in `log`), as a user's launch."""
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "dflash", *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=log.parent, env={**os.environ, **OFFLINE}, start_new_session=True)


def end_session(proc: subprocess.Popen) -> None:
    """Whatever the test left of a launch's session goes (the test's own clean-up, not what it checks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---- 4. no process outlives a killed launch -------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("command", ["features", "train"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_launch_killed_while_it_tokenizes_leaves_no_process(tiny_target_dir, tmp_path, command, sig):
    """The drill: SIGKILL or SIGTERM to the PID of `dflash train` / `dflash features` while it tokenizes 2,400
    rows left 3 processes of about 1.2 GB each (datasets' pool workers and its manager) that never exit.
    Tokenization's workers now die with the process that started them."""
    data = big_chat_file(tmp_path / "big.jsonl")
    args = [command, f"target={tiny_target_dir}", f"data.source={data}", "device=cpu", "data.regenerate=false",
            "data.eval_size=0", "data.max_length=64", f"data.cache_dir={tmp_path / 'cache'}", "progress_bar=false",
            "draft.mask_token_id=16", "data.num_workers=0", f"output_dir={tmp_path / 'run'}",
            f"data.features={tmp_path / 'features'}" if command == "features" else "max_steps=2"]
    proc = dflash_process(args, tmp_path / "launch.log")
    try:
        deadline, workers = time.monotonic() + 120, set()
        while time.monotonic() < deadline and proc.poll() is None:
            workers = descendants(proc.pid)
            if len(workers) >= 2:  # tokenization's worker processes have started (2 cores: 2 of them at least)
                break
            time.sleep(0.02)
        assert workers, f"no worker process appeared; the log ends: {(tmp_path / 'launch.log').read_text()[-2000:]}"
        time.sleep(0.3)  # let the workers get going on their rows
        workers = descendants(proc.pid)
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(workers), f"{len(alive(workers))} of {len(workers)} processes outlived the killed launch"
    finally:
        end_session(proc)


def test_the_parallel_tokenization_gives_the_rows_of_one_process(tokenizer, tmp_path):
    """The worker pool (contiguous shards, concatenated in order) gives the rows and the counted skips one process
    gives, and leaves no scratch file in the cache."""
    from dflash.data.sources import dataset_report
    from dflash.data.tokenization import build_dataset

    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"q {i} " * (1 + i % 7)},
                                         {"role": "assistant", "content": f"a {i}. " * (1 + i % 4)}]} for i in range(37)]
    rows[5]["messages"] = [{"role": "assistant", "content": "no question"}, {"role": "user", "content": "x"}]
    one = build_dataset(rows, tokenizer, 48, cache_dir=tmp_path / "one", num_proc=1)
    two = build_dataset(rows, tokenizer, 48, cache_dir=tmp_path / "two", num_proc=3)
    assert one["input_ids"] == two["input_ids"] and one["loss_mask"] == two["loss_mask"]
    assert dataset_report(one).to_json() == dataset_report(two).to_json()
    assert [p.name for p in (tmp_path / "two").iterdir() if p.name.startswith(".")] == []


# ---- 5. named errors instead of tracebacks and one-word lines ------------------------------------------------


def test_a_damaged_regeneration_cache_is_repaired_and_its_prompts_asked_again(tiny_target_dir, tmp_path, capsys):
    """The drill: bytes that are not UTF-8 in one row, a row without its prompt_id in another, and `dflash generate`
    (or train) ended in `error: utf-8` / `error: prompt_id`. The damaged rows are now counted, moved to
    `<cache>.damaged` and their prompts regenerated; the good rows are reused."""
    args = ["generate", f"target={tiny_target_dir}", f"data.source={chat_file(tmp_path / 'chats.jsonl')}", "device=cpu",
            "data.eval_size=4", "data.limit=12", "data.regenerate_max_new_tokens=4", f"data.cache_dir={tmp_path / 'c'}",
            "draft.mask_token_id=16", "draft.block_size=4", "data.max_length=64"]
    assert main(args) == 0
    assert "8 new replies, 0 reused" in capsys.readouterr().out
    (cache,) = (tmp_path / "c" / "regenerated").glob("*-train.jsonl")
    lines = cache.read_bytes().splitlines(keepends=True)
    second = json.loads(lines[1])
    lines[1] = b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n'  # not UTF-8
    lines[4] = json.dumps({k: v for k, v in json.loads(lines[4]).items() if k != "prompt_id"}).encode() + b"\n"
    cache.write_bytes(b"".join(lines))
    assert main(args) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "2 new replies, 6 reused" in out
    assert f"{cache}: 2 damaged rows (line 2: not UTF-8; line 5: no prompt_id) moved to {cache}.damaged" in err
    assert len((Path(f"{cache}.damaged")).read_bytes().splitlines()) == 2  # kept for a look, out of the cache
    rows = [json.loads(line) for line in cache.read_bytes().splitlines()]
    assert len(rows) == 8 and second["prompt_id"] in {row["prompt_id"] for row in rows}
    assert main(args) == 0 and "0 new replies, 8 reused" in capsys.readouterr().out


@pytest.fixture
def train(tiny_target_dir, conversations_file, tmp_path):
    """`train(out, *overrides)`: `dflash train` on the tiny target, in-process; no end-of-run decoding unless asked."""
    def run(out: Path, *extra: str) -> int:
        return main(_args(tiny_target_dir, conversations_file, out, "spec_eval_prompts=0", "progress_bar=false",
                          f"data.cache_dir={tmp_path / 'cache'}", *extra))
    return run


def test_init_from_an_export_of_another_shape_is_one_line(train, tmp_path, capsys):
    """The drill: `init_from` an export of a 1-layer draft into a 2-layer run was a traceback of size mismatches.
    It is refused in one line naming the settings and tensors that differ and the fix."""
    assert train(tmp_path / "one", "max_steps=2", "draft.num_layers=1") == 0
    capsys.readouterr()
    assert train(tmp_path / "two", "max_steps=2", "draft.num_layers=2", f"init_from={tmp_path / 'one' / 'export'}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("dflash train: error:")]
    assert f"init_from={tmp_path / 'one' / 'export'} is a draft of another shape" in line
    assert "layers.1." in line and "num_hidden_layers 1 (this run: 2)" in line and "drop init_from" in line


@pytest.mark.parametrize("how", ["ENOSPC", "EFBIG"])
def test_a_full_disk_during_the_end_of_run_export_is_one_line_and_keeps_the_checkpoint(train, tmp_path, capsys,
                                                                                        monkeypatch, how):
    """The drill: a full disk while the end-of-run export was written gave safetensors' own error, a traceback. It is
    one line naming the export folder, the cause, the checkpoint (intact) and the command that exports it, exit 4.
    ENOSPC: the write raises as a full disk's does; EFBIG: the kernel refuses it (a file-size limit)."""
    import errno
    import resource

    import dflash.trainer

    real = dflash.trainer.export_draft

    def export_on_a_full_disk(draft, out_dir, **kwargs):
        if how == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(out_dir) / "model.safetensors"))
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, previous[1][1]))
        try:
            return real(draft, out_dir, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, previous[1])
            signal.signal(signal.SIGXFSZ, previous[0])

    monkeypatch.setattr(dflash.trainer, "export_draft", export_on_a_full_disk)
    run = tmp_path / "run"
    assert train(run, "max_steps=2") == 4
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("dflash train: error:")]
    checkpoint = run / "checkpoints" / "step-00000002"
    assert (f"could not write {run / 'export' / 'model.safetensors'} (No space left on device)" if how == "ENOSPC" else
            f"could not write the export to {run / 'export'} (File too large)") in line
    assert f"dflash export {checkpoint} {run / 'export'}" in line
    assert find_latest(run) == checkpoint and damage(checkpoint) is None


def _stopped_in_the_end_of_run_evaluation(args: list[str], sig: signal.Signals, log: Path) -> int:
    """`dflash train ARGS` in a child process that sends itself `sig` as its end-of-run speculative decoding starts."""
    child = f"""
import os, signal, sys
sys.path[:0] = [{str(ROOT)!r}]
import dflash.trainer
real = dflash.trainer.held_out_speculative_eval
def signalled(*args, **kwargs):
    os.kill(os.getpid(), {int(sig)})
    return real(*args, **kwargs)
dflash.trainer.held_out_speculative_eval = signalled
from dflash.cli.main import main
raise SystemExit(main({args!r}))
"""
    with log.open("w") as out:
        return subprocess.run([sys.executable, "-c", child], stdout=out, stderr=subprocess.STDOUT, timeout=300,
                              env={**os.environ, **OFFLINE}, cwd=log.parent).returncode


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_end_of_run_evaluation_ends_it_saved_with_the_interrupted_code(
        tiny_target_dir, conversations_file, tmp_path, sig):
    """The drill: SIGINT during the end-of-run evaluation gave a KeyboardInterrupt traceback, SIGTERM a silent death.
    The stop is honoured there: exit 128 + the signal, a line saying the run is saved and the rest was skipped, the
    checkpoint and the export (written before the decoding) whole, summary.json marked interrupted."""
    run = tmp_path / "run"
    args = _args(tiny_target_dir, conversations_file, run, "max_steps=2", "progress_bar=false",
                 "spec_eval_interval_prompts=0", f"data.cache_dir={tmp_path / 'cache'}")
    code = _stopped_in_the_end_of_run_evaluation(args, sig, tmp_path / "train.log")
    text = (tmp_path / "train.log").read_text()
    assert code == 128 + sig, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    checkpoint = run / "checkpoints" / "step-00000002"
    assert (f"stopped by {sig.name} during the end-of-run evaluation; the run is saved in {checkpoint}; exported to "
            f"{run / 'export'}") in text
    assert find_latest(run) == checkpoint and damage(checkpoint) is None
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == sig.name and summary["end_of_run_skipped"]
    assert "speculative" not in summary and (run / "export" / "model.safetensors").is_file()
    assert {"training", "export"} <= set(summary["phases"]) and summary["wall_seconds"] > 0  # what ran, timed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl, /proc")
@pytest.mark.parametrize("to", ["launcher", "ranks"])
def test_a_torchrun_launch_stopped_by_sigterm_exits_143(tiny_target_dir, conversations_file, tmp_path, to):
    """The drill: SIGTERM to a torchrun launch saved and stopped every rank, but torchrun exited 1 (its agent's
    SignalException, or a ChildFailedError when the ranks alone got it), so a scheduler saw a failure, not "requeue me".
    `python -m dflash.run.torchrun` is torchrun with that mapped back: 143."""
    run = tmp_path / "run"
    args = ["--nproc_per_node", "2", "-m", "dflash", "train", f"target={tiny_target_dir}",
            f"data.source={conversations_file}", f"output_dir={run}", "device=cpu", "draft.mask_token_id=16",
            "draft.block_size=4", "draft.num_anchors=8", "batch_size=2", "data.max_length=64", "data.bucket_multiple=32",
            "data.eval_size=0", "data.regenerate=false", "data.num_workers=0", "log_interval=1", "ce_chunk_size=256",
            "spec_eval_prompts=0", "max_steps=100000", "save_interval=1000", "progress_bar=false",
            f"data.cache_dir={tmp_path / 'cache'}"]
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dflash.run.torchrun", *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=tmp_path, env={**os.environ, **OFFLINE}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2:
                break
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        for pid in [proc.pid] if to == "launcher" else descendants(proc.pid):
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    finally:
        end_session(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and (run / "checkpoints" / "latest").is_file()
    assert "Traceback" not in log.read_text()


# ---- 6. crafted files refused ------------------------------------------------------------------------------------


def recompute_complete(folder: Path) -> None:
    """What a crafter does after editing a checkpoint's files: COMPLETE's sizes and CRC-32s made to match them."""
    marker = json.loads((folder / "COMPLETE").read_text())
    for name in marker["sizes"]:
        data = (folder / name).read_bytes()
        marker["sizes"][name], marker["crc32"][name] = len(data), zlib.crc32(data)
    (folder / "COMPLETE").write_text(json.dumps(marker))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("step", -5, "step -5 (a whole number >= 0)"),
    ("data_batches", 10**12, "a data position no run of this data reaches (epoch 0, batch 1000000000000, after 4 steps"),
    ("data_epoch", 10**9, "a data position no run of this data reaches (epoch 1000000000, batch 0, after 4 steps"),
])
def test_a_crafted_step_or_data_position_in_trainer_state_is_refused(train, tmp_path, capsys, key, value, named):
    """The drill: `step: -5` or a huge data position written into trainer_state.pt (COMPLETE's checksums updated to
    match) resumed and trained. Each is refused in one line naming the value, before a step is trained."""
    run = tmp_path / "run"
    assert train(run, "max_steps=4", "save_interval=2", "export_on_finish=false") == 0
    folder = run / "checkpoints" / "step-00000004"
    state = torch.load(folder / "trainer_state.pt", weights_only=True)
    state.update({"data_batches": 0, key: value} if key == "data_epoch" else {key: value})
    torch.save(state, folder / "trainer_state.pt")
    recompute_complete(folder)
    capsys.readouterr()
    assert train(run, "max_steps=6", "resume_from=latest", "export_on_finish=false") == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("dflash train: error:")]
    assert named in line and "not resumed" in line, line
    assert not (run / "checkpoints" / "step-00000006").exists()


def _craft_weights(path: Path, shapes: dict[str, tuple[int, ...]], keep: dict[str, bytes]) -> None:
    """A safetensors file declaring `shapes` (F32), sparse: the tensors of `keep` written, every other left a hole."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, entry in header.items():
            if name in keep and len(keep[name]) == entry["data_offsets"][1] - entry["data_offsets"][0]:
                f.seek(8 + len(text) + entry["data_offsets"][0])
                f.write(keep[name])
        f.truncate(8 + len(text) + offset)  # a sparse file: the size the header declares, no disk spent


@pytest.mark.parametrize("config", ["kept", "crafted too"])
def test_a_checkpoint_header_declaring_a_huge_tensor_is_refused_before_anything_is_read(train, tmp_path, capsys,
                                                                                     monkeypatch, config):
    """The drill: draft.safetensors' header declares fc.weight of 2^30 values (a 4 GiB sparse file, COMPLETE updated
    to match): the resume allocated all of it before any shape was compared. The header is now compared first, with
    the checkpoint's draft_config.json and with the run's draft (a draft_config.json crafted to match the header
    too): refused, and no tensor of that file read."""
    import dflash.run.checkpoint as checkpoint_module
    from dflash.run.safe_load import config_shapes

    run = tmp_path / "run"
    assert train(run, "max_steps=2", "save_interval=2", "export_on_finish=false") == 0
    folder = run / "checkpoints" / "step-00000002"
    draft_config = json.loads((folder / "draft_config.json").read_text())
    if config == "kept":
        shapes = {**config_shapes(draft_config), "fc.weight": (2**15, 2**15)}
    else:  # a config that declares the huge draft itself: only the run's own draft tells
        draft_config["hidden_size"] = 2**14
        (folder / "draft_config.json").write_text(json.dumps(draft_config))
        shapes = config_shapes(draft_config)
    _craft_weights(folder / "draft.safetensors", shapes, {})
    recompute_complete(folder) if config == "kept" else _complete_by_size(folder)

    def never(path, *args, **kwargs):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(checkpoint_module, "load_file", never)
    capsys.readouterr()
    assert train(run, "max_steps=4", "resume_from=latest", "export_on_finish=false") == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash train: error:")]
    # compared with the run's draft first (when `resume` passes it), else with the checkpoint's draft_config.json
    huge = "32768, 32768" if config == "kept" else "16384, 16384"
    assert (f"does not fit this draft, not resumed: weight fc.weight has shape ({huge}), the draft (64, 64)" in line or (
        config == "kept" and "does not fit the checkpoint's draft_config.json: size mismatch for fc.weight: (32768, "
        "32768) in the file, (64, 64) in the config" in line)), line


def _complete_by_size(folder: Path) -> None:
    """COMPLETE with sizes only (a marker of an older dflash: no CRC), so a many-GiB sparse file is not read."""
    marker = json.loads((folder / "COMPLETE").read_text())
    marker["sizes"] = {name: (folder / name).stat().st_size for name in marker["sizes"]}
    marker.pop("crc32", None)
    (folder / "COMPLETE").write_text(json.dumps(marker))


def _another_target(source: Path, out: Path) -> Path:
    """The tiny target with other trunk weights (its embedding and head kept): another target of the same shape."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def test_a_feature_shard_swapped_in_with_its_manifest_hash_updated_is_refused(tiny_target_dir, conversations_file,
                                                                             tmp_path, capsys):
    """The drill: a feature folder's shard replaced by another folder's (another target's features of the same
    rows), the manifest's sha256 and size updated to match, trained. Each shard now names, inside its checksummed
    bytes, the manifest header it was written for and its rows: refused, naming the shard and the fix."""
    def features(target: Path, out: Path) -> list[str]:
        return [f"target={target}", f"data.source={conversations_file}", "device=cpu", "draft.mask_token_id=16",
                "draft.block_size=4", "draft.num_anchors=8", "batch_size=4", "data.max_length=64",
                "data.bucket_multiple=32", "data.eval_size=0", "data.regenerate=false", "data.num_workers=0",
                "ce_chunk_size=256", "spec_eval_prompts=0", "progress_bar=false", f"data.cache_dir={tmp_path / 'c'}",
                f"data.features={out}"]

    other = _another_target(tiny_target_dir, tmp_path / "other-target")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert main(["features", *features(tiny_target_dir, ours)]) == 0
    assert main(["features", *features(other, theirs)]) == 0
    shard = ours / "train" / "shard-00000.safetensors"
    shard.write_bytes((theirs / "train" / "shard-00000.safetensors").read_bytes())
    manifest = json.loads((ours / "train" / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (ours / "train" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["train", *features(tiny_target_dir, ours), f"output_dir={tmp_path / 'run'}", "max_steps=2"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash train: error:")]
    assert f"feature shard {shard} was written for another feature folder" in line
    assert f"dflash features CONFIG data.features={ours}" in line


def test_two_shards_of_one_folder_swapped_with_their_hashes_updated_are_refused(tokenizer, tmp_path):
    """Shards 0 and 1 of one folder exchanged, the manifest's entries (sha256, size) exchanged to match: each shard
    names its rows, so the swap is refused."""
    import datasets
    from helpers import make_tiny_target

    from dflash.data.feature_data import check_manifest
    from dflash.data.features import MANIFEST, write_features
    from dflash.target_model.frozen import FrozenTarget

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 120, (6 + i,), generator=g).tolist() for i in range(8)]
    rows = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0, 0] + [1] * (len(r) - 2) for r in ids]})
    target = FrozenTarget(make_tiny_target(), [0, 2])
    out = write_features(target, "tiny", rows, tmp_path / "f", tokenizer=tokenizer, dtype="float32", max_length=16,
                         labels=False, shard_rows=4, progress=False)
    settings = {"target_name": "tiny", "target_config": target.text_config, "layer_ids": [0, 2], "dtype": "float32",
                "tokenizer": tokenizer, "max_length": 16, "labels": False}
    check_manifest(out, **settings)  # as written: accepted
    a, b = out / "shard-00000.safetensors", out / "shard-00001.safetensors"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    manifest = json.loads((out / MANIFEST).read_text())
    first, second = manifest["shards"]
    for entry, other in ((first, dict(second)), (second, dict(first))):
        entry.update(bytes=other["bytes"], sha256=other["sha256"])
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"shard-00000.safetensors holds rows \[4, 8\], where the manifest lists rows "
                                         r"\[0, 4\]"):
        check_manifest(out, **settings)
