"""``jascl report``: one self-contained HTML page and a Markdown file for run folders.

Inputs are run folders written by :func:`jascl.experiments.runner.run_benchmark`
(``results.json``, ``config.yaml``, ``protocol-resolved.json``, ``manifest.json``,
``environment.json``, per-session checkpoints) or multi-seed folders
(``seed-<s>/`` run folders, plus ``compare.json``, as written by ``jascl compare``
and ``jascl run --seeds``). A multi-seed folder is reported as mean ± std over
its seeds (sample standard deviation, as in :mod:`jascl.experiments.compare`).

Every input folder becomes one part of the report with these sections
(HTML ids ``p<i>-<section>``, Markdown ``##`` headings):

* ``summary``: all-class mean per session and Total Drop, one row per method;
* ``sessions``: per method, all / old / new / base-class / background scores per
  session and the Total Drop (paper: Total Drop = 100 * sum of session-to-session
  falls / S_0);
* ``curves``: line plot of the all-class (and base-class) mean per session per method;
* ``heatmaps``: per-class score by session, one heat map per method (forgetting at a glance);
* ``qualitative``: input, ground truth and each method's prediction for a few test
  samples of every session (the model after that session, and after the last one);
* ``pseudo-labels``: coverage and precision of the kept pseudo-labels per session
  (semi-supervised methods);
* ``config``: the resolved run configuration and the protocol's sessions;
* ``versions``: library versions, devices, seeds and batch sizes;
* ``manifest``: the K-shot split manifest, summarised.

Tables print the numbers of ``results.json`` with the formatting of
:func:`jascl.results.report.format_score` (IoU ×100 with one decimal, otherwise
three decimals). The HTML embeds every figure as a base64 PNG and has no external
assets; the Markdown file links PNG files written next to it.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import html
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from jascl import __version__
from jascl.errors import ConfigError
from jascl.fileio import atomic_write_text
from jascl.results import plots
from jascl.results.report import MISSING, format_score, md_table, table_title

__all__ = ["ReportBlock", "RunInput", "open_run", "build_part", "protocol_from_resolved", "write_report", "SECTIONS"]

#: section ids and titles of every report part, in order
SECTIONS: dict[str, str] = {
    "summary": "Summary: all-class mean per session",
    "sessions": "Per-session results",
    "curves": "All-class mean per session",
    "heatmaps": "Per-class score by session",
    "qualitative": "Qualitative results",
    "pseudo-labels": "Pseudo-labels (semi-supervised)",
    "config": "Configuration",
    "versions": "Versions",
    "manifest": "Split manifest",
}

TOTAL_DROP_ROW = "Total Drop (%)"


# ----------------------------------------------------------------------------- inputs


@dataclass
class RunInput:
    """One report input: a run folder, or a multi-seed folder of run folders.

    Attributes:
        path: the folder given on the command line.
        runs: the run folders (one for a plain run, one per seed otherwise).
        seeds: the protocol seed of each run folder.
        results: the ``results.json`` of each run folder.
        multi_seed: True for a multi-seed folder.
    """

    path: Path
    runs: list[Path]
    seeds: list[int]
    results: list[dict]
    multi_seed: bool = False

    @property
    def first(self) -> dict:
        return self.results[0]

    @property
    def metric(self) -> str:
        return str(self.first.get("metric", "dice"))

    def methods(self) -> list[str]:
        """Methods present in every run folder, in the order of the first."""
        names = list(self.first.get("methods", {}))
        return [n for n in names if all(n in r.get("methods", {}) for r in self.results)]

    def records(self, method: str) -> list[list[dict]]:
        """Per seed, the method's session records."""
        return [list(r["methods"][method].get("sessions", [])) for r in self.results]

    def sessions(self) -> list[tuple[int, str]]:
        """(index, name) of the sessions of the longest method."""
        longest: list[dict] = []
        for m in self.methods():
            for recs in self.records(m):
                if len(recs) > len(longest):
                    longest = recs
        return [(int(r.get("session", i)), str(r.get("name", ""))) for i, r in enumerate(longest)]


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
        results = _read_json(folder / "results.json")
        return RunInput(folder, [folder], [int(results.get("seed", 0) or 0)], [results])
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
    return RunInput(folder, runs, order, [_read_json(r / "results.json") for r in runs], multi_seed=True)


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


