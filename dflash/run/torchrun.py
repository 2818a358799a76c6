"""`python -m dflash.run.torchrun [torchrun's arguments]`: torchrun, with dflash's exit codes for a signalled run.

Under torchrun the launcher's exit code is the launcher's own. SIGTERM to torchrun (what a scheduler sends to the
job) makes its agent raise `SignalException` and exit 1 with a traceback, once it has passed SIGTERM on to the
ranks, which save and exit 143 (`dflash.run.stopping`); a signal to the ranks alone makes them exit 143 and the
agent report a `ChildFailedError`, again exit 1. A scheduler that requeues on 143 then sees a failure. No rank can
change that: the code is decided by torch's agent. This entry point runs torchrun unchanged and maps those two
endings back to the shell's code for a signalled process, 128 + the signal (143 SIGTERM, 130 SIGINT):

- the agent got a signal: 128 + that signal, in one line instead of the traceback;
- the failed ranks exited 128 + N (saved after signal N; `dflash.run.stopping.interrupted_exit_code`), or some of
  them were ended by the signal itself: 128 + N. A rank that exits 128 + N has passed the save's barrier, so the
  checkpoint is written; the agent, seeing that rank end, sends the others SIGTERM, which may find one already
  past its handlers (seen: rank 1 exited 143, rank 0 was ended by the agent's SIGTERM).

Every other ending is torchrun's (0, or 1 with its failure report).
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    """torchrun with `argv` (default: this process's arguments); its exit code, a signalled run's mapped to 128 + N."""
    try:
        torchrun_main(argv if argv is not None else sys.argv[1:])
    except SignalException as e:  # the agent itself was signalled; it has sent the ranks SIGTERM and waited for them
        print(f"torchrun: stopped by {signal.Signals(e.sigval).name}; the ranks were asked to save and stop",
              file=sys.stderr)
        return 128 + signal.Signals(e.sigval).value
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        for sig in _STOP_SIGNALS:  # a rank saved after `sig` and exited 128 + sig; the others that failed, by `sig`
            if 128 + sig.value in codes and codes <= {128 + sig.value, -sig.value}:
                return 128 + sig.value
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
