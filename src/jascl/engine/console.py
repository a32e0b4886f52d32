"""Training progress a person can follow: one line per epoch and a step bar inside it, as nnU-Net prints.

:class:`EpochLines` is a plugin the run adds after every method's own (``run_benchmark``'s progress display,
not part of any method): it changes nothing in training, keeps no state in checkpoints and can resume inside
an epoch. Per epoch it prints::

    [vanilla] session 1 (mri) epoch 3/10: loss 0.8123 (ce 0.4011, dice 0.4112), 12.3 s, ETA 1 min 26 s

(the loss terms are this process's means over the epoch's steps, those since the checkpoint in an epoch that
resumed inside; the ETA is the session's remaining epochs at its mean epoch time), and when a session continues from an in-session checkpoint, where::

    [vanilla] session 1 (mri): resuming after epoch 2 of 10 from its checkpoint

The step bar (tqdm, cleared at the epoch's end) is shown only when ``bars`` is true: the run asks for it on
an interactive terminal, so that logs written to a file hold lines, not carriage-return redraws.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from jascl.engine.plugin import Plugin
from jascl.engine.state import LoopState


def interactive() -> bool:
    """Whether progress bars can redraw in place: stderr is a terminal, or a Jupyter kernel shows them."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) or "ipykernel" in sys.modules


def duration(seconds: float) -> str:
    """``"12.3 s"``, ``"4 min 05 s"``, ``"2 h 03 min"``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class EpochLines(Plugin):
    """One line per epoch (loss terms, time, ETA), a step bar inside the epoch, and where a session resumed.

    Args:
        echo: where lines go (the run's console).
        bars: show the step bar (an interactive terminal).
    """

    name = "epoch-lines"
    mid_epoch_resume = True  # it sets nothing up that a resumed epoch would lack

    def __init__(self, echo: Callable[[str], None] = print, bars: bool = False) -> None:
        self.echo = echo
        self.bars = bars
        self._bar: Any = None
        self._sums: dict[str, torch.Tensor] = {}
        self._steps = 0
        self._last_steps: int | None = None
        self._started = 0.0
        self._times: list[float] = []
        self._first = True
        self._resumed = False  # the current epoch continues a checkpoint: fewer steps than a whole one

    # not part of any training state: nothing is checkpointed or restored
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

    def _say(self, line: str) -> None:
        """A line above the bars (tqdm clears and redraws them), or through ``echo`` without bars."""
        if self.bars:
            tqdm.write(line)
        else:
            self.echo(line)

    @staticmethod
    def _epochs(state: LoopState) -> int:
        cfg = state.config
        return int(cfg.epochs_base if state.session.index == 0 else cfg.epochs_incremental)

    @staticmethod
    def _where(state: LoopState) -> str:
        return f"[{state.method_name}] session {state.session.index} ({state.session.name})"

    def before_session(self, state: LoopState) -> None:
        self._times, self._first, self._last_steps = [], True, None

    def _start(self, state: LoopState, resumed_inside: bool) -> None:
        epochs = self._epochs(state)
        if self._first and (state.epoch > 0 or resumed_inside):
            where = f"inside epoch {state.epoch + 1}" if resumed_inside else f"after epoch {state.epoch}"
            self._say(f"{self._where(state)}: resuming {where} of {epochs} from its checkpoint")
        self._first, self._resumed = False, resumed_inside
        self._sums, self._steps, self._started = {}, 0, time.time()
        if self.bars:
            total = self._last_steps or math.ceil(len(state.data.train) / max(int(state.config.batch_size), 1))
            self._bar = tqdm(
                total=total, desc=f"epoch {state.epoch + 1}/{epochs}", unit="step", leave=False, position=2
            )

    def before_epoch(self, state: LoopState) -> None:
        self._start(state, resumed_inside=False)

    def resume_epoch(self, state: LoopState) -> None:
        self._start(state, resumed_inside=True)

    def after_update(self, state: LoopState) -> None:
        for key, value in state.losses.items():  # summed on the device: no host synchronisation per step
            value = value.detach().float()
            self._sums[key] = self._sums[key] + value if key in self._sums else value
        self._steps += 1
        if self._bar is not None:
            self._bar.update(1)

    def after_epoch(self, state: LoopState) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        seconds = time.time() - self._started
        self._times.append(seconds)
        if not self._resumed:  # a whole epoch's steps: the next bar's length
            self._last_steps = self._steps or self._last_steps
        epochs = self._epochs(state)
        steps = max(self._steps, 1)
        terms = {k: float(v) / steps for k, v in self._sums.items()}
        shown = ", ".join(f"{k} {v:.4f}" for k, v in terms.items())
        left = epochs - state.epoch - 1
        eta = f", ETA {duration(left * sum(self._times) / len(self._times))}" if left > 0 else ""
        self._say(
            f"{self._where(state)} epoch {state.epoch + 1}/{epochs}: loss {sum(terms.values()):.4f}"
            + (f" ({shown})" if len(terms) > 1 else "")
            + f", {duration(seconds)}{eta}"
        )