def _load_protocol(run: Path, results: Mapping[str, Any]):
    resolved = run / "protocol-resolved.json"
    if resolved.is_file():
        return protocol_from_resolved(_read_json(resolved))
    copied = run / "protocol.yaml"
    if copied.is_file():
        from jascl.protocols.schema import load_protocol

        protocol = load_protocol(copied)
        return dataclasses.replace(protocol, seed=int(results.get("seed", protocol.seed)))
    raise ConfigError(f"{run}: neither protocol-resolved.json nor protocol.yaml")


# ----------------------------------------------------------------------------- numbers


def _values(records_per_seed: Sequence[Sequence[Mapping[str, Any]]], t: int, key: str) -> list[float]:
    out = []
    for recs in records_per_seed:
        if t < len(recs):
            v = recs[t].get(key)
            out.append(math.nan if v is None else float(v))
    return out


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


# ----------------------------------------------------------------------------- blocks


@dataclass
class ReportBlock:
    """One piece of a report section, rendered to both HTML and Markdown.

    ``kind`` is ``"text"`` (``text``), ``"table"`` (``header``, ``rows``, ``name``
    for the HTML ``data-table`` attribute), ``"figure"`` (``png``, ``name`` = file
    stem, ``text`` = caption) or ``"pre"`` (``text`` preformatted).
    """

    kind: str
    text: str = ""
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    name: str = ""
    png: bytes = b""
    heading: str = ""


def _text(text: str) -> ReportBlock:
    return ReportBlock("text", text=text)


def _table(name: str, header: list[str], rows: list[list[str]], heading: str = "") -> ReportBlock:
    return ReportBlock("table", header=header, rows=rows, name=name, heading=heading)


def _figure(name: str, png: bytes, caption: str) -> ReportBlock:
    return ReportBlock("figure", png=png, name=name, text=caption)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


# ----------------------------------------------------------------------------- sections


def _session_labels(run: RunInput) -> list[str]:
    return [f"S{t} {name}" for t, name in run.sessions()]


def summary_section(run: RunInput) -> list[ReportBlock]:
    """Title line and one row per method: the all-class mean per session and the Total Drop (%)."""
    sessions = run.sessions()
    header = ["Method", *[f"S{t} ({n})" for t, n in sessions], TOTAL_DROP_ROW]
    rows = []
    for m in run.methods():
        recs = run.records(m)
        drops = [r["methods"][m].get("total_drop") for r in run.results]
        rows.append(
            [
                m,
                *[fmt_values(_values(recs, t, "all"), run.metric) for t in range(len(sessions))],
                fmt_values([math.nan if d is None else d for d in drops], "pct"),
            ]
        )
    blocks = [_text(_title(run)), _table("summary", header, rows)]
    blocks.append(
        _text(
            "Total Drop (%) = 100 × Σ max(0, S_i − S_{i+1}) / S_0 over the all-class means "
            "(the paper's forgetting measure; lower is better)."
        )
    )
    return blocks


def _title(run: RunInput) -> str:
    title = table_title(run.first if not run.multi_seed else {k: v for k, v in run.first.items() if k != "seed"})
    if run.multi_seed:
        title += f" · mean ± std over {len(run.seeds)} seeds ({', '.join(map(str, run.seeds))})"
    return title


