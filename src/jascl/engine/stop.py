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
* several processes: after the step that follows the one in which the first rank
  saw the signal, every rank after the same step (:class:`StopVote`: after every step each
  rank posts a vote and reads the sum of the votes posted after the step before); a method
  that cannot resume inside an epoch stops at the epoch's end, where the signal
  is combined over ranks with the epoch loss;
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

import torch
import torch.distributed as dist

from jascl import distributed
from jascl.errors import JasclError

#: the signals ``jascl run`` turns into a clean stop
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

#: what the first Ctrl-C prints (rank 0 only); it may come while the run fills the store, before any step
FIRST_INTERRUPT = (
    "\nCtrl-C: stopping cleanly (after the current step, with a checkpoint; while the store is being filled, at "
    "once, keeping its entries); press Ctrl-C again to abort now\n"
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


class StopVote:
    """Whether to stop after this optimiser step: asked after every step, the same answer on every rank.

    One process: :data:`REQUEST`'s answer, at once. Several: each rank posts its own flag after every step in a
    non-blocking all-reduce on a host group (:func:`jascl.distributed.host_group`) and reads the sum posted
    after the step before, which has arrived while this step ran. So a signal that reaches any rank, in any
    step, stops every rank after the same step, one step after the first rank saw it; the price is one
    one-float gloo all-reduce per step, with no wait on the GPU. Without it the ranks could only stop where
    they synchronise anyway (a ``checkpoint_steps`` checkpoint or an epoch's end), which at the paper's scale
    can be minutes after a cluster's warning and after it kills the job.

    Every rank must call :meth:`after_step` after the same steps (the training loop does, for every step of a
    session whose method can resume inside an epoch).
    """

    def __init__(self) -> None:
        self._group = distributed.host_group() if distributed.active() else None
        self._posted: tuple[dist.Work, torch.Tensor] | None = None

    def after_step(self) -> bool:
        if self._group is None:
            return REQUEST.requested
        if self._posted is not None:
            work, votes = self._posted
            work.wait()
            if votes.item() > 0:
                self._posted = None
                return True
        flag = torch.full((1,), float(REQUEST.requested))
        self._posted = (dist.all_reduce(flag, group=self._group, async_op=True), flag)
        return False
