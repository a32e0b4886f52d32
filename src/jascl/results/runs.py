"""Run folders as reports read them: one run or the seeds of a compare folder (:class:`RunInput`), their
protocol, and per-seed values with mean ± sample std."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jascl.errors import ConfigError
from jascl.results.records import RunResults, SessionRecord
from jascl.results.report import MISSING, format_score

TOTAL_DROP_ROW = "Total Drop (%)"


@dataclass
class RunInput:
    """One report input: a run folder, or a multi-seed folder of run folders.

    Attributes:
        path: the folder given on the command line.
        runs: the run folders (one for a plain run, one per seed otherwise).
        seeds: the protocol seed of each run folder.
        results: the ``results.json`` of each run folder, as typed records.
        multi_seed: True for a multi-seed folder.
    """

    path: Path
    runs: list[Path]
    seeds: list[int]
    results: list[RunResults]
    multi_seed: bool = False

    @property
    def first(self) -> RunResults:
        return self.results[0]

    @property
    def metric(self) -> str:
        return self.first.metric

    def methods(self) -> list[str]:
        """Methods present in every run folder, in the order of the first."""
        return [n for n in self.first.methods if all(n in r.methods for r in self.results)]

    def records(self, method: str) -> list[tuple[SessionRecord, ...]]:
        """Per seed, the method's session records."""
        return [r.methods[method].sessions for r in self.results]

    def total_drops(self, method: str) -> list[float]:
        """Per seed, the method's Total Drop (%) (NaN where undefined)."""
        return [r.methods[method].total_drop for r in self.results]

    def sessions(self) -> list[tuple[int, str]]:
        """(index, name) of the sessions of the longest method."""
        longest: tuple[SessionRecord, ...] = ()
        for m in self.methods():
            for recs in self.records(m):
                if len(recs) > len(longest):
                    longest = recs
        return [(r.session, r.name) for r in longest]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc}); is this a finished jascl run folder?") from None


def open_run(path: str | Path) -> RunInput:
    """Read a run folder or a multi-seed folder (``seed-<s>/`` run folders).

    Raises:
        ConfigError: if ``path`` holds neither ``results.json`` nor ``seed-*/results.json``.
    """
    folder = Path(path)
    if (folder / "results.json").is_file():
        results = RunResults.read(folder / "results.json")
        return RunInput(folder, [folder], [results.seed or 0], [results])
    seed_dirs = {}
    for sub in folder.glob("seed-*"):
        match = re.fullmatch(r"seed-(\d+)", sub.name)
        if match and (sub / "results.json").is_file():
            seed_dirs[int(match.group(1))] = sub
    if not seed_dirs:
        raise ConfigError(
            f"{folder}: no results.json and no seed-*/results.json; give a finished run folder "
            "(jascl run --out) or multi-seed folder (jascl compare --out)"
        )
    order = sorted(seed_dirs)
    if (folder / "compare.json").is_file():
        listed = [int(s) for s in _read_json(folder / "compare.json").get("seeds", []) if int(s) in seed_dirs]
        order = listed + [s for s in order if s not in listed]
    runs = [seed_dirs[s] for s in order]
    return RunInput(folder, runs, order, [RunResults.read(r / "results.json") for r in runs], multi_seed=True)


def protocol_from_resolved(data: Mapping[str, Any]):
    """Rebuild the :class:`~jascl.protocols.schema.Protocol` a run used from its ``protocol-resolved.json``.

    The resolved file holds the protocol as run (seed override applied), which
    the copied ``protocol.yaml`` does not. JSON turned the dataclasses' tuples
    into lists; they are turned back (the synthetic data cache key does not
    depend on the difference). Keys this version does not know are ignored.
    """
    from jascl.protocols import schema

    def build(cls, raw: Mapping[str, Any], nested: Mapping[str, Any] | None = None):
        nested = nested or {}
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in raw.items():
            if key not in names:
                continue
            if key in nested and value is not None:
                value = nested[key](value)
            kwargs[key] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)

    source_cls = getattr(schema, "SourceSpec", None)
    dataset_cls = getattr(schema, "DatasetSpec", None)
    session_nested = {"sources": lambda v: [build(source_cls, s) for s in v]} if source_cls else {}
    borrowed_cls = getattr(schema, "UnlabelledSourceSpec", None)
    if borrowed_cls is not None:
        session_nested["unlabelled_sources"] = lambda v: [build(borrowed_cls, s) for s in v]
    nested = {
        "classes": lambda v: [build(schema.ClassSpec, c) for c in v],
        "domains": lambda v: {k: build(schema.DomainSpec, d) for k, d in v.items()},
        "sessions": lambda v: [build(schema.SessionSpec, s, session_nested) for s in v],
        "synthetic": lambda v: build(schema.SyntheticSpec, v),
        "training": dict,
    }
    if dataset_cls is not None:
        nested["datasets"] = lambda v: {k: build(dataset_cls, d) for k, d in v.items()}
    return build(schema.Protocol, data, nested)


def _load_protocol(run: Path, results: RunResults):
    resolved = run / "protocol-resolved.json"
    if resolved.is_file():
        return protocol_from_resolved(_read_json(resolved))
    copied = run / "protocol.yaml"
    if copied.is_file():
        from jascl.protocols.parse import load_protocol

        protocol = load_protocol(copied)
        return dataclasses.replace(protocol, seed=protocol.seed if results.seed is None else results.seed)
    raise ConfigError(f"{run}: neither protocol-resolved.json nor protocol.yaml")


def _values(records_per_seed: Sequence[Sequence[SessionRecord]], t: int, split: str) -> list[float]:
    """Per seed that has session ``t``, its ``split`` score."""
    return [recs[t].score(split) for recs in records_per_seed if t < len(recs)]


def _mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    valid = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not valid:
        return math.nan, math.nan, 0
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / (len(valid) - 1)) if len(valid) > 1 else 0.0
    return mean, std, len(valid)


def fmt_values(values: Sequence[float], kind: str) -> str:
    """Format one cell: a single value, or ``mean ± std`` (sample std) of several seeds' values.

    Args:
        values: per-seed values (NaN / None skipped).
        kind: ``"dice"`` / ``"iou"`` (score formatting of ``format_score``), ``"pct"`` (one
            decimal, Total Drop) or ``"frac"`` (three decimals, pseudo-label fractions) or ``"count"``.
    """
    mean, std, n = _mean_std(values)
    if n == 0:
        return MISSING

    def one(v: float) -> str:
        if kind == "pct":
            return f"{v:.1f}"
        if kind == "count":
            return f"{v:.0f}" if n < 2 or v == round(v) else f"{v:.1f}"
        if kind == "frac":
            return f"{v:.3f}"
        return format_score(v, kind)

    return one(mean) if n < 2 else f"{one(mean)} ± {one(std)}"


def _session_folder(run: Path, method: str, t: int, name: str) -> Path:
    own = run / method / f"s{t}-{name}"
    if (own / "model.safetensors").is_file() or t > 0:
        return own
    return run / "base"


def _config_of(run: Path) -> dict:
    path = run / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