def sessions_section(run: RunInput) -> list[ReportBlock]:
    """Per method: all / old / new / base-class / background score per session, then a Total Drop row."""
    blocks: list[ReportBlock] = []
    keys = ("all", "old", "new", "base", "background")
    header = ["Session", "Name", "Domains", "All", "Old", "New", "Base classes", "Background"]
    for m in run.methods():
        recs = run.records(m)
        rows = []
        for t, name in run.sessions():
            if t >= max(len(r) for r in recs):
                continue
            domains = ", ".join(recs[0][t].get("domains", []) or []) if t < len(recs[0]) else ""
            rows.append([str(t), name, domains, *[fmt_values(_values(recs, t, k), run.metric) for k in keys]])
        drops = [r["methods"][m].get("total_drop") for r in run.results]
        rows.append(
            [TOTAL_DROP_ROW, "", "", fmt_values([math.nan if d is None else d for d in drops], "pct"), "", "", "", ""]
        )
        blocks.append(_table(f"sessions:{m}", header, rows, heading=m))
    blocks.append(
        _text(
            "All = mean over the foreground classes seen so far; Old = classes of earlier sessions; "
            "New = classes introduced in the session; Base classes = session-0 classes; "
            f"background {run.first.get('background', '')}. Evaluated on the test splits of every session so far."
        )
    )
    return blocks


def curves_section(run: RunInput, prefix: str) -> list[ReportBlock]:
    """Line plot of the all-class and base-class means per session, one line per method."""
    labels = _session_labels(run)
    panels: dict[str, dict[str, list[list[float]]]] = {"all classes seen so far": {}, "base-session classes": {}}
    for m in run.methods():
        recs = run.records(m)
        panels["all classes seen so far"][m] = [_values(recs, t, "all") for t in range(len(labels))]
        panels["base-session classes"][m] = [_values(recs, t, "base") for t in range(len(labels))]
    metric = "mIoU" if run.metric == "iou" else run.metric.capitalize()
    png = plots.session_curves(labels, panels, metric)
    caption = f"{metric} per session per method" + (" (line: mean over seeds, band: ± std)" if run.multi_seed else "")
    return [_figure(f"{prefix}-curves", png, caption)]


def _class_matrix(run: RunInput, method: str) -> tuple[np.ndarray, list[str]]:
    recs = run.records(method)
    sessions = run.sessions()
    names = run.first.get("classes", {}) or {}
    keys: list[str] = []
    for per_seed in recs:
        for rec in per_seed:
            keys += [k for k in (rec.get("per_class") or {}) if k != "0" and k not in keys]
    keys.sort(key=lambda k: (0, int(k)) if str(k).isdigit() else (1, str(k)))
    matrix = np.full((len(keys), len(sessions)), np.nan)
    for i, key in enumerate(keys):
        for t in range(len(sessions)):
            vals = [
                float(per_seed[t]["per_class"][key])
                for per_seed in recs
                if t < len(per_seed) and per_seed[t].get("per_class", {}).get(key) is not None
            ]
            mean, _, n = _mean_std(vals)
            if n:
                matrix[i, t] = mean
    return matrix, [f"{k} {names.get(str(k), '')}".strip() for k in keys]


def heatmaps_section(run: RunInput, prefix: str) -> list[ReportBlock]:
    """One per-class-by-session heat map per method (class-wise tables as pictures)."""
    blocks = [
        _text(
            "Rows are foreground classes, columns sessions (the model after that session); grey = class "
            "not yet seen, or absent from the test data" + (". Cells are means over seeds." if run.multi_seed else ".")
        )
    ]
    cols = [f"S{t}\n{n}" for t, n in run.sessions()]
    iou = run.metric == "iou"
    for m in run.methods():
        matrix, rows = _class_matrix(run, m)
        if matrix.size == 0:
            blocks.append(_text(f"{m}: no per-class scores in results.json."))
            continue
        png = plots.class_heatmap(
            matrix,
            rows,
            cols,
            f"{m}: per-class {'IoU ×100' if iou else run.metric} by session",
            scale=100.0 if iou else 1.0,
            decimals=1 if iou else 2,
        )
        blocks.append(_figure(f"{prefix}-heatmap-{_safe(m)}", png, f"{m}: per-class score by session"))
    return blocks


