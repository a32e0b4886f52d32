"""Why a session's new classes are not learned: prototype geometry and which rows take their pixels.

Two measurements of session ``t`` of a method in a finished run folder (:func:`new_class_geometry`):

* **cosines**: each new class's eq. 2 prototype, from session ``t``'s labelled samples (training labels:
  untaught classes are background) under the model session ``t`` *starts* from (the previous session's
  checkpoint: with a frozen backbone, the features the session trains on), against every prototype
  stored before session ``t`` (``s<session>.c<class>``; ``c0`` is a session's background). A new class
  whose prototype is almost parallel to an old class's (cosine near 1) cannot be told apart from it by a
  cosine classifier on those features: replaying the old prototype to its old row then hands the old row
  the new class too.
* **shares**: for each new class, the fraction of its test pixels / voxels (session ``t``'s test split) that
  session ``t``'s own model predicts as each seen class. A new class "learned by none" shows where its
  pixels went: to background, or to an old class's row.

Predictions use the evaluator's sliding window (``patch_size`` as ROI) in eval mode, without GAS noise.
Segmentation runs only. ``tools/new_class_geometry.py RUN METHOD SESSION`` prints both tables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from monai.inferers import sliding_window_inference

from jascl.data.datasets import training_labels
from jascl.data.types import dense
from jascl.engine.checkpoint import read_session_model
from jascl.engine.config import RunConfig, apply_mapping, translate_legacy
from jascl.engine.prototypes import PrototypeAccumulator, PrototypeStore
from jascl.errors import ConfigError
from jascl.evaluation.metrics import ConfusionAccumulator
from jascl.results.runs import RootOptions, load_run_sessions, protocol_from_resolved


@dataclass
class NewClassGeometry:
    """The two tables of :mod:`jascl.results.geometry` for one session.

    Attributes:
        session: the session index ``t`` (>= 1).
        seen: the classes seen in session ``t`` (global ids, row order).
        cosines: new class -> {``s<session>.c<class>``: cosine of its prototype to that stored prototype}.
        shares: new class -> {predicted class: fraction of the new class's test pixels}.
    """

    session: int
    seen: list[int]
    cosines: dict[int, dict[str, float]]
    shares: dict[int, dict[int, float]]

    def to_markdown(self) -> str:
        """Both tables as Markdown (new classes as rows)."""
        keys = sorted({k for row in self.cosines.values() for k in row}, key=_store_order)
        lines = [
            f"Session {self.session}: cosine of each new class's prototype (start-of-session model) "
            "to the prototypes stored before it",
            "",
            "| new class | " + " | ".join(keys) + " |",
            "|---" * (len(keys) + 1) + "|",
        ]
        lines += [f"| {c} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |" for c, row in self.cosines.items()]
        lines += [
            "",
            f"Session {self.session}: share of each new class's test pixels predicted as each seen class",
            "",
            "| new class | " + " | ".join(str(c) for c in self.seen) + " |",
            "|---" * (len(self.seen) + 1) + "|",
        ]
        lines += [f"| {c} | " + " | ".join(f"{row[k]:.3f}" for k in self.seen) + " |" for c, row in self.shares.items()]
        return "\n".join(lines)


def _store_order(key: str) -> tuple[int, int]:
    s, c = key.split(".")
    return int(s[1:]), int(c[1:])


def prototype_cosines(
    new: Mapping[int, torch.Tensor], stored: Mapping[tuple[int, int], torch.Tensor]
) -> dict[int, dict[str, float]]:
    """Cosine of each (D,) new prototype to each (D,) stored one (keys (session, class) -> ``s<session>.c<class>``)."""
    return {
        c: {
            f"s{s}.c{k}": float(F.cosine_similarity(p.float(), q.float(), dim=0))
            for (s, k), q in sorted(stored.items())
        }
        for c, p in new.items()
    }


def prediction_shares(
    confusion: torch.Tensor, seen: Sequence[int], classes: Sequence[int]
) -> dict[int, dict[int, float]]:
    """Row-normalised confusion: for each class of ``classes``, the fraction of its pixels predicted as each seen class.

    Args:
        confusion: (K, K) counts, rows = ground truth, columns = prediction, both in ``seen`` order.
        seen: the K global class ids.
        classes: the ground-truth classes to report (a class without pixels gets NaN shares).
    """
    out: dict[int, dict[int, float]] = {}
    for c in classes:
        row = confusion[list(seen).index(c)].double()
        total = float(row.sum())
        out[c] = {k: (float(row[j]) / total if total else float("nan")) for j, k in enumerate(seen)}
    return out


def _run_config(run: Path) -> RunConfig:
    cfg = RunConfig()
    data = yaml.safe_load((run / "config.yaml").read_text()) or {}
    apply_mapping(cfg, translate_legacy(data), f"{run / 'config.yaml'}")
    cfg.device = "cpu"
    return cfg


def _start_folder(run: Path, method: str, t: int, name: str) -> Path:
    """The folder of the model session ``t`` starts from: the method's session t-1, or the base it reused
    (the base folder whose scores are its session-0 record in ``results.json``)."""
    from jascl.results.records import RunResults
    from jascl.results.runs import shared_base_of

    own = run / method / f"s{t - 1}-{name}"
    if (own / "model.safetensors").is_file():
        return own
    methods = RunResults.read(run / "results.json").methods if (run / "results.json").is_file() else {}
    if t > 1 or method not in methods:
        raise ConfigError(
            f"{run}: results.json does not say which model {method}'s session {t} started from; "
            "pass its folder as start (the tool: --start FOLDER)"
        )
    return shared_base_of(run, methods[method].sessions[0])


@torch.no_grad()
def new_class_geometry(
    run: str | Path, method: str, session: int, cache_dir: str | Path | None = None, start: str | Path | None = None
) -> NewClassGeometry:
    """The prototype cosines and prediction shares of ``method``'s session ``session`` in run folder ``run``.

    Args:
        run: a finished run folder (``jascl run --out``).
        method: a method of that run whose session ``session`` finished.
        session: an incremental session index (1 to the number of sessions - 1).
        cache_dir: the data cache (None: the one the run recorded, else the default; synthetic data is regenerated).
        start: the session folder of the model session ``session`` started from (default: the method's
            previous session, or for session 1 the base its ``results.json`` record names).

    Raises:
        ConfigError: no such method or session in the run folder, or a detection run.
    """
    run = Path(run)
    protocol = protocol_from_resolved(json.loads((run / "protocol-resolved.json").read_text()))
    if protocol.task != "segmentation":
        raise ConfigError(f"{run}: new-class geometry needs a segmentation run (this one is {protocol.task})")
    if not 1 <= session < len(protocol.sessions):
        raise ConfigError(f"{run}: session {session}: choose an incremental session, 1 to {len(protocol.sessions) - 1}")
    folder = run / method / f"s{session}-{protocol.sessions[session].name}"
    if not (folder / "metrics.json").is_file():
        raise ConfigError(f"{folder}: no finished session there; is {method!r} a method of this run?")
    cfg = _run_config(run)
    data = load_run_sessions(run, protocol, cache_dir, RootOptions(), echo=lambda _: None)
    spec = protocol.sessions[session]
    start = (
        Path(start) if start is not None else _start_folder(run, method, session, protocol.sessions[session - 1].name)
    )
    before = read_session_model(start, protocol, cfg, session - 1)
    acc = PrototypeAccumulator(list(spec.new_classes))
    train = dense(data[session].train)
    for i in range(len(train.images)):
        labels = training_labels(np.asarray(train.labels[i]), spec.classes, spec.other_classes)
        feats = before.forward_features(torch.from_numpy(np.asarray(train.images[i : i + 1])).float()).features
        acc.update(feats, torch.from_numpy(labels.astype(np.int64))[None])
    stored = PrototypeStore.load(start / "prototypes.safetensors").before(session).entries
    cosines = prototype_cosines(acc.compute(), stored)
    model = read_session_model(folder, protocol, cfg, session)
    seen = list(protocol.seen_classes(session))
    ids = torch.tensor(seen)
    confusion = ConfusionAccumulator(seen)
    test = dense(data[session].test)
    for i in range(len(test.images)):
        x = torch.from_numpy(np.asarray(test.images[i : i + 1])).float()
        roi = cfg.patch_size
        if roi is not None and any(r < s for r, s in zip(roi, x.shape[2:])):
            logits = sliding_window_inference(x, roi, cfg.sw_batch_size, model, cfg.sw_overlap)
        else:
            logits = model(x)
        target = torch.from_numpy(np.asarray(test.labels[i : i + 1]).astype(np.int64))
        confusion.update(ids[torch.as_tensor(logits).argmax(1)], target)
    return NewClassGeometry(session, seen, cosines, prediction_shares(confusion.matrix(), seen, list(spec.new_classes)))
