"""The stop decision under several processes: all ranks take the reduced decision, never their own flag."""

from __future__ import annotations

import torch

from dflash.run import stopping
from dflash.run.stopping import StopRequest


def test_a_signal_after_the_reduction_waits_for_the_next_flush(monkeypatch):
    """A signal that lands on this rank just after the all-reduce (the other rank saw no signal) must not
    stop this rank alone: it returns the reduced decision, False, and both ranks stop at the next flush."""
    stop = StopRequest(world_size=2)
    try:
        calls = []

        def all_reduce(flags: torch.Tensor, op=None) -> None:  # the other rank had no signal, no deadline
            calls.append(flags.clone())
            if len(calls) == 1:
                stop._handle(15, None)  # SIGTERM arrives on this rank right after the reduction

        monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
        assert stop.due(10, at_flush=False) is False and not calls  # between flushes: no collective
        assert stop.due(10, at_flush=True) is False  # what the other rank decides too
        assert stop.requested and stop.signal == "SIGTERM"
        assert stop.due(20, at_flush=True) is True  # the next flush carries it to every rank
        assert calls[1][0] == 1.0
    finally:
        stop.restore()


def test_another_ranks_signal_stops_this_rank_at_the_same_flush(monkeypatch):
    stop = StopRequest(world_size=2)
    try:
        monkeypatch.setattr(stopping.dist, "all_reduce", lambda flags, op=None: flags.__setitem__(0, 1.0))
        assert not stop.requested
        assert stop.due(5, at_flush=True) is True and stop.requested and stop.signal == "SIGTERM"
    finally:
        stop.restore()
