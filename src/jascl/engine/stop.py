"""Stopping a run cleanly on a signal: finish the step, write a checkpoint, exit resumable.

Clusters announce the end of a job before killing it: SLURM sends SIGTERM at
pre-emption and at the time limit (or, with ``#SBATCH --signal=USR1@120``,
SIGUSR1 two minutes before), and torchrun forwards SIGTERM to its workers.
Ctrl-C (SIGINT) is the same request from a terminal. ``jascl run``, ``compare``
and ``sweep`` install :data:`REQUEST`'s handlers for SIGTERM, SIGUSR1 and SIGINT;
the handler only records the signal, and the trainer acts on it at a safe point:

* one process: right after the current optimiser step, with an in-session
  checkpoint taken there (at the epoch's end for a method that cannot resume
  inside an epoch);
* several processes: at the next point where the ranks synchronise anyway
  (a ``checkpoint_steps`` checkpoint or an epoch's end), so that every rank stops
  at the same step; the signal is combined over ranks with the epoch loss;
* between sessions: before the next session starts.

It then raises :class:`Stopped`; ``jascl run`` prints where the run stands and
exits with 128 + the signal number. ``jascl run --resume`` continues it exactly.

A second Ctrl-C while a stop is pending does not wait for the step: it raises
:class:`KeyboardInterrupt` at once. What is on disk then is the last checkpoint
(every write is atomic, :mod:`jascl.fileio`), from which the run resumes.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from jascl import distributed
from jascl.errors import JasclError

#: the signals ``jascl run`` turns into a clean stop
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

#: what the first Ctrl-C prints (rank 0 only)
FIRST_INTERRUPT = (
    "\nCtrl-C: stopping after the current step and writing a checkpoint; press Ctrl-C again to abort now\n"
)


class Stopped(JasclError):
    """The run stopped on a signal after saving its state; ``jascl run --resume`` continues it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopRequest:
    """The first stop signal received since :meth:`installed` (None: none)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "-"

    def request(self, signum: int) -> None:
        if self.signum is None:
            self.signum = int(signum)

    def clear(self) -> None:
        self.signum = None

    def handle(self, signum: int, frame: object = None) -> None:
        """The signal handler: record the first stop signal; a Ctrl-C while a stop is pending aborts at once.

        Raises:
            KeyboardInterrupt: SIGINT after an earlier stop signal.
        """
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt
        self.request(signum)
        if signum == signal.SIGINT and distributed.is_main():
            sys.stderr.write(FIRST_INTERRUPT)
            sys.stderr.flush()

    @contextlib.contextmanager
    def installed(self, signals: tuple[str, ...] = SIGNALS) -> Iterator[StopRequest]:
        """Handle ``signals`` by recording them while the block runs (main thread only; else a no-op)."""
        self.clear()
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {}
        for name in signals:
            number = getattr(signal, name, None)
            if number is not None:  # (SIGUSR1 does not exist on Windows)
                previous[number] = signal.signal(number, self.handle)
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            self.clear()

    def stopped(self, where: str) -> Stopped:
        """The exception that ends the run, ``where`` saying what was saved.

        A rank stopped because another rank received the signal reports SIGTERM's exit code.
        """
        if self.signum is None:
            return Stopped(f"stopped (another process received a stop signal) {where}", signal.SIGTERM)
        return Stopped(f"stopped on {self.name} {where}", self.signum)


#: the request the trainer consults (``jascl run`` installs its handlers)
REQUEST = StopRequest()
