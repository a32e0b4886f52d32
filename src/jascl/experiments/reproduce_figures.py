"""The paper's figures as ``jascl reproduce`` targets: each one planned, run and drawn like the paper's panels.

A figure is a list of panels; a panel shows *series* (a method on a benchmark) over sessions, or a few bars. A
series names the table row that holds its configuration where the paper has one (protocol, backbone, method,
evaluation mode; its stand-in is the table's), so the figure runs exactly what the table runs, and the
table row's published numbers are drawn beside the measured ones (dashed, hollow markers). Where the paper
prints no numbers for a figure (Figures 1 and 2) the panels show the measured values alone.

=================  =========================================================================================
target             the paper's figure
=================  =========================================================================================
``fig_constraints``  Figure 1 (``abl_beg``): fine-tuning the common base model with no constraint, or one of
                   class-incremental (CI), few-shot (FS), domain-incremental (DI): Dice after session 1, all
                   seen classes (a) and the base classes (b). The paper gives neither data nor numbers; both
                   modes run the embedded ``constraint-*`` protocols.
``fig_frozen``     Figure 2 (``abl_beg_frozen``): session 0 and session 1 Dice of several backbones, partially
                   frozen (a: the encoder) or unfrozen (b). The paper names no benchmark; the real run uses
                   Med JASCL-Mixed's first two sessions (the backbone table's benchmark: U-Net, SwinUNETR,
                   MedFormer), the stand-in synthetic-2d with the 2D backbones.
``fig_ss``         Figure 4 (``Swin_semi_fig``): JASCL (U-Net) on Med JASCL-Disjoint without unlabelled data
                   and on Med Semi-Supervised-JASCL with it, Dice per session (``tab_set1_full``, ``semi_med``).
``fig_ablation``   Figure 5 (``without_gn1_plr``): (a) JASCL (MedFormer) with and without GAS on Med
                   JASCL-Mixed (``backbone_set2``, ``abl_gni``); (b) JASCL + GAPS with and without PAS on
                   Semi-Supervised Natural-JASCL (``Semi_natural_gaps``, ``without_plr``).
``fig_seen_new``   The Seen / New / HM grid (``fig:JASCL_full_grid``, a-i): per incremental session the seen
                   classes' score, the new classes' and their harmonic mean, for (a-c) JASCL vs SS JASCL,
                   (d-f) JASCL vs w/o PAS, (g-i) JASCL vs w/o GAS. The paper draws them without numbers; its
                   class-wise tables hold every class per session, so the published Seen / New / HM are
                   computed from them (foreground classes; seen = taught before the session).
=================  =========================================================================================

Outputs in ``--out``: the jobs' compare folders, ``reproduce.{md,csv,json}`` (every series' all-class score per
session beside the table's value), ``figure.png`` and ``figure.svg`` laid out like the paper's panels and
``figure.csv`` (the numbers behind every point: panel, series, x, measured mean / std / seeds, published).
``--report`` redraws them from the folders; an interrupted run draws what finished.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jascl.errors import ConfigError
from jascl.experiments.compare import mean_std
from jascl.experiments.reproduce import Collected, collect, measure, run_plan
from jascl.experiments.reproduce_plan import Plan, plan_table
from jascl.paper.tables import Column, PaperTable, Row, get_table
from jascl.results.paper_figures import FigureData, PanelData, SeriesData, write_figure
from jascl.results.reproduce_table import write_reproduce

#: what a panel plots per session: a split of the session record (``hm``: harmonic mean of old and new)
MEASURES = {"all": "all seen classes", "old": "Seen", "new": "New", "hm": "HM", "base": "base classes"}


@dataclasses.dataclass(frozen=True)
class Series:
    """One method on one benchmark: ``source`` (table label, row name) or its own configuration.

    Attributes:
        label: the legend entry.
        source: the paper table and row it runs (configuration, stand-in and published values).
        protocol, method, backbone, settings: the configuration when there is no source (both modes).
        stand_in_settings: settings of the stand-in run only (e.g. a 2D backbone).
        stand_in: the embedded protocol of the stand-in run (None: ``protocol``, itself embedded).
        sessions: run only the first N sessions.
    """

    label: str
    source: tuple[str, str] | None = None
    protocol: str | None = None
    method: str | None = None
    backbone: str | None = None
    settings: tuple[tuple[str, Any], ...] = ()
    stand_in_settings: tuple[tuple[str, Any], ...] = ()
    stand_in: str | None = None
    sessions: int | None = None


@dataclasses.dataclass(frozen=True)
class Panel:
    """A panel: ``kind`` "sessions" (x = sessions, a line per series) or "bars" (x = series, a bar per session).

    ``sessions``: the sessions drawn (None: all, or every incremental one for Seen / New / HM)."""

    key: str
    title: str
    measure: str
    series: tuple[Series, ...]
    kind: str = "sessions"
    sessions: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    label: str
    line: int
    caption: str
    panels: tuple[Panel, ...]
    columns: int = 2
    notes: tuple[str, ...] = ()


def _constraint(name: str, label: str) -> Series:
    return Series(label, protocol=f"constraint-{name}", method="vanilla")


_CONSTRAINTS = tuple(
    _constraint(n, lbl) for n, lbl in (("none", "no constraint"), ("ci", "CI"), ("fs", "FS"), ("di", "DI"))
)


def _backbones(freeze: str) -> tuple[Series, ...]:
    real = (
        ("U-Net", "unet3d-authors", "unet"),
        ("SwinUNETR", "swinunetr", "swinunetr"),
        ("MedFormer", "medformer", "medformer"),
    )
    return tuple(
        Series(label, protocol="med-mixed", method="vanilla", backbone=b, settings=(("freeze_incremental", freeze),),
               stand_in_settings=(("backbone", b2d), ("freeze_incremental", freeze)), stand_in="synthetic-2d",
               sessions=2)
        for label, b, b2d in real
    )  # fmt: skip


_SS = (
    Series("JASCL (U-Net)", ("tab_set1_full", "JASCL (U-Net)")),
    Series("SS JASCL (U-Net)", ("semi_med", "JASCL (U-Net)")),
)
_GAS = (Series("JASCL (MedFormer)", ("backbone_set2", "JASCL (MedFormer)")), Series("w/o GAS", ("abl_gni", "Average")))
_PAS = (Series("JASCL + GAPS", ("Semi_natural_gaps", "JASCL + GAPS")), Series("w/o PAS", ("without_plr", "Average")))
_GRID = (
    ("JASCL vs SS JASCL (U-Net, Med-Disjoint / Med-SS)", (Series("JASCL", ("tab:class_Sessions", "Average")), Series("SS JASCL", ("tab:class_performance", "Average")))),
    ("JASCL vs w/o PAS (DeepLab, SS Natural)", (Series("JASCL", ("tab:per_class_performance_Sessions", "Average")), Series("w/o PAS", ("without_plr", "Average")))),
    ("JASCL vs w/o GAS (MedFormer, Med-Mixed)", (Series("JASCL", ("tab:class_Sessions_0to4", "Average")), Series("w/o GAS", ("abl_gni", "Average")))),
)  # fmt: skip

FIGURES: dict[str, Figure] = {
    f.name: f
    for f in (
        Figure("fig_constraints", "abl_beg", 122, "Class-incremental (CI), few-shot (FS) and domain-incremental (DI) "
               "constraints against unconstrained fine-tuning on the common base model (Dice after session 1).",
               (Panel("a", "all seen classes", "all", _CONSTRAINTS, "bars", (1,)),
                Panel("b", "base classes", "base", _CONSTRAINTS, "bars", (1,))),
               notes=("The paper gives neither the data nor the numbers of this figure; both modes run the embedded "
                      "constraint-none / -ci / -fs / -di protocols (synthetic-2d's base session, then one session "
                      "with one constraint), vanilla fine-tuning. Panel (b), the base classes, is our choice of the "
                      "second panel.",)),
        Figure("fig_frozen", "abl_beg_frozen", 142, "Fine-tuning the session 0 base model in session 1, partially "
               "frozen (a) or fully unfrozen (b): session 0 and session 1 Dice per backbone.",
               (Panel("a", "partially frozen (encoder)", "all", _backbones("encoder"), "bars", (0, 1)),
                Panel("b", "unfrozen", "all", _backbones("none"), "bars", (0, 1))),
               columns=1,
               notes=("The paper names no benchmark for this figure; the real run uses Med JASCL-Mixed's first two "
                      "sessions (the benchmark of the backbone table), the stand-in synthetic-2d with 2D backbones.",)),
        Figure("fig_ss", "Swin_semi_fig", 607, "JASCL without unlabelled data (Med JASCL-Disjoint) and with it "
               "(Med Semi-Supervised-JASCL), Dice per session.", (Panel("a", "U-Net", "all", _SS),), columns=1),
        Figure("fig_ablation", "without_gn1_plr", 617, "(a) JASCL without GAS (MedFormer, Med JASCL-Mixed); "
               "(b) JASCL without PAS (Semi-Supervised Natural-JASCL).",
               (Panel("a", "w/o GAS, Med JASCL-Mixed", "all", _GAS), Panel("b", "w/o PAS, SS Natural", "all", _PAS))),
        Figure("fig_seen_new", "fig:JASCL_full_grid", 2666, "Seen, New and HM per incremental session: (a-c) JASCL "
               "vs SS JASCL, (d-f) JASCL vs w/o PAS, (g-i) JASCL (MedFormer) vs w/o GAS.",
               tuple(Panel("abcdefghi"[3 * r + k], f"{MEASURES[m]}\n{title}", m, series)
                     for r, (title, series) in enumerate(_GRID) for k, m in enumerate(("old", "new", "hm"))),
               columns=3,
               notes=("Published Seen / New / HM are computed from the paper's class-wise tables (foreground "
                      "classes; seen = classes taught before the session, new = the session's new classes), the "
                      "figure itself prints no numbers.",)),
    )
}  # fmt: skip


def _source(series: Series) -> tuple[PaperTable, Row]:
    assert series.source is not None
    table = get_table(series.source[0])
    return table, table.row(series.source[1])


def series_key(series: Series) -> str:
    """The row name of a series in the figure's table: its source (table and row) or its label and settings."""
    if series.source is not None:
        return f"{series.source[0]}: {series.source[1]}"
    parts = [series.label, series.protocol or "", *(f"{k}={v}" for k, v in series.settings)]
    return " | ".join(p for p in parts if p)


