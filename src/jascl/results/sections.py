"""The sections of a report: summary, sessions, curves, heat maps, pseudo-label statistics, configuration,
versions and the split manifest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import yaml

from jascl import __version__
from jascl.errors import DataError
from jascl.results import charts, figure_style, tables
from jascl.results.blocks import ReportBlock, _figure, _safe, _table, _text
from jascl.results.report import is_detection_metric, metric_name, table_title
from jascl.results.runs import RunInput, _config_of, _load_protocol, _mean_std, _read_json, _values, fmt_values


def _session_labels(run: RunInput) -> list[str]:
    return [f"S{t} {name}" for t, name in run.sessions()]


def summary_section(run: RunInput) -> list[ReportBlock]:
    """Title line and one row per method: the all-class mean per session, Base@last, HM@last, Total Drop (%)."""
    return [_text(_title(run)), tables.summary_table(run), *tables.summary_notes(run)]


def _title(run: RunInput) -> str:
    title = table_title(dataclasses.replace(run.first, seed=None) if run.multi_seed else run.first)
    return f"{title} · {tables.seeds_note(run)}"


def sessions_section(run: RunInput) -> list[ReportBlock]:
    """Per method: all / old / new / HM / base-class / background per session, the other metric, training time."""
    background_in_mean = bool(_config_of(run.runs[0]).get("background_in_mean", False))
    blocks = [tables.sessions_table(run, m, background_in_mean) for m in run.methods()]
    if is_detection_metric(run.metric):
        blocks.append(
            _text(
                "All = mean AP (COCO, IoU 0.50:0.95) over the classes seen so far that have test boxes; Old = classes "
                "of earlier sessions; New = classes introduced in the session; HM = harmonic mean of Old and New "
                "(undefined in session 0); Base classes = session-0 classes; a detector scores no background class, "
                "so there is no background column. All (mAP@0.5): mAP at IoU 0.5 over the same classes. Evaluated on "
                f"the whole test images of every session so far. {tables.seeds_note(run).capitalize()}. Train time: "
                "wall-clock seconds of the session's training and evaluation (its metrics.json); a session 0 reused "
                "from the shared base shows the base's time."
            )
        )
        return blocks
    blocks.append(
        _text(
            "All = mean over the foreground classes seen so far; Old = classes of earlier sessions; "
            "New = classes introduced in the session; HM = harmonic mean of Old and New (the paper's Seen / "
            "New / HM figure; undefined in session 0); Base classes = session-0 classes; "
            f"background {run.first.background}. Evaluated on the test splits of every session so far. "
            f"{tables.seeds_note(run).capitalize()}. Train time: wall-clock seconds of the session's training "
            "and evaluation (its metrics.json); a session 0 reused from the shared base shows the base's time."
        )
    )
    return blocks


def per_class_section(run: RunInput) -> list[ReportBlock]:
    """Per method: each class's score after every session, its forgetting and the support of its last score."""
    return [tables.per_class_notes(run), *[tables.per_class_table(run, m) for m in run.methods()]]


def methods_section(run: RunInput) -> list[ReportBlock]:
    """Each method's description, paper and options as run."""
    return tables.methods_table(run)


def _metric_name(run: RunInput) -> str:
    return metric_name(run.metric)


def curves_section(run: RunInput, prefix: str) -> list[ReportBlock]:
    """Line plot of the all-class and base-class means per session, one line per method, a marker per session
    and a ± std band over seeds; the y axis fitted to the values, its range in the caption."""
    labels = _session_labels(run)
    every, base = "all classes seen so far", "base-session classes"
    panels: dict[str, dict[str, list[list[float]]]] = {every: {}, base: {}}
    for m in run.methods():
        recs = run.records(m)
        panels[every][m] = [_values(recs, t, "all") for t in range(len(labels))]
        panels[base][m] = [_values(recs, t, "base") for t in range(len(labels))]
    metric = _metric_name(run)
    ylabels = {every: f"{metric} (mean over all classes seen)", base: f"{metric} (mean over base classes)"}
    if is_detection_metric(run.metric):  # a class's score is its AP: "mAP over base classes" reads as it is
        ylabels = {every: "mAP (over all classes seen)", base: "mAP (over base classes)"}
    lo, hi = charts.curves_range(panels)
    png = charts.session_curves(labels, panels, ylabels, (lo, hi))
    seeds = (
        f"line: mean over {len(run.seeds)} seeds, band: ± std"
        if run.multi_seed
        else f"one seed ({run.seeds[0]}): no spread shown"
    )
    caption = (
        f"{metric} per session per method, a marker per session ({seeds}); both y axes fitted to the values: "
        f"{figure_style.format_range(lo, hi)}, not 0–1"
    )
    return [_figure(f"{prefix}-curves", png, caption)]


