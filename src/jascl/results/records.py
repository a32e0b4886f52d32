"""Typed records of a run's results: what ``results.json`` holds, read once and checked.

``results.json`` (written by :func:`jascl.results.report.write_all`) is the
contract between a run and everything that reads it later (reports, compare,
sweep). Readers do not index string-keyed dicts; they call
:meth:`RunResults.read` (or :meth:`RunResults.from_json`) and get
:class:`RunResults` -> :class:`MethodResults` -> :class:`SessionRecord`.

Conventions (the same as the writer's):

* Scores are fractions in ``[0, 1]``; a missing value (``null`` in JSON, NaN
  in memory) is ``math.nan`` here, so arithmetic and formatting need no
  ``None`` checks.
* Class ids stay strings (``"1"``), as JSON object keys are; class names in
  :attr:`RunResults.classes` use the same keys.
* Entries this version does not model (a plugin's report such as GAS noise
  statistics, ``dice`` / ``iou`` copies of a session's score) are kept in
  ``extra`` untouched, so a newer run folder still opens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from jascl.errors import ConfigError
from jascl.evaluation.metrics import harmonic_mean

T = TypeVar("T")

#: the score splits of every session record, in table order
SPLITS = ("all", "old", "new", "hm", "base", "background")

_IOU_NAMES = {"iou", "miou", "jaccard"}


def _score(value: Any, where: str) -> float:
    """A score or NaN for ``None``; anything else that is not a number is an error naming ``where``."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: must be a number or null (got {value!r})")
    return float(value)


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: must be a count, an integer >= 0 (got {value!r})")
    return value


#: per-class entries of a session record besides ``per_class``
_PER_CLASS = ("dice", "iou", "support", "samples")


def _per_class(data: Mapping[str, Any], key: str, where: str, read: Callable[[Any, str], T]) -> dict[str, T]:
    return {str(k): read(v, f"{where}.{key}.{k}") for k, v in _mapping(data.get(key), f"{where}.{key}").items()}


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be a JSON object (got {type(value).__name__})")
    return value


@dataclass(frozen=True)
class SessionRecord:
    """One evaluation after training session ``session`` (the scores over the test splits seen so far).

    Attributes:
        session: the session index.
        name: the session's name in the protocol.
        all, old, new, base, background: the split means (see :mod:`jascl.evaluation.metrics`); NaN if missing.
        hm: the harmonic mean of old and new (:func:`jascl.evaluation.metrics.harmonic_mean`); computed from
            them for records written before jascl saved it.
        per_class: class id (string) -> score; NaN if the class had no pixels.
        dice, iou: class id (string) -> each metric's score (empty for records written before both were saved).
        support: class id (string) -> pixels / voxels of the class in the test ground truth that was scored.
        samples: class id (string) -> test samples containing the class (both empty for older records).
        domains: the domains evaluated.
        pseudo_labels: the pseudo-label statistics of a semi-supervised method, or None.
        extra: every other entry of the record, unchanged.
    """

    session: int
    name: str = ""
    all: float = math.nan
    old: float = math.nan
    new: float = math.nan
    hm: float = math.nan
    base: float = math.nan
    background: float = math.nan
    per_class: Mapping[str, float] = field(default_factory=dict)
    dice: Mapping[str, float] = field(default_factory=dict)
    iou: Mapping[str, float] = field(default_factory=dict)
    support: Mapping[str, int] = field(default_factory=dict)
    samples: Mapping[str, int] = field(default_factory=dict)
    domains: tuple[str, ...] = ()
    pseudo_labels: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def score(self, split: str) -> float:
        """The score of ``split`` (one of :data:`SPLITS`)."""
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
        return float(getattr(self, split))

    def pseudo_label_value(self, key: str) -> float:
        """A numeric pseudo-label statistic, NaN if this session has none or lacks ``key``."""
        value = (self.pseudo_labels or {}).get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan

    @classmethod
    def from_json(cls, data: Any, index: int = 0, where: str = "session") -> SessionRecord:
        """A record from its JSON object; ``index`` stands in for a missing ``session``.

        Raises:
            ConfigError: a value of the wrong type, naming ``where.<key>``.
        """
        data = _mapping(data, where)
        known = {"session", "name", "per_class", "domains", "pseudo_labels", *SPLITS, *_PER_CLASS}
        per_class = _mapping(data.get("per_class"), f"{where}.per_class")
        pseudo = data.get("pseudo_labels")
        if pseudo is not None and not isinstance(pseudo, Mapping):
            raise ConfigError(f"{where}.pseudo_labels: must be a JSON object or null (got {pseudo!r})")
        session = data.get("session", index)
        if isinstance(session, bool) or not isinstance(session, int):
            raise ConfigError(f"{where}.session: must be an integer (got {session!r})")
        scores = {k: _score(data.get(k), f"{where}.{k}") for k in SPLITS}
        if "hm" not in data:  # a record written before the harmonic mean was saved
            scores["hm"] = harmonic_mean(scores["old"], scores["new"])
        return cls(
            session=session,
            name=str(data.get("name") or ""),
            **scores,
            per_class={str(k): _score(v, f"{where}.per_class.{k}") for k, v in per_class.items()},
            dice=_per_class(data, "dice", where, _score),
            iou=_per_class(data, "iou", where, _score),
            support=_per_class(data, "support", where, _count),
            samples=_per_class(data, "samples", where, _count),
            domains=tuple(str(d) for d in data.get("domains") or ()),
            pseudo_labels=dict(pseudo) if pseudo is not None else None,
            extra={k: v for k, v in data.items() if k not in known},
        )


