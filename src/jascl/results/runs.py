"""Run folders as reports read them: one run or the seeds of a compare folder (:class:`RunInput`), their
protocol, and per-seed values with mean ± sample std."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jascl.errors import ConfigError
from jascl.results.records import RunResults, SessionRecord
from jascl.results.report import MISSING, format_score

TOTAL_DROP_ROW = "Total Drop (%)"


@dataclass(frozen=True)
class RootOptions:
    """Dataset roots given to ``jascl report``, over those the run recorded (see :func:`run_roots`).

    Attributes:
        given: root name -> folder (``--root NAME=PATH``).
        file: a YAML file of root names to folders (``--roots FILE``).
    """

    given: Mapping[str, str] = field(default_factory=dict)
    file: str | None = None


@dataclass
class RunInput:
    """One report input: a run folder, or a multi-seed folder of run folders.

    Attributes:
        path: the folder given on the command line.
        runs: the run folders (one for a plain run, one per seed otherwise).
        seeds: the protocol seed of each run folder.
        results: the ``results.json`` of each run folder, as typed records.
        multi_seed: True for a multi-seed folder.
        roots: dataset roots given to the report over the recorded ones (protocols on datasets).
    """

    path: Path
    runs: list[Path]
    seeds: list[int]
    results: list[RunResults]
    multi_seed: bool = False
    roots: RootOptions = field(default_factory=RootOptions)

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

    See :mod:`jascl.protocols.resolved`: tuples come back as tuples, label maps keep their integer native ids
    (also from run folders written before label maps were stored as pairs); keys this version does not know
    are ignored.
    """
    from jascl.protocols.resolved import protocol_from_json

    return protocol_from_json(data)


def _load_protocol(run: Path, results: RunResults):
    """The protocol of run folder ``run``, named after the run folder's own file (``protocol-resolved.json``, else
    the copied ``protocol.yaml``), so that messages point there and not at the YAML file the run started from."""
    resolved = run / "protocol-resolved.json"
    if resolved.is_file():
        return dataclasses.replace(protocol_from_resolved(_read_json(resolved)), path=str(resolved), file=None)
    copied = run / "protocol.yaml"
    if copied.is_file():
        from jascl.protocols.parse import load_protocol

        protocol = load_protocol(copied)
        return dataclasses.replace(protocol, seed=protocol.seed if results.seed is None else results.seed)
    raise ConfigError(f"{run}: neither protocol-resolved.json nor protocol.yaml")


def recorded_roots(run: Path) -> dict[str, tuple[str, Path]]:
    """Root name -> (folder, the run-folder file recording it) for the dataset roots a run read its data from.

    ``run.json`` records them (``resolved_roots``: every root, however it was given; run folders written
    before it have ``roots``, the ``--root`` values only); ``manifest.json`` records the folder of every
    dataset entry, which covers roots that came from a roots file or ``JASCL_ROOT_<NAME>``.
    """
    out: dict[str, tuple[str, Path]] = {}
    manifest = run / "manifest.json"
    if manifest.is_file():
        for entry in (_read_json(manifest).get("datasets") or {}).values():
            if isinstance(entry, Mapping) and entry.get("root") and entry.get("path"):
                out[str(entry["root"])] = (str(entry["path"]), manifest)
    record = run / "run.json"
    if record.is_file():
        data = _read_json(record)
        for key in ("roots", "resolved_roots"):  # the later wins
            for name, path in (data.get(key) or {}).items():
                out[str(name)] = (str(path), record)
    return out


