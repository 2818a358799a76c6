"""Fault drills (issue 18): `dflash train` on a tiny local target, interrupted at every kind of moment.

Each drill chain trains one run folder to step 12 (saves every 3 steps, a log line every 2, the data's
epoch ends at step 10) through a sequence of faults, each followed by a launch with `resume_from=latest`:

- SIGKILL at named points of a save, a re-save and a deletion (the `DFLASH_FAULT` hook of
  dflash.run.checkpoint), including inside the final save and during pruning;
- SIGKILL at random moments (seeded delays);
- SIGTERM / SIGINT to the whole process group with DataLoader workers on, at random moments and
  inside a save (what `scancel`, preemption, `systemctl stop` and Ctrl-C send);
- a damaged newest checkpoint (truncated weights or trainer state, a missing file, a broken header).

After each fault the next launch must resume from the newest intact checkpoint (checked independently:
the newest folder whose weights load and equal the uninterrupted run's at that step), say so when it
falls back from a damaged one, and no fault may lose a checkpoint that was complete before it. At the
end of each chain the weights and AdamW state are bit-identical to an uninterrupted run and
metrics.jsonl holds every log step exactly once. Two chains run at a time (threads of this process).

Runs are never forked from the pytest process: earlier tests leave it with state a SIGKILLed fork can
poison for everyone. tqdm's write lock is a multiprocessing semaphore shared with every fork, so a run
killed while it draws a bar leaves the lock held, and every later run and the test process itself hang
at their next bar (seen in CI). Runs are forked instead from a forkserver that has only imported
dflash (one thread, no tqdm lock), so imports are still paid once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import chat_file, save_tiny_target
from safetensors.torch import load_file

from dflash.cli.main import main

MAX_STEPS, SAVE_EVERY, LOG_EVERY = 12, 3, 2
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


def train_args(setup: dict, out: Path, *extra: str) -> list[str]:
    return ["train", f"target={setup['target']}", f"data.source={setup['data']}", f"output_dir={out}", "device=cpu",
            "draft.mask_token_id=16", "draft.block_size=4", "draft.num_anchors=8", "batch_size=4",
            "data.max_length=64", "data.bucket_multiple=32", "data.eval_size=0", "data.regenerate=false",
            f"log_interval={LOG_EVERY}", "ce_chunk_size=256", "spec_eval_prompts=0", "export_on_finish=false",
            f"max_steps={MAX_STEPS}", f"save_interval={SAVE_EVERY}", "progress_bar=false",
            f"data.cache_dir={out}-cache", "resume_from=latest", *extra]


FORKSERVER = multiprocessing.get_context("forkserver")
# What a run imports, paid once by the server (this module too: the children unpickle `_run_dflash` from it).
FORKSERVER.set_forkserver_preload(["test_faults", "dflash.trainer", "datasets", "pandas",
                                   "transformers.models.llama.modeling_llama"])
# The fd-sharing thread of a SIGKILLed group may print this when a worker died a moment before the main
# process (EOFError, or ConnectionResetError mid-handshake): the kill's noise, not the run's doing.
ORPHANED_WORKER = re.compile(r"Traceback \(most recent call last\):\n  File \S*multiprocessing/resource_sharer\.py"
                             r"[^\n]*in _serve\n(?:  .*\n)*?(?:EOFError|ConnectionResetError: [^\n]*)\n?")


class Hung(Exception):
    """A launch that did not end within its time (a hang, not a fault the drill planted)."""


def _run_dflash(args: list[str], log: Path, env: dict[str, str], setsid: bool, file_size_limit: int) -> None:
    """The child: `dflash <args>` with stdout and stderr (Python's and the file descriptors) in `log`."""
    code = 99
    try:
        # A forkserver child inherits its start method; a real launch forks its DataLoader workers.
        multiprocessing.set_start_method("fork", force=True)
        if setsid:
            os.setsid()
        os.environ.update(env)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(log, "a", buffering=1)  # noqa: SIM115 (the process ends with os._exit)
        torch.set_num_threads(1)
        if file_size_limit:  # the kernel refuses a larger write with EFBIG (a full disk gives ENOSPC alike)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))
        code = main(args)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def launch(args: list[str], log: Path, env: dict[str, str] | None = None, *, setsid: bool = False,
           file_size_limit: int = 0) -> multiprocessing.Process:
    """Start `dflash <args>` in a process forked from the forkserver, logging to `log`."""
    proc = FORKSERVER.Process(target=_run_dflash, args=(args, log, env or {}, setsid, file_size_limit))
    proc.start()
    if setsid:  # signals go to its group: wait until it leads one
        deadline = time.monotonic() + 30
        while proc.is_alive() and time.monotonic() < deadline:
            try:
                if os.getpgid(proc.pid) == proc.pid:
                    break
            except ProcessLookupError:
                break
            time.sleep(0.001)
    return proc


# What CPython's forkserver reports when it lost a child's status (EOF on the status pipe, popen_forkserver.py).
# dflash never exits 255 (its codes are 0-4, 130 and 143; `_run_dflash` turns an exception into 99).
LOST_STATUS = 255


def wait(proc: multiprocessing.Process, log: Path, timeout: float = 180.0) -> int:
    """The exit code (negative: the signal that ended it); `Hung` with the log's tail past `timeout`. A
    status the forkserver lost is told from the log: a run that printed no error line and no final table
    was killed (seen once in CI: a SIGKILLed save reported as 255)."""
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        tail = log.read_text()[-1500:] if log.exists() else ""
        raise Hung(f"{log.name} did not end within {timeout:.0f} s; its log ends: {tail!r}")
    if proc.exitcode == LOST_STATUS:
        text = log.read_text() if log.exists() else ""
        if not re.search(r"^(summary  |dflash \w+: (error|stopped):)", text, re.M):
            return -signal.SIGKILL
    return proc.exitcode


def holds_open(fd_dir: Path, target: str) -> bool:
    """Whether the process of `/proc/PID/fd` has `target` open. An fd closed, or the process gone, between
    the listing and the read is skipped alone (it once failed the test below: a starting interpreter opens
    and closes files while it is looked at), never the rest of the process's fds."""
    try:
        fds = list(fd_dir.iterdir())
    except OSError:  # the process ended
        return False
    for fd in fds:
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False


def wait_for_writers(log: Path, timeout: float = 30.0) -> None:
    """Until no process holds `log` open (Linux /proc): a SIGKILLed run's DataLoader workers outlive it a
    moment and may still be printing, so its log is complete only once they are gone."""
    target, deadline = str(log.resolve()), time.monotonic() + timeout
    while time.monotonic() < deadline:
        holders = sum(holds_open(fd_dir, target) for fd_dir in Path("/proc").glob("[0-9]*/fd"))
        if not holders:
            return
        time.sleep(0.05)
    raise Hung(f"{log.name}: a process still holds it open {timeout:.0f} s after its run ended")


def wait_for_lines(metrics: Path, before: int, lines: int, proc: multiprocessing.Process,
                   timeout: float = 60.0) -> None:
    """Until metrics.jsonl has `lines` more lines than `before` (a run `lines` log steps further on)."""
    deadline = time.monotonic() + timeout
    while lines and time.monotonic() < deadline:
        if (metrics.read_text().count("\n") if metrics.exists() else 0) >= before + lines:
            return
        if not proc.is_alive():
            return  # the run ended first (left to `wait`)
        time.sleep(0.005)


def step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def weights_at(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:08d}" / "draft.safetensors"))


def newest_intact(run: Path, reference: Path) -> int:
    """Independent of dflash.run.checkpoint: the highest step whose folder has a COMPLETE marker, weights and
    trainer state that load, and weights equal to the uninterrupted run's at that step (0: none)."""
    for folder in sorted((run / "checkpoints").glob("step-*"), reverse=True):
        try:
            assert (folder / "COMPLETE").exists() and (folder / "draft_config.json").exists()
            weights = load_file(str(folder / "draft.safetensors"))
            state = torch.load(folder / "trainer_state.pt", weights_only=True)
            expected = weights_at(reference, step_of(folder))
            if state["step"] == step_of(folder) and all(torch.equal(weights[k], v) for k, v in expected.items()):
                return step_of(folder)
        except Exception:
            continue
    return 0


def damage(run: Path, how: str) -> str:
    """Damage the newest checkpoint folder; returns its name."""
    folder = max((run / "checkpoints").glob("step-*"))
    if how == "truncate-draft":
        data = (folder / "draft.safetensors").read_bytes()
        (folder / "draft.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "truncate-state":
        data = (folder / "trainer_state.pt").read_bytes()
        (folder / "trainer_state.pt").write_bytes(data[: len(data) - 100])
    elif how == "missing-config":
        (folder / "draft_config.json").unlink()
    elif how == "broken-header":
        data = bytearray((folder / "draft.safetensors").read_bytes())
        data[8:16] = b"\x00garbage"
        (folder / "draft.safetensors").write_bytes(bytes(data))
    return folder.name


def fault_count(point: str, which: str, resume_step: int, fresh: bool) -> int:
    """`DFLASH_FAULT`'s n for `point` at the first or the final save of a run resumed at `resume_step`
    (save-write counts files, 3 a save; a deletion follows each save that has an older checkpoint)."""
    saves = (MAX_STEPS - resume_step) // SAVE_EVERY
    index = 1 if which == "first" else saves
    if point.startswith("save-write"):
        return 3 * (index - 1) + int(point.rsplit("-", 1)[1])
    if point == "delete":
        return index - 1 if fresh else index
    return index


def run_chain(setup: dict, name: str, attempts: list[dict], out_file: Path, *, workers: int = 0,
              keep_last: int = 1) -> None:
    """One drill chain, in a forked process: faults, resumes, checks; the record goes to `out_file`."""
    reference = setup["reference"]
    run = setup["root"] / name
    args = train_args(setup, run, f"data.num_workers={workers}", f"keep_last={keep_last}")
    record: dict = {"name": name, "attempts": [], "errors": []}
    pending_damage = None
    for number, attempt in enumerate([*attempts, {"kind": "finish"}]):
        before = newest_intact(run, reference) if run.exists() else 0
        fresh = before == 0
        log = run.parent / f"{name}.{number}.log"
        kind = attempt["kind"]
        entry = {**attempt, "before": before}
        if kind == "damage":
            entry["folder"] = pending_damage = damage(run, attempt["how"])
            record["attempts"].append(entry)
            continue
        env, metrics = {}, run / "metrics.jsonl"
        lines_before = metrics.read_text().count("\n") if metrics.exists() else 0
        if kind == "fault":
            n = fault_count(attempt["point"], attempt.get("at", "first"), before, fresh)
            point = "save-write" if attempt["point"].startswith("save-write") else attempt["point"]
            env["DFLASH_FAULT"] = f"{point}:{n}" + (":TERM" if attempt.get("term") else "")
        started = time.monotonic()
        proc = launch(args, log, env, setsid=kind == "group" or attempt.get("term", False))
        if kind in ("timed", "group"):  # a random kill waits for at most the lines the run has left to log
            left = (MAX_STEPS - before) // LOG_EVERY - 1
            wait_for_lines(run / "metrics.jsonl", lines_before, attempt["lines"] if kind == "group" else
                           min(attempt["lines"], left), proc)
            time.sleep(attempt.get("delay", 0))
            if kind == "timed":
                proc.kill()  # a no-op when the run has already ended (its pid may be reused by then)
            elif proc.is_alive():
                os.killpg(proc.pid, getattr(signal, attempt["signal"]))
        entry["status"] = wait(proc, log)
        entry["seconds"] = round(time.monotonic() - started, 2)
        wait_for_writers(log)
        text = log.read_text() if log.exists() else ""  # a kill can land before the run opens its log
        found = RESUMED.search(text)
        entry["resumed"] = int(found.group(2)) if found else 0
        # A launch killed before it logged its resume (start-up) decided nothing yet.
        decided = found or entry["status"] != -signal.SIGKILL or re.search(r"step \d+/\d+ \||saved checkpoint", text)
        if decided and entry["resumed"] != before:
            record["errors"].append(f"attempt {number} ({attempt}): resumed at {entry['resumed']}, the newest intact "
                                    f"checkpoint was {before}")
        if pending_damage is not None:
            said = re.search(rf"checkpoint \S*{pending_damage} is damaged \((.*)\): falling back", text)
            entry["fallback_said"] = said.group(1) if said else None
            if not said:
                record["errors"].append(f"attempt {number}: no log line about the damaged {pending_damage}")
            pending_damage = None
        if "Traceback" in (ORPHANED_WORKER.sub("", text) if entry["status"] == -signal.SIGKILL else text):
            record["errors"].append(f"attempt {number}: a traceback in {log}")
        entry["after"] = newest_intact(run, reference)
        if entry["after"] < before:
            record["errors"].append(f"attempt {number}: the newest intact checkpoint went from {before} to "
                                    f"{entry['after']}")
        record["attempts"].append(entry)
    final = record["attempts"][-1]
    if final["status"] != 0 or final["after"] != MAX_STEPS:
        record["errors"].append(f"the final launch ended with {final['status']} at step {final['after']}")
    else:
        ours = torch.load(run / "checkpoints" / f"step-{MAX_STEPS:08d}" / "trainer_state.pt", weights_only=True)
        theirs = setup["reference_state"]
        for (key, a), b in zip(ours["optimizer"]["state"].items(), theirs["optimizer"]["state"].values(), strict=True):
            if not all(torch.equal(a[k], b[k]) for k in b):
                record["errors"].append(f"AdamW state of {key} differs from the uninterrupted run")
        if not torch.equal(ours["metrics"]["buffer"], theirs["metrics"]["buffer"]):
            record["errors"].append("metric buffer differs from the uninterrupted run")
    metrics = run / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in (metrics.read_text().splitlines() if metrics.exists() else [])
             if "loss" in json.loads(line)]
    if steps != list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY)):
        record["errors"].append(f"metrics.jsonl logs steps {steps}")
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-"))]
    if leftovers:
        record["errors"].append(f"left over after the final launch: {leftovers}")
    out_file.write_text(json.dumps(record))