def _session_folder(run: Path, method: str, t: int, name: str) -> Path:
    own = run / method / f"s{t}-{name}"
    if (own / "model.safetensors").is_file() or t > 0:
        return own
    return run / "base"


def qualitative_section(
    run: RunInput, prefix: str, samples: int, device: str, cache_dir: str | Path | None, echo: Callable[[str], None]
) -> list[ReportBlock]:
    """Overlays of a few test samples per session; a sentence instead when the data or models cannot be loaded."""
    if samples <= 0:
        return [_text("Skipped (--samples 0).")]
    folder = run.runs[0]
    note = [] if not run.multi_seed else [_text(f"Models and data of seed {run.seeds[0]} ({folder}).")]
    try:
        return note + _qualitative(folder, run.first, run.methods(), samples, device, cache_dir, prefix, echo)
    except Exception as exc:  # the report is still useful without pictures; say why they are missing
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        echo(f"[report] qualitative overlays unavailable for {folder}: {reason}")
        return note + [
            _text(
                f"Qualitative overlays are not available: the data or models could not be loaded "
                f"({type(exc).__name__}: {reason})."
            )
        ]


def _predict(model, image: np.ndarray, roi: Sequence[int] | None, device) -> np.ndarray:
    import torch
    from monai.inferers import sliding_window_inference

    x = torch.from_numpy(np.ascontiguousarray(image[None])).float().to(device)
    model.eval()
    with torch.no_grad():
        if roi is None or all(r >= s for r, s in zip(roi, x.shape[2:])):
            logits = model(x)
        else:
            logits = sliding_window_inference(x, list(roi), 1, model, overlap=0.25)
    return torch.as_tensor(logits).argmax(1)[0].cpu().numpy()


