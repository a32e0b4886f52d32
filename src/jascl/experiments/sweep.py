"""Grids of runs for the paper's sensitivity and ablation studies (``jascl sweep``).

Every grid point is a full run of one method into ``<out>/<grid>/<point>/``. The
session-0 model the method starts from (the vanilla ``base``, or the keyed base of
the JASCL family, ``base-stochastic-classifier``: :mod:`jascl.experiments.bases`) is
trained once into ``<out>/`` and linked into every point, so a sweep costs the
incremental sessions only: no grid changes session 0 (a ``shots`` point's protocol,
``<name>-k<K>``, keeps its session 0: ``Protocol.session0_of``; under ``--split-manifest``
it selects its own samples and trains its own session 0). The points of a
method with no shared base (one that changes session 0 in a way of its own, e.g.
GAS in session 0) train their own. Points and sessions already finished are reused, so an
interrupted sweep resumes where it stopped. The collected table is written
to ``<out>/sweep.{md,csv,json}``.

Grids (the paper's tables):

* ``eps``: GAS epsilon in {1e-6, 1e-7, 1e-8, 1e-9} (sensitivity table)
* ``sigma2``: GAS noise variance in {0.1, 1, 10} (sensitivity table)
* ``shots``: K in {3, 4, 5} for every incremental session (sensitivity table)
* ``tau``: tau_conf x tau_sim in {0.6, 0.7, 0.8}^2 with retention % (the
  "Retention analysis" table: retention = fraction of unlabelled pixels
  passing both filters for both student and teacher)
* ``gas-layer``: GAS on an encoder layer, a decoder layer or the classifier,
  with the whole network trainable (``freeze_incremental=none``), as in the
  paper's layer-choice appendix.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from jascl.data.sessions import load_sessions
from jascl.engine.config import RunConfig, resolve_config
from jascl.errors import ConfigError
from jascl.experiments.bases import VANILLA, base_folders, ensure_base, restorers
from jascl.experiments.fanout import RunSpec, fan_out, share_base
from jascl.experiments.runner import run_benchmark
from jascl.fileio import atomic_write_text
from jascl.methods.registry import create_method
from jascl.protocols.schema import Protocol
from jascl.protocols.variants import renamed_variant
from jascl.results.records import RunResults
from jascl.results.report import md_table, write_json

if TYPE_CHECKING:
    from jascl.experiments.launcher import Launcher

GRIDS: dict[str, list[dict[str, object]]] = {
    "eps": [{"gas.eps": v} for v in (1e-6, 1e-7, 1e-8, 1e-9)],
    "sigma2": [{"gas.sigma2": v} for v in (0.1, 1.0, 10.0)],
    "shots": [{"shots": k} for k in (3, 4, 5)],
    "tau": [{"pas.tau_conf": c, "pas.tau_sim": s} for c in (0.6, 0.7, 0.8) for s in (0.6, 0.7, 0.8)],
    "gas-layer": [{"gas.layer": layer, "freeze_incremental": "none"} for layer in ("encoder", "decoder", "classifier")],
}


def with_shots(protocol: Protocol, shots: int) -> Protocol:
    """The protocol with K = ``shots`` in every incremental session (the paper's K). Session 0 is kept as it is,
    also where it is a few-shot one itself, so every point starts from the protocol's base (``session0_of``)."""
    sessions = tuple(
        s if t == 0 or s.shots is None else dataclasses.replace(s, shots=shots) for t, s in enumerate(protocol.sessions)
    )
    return renamed_variant(protocol, f"{protocol.name}-k{shots}", sessions=sessions)


def _point_name(point: dict[str, object]) -> str:
    return ",".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


@dataclasses.dataclass(frozen=True)
class _Point:
    """One grid point: its run's protocol, configuration and folder; ``manifest``: the samples it reuses;
    ``keeps_session0``: it starts from the sweep's shared bases."""

    grid: str
    values: dict[str, object]
    protocol: Protocol
    config: RunConfig
    folder: Path
    manifest: str | Path | None
    keeps_session0: bool

    @property
    def name(self) -> str:
        return _point_name(self.values)


def _points(protocol: Protocol, grids: Sequence[str], out: Path, config_file: str | Path | None,
            overrides: Sequence[str], split_manifest: str | Path | None) -> list[_Point]:  # fmt: skip
    points = []
    for grid in grids:
        for values in GRIDS[grid]:
            point_protocol = protocol
            point_overrides = list(overrides)
            for key, value in values.items():
                if key == "shots":
                    point_protocol = with_shots(protocol, cast(int, value))  # the "shots" grid holds ints
                else:
                    point_overrides.append(f"{key}={value}")
            config = resolve_config(protocol.training, protocol.path, config_file, point_overrides)
            # a K-shot point selects its own samples; with --split-manifest the base's session 0 came from the file
            variant = split_manifest is None and protocol.name in point_protocol.session0_of
            keeps = point_protocol is protocol or variant
            manifest = split_manifest if "shots" not in values else None
            folder = out / grid / _point_name(values)
            points.append(_Point(grid, values, point_protocol, config, folder, manifest, keeps))
    return points


def run_sweep(
    protocol: Protocol,
    grids: Sequence[str],
    out: str | Path,
    method: str = "jascl",
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    cache_dir: str | Path | None = None,
    progress: bool = True,
    echo=print,
    roots: Mapping[str, str | Path] | None = None,
    roots_file: str | Path | None = None,
    split_manifest: str | Path | None = None,
    launcher: Launcher | None = None,
) -> list[dict]:
    """Run every point of ``grids`` for ``method`` and write the sweep table; returns its rows.

    ``roots`` / ``roots_file``: dataset roots (protocols on datasets); ``split_manifest``: a run's
    ``manifest.json`` whose samples every point reuses, but the points of the ``shots`` grid (another K
    selects its own samples). ``launcher``: the shared bases, then every point, run as jobs first
    (:func:`jascl.experiments.fanout.fan_out`: the points at once, each once the base it starts from is
    complete); the table is then collected by the same code, from the same folders, as without one."""
    unknown = [g for g in grids if g not in GRIDS]
    if unknown or not grids:
        raise ConfigError(f"--grid {','.join(unknown) or '(none)'}: choose from {', '.join(GRIDS)}")
    if launcher is not None:
        launcher.check()  # (before the sweep's folder is made)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base_config = resolve_config(protocol.training, protocol.path, config_file, list(overrides))
    built = create_method(method, base_config, protocol.task)
    points = _points(protocol, grids, out, config_file, overrides, split_manifest)
    # the base the method starts from (none if its session 0 is its own, or no point starts from it)
    shared = list(base_folders([built])) if any(p.keeps_session0 for p in points) else []
    if launcher is not None:
        specs = [RunSpec(protocol, base_config, (method,), out, "for every point", {"split_manifest": split_manifest},
                         bases_only=True)] if shared else []  # fmt: skip
        for point in points:
            borrows = {name: out / name for name in shared} if point.keeps_session0 else {}
            specs.append(
                RunSpec(
                    point.protocol,
                    point.config,
                    (method,),
                    point.folder,
                    f"{point.grid} {point.name}",
                    {"split_manifest": point.manifest},
                    borrows,
                )  # fmt: skip
            )
        data = {"cache_dir": cache_dir, "roots": roots, "roots_file": roots_file}
        fan_out(launcher, specs, out, data, progress, echo)
    # (after a launcher: every base and point is reused, and the table comes from their folders)
    base_data = load_sessions(protocol, cache_dir, echo, roots, split_manifest, roots_file, base_config.patch_size)
    for name in shared:
        trainer = None if name == VANILLA else built.base_method()
        ensure_base(protocol, base_config, base_data, out / name, progress, echo, trainer, (), restorers([built]))
    rows = []
    for point in points:
        point.folder.mkdir(parents=True, exist_ok=True)
        for name in shared if point.keeps_session0 else []:
            share_base(out / name, point.folder / name)
        echo(f"[sweep] {point.grid}: {point.name}")
        results = run_benchmark(
            point.protocol,
            point.config,
            [method],
            point.folder,
            cache_dir=cache_dir,
            progress=progress,
            echo=echo,
            split_manifest=point.manifest,
            roots=roots,
            roots_file=roots_file,
        )
        m = RunResults.from_json(results).methods[method]
        pls = [s for s in m.sessions if s.pseudo_labels is not None]
        rows.append(
            {
                "grid": point.grid,
                "point": point.name,
                **{k: v for k, v in point.values.items()},
                "last_all": m.sessions[-1].all,
                "last_base": m.sessions[-1].base,
                "total_drop": m.total_drop,
                "retention_pct": 100 * _mean([s.pseudo_label_value("coverage") for s in pls]) if pls else math.nan,
                "precision": _mean([s.pseudo_label_value("precision") for s in pls]) if pls else math.nan,
            }
        )
    write_sweep(rows, out, protocol, method)
    return rows


def sweep_table(rows: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["grid", "point", "last all", "last base", "Total Drop (%)", "retention (%)", "precision"]

    def f(v: float, fmt: str) -> str:
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    body = [
        [
            r["grid"],
            r["point"],
            f(r["last_all"], ".3f"),
            f(r["last_base"], ".3f"),
            f(r["total_drop"], ".1f"),
            f(r["retention_pct"], ".1f"),
            f(r["precision"], ".3f"),
        ]
        for r in rows
    ]
    return header, body


def write_sweep(rows: Sequence[dict], out: Path, protocol: Protocol, method: str) -> None:
    header, body = sweep_table(rows)
    title = (
        f"## sweep: {method} on {protocol.name} (seed {protocol.seed}); scores = mean Dice/IoU over foreground classes"
    )
    atomic_write_text(out / "sweep.md", f"{title}\n\n{md_table(header, body)}\n")
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *body])  # point names contain commas: quote them
    atomic_write_text(out / "sweep.csv", buf.getvalue())
    write_json(
        {"protocol": protocol.name, "seed": protocol.seed, "method": method, "rows": list(rows)}, out / "sweep.json"
    )