def run_roots(run: Path, protocol, options: RootOptions, environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Folder of every dataset root the run's protocol names, for a report of run folder ``run``.

    Precedence: ``--root NAME=PATH`` > ``--roots FILE`` > the folder recorded at run time (``run.json``,
    else ``manifest.json``), if it still exists > the environment variable ``JASCL_ROOT_<NAME>``. Names the
    protocol does not use are ignored here (:func:`check_root_names` refuses those no input uses).

    Raises:
        DataError: a root that is set nowhere, or whose folder does not exist; one line naming where the
            folder came from and the fix (``--root NAME=PATH``).
    """
    from jascl.data.real import env_var, read_roots_file
    from jascl.data.real.roots import root_names
    from jascl.errors import DataError

    environ = os.environ if environ is None else environ
    from_file = read_roots_file(options.file) if options.file else {}
    recorded = recorded_roots(run)
    out: dict[str, Path] = {}
    for name in sorted(root_names(protocol)):
        env = environ.get(env_var(name))
        if name in options.given:
            path, where = options.given[name], f"given with --root {name}=..."
        elif name in from_file:
            path, where = from_file[name], f"given in the roots file {options.file}"
        elif name in recorded and (Path(recorded[name][0]).expanduser().is_dir() or not env):
            path, where = recorded[name][0], f"recorded in {recorded[name][1]}"
        elif env:  # the data moved (or was never recorded), and the environment says where it is now
            path, where = env, f"from {env_var(name)}"
            if name in recorded:
                where += f" (the folder recorded in {recorded[name][1]}, {recorded[name][0]}, does not exist either)"
        else:
            raise DataError(
                f"dataset root {name!r} is recorded in neither {run / 'run.json'} nor {run / 'manifest.json'}; "
                f"give --root {name}=PATH (or set {env_var(name)})"
            )
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise DataError(f"dataset root {name!r} not found at {folder} {where}; give --root {name}=PATH")
        out[name] = folder
    return out


def check_root_names(runs: Sequence[RunInput], options: RootOptions) -> None:
    """Refuse a ``--root`` name that no input's protocol uses (a typo), in one line naming the roots they use.

    Inputs whose protocol cannot be read are passed over (the sections that need it say why).
    """
    from jascl.data.real import read_roots_file
    from jascl.data.real.roots import root_names

    if options.file is not None:
        read_roots_file(options.file)  # a missing or malformed file fails before any section is built
    if not options.given:
        return
    used: set[str] = set()
    for run in runs:
        try:
            used |= set(root_names(_load_protocol(run.runs[0], run.first)))
        except ConfigError:
            continue
    unknown = sorted(set(options.given) - used)
    if unknown:
        raise ConfigError(
            f"--root {unknown[0]}=...: no input's protocol has a dataset root of that name "
            f"(their roots: {', '.join(sorted(used)) or 'none'})"
        )


def load_run_sessions(
    run: Path, protocol, cache_dir: str | Path | None, roots: RootOptions, echo: Callable[[str], None]
) -> list:
    """The sessions' data of run folder ``run``, as the run saw them.

    Synthetic protocols are regenerated (or read from the cache); protocols on datasets read the
    dataset roots of :func:`run_roots` and the samples listed in the run's ``manifest.json``.
    ``cache_dir`` None: the cache the run recorded in ``run.json`` if it still exists, else the default.
    """
    from jascl.data.sessions import load_sessions

    if cache_dir is None and (run / "run.json").is_file():
        recorded = _read_json(run / "run.json").get("cache_dir")
        cache_dir = recorded if recorded and Path(recorded).is_dir() else None
    if not protocol.uses_datasets:
        return load_sessions(protocol, cache_dir, echo=echo)
    manifest = run / "manifest.json"
    return load_sessions(
        protocol,
        cache_dir,
        echo,
        roots=run_roots(run, protocol, roots),
        split_manifest=manifest if manifest.is_file() else None,
    )


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


def _session_folder(run: Path, method: str, t: int, name: str, record: SessionRecord | None = None) -> Path:
    """The folder of ``method``'s session ``t`` in the run folder ``run``: its own, or for a session 0 it reused,
    the shared base it started from (:func:`shared_base_of`; ``base`` when ``record`` is not given)."""
    own = run / method / f"s{t}-{name}"
    if (own / "model.safetensors").is_file() or t > 0:
        return own
    return shared_base_of(run, record) if record is not None else run / "base"


def shared_base_of(run: Path, record: SessionRecord) -> Path:
    """The base folder (``base``, or a family's keyed ``base-<key>``, e.g. JASCL's ``base-stochastic-classifier``)
    whose ``metrics.json`` has ``record``'s per-class scores: the session 0 a method reused (``base`` if none
    matches)."""
    bases = [run / "base", *sorted(p for p in run.glob("base-*") if p.is_dir())]
    return next((b for b in bases if same_scores(b / "metrics.json", record)), run / "base")


def same_scores(metrics: Path, record: SessionRecord) -> bool:
    """Whether the ``metrics.json`` at ``metrics`` holds exactly ``record``'s per-class scores."""
    try:
        saved = json.loads(metrics.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    per_class = saved.get("per_class") or {}
    if set(map(str, per_class)) != set(record.per_class):
        return False
    for key, value in per_class.items():
        mine = record.per_class[str(key)]
        if value is None:
            if not math.isnan(mine):
                return False
        elif not math.isclose(float(value), mine, rel_tol=0, abs_tol=1e-12):
            return False
    return True


def _config_of(run: Path) -> dict:
    path = run / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
