"""Training loss per epoch, read from a run's log, for the report's "losses" section.

The training loop (:mod:`jascl.engine.loop`) writes one line per epoch to the run's ``log.txt``::

    2026-11-26 20:10:58,079 INFO vanilla session 1 epoch 0: loss 1.0726 (seg 0.8882, kd 0.1020)

``loss`` is the epoch's mean total loss over its steps; the named terms in parentheses are
those of the epoch's *last* step (the loop logs ``state.losses`` as it stands at the epoch's
end), so they are noisier than the total. A resumed run appends to ``log.txt``: the last line
of an epoch wins.

Session 0 of a method that reuses a shared base model is logged under the base's own name:
``base`` (the vanilla base in ``<run>/base``) or ``base-<key>`` (a keyed base in
``<run>/base-<key>``). Which base a method used is read from the files, not from the method:
the base folder whose ``metrics.json`` holds the method's session-0 scores of ``results.json``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jascl.errors import ConfigError
from jascl.results import charts
from jascl.results.blocks import ReportBlock, _figure, _text
from jascl.results.records import SessionRecord
from jascl.results.runs import RunInput, shared_base_of

__all__ = ["EpochLoss", "parse_log", "session_log_names", "loss_series", "losses_section"]

_LINE = re.compile(
    r"\bINFO (?P<name>\S+) session (?P<session>\d+) epoch (?P<epoch>\d+): loss (?P<loss>\S+)"
    r"(?: \((?P<terms>[^)]*)\))?\s*$"
)


@dataclass(frozen=True)
class EpochLoss:
    """One epoch's line of the log: its mean total loss and the named terms of its last step."""

    epoch: int
    total: float
    terms: Mapping[str, float] = field(default_factory=dict)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def parse_log(lines: Iterable[str]) -> dict[tuple[str, int], list[EpochLoss]]:
    """Per (logged name, session): its epochs in order, from the lines of a ``log.txt``.

    Lines other than epoch lines are skipped; a repeated epoch (a resumed run) keeps its last line.
    """
    found: dict[tuple[str, int], dict[int, EpochLoss]] = {}
    for line in lines:
        match = _LINE.search(line)
        if match is None:
            continue
        terms: dict[str, float] = {}
        for part in (match["terms"] or "").split(","):
            words = part.split()
            if len(words) == 2:
                terms[words[0]] = _number(words[1])
        key = (match["name"], int(match["session"]))
        epoch = int(match["epoch"])
        found.setdefault(key, {})[epoch] = EpochLoss(epoch, _number(match["loss"]), terms)
    return {key: [epochs[e] for e in sorted(epochs)] for key, epochs in found.items()}


def session_log_names(run: Path, method: str, records: Sequence[SessionRecord]) -> list[str]:
    """The name each of the method's sessions is logged under in ``run/log.txt``.

    Session 0 is the method's own when ``<run>/<method>/s0-<name>/metrics.json`` exists, otherwise the
    base folder (``base``, ``base-<key>``) whose ``metrics.json`` has the same per-class scores as the
    method's session-0 record (``base`` when none matches).
    """
    names = [method] * len(records)
    if records:
        own = run / method / f"s0-{records[0].name}" / "metrics.json"
        if not own.is_file():
            names[0] = shared_base_of(run, records[0]).name
    return names


#: the name of the epoch-mean series in :func:`loss_series`
TOTAL = "total (epoch mean)"


def loss_series(
    run: RunInput, method: str, parsed: Sequence[Mapping[tuple[str, int], list[EpochLoss]]]
) -> list[tuple[str, dict[str, list[list[float]]]]]:
    """Per session of ``method``: ``(label, {series: per-epoch per-seed values})``, from parsed logs.

    Args:
        run: the report input.
        method: a method of the run.
        parsed: :func:`parse_log` of each run folder's ``log.txt``, in the order of ``run.runs``.

    Returns:
        One entry per session with at least one logged epoch: the label (``"S1 mri"``, with
        ``" · shared model base"`` / ``"... base-<key>"`` for a shared base) and the series :data:`TOTAL` plus, when
        the log names more than one term, one series per term (last step of each epoch).
        Seeds with fewer epochs leave NaN.
    """
    sessions: list[tuple[str, dict[str, list[list[float]]]]] = []
    per_seed_records = run.records(method)
    for t, name in run.sessions():
        epochs_per_seed: list[list[EpochLoss]] = []
        sources: set[str] = set()
        for folder, records, logged in zip(run.runs, per_seed_records, parsed):
            if t >= len(records):
                continue
            source = session_log_names(folder, method, records)[t]
            sources.add(source)
            epochs_per_seed.append(logged.get((source, t), []))
        n_epochs = max((len(e) for e in epochs_per_seed), default=0)
        if n_epochs == 0:
            continue
        terms: list[str] = []
        for epochs in epochs_per_seed:
            for e in epochs:
                terms += [k for k in e.terms if k not in terms]

        def values(pick, epochs_per_seed=epochs_per_seed, n_epochs=n_epochs) -> list[list[float]]:
            return [[pick(e[i]) if i < len(e) else math.nan for e in epochs_per_seed] for i in range(n_epochs)]

        series = {TOTAL: values(lambda e: e.total)}
        if len(terms) > 1:
            for term in terms:
                series[term] = values(lambda e, term=term: e.terms.get(term, math.nan))
        shared = sorted(s for s in sources if s != method)
        label = f"S{t} {name}" + (f" · shared model {', '.join(shared)}" if shared else "")
        sessions.append((label, series))
    return sessions


def losses_section(run: RunInput, prefix: str) -> list[ReportBlock]:
    """Training loss against epoch per method, the sessions one after another, from each run's ``log.txt``.

    Raises:
        ConfigError: a run folder has no ``log.txt``.
    """
    parsed = []
    for folder in run.runs:
        path = folder / "log.txt"
        if not path.is_file():
            raise ConfigError(f"{path}: not found; the training losses are read from the run's log")
        with path.open(encoding="utf-8", errors="replace") as lines:
            parsed.append(parse_log(lines))
    methods = {m: loss_series(run, m, parsed) for m in run.methods()}
    methods = {m: s for m, s in methods.items() if s}
    if not methods:
        return [_text(f"No epoch losses in {', '.join(str(f / 'log.txt') for f in run.runs)}.")]
    logs = str(run.runs[0] / "log.txt") if not run.multi_seed else f"the log.txt of each seed ({len(run.runs)})"
    terms = any(len(series) > 1 for sessions in methods.values() for _, series in sessions)
    caption = (
        f"Training loss per epoch, read from {logs}: solid line the epoch's mean total loss"
        + (" (mean over seeds, band ± std)" if run.multi_seed else "")
        + ("; dashed lines the named loss terms of the epoch's last step (as the log records them)" if terms else "")
        + ". A session marked 'shared model' was trained once, as the shared base model of that name. "
        "Each y axis is fitted to its values (not from 0)."
    )
    return [_figure(f"{prefix}-losses", charts.loss_curves(methods, total=TOTAL), caption)]
