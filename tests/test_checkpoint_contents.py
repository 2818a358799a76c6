"""A checkpoint whose contents do not fit the draft is refused before anything is loaded, naming the tensor.

Each case re-saves a real run's checkpoint with one value changed through `save_checkpoint`, so sizes and
checksums are consistent: what is refused is the content (a state written for another draft, or by a
tool that wrote NaNs), not the file's damage, which `find_latest` already catches."""

from __future__ import annotations

import pytest
import torch
from test_reliability import fresh_trainer, run_config

from dflash.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def _edit_and_resave(run, edit) -> None:
    folder = run / "checkpoints" / "step-00000004"
    draft_state, draft_config, state = load_checkpoint(folder)
    edit(draft_state, state)
    save_checkpoint(run, 4, draft_state, draft_config, state)


def _moment(name, key, value):
    def edit(draft_state, state):
        state["optimizer"]["state"][name][key] = value(state["optimizer"]["state"][name][key])
    return edit


CASES = {
    "moment of the wrong shape": (_moment("fc.weight", "exp_avg", lambda m: m[:, :-1].clone()),
                                  "optimizer exp_avg of fc.weight is"),
    "moment of another dtype": (_moment("fc.weight", "exp_avg_sq", lambda m: m.double()),
                                "optimizer exp_avg_sq of fc.weight is"),
    "NaN moment": (_moment("norm.weight", "exp_avg", lambda m: torch.full_like(m, float("nan"))),
                   "optimizer exp_avg of norm.weight holds non-finite values"),
    "negative second moment": (_moment("norm.weight", "exp_avg_sq", lambda m: -1 - m),
                               "optimizer exp_avg_sq of norm.weight holds negative values"),
    "weight of the wrong shape": (lambda d, s: d.update({"fc.weight": d["fc.weight"][:-1].clone()}),
                                  "weight fc.weight has shape"),
    "NaN weight": (lambda d, s: d["norm.weight"].fill_(float("inf")), "weight norm.weight holds non-finite values"),
    "missing weight": (lambda d, s: d.pop("norm.weight"), "weight norm.weight is missing"),
    "state of an unknown parameter": (lambda d, s: s["optimizer"]["state"].update(
        {"extra.weight": {"exp_avg": torch.zeros(2)}}), "optimizer state for extra.weight"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_refuses_a_checkpoint_that_does_not_fit(tmp_path, case):
    edit, message = CASES[case]
    fresh_trainer(run_config(tmp_path, max_steps=4, save_interval=4)).fit()
    _edit_and_resave(tmp_path, edit)
    resumed = fresh_trainer(run_config(tmp_path, max_steps=6, save_interval=4, resume_from="latest"))
    before = {k: v.clone() for k, v in resumed.draft.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not fit this draft") as caught:
        resumed.fit()
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    after = resumed.draft.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    assert resumed.step == 0


def test_an_unedited_resave_resumes(tmp_path):
    """The control: the same re-save without an edit resumes and trains on (the cases above fail for
    their edit alone)."""
    fresh_trainer(run_config(tmp_path, max_steps=4, save_interval=4)).fit()
    _edit_and_resave(tmp_path, lambda draft_state, state: None)
    resumed = fresh_trainer(run_config(tmp_path, max_steps=6, save_interval=4, resume_from="latest"))
    resumed.fit()
    assert resumed.step == 6
