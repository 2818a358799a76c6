"""examples/finetune.ipynb runs top to bottom (tiny configuration), with plain json + exec; the
plot helper it uses (dflash.report.plot) writes its PNGs.

The notebook reads its parameters from the environment (`DFLASH_NOTEBOOK_TINY=1`: a random
2-layer target over SmolLM2's tokenizer, a few prompts, 6 steps). Running this file as a script
executes the notebook in its real configuration and prints each cell's time:

    python tests/test_notebook.py [RUN_DIR] [PLOTS_DIR]

The notebook is committed with the outputs of one real run, so that its plots show when the repository
is browsed. To record them again (a Jupyter kernel, `pip install nbclient ipykernel`; about six minutes
on two CPU cores):

    python tests/test_notebook.py --record
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "finetune.ipynb"


def code_cells(path: Path = NOTEBOOK) -> list[str]:
    """The source of every code cell, in order."""
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4, "expected an nbformat 4 notebook"
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def run_notebook(path: Path = NOTEBOOK, *, verbose: bool = False) -> dict[str, Any]:
    """Execute the code cells in one namespace, as a kernel would; returns the namespace.

    A failing cell raises with its index, so the error names the cell."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for index, source in enumerate(code_cells(path)):
        start = time.perf_counter()
        try:
            exec(compile(source, f"{path.name}[cell {index}]", "exec"), namespace)
        except Exception as e:
            raise RuntimeError(f"{path.name}: code cell {index} failed: {type(e).__name__}: {e}") from e
        if verbose:
            print(f"--- cell {index}: {time.perf_counter() - start:.1f} s", flush=True)
    return namespace


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_cells_are_plain_python_and_the_saved_outputs_are_one_run():
    nb = json.loads(NOTEBOOK.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for index, cell in enumerate(cells):
        source = "".join(cell["source"])
        compile(source, f"cell {index}", "exec")  # no IPython magics or shell escapes: exec must run it
        assert not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()), index
    if any(cell["outputs"] for cell in cells):  # recorded by `--record`: every cell, top to bottom, plots shown
        assert [cell["execution_count"] for cell in cells] == list(range(1, len(cells) + 1))
        assert not [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
        images = [i for i, c in enumerate(cells) if any("image/png" in o.get("data", {}) for o in c["outputs"])]
        plotting = [i for i, c in enumerate(cells) if "plt.show()" in "".join(c["source"])]
        assert images == plotting and plotting, (images, plotting)


def test_notebook_runs_end_to_end_on_a_tiny_configuration(tmp_path, monkeypatch):
    from helpers import check_speculative_report  # here: run as a script, this file leaves torch's threads alone

    run_dir, plots = tmp_path / "run", tmp_path / "plots"
    monkeypatch.setenv("DFLASH_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("DFLASH_NOTEBOOK_RUN_DIR", str(run_dir))
    monkeypatch.setenv("DFLASH_NOTEBOOK_PLOTS_DIR", str(plots))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # plt.show() in a headless test
    ns = run_notebook()

    assert ns["TINY"] and ns["summary"]["steps"] == ns["MAX_STEPS"] == 6
    train_logs = [h for h in ns["history"] if "loss" in h]
    assert [h["step"] for h in train_logs] == [2, 4, 6]  # log_interval 2
    assert len(train_logs[-1]["per_position_accuracy"]) == ns["config"].draft.block_size - 1
    assert any("eval_tau" in h for h in ns["history"])
    assert {p.name for p in ns["export_dir"].iterdir()} == {"config.json", "model.safetensors", "eval.json"}
    spec = ns["spec"]
    assert spec["num_prompts"] == ns["HELD_OUT"] and spec["block_size"] == ns["BLOCK_SIZE"]
    assert spec["new_tokens"] <= ns["HELD_OUT"] * ns["SPEC_TOKENS"]
    check_speculative_report(spec)  # the τ the notebook prints is the decode's tokens per target forward
    assert json.loads((run_dir / "export" / "eval.json").read_text()) == spec  # what plot_run reads
    if _has_matplotlib():
        assert sorted(p.name for p in plots.iterdir()) == sorted(
            ["loss.png", "tau.png", "per_position_heatmap.png", "per_position.png"])
    else:
        assert not plots.exists()  # the plot cells say how to get matplotlib and skip


def _history(logs: int = 5, bs: int = 4) -> list[dict[str, Any]]:
    """A DFlashTrainer-style history: training logs every 10 steps, evaluations every 20."""
    rows: list[dict[str, Any]] = []
    for i in range(1, logs + 1):
        acc = [min(1.0, 0.1 * i / k) for k in range(1, bs)]
        rows.append({"step": 10 * i, "loss": 8.0 / i, "tau": 1 + 0.1 * i, "per_position_accuracy": acc})
        if i % 2 == 0:
            rows.append({"step": 10 * i, "eval_loss": 9.0 / i, "eval_tau": 1 + 0.08 * i,
                         "eval_per_position_accuracy": acc})
    return rows


def test_plot_run_writes_the_pngs_of_a_run_folder(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from dflash.report.plot import history_figures, plot_run

    run = tmp_path / "run"
    run.mkdir()
    history = _history()
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    (run / "export").mkdir()
    (run / "export" / "eval.json").write_text(json.dumps({"tau": 1.4, "per_position_acceptance": [0.3, 0.1, 0.0]}))
    paths = plot_run(run)
    assert [p.name for p in paths] == ["loss.png", "tau.png", "per_position_heatmap.png", "per_position.png"]
    assert all(p.parent == run / "plots" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    assert plot_run(run, tmp_path / "elsewhere")[0] == tmp_path / "elsewhere" / "loss.png"

    figures = history_figures(history, {"per_position_acceptance": [0.3, 0.1, 0.0]})
    heat = figures["per_position_heatmap"].axes[0].images[0].get_array()
    assert heat.shape == (3, 5)  # positions 1..bs-1 by training logs, in order
    last_train = [row for row in history if "loss" in row][-1]
    assert heat[0, -1] == last_train["per_position_accuracy"][0] and heat[2, -1] == last_train["per_position_accuracy"][2]
    loss_axes = figures["loss"].axes[0]
    assert [line.get_label() for line in loss_axes.lines] == ["train", "held-out"]
    assert list(loss_axes.lines[0].get_xdata()) == [10, 20, 30, 40, 50]
    curves = [line.get_label() for line in figures["per_position"].axes[0].lines]
    assert curves[-1].startswith("speculative") and len(curves) == 4


def test_plot_run_refuses_a_folder_without_history(tmp_path):
    from dflash.report.plot import plot_run

    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        plot_run(tmp_path)


def as_terminal(text: str) -> str:
    """A stream as a terminal leaves it: on each line, what follows the last carriage return (a progress
    bar's final state, not every redraw), cursor-movement escapes dropped, blank lines folded."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n") + "\n"


def _merged_streams(outputs: list[Any]) -> list[Any]:
    """Consecutive outputs of one stream joined into one, as a notebook front end shows them."""
    merged: list[Any] = []
    for output in outputs:
        if (output.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1]["name"] == output["name"]):
            merged[-1]["text"] += output["text"]
        else:
            merged.append(output)
    return merged


def record_outputs(path: Path = NOTEBOOK, timeout: int = 3600) -> None:
    """Run the notebook in a Jupyter kernel (the real configuration, from the repository root) and save it
    with its outputs, streams as a terminal shows them."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parents[1])}}).execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = _merged_streams(cell.outputs)
            for output in cell.outputs:
                if output.get("output_type") == "stream":
                    output["text"] = as_terminal(output["text"])
            cell.outputs = [o for o in cell.outputs if o.get("output_type") != "stream" or o["text"].strip()]
    nbformat.write(nb, path)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record_outputs()
elif __name__ == "__main__":  # the real configuration, e.g. to refresh docs/images
    if len(sys.argv) > 1:
        os.environ["DFLASH_NOTEBOOK_RUN_DIR"] = sys.argv[1]
    if len(sys.argv) > 2:
        os.environ["DFLASH_NOTEBOOK_PLOTS_DIR"] = sys.argv[2]
    os.environ.setdefault("MPLBACKEND", "Agg")
    run_notebook(verbose=True)


def test_the_committed_outputs_show_no_machine_paths():
    """The notebook is committed with a real run's outputs: they name the run's folder as a reader's clone would
    (`runs/notebook/...`), never the machine it ran on (an absolute checkout or home path, a venv's warnings)."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    texts = ["".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert any("runs/notebook/export" in t for t in texts)
    for text in texts:
        assert not re.search(r"(^|[\s'\"(])/(work|root|home|Users|tmp)/", text), text[:300]
        assert "site-packages" not in text, text[:300]