@dataclasses.dataclass
class FigurePlan:
    """A figure's plan (its series as a table's rows) and every series' number of sessions."""

    figure: Figure
    plan: Plan
    sessions: dict[str, int]


def figure_table(figure: Figure, stand_in: bool) -> tuple[PaperTable, dict[str, int]]:
    """The figure as a table: one row per distinct series (its configuration in this mode; its published
    session values where it has a source, as fractions: mIoU tables print percent), one column per session of
    the longest; and each row's sessions."""
    from jascl.protocols import get_protocol

    rows: dict[str, Row] = {}
    counts: dict[str, int] = {}
    for panel in figure.panels:
        for s in panel.series:
            name = series_key(s)
            if name in rows:
                continue
            settings: dict[str, Any]
            if s.source is not None:
                table, row = _source(s)
                protocol = str(table.stand_in if stand_in else row.protocol or table.protocol)
                method, backbone = row.method or table.method, None if stand_in else row.backbone or table.backbone
                settings = {} if stand_in else {**table.set, **row.set}
                if table.eval_mode:
                    settings["eval_mode"] = table.eval_mode
                published = [None if v is None else v / table.scale for v in table.session_values(row)]
            else:
                protocol = str(s.stand_in if stand_in and s.stand_in else s.protocol)
                method, backbone = s.method, None if stand_in else s.backbone
                settings = dict(s.stand_in_settings if stand_in else s.settings)
                published = []
            if "backbone" in settings:
                backbone = str(settings.pop("backbone"))
            counts[name] = min(s.sessions or 99, len(get_protocol(protocol).sessions))
            rows[name] = Row(name=name, values=tuple(published), method=method, protocol=protocol,
                             backbone=backbone, set=settings)  # fmt: skip
    width = max(counts.values())
    fixed = {s.sessions for p in figure.panels for s in p.series}
    columns = tuple(Column(name=f"Session {t}", session=t) for t in range(width))
    padded = tuple(
        dataclasses.replace(r, values=tuple(r.values[t] if t < min(len(r.values), counts[r.name]) else None
                                            for t in range(width)))
        for r in rows.values()
    )  # fmt: skip
    table = PaperTable(
        label=figure.name, caption=figure.caption, line=figure.line, kind="methods", metric="dice",
        columns=columns, rows=padded, sessions=fixed.pop() if len(fixed) == 1 else None, notes=figure.notes,
        stand_in=", ".join(dict.fromkeys(str(r.protocol) for r in padded)) if stand_in else None,
        source=f"jascl figure {figure.name}",
    )  # fmt: skip
    return table, counts