def run_chains(setup: dict, chains: list[tuple], jobs: int = 2) -> list[dict]:
    """Run drill chains `jobs` at a time (each chain a thread; its runs are processes)."""
    def one(chain: tuple) -> dict:
        name, attempts, options = chain
        out = setup["root"] / f"{name}.json"
        try:
            run_chain(setup, name, attempts, out, **options)
            return json.loads(out.read_text())
        except Exception:
            return {"name": name, "attempts": [], "errors": [traceback.format_exc()]}

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, chains))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("drills")
    save_tiny_target(root / "target")
    setup = {"root": root, "target": root / "target", "data": chat_file(root / "chats.jsonl")}
    reference = root / "reference"
    started = time.monotonic()
    args = train_args(setup, reference, "data.num_workers=0", "keep_last=100", "save_interval=1")  # every step kept
    status = wait(launch(args, root / "reference.log"), root / "reference.log")
    assert status == 0, (root / "reference.log").read_text()[-3000:]
    setup.update(reference=reference, seconds=time.monotonic() - started,
                 reference_state=torch.load(reference / "checkpoints" / f"step-{MAX_STEPS:08d}" / "trainer_state.pt",
                                            weights_only=True))
    return setup


def test_fault_drills(setup, capsys):
    rng = random.Random(18)
    run_seconds = setup["seconds"]

    def timed(n: int) -> list[dict]:  # SIGKILLs at seeded random moments: start-up, or 1-2 log lines in, then 0-0.3 s
        kills = []
        for _ in range(n):
            lines = rng.choice((0, 1, 1, 2))
            delay = rng.uniform(0, 0.3) if lines else rng.uniform(0.2, 0.7) * run_seconds
            kills.append({"kind": "timed", "lines": lines, "delay": round(delay, 3)})
        return kills

    def fault(point: str, at: str = "first", **kw) -> dict:
        return {"kind": "fault", "point": point, "at": at, **kw}

    chains = [
        ("saves", [fault("save-write-1"), fault("save-write-3"), fault("save-complete"), fault("save-installed"),
                   fault("save-pointer"), fault("delete"), fault("save-write-2", "final"),
                   fault("save-installed", "final")], {}),
        # Each final-save fault leaves the last step unsaved, but the last one, which kills during pruning.
        ("final-save", [fault("save-write-1", "final"), fault("save-complete", "final"), fault("save-write-3", "final"),
                        fault("delete", "final")], {}),
        # A damaged newest checkpoint is passed over; its step is saved again (the old folder set aside first).
        ("damaged", [fault("save-pointer", "final"), {"kind": "damage", "how": "truncate-state"},
                     fault("save-aside"), fault("save-installed"), {"kind": "damage", "how": "truncate-draft"},
                     fault("delete"), {"kind": "damage", "how": "missing-config"}, fault("save-complete"),
                     fault("save-pointer"), {"kind": "damage", "how": "broken-header"}], {"keep_last": 2}),
        *((f"random-{seed}", timed(4), {}) for seed in range(3)),
        *((f"random-workers-{seed}", timed(3), {"workers": 2, "keep_last": 2}) for seed in range(2)),
        ("group-signals", [{"kind": "group", "signal": "SIGTERM", "lines": 1},
                           fault("save-write-2", term=True),
                           {"kind": "group", "signal": "SIGINT", "lines": 2},
                           {"kind": "group", "signal": "SIGTERM", "lines": 1}], {"workers": 2}),
    ]
    results = run_chains(setup, chains)
    kills = [a for r in results for a in r["attempts"] if a["kind"] in ("timed", "fault") and not a.get("term")]
    landed = [a for a in kills if a["status"] == -signal.SIGKILL]
    groups = [a for r in results for a in r["attempts"] if a["kind"] == "group" or a.get("term")]
    saved = [a for a in groups if a["status"] in (130, 143) and a["after"] > a["before"]]
    damaged = [a for r in results for a in r["attempts"] if a["kind"] == "damage"]
    errors = [f"{r['name']}: {e}" for r in results for e in r["errors"]]
    with capsys.disabled():
        print(f"\nfault drills: {len(landed)} SIGKILLs landed of {len(kills)} tried (the rest found the run done), "
              f"{len(groups)} group signals ({len(saved)} saved a new checkpoint and exited 130/143), "
              f"{len(damaged)} damaged newest checkpoints; {len(results)} chains, "
              f"{'no failures' if not errors else f'{len(errors)} failures'}")
    assert not errors, "\n".join(errors)
    assert len(results) == len(chains)
    assert all(a["status"] == -signal.SIGKILL for a in kills if a["kind"] == "fault"), kills  # every point reached
    assert len(landed) >= len(kills) - 4  # the random delays mostly land before the run ends
    assert all(a["status"] in (130, 143) for a in groups), groups  # saved and said so, never a traceback