def _class_matrix(run: RunInput, method: str) -> tuple[np.ndarray, list[str]]:
    recs = run.records(method)
    sessions = run.sessions()
    names = run.first.classes
    keys: list[str] = []
    for per_seed in recs:
        for rec in per_seed:
            keys += [k for k in rec.per_class if k != "0" and k not in keys]
    keys.sort(key=lambda k: (0, int(k)) if str(k).isdigit() else (1, str(k)))
    matrix = np.full((len(keys), len(sessions)), np.nan)
    for i, key in enumerate(keys):
        for t in range(len(sessions)):
            vals = [
                per_seed[t].per_class[key] for per_seed in recs if t < len(per_seed) and key in per_seed[t].per_class
            ]
            mean, _, n = _mean_std(vals)
            if n:
                matrix[i, t] = mean
    return matrix, [f"{k} {names.get(k, '')}".strip() for k in keys]


def heatmaps_section(run: RunInput, prefix: str) -> list[ReportBlock]:
    """One per-class-by-session heat map per method (class-wise tables as pictures), every cell's value printed;
    one colour scale for all of them, fitted to the run's values and stated in the caption."""
    matrices = {m: _class_matrix(run, m) for m in run.methods()}
    values = [matrix.ravel() for matrix, _ in matrices.values() if matrix.size]
    lo, hi = figure_style.fitted_range(np.concatenate(values)) if values else (0.0, 1.0)
    iou = run.metric == "iou"
    scale = 100.0 if iou else 1.0
    metric = "IoU ×100" if iou else "AP" if is_detection_metric(run.metric) else _metric_name(run)
    blocks = [
        _text(
            "Rows are foreground classes, columns sessions (the model after that session); grey = class "
            "not yet seen, or absent from the test data"
            + (". Cells are means over seeds." if run.multi_seed else ".")
            + f" The colour scale is fitted to this run's values, {figure_style.format_range(lo, hi, scale)}, and is the "
            "same for every method; the printed numbers are the scores."
        )
    ]
    cols = [f"S{t}\n{n}" for t, n in run.sessions()]
    for m, (matrix, rows) in matrices.items():
        if matrix.size == 0:
            blocks.append(_text(f"{m}: no per-class scores in results.json."))
            continue
        png = charts.class_heatmap(
            matrix,
            rows,
            cols,
            f"{m}: per-class {metric} by session",
            scale=scale,
            decimals=1 if iou else 2,
            value_range=(lo, hi),
            colour_label=metric,
        )
        blocks.append(
            _figure(
                f"{prefix}-heatmap-{_safe(m)}",
                png,
                f"{m}: per-class {metric} by session (colour scale {figure_style.format_range(lo, hi, scale)})",
            )
        )
    return blocks


_PL_COLUMNS = (
    ("coverage", "Coverage"),
    ("precision", "Precision"),
    ("confidence_only_coverage", "Conf.-only coverage"),
    ("confidence_only_precision", "Conf.-only precision"),
    ("teacher_error_final", "Teacher error (final)"),
)

#: the detection PAS record (:mod:`jascl.methods.detection.pas`): box counts, then fractions
_PL_BOX_COUNTS = (
    ("teacher_boxes", "Teacher boxes"),
    ("kept", "Kept boxes"),
    ("confidence_only_kept", "Conf.-only kept"),
)
_PL_BOX_FRACTIONS = (
    ("coverage", "Kept / teacher boxes"),
    ("precision", "Precision (IoU ≥ 0.5)"),
    ("confidence_only_precision", "Conf.-only precision (IoU ≥ 0.5)"),
)


