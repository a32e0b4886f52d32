"""Runs ``jascl <args>`` and SIGKILLs its own process at a chosen point (for the crash-resume tests).

Usage: ``python tests/kill_run.py POINT jascl-args...`` where POINT is

* ``step:N``          right after the N-th optimiser step of the run (mid-epoch),
* ``write:NAME:N``    in the middle of the N-th safetensors write of a file called NAME
                      (half of the temporary file is on disk, the rename has not happened),
* ``session:N``       right after the N-th session of the run was completed and saved (between sessions),
* ``signal:N:NAME``   sends itself signal NAME (e.g. SIGTERM) right after the N-th optimiser step, and lets
                      jascl handle it (a clean stop, not a kill); ``SIGINT,SIGINT`` sends two in a row (the
                      second Ctrl-C that aborts at once),
* ``none``            nowhere: the run as ``jascl <args>`` (the uninterrupted reference).

Nothing in jascl knows about this: the points are reached by wrapping its functions from outside.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    point, args = sys.argv[1], sys.argv[2:]
    kind, _, rest = point.partition(":")
    count = {"n": 0}

    if kind in ("step", "signal"):
        from jascl.engine.loop import ContinualTrainer

        n, _, name = rest.partition(":")

        def send() -> None:  # NAME may list several signals, sent one after the other: SIGINT,SIGINT
            for one in name.split(","):
                os.kill(os.getpid(), getattr(signal, one))

        act = die if kind == "step" else send
        fire = ContinualTrainer.fire

        def fire_and_maybe_act(self, event, state):
            fire(self, event, state)
            if event == "after_update":
                count["n"] += 1
                if count["n"] == int(n):
                    act()

        ContinualTrainer.fire = fire_and_maybe_act
    elif kind == "write":
        import jascl.engine.checkpoint as checkpoint

        name, n = rest.rsplit(":", 1)
        save_file = checkpoint.save_file

        def save_half_and_die(tensors, filename, metadata=None):
            save_file(tensors, filename, metadata=metadata)
            tmp = Path(filename).name  # jascl.fileio.atomic_write's temporary name: .<name>.<random>.tmp
            if tmp.startswith(f".{name}.") and tmp.endswith(".tmp"):
                count["n"] += 1
                if count["n"] == int(n):
                    size = os.path.getsize(filename)
                    with open(filename, "r+b") as fh:
                        fh.truncate(size // 2)
                    die()

        checkpoint.save_file = save_half_and_die
    elif kind == "session":
        from jascl.engine.loop import ContinualTrainer

        run_session = ContinualTrainer.run_session

        def run_and_maybe_die(self, *a, **kw):
            record = run_session(self, *a, **kw)
            count["n"] += 1
            if count["n"] == int(rest):
                die()
            return record

        ContinualTrainer.run_session = run_and_maybe_die
    elif kind != "none":
        raise SystemExit(f"unknown point {point!r}")

    from jascl.cli import main as jascl_main

    return jascl_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