def test_group_signal_before_the_first_step_ends_the_run_cleanly(setup):
    """SIGTERM to the group while the run is still loading (no step trained, no handler yet): the
    process ends by the signal, nothing half-written is left, and the next launch trains from scratch."""
    run = setup["root"] / "early"
    args = train_args(setup, run, "data.num_workers=2", "keep_last=1")
    log = setup["root"] / "early.log"
    proc = launch(args, log, setsid=True)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    status = wait(proc, log)
    assert status in (-signal.SIGTERM, 143), status
    assert wait(launch(args, setup["root"] / "early.2.log"), setup["root"] / "early.2.log") == 0
    assert newest_intact(run, setup["reference"]) == MAX_STEPS
    shutil.rmtree(run)


def test_a_write_error_from_the_kernel_ends_in_one_line_and_keeps_the_checkpoints(setup):
    """A real failing write during a save: a file-size limit makes the kernel refuse the weights file
    (EFBIG; a full disk gives ENOSPC the same way). One line names the file and the cause, the exit code
    is 4, the earlier checkpoints are intact and nothing half-written is left."""
    run = setup["root"] / "full"
    shutil.copytree(setup["reference"], run)
    args = train_args(setup, run, "data.num_workers=0", "keep_last=100", "save_interval=1", f"max_steps={MAX_STEPS + 1}")
    log = setup["root"] / "full.log"
    assert wait(launch(args, log, file_size_limit=100_000), log) == 4
    text = (setup["root"] / "full.log").read_text()
    assert "Traceback" not in text
    (line,) = [line for line in text.splitlines() if line.startswith("dflash train: error:")]
    assert f"step-{MAX_STEPS + 1:08d}" in line and "draft.safetensors: File too large" in line, line
    assert newest_intact(run, setup["reference"]) == MAX_STEPS
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    shutil.rmtree(run)