def pseudo_label_section(run: RunInput, prefix: str) -> list[ReportBlock]:
    """Per semi-supervised method: pseudo-label statistics per session (``metrics.json`` ``pseudo_labels``), and a plot."""
    blocks: list[ReportBlock] = []
    sessions = run.sessions()
    with_stats: dict[str, list[int]] = {}
    for m in run.methods():
        ts = sorted({t for recs in run.records(m) for t, r in enumerate(recs) if r.pseudo_labels is not None})
        if ts:
            with_stats[m] = ts
    if not with_stats:
        return [
            _text(
                "No pseudo-label statistics in this run (no semi-supervised method, or no unlabelled "
                "phase ran: the protocol has no unlabelled pools or pas.start_epoch ≥ the epochs)."
            )
        ]
    boxes = is_detection_metric(run.metric)
    counts = [("phases", "Phases"), *(_PL_BOX_COUNTS if boxes else ())]
    fractions = _PL_BOX_FRACTIONS if boxes else _PL_COLUMNS
    header = ["Session", "Name", "Filter", *[title for _, title in (*counts, *fractions)]]
    for m, ts in with_stats.items():
        recs = run.records(m)

        def stat(t: int, key: str) -> list[float]:
            return [per_seed[t].pseudo_label_value(key) for per_seed in recs if t < len(per_seed)]

        rows = []
        for t in ts:
            filters = sorted(
                {
                    str((p[t].pseudo_labels or {}).get("filter", ""))
                    for p in recs
                    if t < len(p) and p[t].pseudo_labels is not None
                }
            )
            rows.append(
                [
                    str(t),
                    sessions[t][1],
                    "/".join(filters),
                    *[fmt_values(stat(t, key), "count") for key, _ in counts],
                    *[fmt_values(stat(t, key), "frac") for key, _ in fractions],
                ]
            )
        blocks.append(_table(f"pseudo-labels:{m}", header, rows, heading=m))
        revealed = [t for t in ts if any(t < len(p) and "revealed" in (p[t].pseudo_labels or {}) for p in recs)]
        if revealed:  # an active-learning oracle (HALO): what it revealed of the pool's ground truth
            keys = ("revealed", "budget_pixels", "without_truth")
            oracle_rows = [[str(t), sessions[t][1], *(fmt_values(stat(t, k), "count") for k in keys)] for t in revealed]
            header_o = ["Session", "Name", "Pixels revealed", "Budget (pixels)", "Pool pixels without truth"]
            blocks.append(_table(f"oracle:{m}", header_o, oracle_rows, heading=f"{m}: oracle"))
    shown = sorted({t for ts in with_stats.values() for t in ts})
    series: dict[str, dict[str, list[list[float]]]] = {"coverage": {}, "precision": {}}
    for m in with_stats:
        recs = run.records(m)
        for key in series:
            series[key][m] = [[p[t].pseudo_label_value(key) if t < len(p) else math.nan for p in recs] for t in shown]
    if not any(math.isfinite(v) for per_m in series.values() for per_t in per_m.values() for vs in per_t for v in vs):
        blocks.append(
            _text(
                "No plot: no pseudo-label was kept or measured in any session (phases 0: pas.start_epoch ≥ the "
                "epochs, or the teacher gave none)."
            )
        )
        return blocks
    lo, hi = charts.curves_range(series)
    ylabels = {"coverage": "kept / teacher boxes", "precision": "precision (IoU ≥ 0.5, same class)"} if boxes else None
    png = charts.pseudo_label_plot([f"S{t} {sessions[t][1]}" for t in shown], series, (lo, hi), ylabels)
    words = (
        "Kept / teacher boxes = boxes PAS kept / the teacher's detections on the unlabelled images; precision = "
        "kept boxes matching a hidden ground-truth box of the same class at IoU ≥ 0.5 / kept boxes"
        if boxes
        else "Coverage = kept / all unlabelled pixels; precision = "
        "kept pixels whose pseudo-label equals the hidden ground truth / kept pixels"
    )
    blocks.append(
        _figure(
            f"{prefix}-pseudo-labels",
            png,
            words
            + ("; line: mean over seeds, band: ± std" if run.multi_seed else "")
            + f"; y axes fitted to the values: {figure_style.format_range(lo, hi)}",
        )
    )
    return blocks


def config_section(run: RunInput) -> list[ReportBlock]:
    """The resolved run configuration and the protocol's session table."""
    folder = run.runs[0]
    blocks = []
    path = folder / "config.yaml"
    blocks.append(_text(f"Resolved run configuration ({path}):"))
    if path.is_file():
        # lists in flow style ([16, 16, 32]) keep the block short; key order as written
        text = yaml.safe_dump(yaml.safe_load(path.read_text()), sort_keys=False, default_flow_style=None)
    else:
        text = "(config.yaml not found)"
    blocks.append(ReportBlock("pre", text=text))
    protocol = _load_protocol(folder, run.first)  # ConfigError: the section cannot be produced
    blocks.append(
        _text(
            f"Protocol {protocol.name} ({protocol.spatial_dims}D, {protocol.task}, metric "
            f"{metric_name(protocol.metric)}, unlabelled noise {protocol.unlabelled_noise}): {protocol.description}"
        )
    )
    cls = lambda ids: ", ".join(f"{c} {protocol.class_name(c)}" for c in ids) or "—"  # noqa: E731
    manifest = folder / "manifest.json"
    used = _split_sizes(manifest)
    rows = []
    for s in protocol.sessions:
        sizes = used.get(s.index) if used is not None else None
        requested = {
            "train": s.train if s.shots is None else s.num_labelled,
            "unlabelled": s.unlabelled + s.unlabelled_per_class * len(s.classes) + s.unlabelled_extra,
            "test": s.test,
        }
        rows.append(
            [
                str(s.index),
                s.name,
                ", ".join(s.domains),
                cls(s.new_classes),
                cls(s.recurring_classes),
                "all" if s.shots is None else str(s.shots),
                *[_size_cell(sizes, key, value) for key, value in requested.items()],
            ]
        )
    blocks.append(
        _table(
            "protocol",
            ["Session", "Name", "Domains", "New classes", "Recurring", "Shots K", "Labelled", "Unlabelled", "Test"],
            rows,
        )
    )
    seed = f" of seed {run.seeds[0]}" if run.multi_seed else ""
    blocks.append(
        _text(
            f"Labelled / Unlabelled / Test: the samples the run used ({manifest.name}{seed}), the protocol's "
            "value in parentheses where it differs. K shots guarantee at least K labelled samples showing each "
            "taught class (one sample can show several); on datasets a session's train and test sizes are caps, "
            "none meaning every eligible sample."
            if used is not None
            else f"Labelled / Unlabelled / Test: the protocol's values ({manifest} not found; all = every eligible "
            "sample)."
        )
    )
    return blocks