def figure_plan(
    figure: Figure, stand_in: bool, quick: bool = False, protocols: Sequence[str] | None = None
) -> FigurePlan:
    """The plan of a figure's jobs; a series' cells beyond its own sessions are not run. ``protocols``: the
    protocol names (or YAML paths) a series may name, default the built-in ones."""
    table, counts = figure_table(figure, stand_in)
    plan = plan_table(table, quick=quick, protocols=protocols)
    plan.stand_in = stand_in  # the rows already name the stand-in protocols: planned as they are, labelled so
    for p in plan.cells:
        if p.cell.session is not None and p.cell.session >= counts[p.cell.row]:
            p.status, p.reason, p.job = "not runnable", "beyond the series' sessions", None
    return FigurePlan(figure, plan, counts)


def describe_figure(figure: Figure, seeds: Sequence[int], stand_in: bool, quick: bool = False) -> list[str]:
    """The ``--dry-run`` text of a figure: its panels, then its jobs (as a table's plan)."""
    from jascl.experiments.reproduce_cost import describe_estimate
    from jascl.experiments.reproduce_plan import describe_plan

    fp = figure_plan(figure, stand_in, quick)
    lines = [f"{figure.name}: the paper's figure {figure.label} (line {figure.line}): {figure.caption}"]
    for panel in figure.panels:
        names = ", ".join(s.label for s in panel.series)
        lines.append(f"  panel ({panel.key}) {panel.title.replace(chr(10), ' ')}: {MEASURES[panel.measure]}; {names}")
    return lines + describe_plan(fp.plan, seeds)[1:] + describe_estimate(fp.plan, len(seeds))