def test_runs_share_no_lock_with_the_test_process(setup):
    """The CI hang, planted: this process holds tqdm's write lock (as a SIGKILLed fork that was drawing a
    bar leaves it). A run, which draws bars, must still finish: runs come from the forkserver."""
    from tqdm import tqdm

    lock = tqdm.get_lock()
    run, log = setup["root"] / "locked", setup["root"] / "locked.log"
    lock.acquire()
    try:
        status = wait(launch(train_args(setup, run, "data.num_workers=0", "max_steps=2"), log), log, timeout=90)
    finally:
        lock.release()
    assert status == 0, log.read_text()[-2000:]
    assert "Loading weights" in log.read_text()  # it drew a bar
    shutil.rmtree(run)


def test_a_log_is_read_only_after_its_last_writer_is_gone(tmp_path):
    """What a SIGKILLed run's orphaned worker prints after the run ended is in the log the drill reads."""
    log = tmp_path / "orphan.log"
    script = "import sys, time; f = open(sys.argv[1], 'a'); time.sleep(1.0); f.write('EOFError'); f.close()"
    with log.open("w") as opened:
        writer = subprocess.Popen([sys.executable, "-c", script, str(log)])  # fork + exec: no shared locks
        opened.write("Traceback (most recent call last):\n")
    deadline = time.monotonic() + 10
    while not holds_open(Path(f"/proc/{writer.pid}/fd"), str(log.resolve())):
        assert time.monotonic() < deadline, "the writer never opened the log"
        time.sleep(0.01)
    wait_for_writers(log)
    assert log.read_text().endswith("EOFError")
    writer.wait()