def _split_sizes(manifest: Path) -> dict[int, dict[str, int]] | None:
    """Per session index, how many samples each split of a run's ``manifest.json`` lists (None without one)."""
    if not manifest.is_file():
        return None
    sizes: dict[int, dict[str, int]] = {}
    for entry in _read_json(manifest).get("sessions", []):
        sizes[int(entry["session"])] = {k: len(entry.get(k) or []) for k in ("train", "unlabelled", "test")}
    return sizes


def _size_cell(sizes: dict[str, int] | None, key: str, requested: int | None) -> str:
    """A split's size as used, with the protocol's ``requested`` value beside it where it differs.

    ``requested`` None: every eligible sample (datasets' optional caps), shown as "all" without a manifest.
    """
    if sizes is None:
        return "all" if requested is None else str(requested)
    used = sizes[key]
    return str(used) if requested is None or requested == used else f"{used} (protocol: {requested})"


def versions_section(run: RunInput) -> list[ReportBlock]:
    """``environment.json`` of every run folder plus seeds, batch sizes and the configured device."""
    rows: list[list[str]] = []
    for folder, seed in zip(run.runs, run.seeds):
        env_path = folder / "environment.json"
        env = _read_json(env_path) if env_path.is_file() else {}
        if not env:
            rows.append(["environment.json", "not found", folder.name])
        for key, value in env.items():
            rows.append([str(key), str(value), folder.name if run.multi_seed else ""])
        config = _config_of(folder)
        batch = config.get("batch_size")
        pas = config.get("pas") or {}
        rows.append(["protocol seed (data, K-shot selection)", str(seed), folder.name if run.multi_seed else ""])
        rows.append(
            [
                "training seed",
                str(config.get("seed") if config.get("seed") is not None else seed),
                folder.name if run.multi_seed else "",
            ]
        )
        rows.append(
            [
                "effective batch size (labelled; no gradient accumulation)",
                str(batch),
                folder.name if run.multi_seed else "",
            ]
        )
        rows.append(
            [
                "unlabelled batch size (mean-teacher phases)",
                str(pas.get("batch_size") or batch),
                folder.name if run.multi_seed else "",
            ]
        )
        rows.append(["device (configuration)", str(config.get("device")), folder.name if run.multi_seed else ""])
    import matplotlib

    rows.append(["report written by", f"jascl {__version__}, matplotlib {matplotlib.__version__}", ""])
    header = ["Item", "Value", "Run folder"]
    if not run.multi_seed:
        header, rows = header[:2], [r[:2] for r in rows]
    return [_table("versions", header, rows)]


def manifest_section(run: RunInput) -> list[ReportBlock]:
    """Split sizes and the first labelled sample ids per session, with the manifest's hash, per seed.

    Raises:
        DataError: a run folder without ``manifest.json`` (every run writes it before training).
    """
    blocks = []
    for folder, seed in zip(run.runs, run.seeds):
        path = folder / "manifest.json"
        if not path.is_file():
            raise DataError(f"{path} not found (a run writes it before training); is {folder} a jascl run folder?")
        raw = path.read_bytes()
        manifest = json.loads(raw)
        rows = []
        for s in manifest.get("sessions", []):
            train = list(s.get("train", []))
            shown = ", ".join(train[:4]) + (f", … ({len(train) - 4} more)" if len(train) > 4 else "")
            rows.append(
                [
                    str(s.get("session")),
                    str(s.get("name")),
                    str(s.get("shots")),
                    str(len(train)),
                    str(len(s.get("test", []))),
                    str(len(s.get("unlabelled", []))),
                    shown,
                ]
            )
        blocks.append(
            _text(
                f"Seed {seed}: {path} (sha256 {hashlib.sha256(raw).hexdigest()[:16]}); sample ids "
                "of every split, regenerated from (seed, protocol)."
            )
        )
        blocks.append(
            _table(
                f"manifest:{seed}",
                ["Session", "Name", "Shots", "Labelled", "Test", "Unlabelled", "Labelled sample ids"],
                rows,
            )
        )
    return blocks