def _qualitative(
    run: Path,
    results: Mapping[str, Any],
    methods: Sequence[str],
    samples: int,
    device: str,
    cache_dir: str | Path | None,
    prefix: str,
    echo: Callable[[str], None],
) -> list[ReportBlock]:
    import torch

    from jascl.data.sessions import load_sessions
    from jascl.engine.checkpoint import read_session_model
    from jascl.engine.config import resolve_config

    protocol = _load_protocol(run, results)
    config = resolve_config(None, "config.yaml", run / "config.yaml")
    config.device = device
    data = load_sessions(protocol, cache_dir, echo=lambda msg: echo(f"[report] {msg}"))
    manifest = run / "manifest.json"
    if manifest.is_file():
        listed = {int(s["session"]): s.get("test", []) for s in _read_json(manifest).get("sessions", [])}
        for d in data:
            if listed.get(d.session.index, d.test.ids) != d.test.ids:
                raise ConfigError(f"the test split of session {d.session.index} differs from {manifest}")
    names = {c.id: c.name for c in protocol.classes}
    colours = plots.class_colours([c.id for c in protocol.classes])
    target = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    cache: dict[tuple[str, int], Any] = {}

    def model_after(method: str, t: int):
        if (method, t) not in cache:
            folder = _session_folder(run, method, t, protocol.sessions[t].name)
            cache[(method, t)] = read_session_model(folder, protocol, config, t).to(target)
        return cache[(method, t)]

    last = {m: len(results["methods"][m]["sessions"]) - 1 for m in methods}
    blocks: list[ReportBlock] = []
    for t, session in enumerate(protocol.sessions):
        if all(t > last[m] for m in methods):
            break
        test = data[t].test
        picks = sorted(set(np.linspace(0, len(test) - 1, min(samples, len(test))).round().astype(int).tolist()))
        columns = ["input", "ground truth"]
        for m in methods:
            if t <= last[m]:
                columns.append(f"{m} after S{t}")
            if t < last[m]:
                columns.append(f"{m} after S{last[m]}")
        rows = []
        for i in picks:
            truth = test.labels[i]
            image, where = plots.display_slice(test.images[i][0], truth)
            row: dict[str, Any] = {
                "image": image,
                "label": f"{test.ids[i]} {where}".strip(),
                "ground truth": plots.display_slice(truth, truth)[0],
            }
            for m in methods:
                for s in sorted({t, last[m]}):
                    if s < t or s > last[m]:
                        continue
                    seen = np.asarray(protocol.seen_classes(s))
                    pred = seen[_predict(model_after(m, s), test.images[i], config.patch_size, target)]
                    row[f"{m} after S{s}"] = plots.display_slice(pred, truth)[0]
            rows.append(row)
        title = f"S{t} {session.name} (domain {', '.join(session.domains)}): test samples"
        what = "input (the slice of the volume with the most foreground)" if protocol.spatial_dims == 3 else "input"
        blocks.append(
            _figure(
                f"{prefix}-qualitative-s{t}",
                plots.overlay_grid(rows, columns, colours, names, title),
                f"Session {t} ({session.name}) test samples: {what}, ground truth, and each method's "
                "prediction after that session and after its last one",
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


def pseudo_label_section(run: RunInput, prefix: str) -> list[ReportBlock]:
    """Per semi-supervised method: pseudo-label statistics per session (``metrics.json`` ``pseudo_labels``), and a plot."""
    blocks: list[ReportBlock] = []
    sessions = run.sessions()
    with_stats: dict[str, list[int]] = {}
    for m in run.methods():
        ts = sorted(
            {t for recs in run.records(m) for t, r in enumerate(recs) if isinstance(r.get("pseudo_labels"), Mapping)}
        )
        if ts:
            with_stats[m] = ts
    if not with_stats:
        return [
            _text(
                "No pseudo-label statistics in this run (no semi-supervised method, or no unlabelled "
                "phase ran: the protocol has no unlabelled pools or pas.start_epoch ≥ the epochs)."
            )
        ]
    header = ["Session", "Name", "Filter", "Phases", *[title for _, title in _PL_COLUMNS]]
    for m, ts in with_stats.items():
        recs = run.records(m)

        def stat(t: int, key: str) -> list[float]:
            out = []
            for per_seed in recs:
                pl = per_seed[t].get("pseudo_labels") if t < len(per_seed) else None
                if isinstance(pl, Mapping) and pl.get(key) is not None:
                    out.append(float(pl[key]))
            return out

        rows = []
        for t in ts:
            filters = sorted(
                {
                    str(p[t]["pseudo_labels"].get("filter", ""))
                    for p in recs
                    if t < len(p) and isinstance(p[t].get("pseudo_labels"), Mapping)
                }
            )
            rows.append(
                [
                    str(t),
                    sessions[t][1],
                    "/".join(filters),
                    fmt_values(stat(t, "phases"), "count"),
                    *[fmt_values(stat(t, key), "frac") for key, _ in _PL_COLUMNS],
                ]
            )
        blocks.append(_table(f"pseudo-labels:{m}", header, rows, heading=m))
    shown = sorted({t for ts in with_stats.values() for t in ts})
    series: dict[str, dict[str, list[list[float]]]] = {"coverage": {}, "precision": {}}
    for m in with_stats:
        recs = run.records(m)
        for key in series:
            series[key][m] = [
                [
                    float(p[t]["pseudo_labels"][key])
                    if t < len(p)
                    and isinstance(p[t].get("pseudo_labels"), Mapping)
                    and p[t]["pseudo_labels"].get(key) is not None
                    else math.nan
                    for p in recs
                ]
                for t in shown
            ]
    png = plots.pseudo_label_plot([f"S{t} {sessions[t][1]}" for t in shown], series)
    blocks.append(
        _figure(
            f"{prefix}-pseudo-labels",
            png,
            "Coverage = kept / all unlabelled pixels; precision = "
            "kept pixels whose pseudo-label equals the hidden ground truth / kept pixels",
        )
    )
    return blocks


def _config_of(run: Path) -> dict:
    path = run / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


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
    try:
        protocol = _load_protocol(folder, run.first)
    except ConfigError as exc:
        return blocks + [_text(f"Protocol not available: {exc}")]
    blocks.append(
        _text(
            f"Protocol {protocol.name} ({protocol.spatial_dims}D, metric {protocol.metric}, "
            f"unlabelled noise {protocol.unlabelled_noise}): {protocol.description}"
        )
    )
    cls = lambda ids: ", ".join(f"{c} {protocol.class_name(c)}" for c in ids) or "—"  # noqa: E731
    rows = [
        [
            str(s.index),
            s.name,
            ", ".join(s.domains),
            cls(s.new_classes),
            cls(s.recurring_classes),
            "all" if s.shots is None else str(s.shots),
            str(s.num_labelled),
            str(s.unlabelled),
            str(s.test),
        ]
        for s in protocol.sessions
    ]
    blocks.append(
        _table(
            "protocol",
            ["Session", "Name", "Domains", "New classes", "Recurring", "Shots K", "Labelled", "Unlabelled", "Test"],
            rows,
        )
    )
    return blocks


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
    """Split sizes and the first labelled sample ids per session, with the manifest's hash, per seed."""
    blocks = []
    for folder, seed in zip(run.runs, run.seeds):
        path = folder / "manifest.json"
        if not path.is_file():
            blocks.append(_text(f"{path}: not found."))
            continue
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


# ----------------------------------------------------------------------------- assembly


def build_part(
    run: RunInput,
    index: int,
    samples: int = 2,
    device: str = "cpu",
    cache_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> list[tuple[str, list[ReportBlock]]]:
    """The sections of one input folder: ``[(section id, blocks), ...]`` in :data:`SECTIONS` order."""
    prefix = f"p{index}"
    return [
        ("summary", summary_section(run)),
        ("sessions", sessions_section(run)),
        ("curves", curves_section(run, prefix)),
        ("heatmaps", heatmaps_section(run, prefix)),
        ("qualitative", qualitative_section(run, prefix, samples, device, cache_dir, echo)),
        ("pseudo-labels", pseudo_label_section(run, prefix)),
        ("config", config_section(run)),
        ("versions", versions_section(run)),
        ("manifest", manifest_section(run)),
    ]


_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1360px;color:#222;
line-height:1.45;padding:0 16px}
h1{font-size:1.7em;border-bottom:2px solid #444;padding-bottom:4px}
h2{font-size:1.35em;margin-top:1.6em;border-bottom:1px solid #ccc;padding-bottom:2px}
h3{font-size:1.1em;margin:1.1em 0 .3em}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:14px}
th,td{border:1px solid #ccc;padding:3px 9px;text-align:right;white-space:nowrap}
th{background:#f0f0f0} td:first-child,th:first-child,td.t{text-align:left}
tr.total td{font-weight:bold;background:#fafafa}
figure{display:inline-block;vertical-align:top;margin:.6em 1.2em 1.4em 0;max-width:100%}
figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:13px;color:#555}
pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto;border:1px solid #e2e2e2}
.part{border-top:3px solid #2c5d8f;margin-top:2em} nav{font-size:14px}
"""


#: numbers, "mean ± std" and the missing mark are right-aligned; any other cell is text (left-aligned)
_NUMERIC = re.compile(r"^(—|[-+]?\d+(\.\d+)?( ± \d+(\.\d+)?)?)$")


def _html_block(block: ReportBlock) -> str:
    e = html.escape
    if block.kind == "text":
        return f"<p>{e(block.text)}</p>"
    if block.kind == "pre":
        return f"<pre>{e(block.text)}</pre>"
    if block.kind == "figure":
        data = base64.b64encode(block.png).decode("ascii")
        return (
            f'<figure><img alt="{e(block.text)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{e(block.text)}</figcaption></figure>"
        )
    head = f"<h3>{e(block.heading)}</h3>" if block.heading else ""
    lines = [
        f'{head}<table data-table="{e(block.name)}"><thead><tr>'
        + "".join(f"<th>{e(h)}</th>" for h in block.header)
        + "</tr></thead><tbody>"
    ]
    for row in block.rows:
        cls = ' class="total"' if row and row[0] == TOTAL_DROP_ROW else ""
        lines.append(
            f"<tr{cls}>"
            + "".join(f"<td>{e(c)}</td>" if _NUMERIC.match(c) else f'<td class="t">{e(c)}</td>' for c in row)
            + "</tr>"
        )
    lines.append("</tbody></table>")
    return "\n".join(lines)


def _md_block(block: ReportBlock, figures: dict[str, str]) -> str:
    if block.kind == "text":
        return block.text
    if block.kind == "pre":
        return "```yaml\n" + block.text.rstrip("\n") + "\n```"
    if block.kind == "figure":
        return f"![{block.text}]({figures[block.name]})\n\n*{block.text}*"
    head = f"### {block.heading}\n\n" if block.heading else ""
    return head + md_table(block.header, block.rows)


def render(
    parts: Sequence[tuple[RunInput, list[tuple[str, list[ReportBlock]]]]], figures: dict[str, str]
) -> tuple[str, str]:
    """HTML page and Markdown text of the report; ``figures`` maps figure names to Markdown file names."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    heading = f"jascl report ({stamp}, jascl {__version__})"
    body = [f"<h1>{html.escape(heading)}</h1>"]
    md = [f"# {heading}", ""]
    nav = []
    for i, (run, _) in enumerate(parts):
        nav.append(f'<a href="#p{i}">{html.escape(str(run.path))}</a>')
    body.append("<nav>Runs: " + " · ".join(nav) + "</nav>")
    for i, (run, sections) in enumerate(parts):
        kind = f"multi-seed folder, {len(run.seeds)} seeds" if run.multi_seed else "run folder"
        title = f"Run {i + 1}: {run.path} ({kind})"
        body.append(f'<div class="part" id="p{i}"><h1>{html.escape(title)}</h1>')
        md += [f"# {title}", ""]
        for sid, blocks in sections:
            body.append(f'<section id="p{i}-{sid}"><h2>{html.escape(SECTIONS[sid])}</h2>')
            body += [_html_block(b) for b in blocks]
            body.append("</section>")
            md += [f"## {SECTIONS[sid]}", ""]
            for b in blocks:
                md += [_md_block(b, figures), ""]
        body.append("</div>")
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(heading)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    return page, "\n".join(md).rstrip("\n") + "\n"


def write_report(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    samples: int = 2,
    device: str = "cpu",
    cache_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Write ``report.html`` (self-contained) and ``report.md`` (+ its PNG figures) into ``out``.

    Args:
        run_dirs: run folders and/or multi-seed folders; each becomes one part of the report.
        out: output folder (created).
        samples: test samples per session in the qualitative overlays (0 = no overlays).
        device: where the saved models run for the overlays ("cpu", "cuda", ...).
        cache_dir: synthetic data cache (default ``$JASCL_CACHE`` or ``~/.cache/jascl``).

    Returns:
        ``{"html": path, "markdown": path}``.

    Raises:
        ConfigError: a folder is not a finished run or multi-seed folder.
    """
    if not run_dirs:
        raise ConfigError("report: give at least one run folder")
    runs = [open_run(p) for p in run_dirs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, run in enumerate(runs):
        echo(f"[report] {run.path}: {len(run.methods())} methods, {len(run.seeds)} seed(s)")
        parts.append((run, build_part(run, i, samples, device, cache_dir, echo)))
    figures: dict[str, str] = {}
    for _, sections in parts:
        for _, blocks in sections:
            for b in blocks:
                if b.kind == "figure":
                    figures[b.name] = f"{b.name}.png"
                    (out / figures[b.name]).write_bytes(b.png)
    page, md = render(parts, figures)
    atomic_write_text(out / "report.html", page)
    atomic_write_text(out / "report.md", md)
    return {"html": out / "report.html", "markdown": out / "report.md"}
