"""The tests' environment (offline, one thread) and shared fixtures: `tiny_target` (fresh per test), `target`,
`tokenizer`, `trained` and `trained_domino` (built once per module that asks: module scope, so a module trains each
draft once), `tiny_target_dir`, `conversations_file`, and every test's own empty working folder. The builders
behind them live in `helpers.py`, which test files import by name."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# One thread per process (the test's and every process it starts) unless a test says otherwise: the steps
# here are tiny, and on shared CI cores torch's default thread count stalls in OpenMP (one test 54 s -> 2.8 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # also where the environment already set OMP_NUM_THREADS to more

from helpers import DOMINO_HEAD, chat_file, make_tiny_target, save_tiny_target, train_on_continuations  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _module_working_folder(tmp_path_factory):
    """Module-scoped fixtures start in a fresh, empty folder of the module's own (autouse: entered before them).
    See `_own_working_folder`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cwd-module"))
        yield


@pytest.fixture(autouse=True)
def _own_working_folder(_module_working_folder, tmp_path_factory, monkeypatch):
    """Every test runs in a fresh, empty working folder of its own, outside the clone: a relative path (the
    default `output_dir`, `runs/embedded` or `runs/dflash`) then never meets what `dflash train` or another
    test left in the folder pytest was started from, and no test writes into the clone. Imports do not
    depend on it (pyproject's `pythonpath` is absolute), and the tests that run `scripts/...` or
    `tests/...` pass `cwd=ROOT` to the process they start."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def tiny_target():
    """A fresh tiny target per test (one the test may change)."""
    return make_tiny_target()


@pytest.fixture(scope="module")
def target():
    """One tiny target shared by a module's tests (left unchanged by them)."""
    return make_tiny_target()


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded SmolLM2 tokenizer (with its chat template), loaded once per module."""
    from transformers import AutoTokenizer

    from dflash.embedded import embedded_target_dir

    return AutoTokenizer.from_pretrained(embedded_target_dir())


@pytest.fixture(scope="module")
def trained(target):
    """A DFlash draft trained on the module's `target`'s greedy continuations (20 steps, once per module)."""
    return train_on_continuations(target)


@pytest.fixture(scope="module")
def trained_domino(target):
    """A Domino draft trained on the module's `target`'s greedy continuations (30 steps, once per module)."""
    return train_on_continuations(target, steps=30, **DOMINO_HEAD, domino__decay_ratio=0.3)


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-target")
    save_tiny_target(out)
    return out


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory):
    return chat_file(tmp_path_factory.mktemp("data") / "chats.jsonl")