@dataclass(frozen=True)
class MethodResults:
    """One method's results in a run.

    Attributes:
        sessions: one record per session trained, in order.
        total_drop: Total Drop (%) over the sessions' ``all`` means; NaN if undefined.
        forgetting: class id -> best earlier score minus the last score.
        extra: every other entry, unchanged.
    """

    sessions: tuple[SessionRecord, ...] = ()
    total_drop: float = math.nan
    forgetting: Mapping[str, float] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def last(self) -> SessionRecord | None:
        """The record of the last session, None if the method has none."""
        return self.sessions[-1] if self.sessions else None

    @classmethod
    def from_json(cls, data: Any, where: str = "method") -> MethodResults:
        data = _mapping(data, where)
        sessions = data.get("sessions") or []
        if not isinstance(sessions, list):
            raise ConfigError(f"{where}.sessions: must be a list (got {type(sessions).__name__})")
        forgetting = _mapping(data.get("forgetting"), f"{where}.forgetting")
        return cls(
            sessions=tuple(SessionRecord.from_json(s, i, f"{where}.sessions[{i}]") for i, s in enumerate(sessions)),
            total_drop=_score(data.get("total_drop"), f"{where}.total_drop"),
            forgetting={str(k): _score(v, f"{where}.forgetting.{k}") for k, v in forgetting.items()},
            extra={k: v for k, v in data.items() if k not in ("sessions", "total_drop", "forgetting")},
        )


@dataclass(frozen=True)
class RunResults:
    """The results of one run (one seed): what ``results.json`` holds.

    Attributes:
        protocol: the protocol's name.
        metric: ``"dice"`` or ``"iou"`` (tables show IoU ×100).
        eval_mode: how the test images were evaluated (e.g. sliding-window).
        background: the background rule of the means (e.g. "excluded from means").
        seed: the protocol seed; None for an aggregate of several seeds.
        classes: class id (string) -> name.
        methods: method name -> its results, in the order they ran.
        extra: every other entry, unchanged.
    """

    protocol: str = "run"
    metric: str = "dice"
    eval_mode: str = ""
    background: str = "excluded from means"
    seed: int | None = None
    classes: Mapping[str, str] = field(default_factory=dict)
    methods: Mapping[str, MethodResults] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_iou(self) -> bool:
        return self.metric.lower() in _IOU_NAMES

    @classmethod
    def from_json(cls, data: Any, where: str = "results") -> RunResults:
        """Results from the JSON object of ``results.json`` (or the dict a run is about to write).

        Raises:
            ConfigError: a missing or mistyped entry, naming ``where`` and the key.
        """
        if isinstance(data, RunResults):
            return data
        data = _mapping(data, where)
        methods = _mapping(data.get("methods"), f"{where}.methods")
        seed = data.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"{where}.seed: must be an integer or null (got {seed!r})")
        known = ("protocol", "metric", "eval_mode", "background", "seed", "classes", "methods")
        return cls(
            protocol=str(data.get("protocol") or "run"),
            metric=str(data.get("metric") or "dice"),
            eval_mode=str(data.get("eval_mode") or ""),
            background=str(data.get("background", "excluded from means")),
            seed=seed,
            classes={str(k): str(v) for k, v in _mapping(data.get("classes"), f"{where}.classes").items()},
            methods={str(k): MethodResults.from_json(v, f"{where}.methods.{k}") for k, v in methods.items()},
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def read(cls, path: str | Path) -> RunResults:
        """Read and check a ``results.json``.

        Raises:
            ConfigError: the file is missing, not JSON, or malformed (naming the file and the key).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read ({exc}); is this a finished jascl run folder?") from None
        return cls.from_json(data, str(path))

    def session_names(self) -> list[tuple[int, str]]:
        """(index, name) of the sessions of the method that ran the most sessions."""
        longest: tuple[SessionRecord, ...] = ()
        for m in self.methods.values():
            if len(m.sessions) > len(longest):
                longest = m.sessions
        return [(r.session, r.name) for r in longest]