def _values(fp: FigurePlan, collected: Collected, row: str, t: int, measure: str) -> list[float]:
    """Per-seed values of one series at session ``t`` (the seeds that finished it)."""
    cell = next((p for p in fp.plan.cells if p.cell.row == row and p.job), None)
    if cell is None or cell.job is None:
        return []
    out = []
    for per_method in collected.get(cell.job, {}).values():
        m = per_method.get(str(cell.cell.method))
        record = m.sessions[t] if m is not None and t < len(m.sessions) else None
        if record is not None:
            out.append(float(record.score(measure)))
    return out


def paper_split(table_label: str, row_name: str, t: int, measure: str) -> float | None:
    """A published value as a fraction: the row's session-``t`` value (``all``), or Seen / New / HM computed
    from a class-wise table's class rows (foreground; seen = the session's seen classes less its new ones)."""
    from jascl.evaluation.metrics import harmonic_mean
    from jascl.protocols import get_protocol

    table = get_table(table_label)
    column = next((i for i, c in enumerate(table.columns) if c.session == t), None)
    if column is None:
        return None
    if measure == "all":
        value = table.row(row_name).values[column]
        return None if value is None else value / table.scale
    if table.kind != "classes" or measure not in ("old", "new", "hm"):
        return None
    protocol = get_protocol(str(table.protocol))
    new = set(protocol.sessions[t].new_classes)
    seen = {c for c in protocol.seen_classes(t) if c != 0}

    def mean(classes: set[int]) -> float:
        vals = [v for r in table.rows if r.class_id in classes and (v := r.values[column]) is not None]
        return sum(vals) / len(vals) / table.scale if vals else math.nan

    old_v, new_v = mean(seen - new), mean(new)
    value = {"old": old_v, "new": new_v, "hm": harmonic_mean(old_v, new_v)}[measure]
    return None if math.isnan(value) else value


