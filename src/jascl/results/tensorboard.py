"""Live TensorBoard scalars of a run, as a plugin on the training loop (``tensorboard: true``).

Appended as the *last* plugin of every method (so it sees every loss term and
the statistics other plugins leave in ``state.metrics``), it writes to
``<run>/tensorboard/<method>/`` with :class:`torch.utils.tensorboard.SummaryWriter`:

==========================================  ========================================  ======================
tag                                         value                                     step
==========================================  ========================================  ======================
``s<t>-<name>/loss/<term>``, ``.../total``  every loss term of the iteration          iteration in session t
``s<t>-<name>/epoch_loss``                  mean total loss of the epoch              epoch in session t
``s<t>-<name>/gas/<layer>/scale_<stat>``    mean / std / min / max of the GAS noise   iteration in session t
                                            scale G~^-1 (paper eq. 1) per GAS layer
``eval/<split>``                            all / old / new / base / background       session index
``eval_class/<id>-<name>``                  per-class score (the protocol's metric)   session index
``pseudo_labels/<stat>``                    coverage, precision, confidence-only      session index
                                            ones, teacher error (mean teacher / PAS)
==========================================  ========================================  ======================

Sessions are logged under their own tags with steps counted from 0, so a
resumed run adds exactly the sessions it trains. A session reused instead of
trained (the shared base model, or a finished session of an interrupted run)
logs its saved ``metrics.json`` (evaluation and pseudo-label statistics);
its training curves are in the TensorBoard files of the run that trained it
(the shared base model is trained without method plugins: its losses are in
``log.txt``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jascl.engine.plugin import Plugin
from jascl.methods.gas import GASNoise
from jascl.results.records import SPLITS, SessionRecord

if TYPE_CHECKING:
    from jascl.engine.state import LoopState

__all__ = ["TensorBoardPlugin", "gas_scale_stats", "session_scalars"]

#: numeric pseudo-label statistics logged per session (``metrics.json`` -> ``pseudo_labels``)
PSEUDO_LABEL_KEYS = (
    "coverage",
    "precision",
    "confidence_only_coverage",
    "confidence_only_precision",
    "foreground_precision",
    "teacher_error_final",
    "eps_inf_predicted",
)


@torch.no_grad()
def gas_scale_stats(noise: GASNoise) -> dict[str, float]:
    """Summary of a GAS layer's current noise scale G~^-1 (paper eq. 1), elementwise in (0, 1].

    Args:
        noise: the parametrization holding the last squared gradient.

    Returns:
        ``{"mean", "std", "min", "max"}`` of ``noise.scale()`` (std over elements, population).
    """
    scale = noise.scale().double()
    return {
        "mean": float(scale.mean()),
        "std": float(scale.std(unbiased=False)),
        "min": float(scale.min()),
        "max": float(scale.max()),
    }


def session_scalars(record: SessionRecord | Mapping[str, Any], class_names: Mapping[int, str]) -> dict[str, float]:
    """TensorBoard tags and values of one session's metrics record (as saved in ``metrics.json``).

    Missing (None / NaN) values are left out: TensorBoard cannot draw them.
    """
    if not isinstance(record, SessionRecord):
        record = SessionRecord.from_json(record)
    out: dict[str, float] = {}
    for key in SPLITS:
        if not math.isnan(v := record.score(key)):
            out[f"eval/{key}"] = v
    for key, v in record.per_class.items():
        if not math.isnan(v):
            out[f"eval_class/{key}-{class_names.get(int(key), key)}"] = v
    if record.pseudo_labels is not None:
        for key in PSEUDO_LABEL_KEYS:
            if not math.isnan(v := record.pseudo_label_value(key)):
                out[f"pseudo_labels/{key}"] = v
    return out


class TensorBoardPlugin(Plugin):
    """Writes losses, GAS noise-scale statistics, evaluation and pseudo-label scalars to TensorBoard.

    Args:
        run_dir: the run folder; logs go to ``<run_dir>/tensorboard/<method name>/``.
        gas_every: log GAS statistics every this many iterations (they cost one
            pass over the GAS layer's squared gradients).
    """

    name = "tensorboard"

    def __init__(self, run_dir: str | Path, gas_every: int = 1) -> None:
        self.run_dir = Path(run_dir)
        self.gas_every = max(int(gas_every), 1)
        self._writer: Any = None  # a torch.utils.tensorboard.SummaryWriter once the first method starts
        self._method: str | None = None
        self._epoch_total = 0.0
        self._epoch_steps = 0

    # ---------------------------------------------------------------- helpers

    def writer(self, state: LoopState):
        if self._writer is None or self._method != state.method_name:
            from torch.utils.tensorboard import SummaryWriter

            self.close()
            self._method = state.method_name
            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard" / state.method_name))
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @staticmethod
    def _prefix(state: LoopState) -> str:
        return f"s{state.session.index}-{state.session.name}"

    def _log_record(self, state: LoopState, record: Mapping[str, Any]) -> None:
        names = {c.id: c.name for c in state.protocol.classes}
        writer = self.writer(state)
        for tag, value in session_scalars(record, names).items():
            writer.add_scalar(tag, value, state.session.index)
        writer.flush()

    # ---------------------------------------------------------------- events

    #: the epoch's running loss sum and step count are in the checkpoint
    mid_epoch_resume = True

    def before_epoch(self, state: LoopState) -> None:
        self._epoch_total, self._epoch_steps = 0.0, 0

    def after_update(self, state: LoopState) -> None:
        writer = self.writer(state)
        prefix = self._prefix(state)
        total = 0.0
        for term, value in state.losses.items():
            v = float(value.detach())
            total += v
            writer.add_scalar(f"{prefix}/loss/{term}", v, state.iteration)
        writer.add_scalar(f"{prefix}/loss/total", total, state.iteration)
        self._epoch_total += total
        self._epoch_steps += 1
        if state.iteration % self.gas_every == 0:
            for module_name, module in state.model.named_modules():
                if isinstance(module, GASNoise):
                    # "classifier.conv.parametrizations.weight.0" -> "classifier.conv"
                    layer = module_name.split(".parametrizations.")[0]
                    for stat, stat_value in gas_scale_stats(module).items():
                        writer.add_scalar(f"{prefix}/gas/{layer}/scale_{stat}", stat_value, state.iteration)

    def after_epoch(self, state: LoopState) -> None:
        if self._epoch_steps:
            self.writer(state).add_scalar(
                f"{self._prefix(state)}/epoch_loss", self._epoch_total / self._epoch_steps, state.epoch
            )

    def after_session(self, state: LoopState) -> None:
        if state.record:  # the session's record as it will be saved (evaluation's, and the plugins' reports)
            self._log_record(state, {**state.record, **state.report})
        self.close()

    def session_restored(self, state: LoopState) -> None:
        t, name = state.session.index, state.session.name
        # the folder the session was restored from (the shared base, a keyed base such as JASCL's, or the
        # method's own finished session), then the usual places
        candidates = [*([state.out_dir] if state.out_dir is not None else [])]
        candidates += [self.run_dir / state.method_name / f"s{t}-{name}"] + ([self.run_dir / "base"] if t == 0 else [])
        for folder in candidates:
            path = folder / "metrics.json"
            if path.is_file():
                self._log_record(state, json.loads(path.read_text()))
                break
        self.close()