def _ylabel(panel: Panel) -> str:
    metrics = {get_table(s.source[0]).metric for s in panel.series if s.source}
    name = "mIoU" if metrics == {"miou"} else "Dice"
    return f"{name} ({MEASURES[panel.measure]})" if panel.measure not in ("old", "new", "hm") else name


def figure_data(fp: FigurePlan, collected: Collected) -> FigureData:
    """Every panel's measured (mean ± std over the seeds that finished) and published values, as fractions."""
    panels = []
    for panel in fp.figure.panels:
        series = []
        for s in panel.series:
            row = series_key(s)
            first = 1 if panel.measure in ("old", "new", "hm") else 0
            sessions = panel.sessions or tuple(range(first, fp.sessions[row]))
            points = []
            for t in sessions:
                values = _values(fp, collected, row, t, panel.measure)
                mean, std = mean_std(values)
                published = paper_split(*s.source, t, panel.measure) if s.source else None
                points.append((f"S{t}", mean, std, len(values), published))
            series.append(SeriesData(s.label, tuple(points)))
        panels.append(PanelData(panel.key, panel.title, panel.kind, tuple(series), _ylabel(panel)))
    return FigureData(fp.figure.name, fp.figure.caption, tuple(panels), fp.figure.columns)


def run_figure(
    figure: Figure,
    seeds: Sequence[int],
    out: str | Path,
    *,
    stand_in: bool = False,
    quick: bool = False,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    protocols: Sequence[str] | None = None,
    **compare_kwargs: Any,
) -> dict[str, Path]:
    """Run a figure's jobs into ``out`` and draw it (``figure.{png,svg,csv}``; drawn too when stopped)."""
    fp = figure_plan(figure, stand_in, quick, protocols)
    if not fp.plan.jobs:
        raise ConfigError(f"figure {figure.name}: no series can run here")
    seeds = list(seeds)[:1] if quick else list(seeds)
    out = Path(out)
    try:
        run_plan(fp.plan, seeds, out, overrides=overrides, echo=echo, **compare_kwargs)
    finally:
        paths = write_figure(figure_data(fp, collect(fp.plan, seeds, out)), out)
    return paths


def report_figure(figure: Figure, out: str | Path) -> dict[str, Path]:
    """Redraw a figure and its ``reproduce.{md,csv,json}`` from the run folders under ``out`` (the mode and seeds
    it was run with)."""
    import json

    out = Path(out)
    recorded = json.loads((out / "reproduce.json").read_text()) if (out / "reproduce.json").is_file() else {}
    quick = bool(recorded.get("quick"))
    stand_in = any((out / j).is_dir() for j in figure_plan(figure, True, quick).plan.jobs)
    fp = figure_plan(figure, stand_in, quick)
    seeds = sorted({int(p.name.split("-", 1)[1]) for job in fp.plan.jobs for p in (out / job).glob("seed-*")})
    if not seeds:
        raise ConfigError(f"{out}: no run folder of {figure.name}'s jobs; give the --out of the reproduction")
    collected = collect(fp.plan, seeds, out)
    write_reproduce(measure(fp.plan, collected, seeds), out)
    return write_figure(figure_data(fp, collected), out)
