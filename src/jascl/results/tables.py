"""The report's tables of numbers: summary, per-session detail, per-class scores with their support and
forgetting, and the methods as run.

Conventions, the same in every table:

* a cell is the value of ``results.json``, or ``mean ± std`` (sample std) over the seeds of a multi-seed
  folder; the title says how many seeds, and "1 seed" when there is one (then nothing says how much a
  difference between methods is noise);
* the best value of each numeric column is marked (highest score; lowest Total Drop, forgetting and
  time) when at least two methods have one; ties are all marked;
* IoU is ×100 with one decimal, other scores three decimals (:func:`jascl.results.report.format_score`);
* the support of a per-class score is the number of test pixels / voxels of the class in the scored
  ground truth and the number of test samples containing it, after that session (``results.json``'s
  ``support`` / ``samples``; runs written before jascl saved them show "—");
* detection runs (metric ``map``): scores are AP / mAP, the support is test boxes and images, there is no
  background column, and the metric beside the protocol's is mAP at IoU 0.5 (the record's ``map_50``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jascl.evaluation.metrics import summarise
from jascl.methods.fidelity import Fidelity
from jascl.results.blocks import ReportBlock, _table, _text
from jascl.results.fidelity import footnotes, mark
from jascl.results.records import SPLITS, SessionRecord
from jascl.results.report import MISSING, is_detection_metric, metric_name
from jascl.results.runs import TOTAL_DROP_ROW, RunInput, _config_of, _mean_std, _read_json, _session_folder, fmt_values

HIGHER, LOWER = 1, -1


def best_rows(values: Sequence[float], direction: int = HIGHER) -> set[int]:
    """Indices of the best of ``values`` (NaN skipped; ties all); empty unless two or more are valid."""
    valid = [(i, v) for i, v in enumerate(values) if v is not None and not math.isnan(v)]
    if len(valid) < 2:
        return set()
    best = max(v * direction for _, v in valid)
    return {i for i, v in valid if math.isclose(v * direction, best, rel_tol=0, abs_tol=1e-12)}


def mark_best(columns: dict[int, tuple[list[float], int]]) -> set[tuple[int, int]]:
    """The (row, column) cells to mark: per column index, its per-row values and direction."""
    return {(r, c) for c, (values, direction) in columns.items() for r in best_rows(values, direction)}


def seeds_note(run: RunInput) -> str:
    """How many seeds the numbers rest on, said in words."""
    if run.multi_seed and len(run.seeds) > 1:
        return f"mean ± std over {len(run.seeds)} seeds ({', '.join(map(str, run.seeds))})"
    return "1 seed: no uncertainty estimate, so a small difference between methods may be noise"


def _mean(values: Sequence[float]) -> float:
    return _mean_std(values)[0]


def other_metric(run: RunInput) -> str:
    """The metric shown beside the protocol's: IoU beside Dice, Dice beside IoU, mAP@0.5 (``map_50``) beside mAP."""
    if is_detection_metric(run.metric):
        return "map_50"
    return "dice" if run.metric == "iou" else "iou"


def other_mean(rec: SessionRecord, metric: str, background_in_mean: bool) -> float:
    """The all-class mean of ``metric`` over the classes the record's ``all`` averages (NaN if not saved);
    ``"map_50"``: the record's mAP at IoU 0.5."""
    if metric == "map_50":
        value = rec.extra.get("map_50")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    scores = rec.dice if metric == "dice" else rec.iou
    if not scores:
        return math.nan
    by_id = {int(k): v for k, v in scores.items()}
    return summarise(by_id, [c for c in by_id if c != 0], [], include_background=background_in_mean)["all"]


def session_seconds(run: RunInput, method: str, t: int, name: str) -> list[float]:
    """Per seed, the training seconds of session ``t`` (its ``metrics.json``; NaN where not recorded)."""
    out = []
    for folder, results in zip(run.runs, run.results):
        sessions = results.methods[method].sessions
        path = _session_folder(folder, method, t, name, sessions[0] if t == 0 and sessions else None) / "metrics.json"
        value = _read_json(path).get("seconds") if path.is_file() else None
        out.append(float(value) if isinstance(value, (int, float)) else math.nan)
    return out


def _metric_label(metric: str) -> str:
    if metric == "map_50":
        return "mAP@0.5"
    return "IoU ×100" if metric == "iou" else metric_name(metric)


def summary_table(run: RunInput) -> ReportBlock:
    """One row per method: the all-class mean per session, Base@last, HM@last and Total Drop, best marked."""
    sessions = run.sessions()
    header = ["Method", *[f"S{t} ({n})" for t, n in sessions], "Base@last", "HM@last", TOTAL_DROP_ROW]
    rows: list[list[str]] = []
    numbers: dict[int, tuple[list[float], int]] = {c: ([], HIGHER) for c in range(1, len(header))}
    numbers[len(header) - 1] = ([], LOWER)
    for m in run.methods():
        recs = run.records(m)
        cells = [[r[t].all if t < len(r) else math.nan for r in recs] for t in range(len(sessions))]
        cells.append([r[-1].base if r else math.nan for r in recs])
        cells.append([r[-1].hm if r else math.nan for r in recs])
        rows.append([mark(m), *(fmt_values(v, run.metric) for v in cells), fmt_values(run.total_drops(m), "pct")])
        for c, values in enumerate([*cells, run.total_drops(m)], start=1):
            numbers[c][0].append(_mean(values))
    block = _table("summary", header, rows)
    block.best = mark_best(numbers)
    return block


def summary_notes(run: RunInput) -> list[ReportBlock]:
    return [
        *(_text(line) for line in footnotes(run.methods())),
        _text(
            f"All-class mean ({_metric_label(run.metric)}) after each session; {seeds_note(run)}. "
            "Best per column in bold. Base@last: the mean over the session-0 classes after the last session; "
            "HM@last: the harmonic mean of the old- and new-class means in the last session."
        ),
        _text(
            "Total Drop (%) = 100 × Σ_i max(0, S_i − S_{i+1}) / S_0, with S_i the all-class mean after session i "
            "(the paper's definition; lower is better). It measures how far the all-class mean falls from session "
            "to session, so weak new classes raise it even where no old class is forgotten; what each class lost "
            "is its forgetting, in the per-class tables below."
        ),
    ]


def sessions_table(run: RunInput, method: str, background_in_mean: bool) -> ReportBlock:
    """One method's sessions: all / old / new / HM / base / background, the other metric's all, training time."""
    recs = run.records(method)
    other = other_metric(run)
    # a detector scores no background class: its column would be empty
    splits = [k for k in SPLITS if k != "background"] if is_detection_metric(run.metric) else list(SPLITS)
    header = ["Session", "Name", "Domains", "All", "Old", "New", "HM", "Base classes", "Background"][: 3 + len(splits)]
    header += [f"All ({_metric_label(other)})", "Train time (s)"]
    rows = []
    for t, name in run.sessions():
        if t >= max(len(r) for r in recs):
            continue
        domains = ", ".join(recs[0][t].domains) if t < len(recs[0]) else ""
        cells = [fmt_values([r[t].score(k) for r in recs if t < len(r)], run.metric) for k in splits]
        values = [other_mean(r[t], other, background_in_mean) for r in recs if t < len(r)]
        cells.append(fmt_values(values, run.metric if other == "map_50" else other))
        seconds = session_seconds(run, method, t, name)
        shared = t == 0 and not (run.runs[0] / method / f"s0-{name}" / "model.safetensors").is_file()
        time = fmt_values(seconds, "count") + (" (shared base)" if shared and time_known(seconds) else "")
        rows.append([str(t), name, domains, *cells, time])
    rows.append([TOTAL_DROP_ROW, "", "", fmt_values(run.total_drops(method), "pct"), *[""] * (len(header) - 4)])
    return _table(f"sessions:{method}", header, rows, heading=method)


def time_known(seconds: Sequence[float]) -> bool:
    return any(not math.isnan(s) for s in seconds)


def _class_keys(recs: list[tuple[SessionRecord, ...]]) -> list[str]:
    keys: list[str] = []
    for per_seed in recs:
        for rec in per_seed:
            keys += [k for k in rec.per_class if k not in keys]
    return sorted(keys, key=lambda k: (0, int(k)) if k.isdigit() else (1, k))


def per_class_table(run: RunInput, method: str) -> ReportBlock:
    """One method's classes: the score after every session, forgetting, and the support of the last score."""
    recs = run.records(method)
    sessions = run.sessions()
    names = run.first.classes
    support = (
        ["Test boxes", "Test images"] if is_detection_metric(run.metric) else ["Test pixels/voxels", "Test samples"]
    )
    header = ["Class", *[f"S{t}" for t, _ in sessions], "Forgetting", *support]
    rows = []
    for key in _class_keys(recs):
        row = [f"{key} {names.get(key, '')}".strip()]
        for t in range(len(sessions)):
            row.append(fmt_values([r[t].per_class.get(key, math.nan) for r in recs if t < len(r)], run.metric))
        # defined only for a class scored before the last session (the runner writes 0 for one first seen there)
        forgetting = [
            res.methods[method].forgetting.get(key, math.nan) if _scored_before_last(r, key) else math.nan
            for res, r in zip(run.results, recs)
        ]
        row.append(fmt_values(forgetting, run.metric))
        last = [r[-1] for r in recs if r]
        row.append(_support(last, key, "support"))
        row.append(_support(last, key, "samples"))
        rows.append(row)
    return _table(f"per-class:{method}", header, rows, heading=method)


def _scored_before_last(records: Sequence[SessionRecord], key: str) -> bool:
    return any(not math.isnan(rec.per_class.get(key, math.nan)) for rec in records[:-1])


def _support(last: Sequence[SessionRecord], key: str, what: str) -> str:
    """The support over seeds: one count, or ``mean ± std`` in whole units (the seeds' test splits differ)."""
    values = [float(getattr(rec, what)[key]) for rec in last if key in getattr(rec, what)]
    if not values:
        return MISSING
    mean, std, n = _mean_std(values)
    return f"{mean:.0f}" if n < 2 else f"{mean:.0f} ± {std:.0f}"


def per_class_notes(run: RunInput) -> ReportBlock:
    if is_detection_metric(run.metric):
        return _text(
            f"Per class (AP, COCO IoU 0.50:0.95) after each session; {seeds_note(run)}. Forgetting = best AP in an "
            "earlier session − AP after the last session (positive: the class lost ground; — for a class first "
            "scored in the last session). The support columns give how much test data the last session's AP rests "
            "on: ground-truth boxes of the class and test images showing it; an AP on a few boxes is a weak finding."
        )
    return _text(
        f"Per class ({_metric_label(run.metric)}) after each session; {seeds_note(run)}. Forgetting = best score "
        "in an earlier session − score after the last session (positive: the class lost ground; — for a class "
        "first scored in the last session). The support "
        "columns give how much test data the last session's score rests on: pixels / voxels of the class in the "
        "scored ground truth and test samples containing it; a score on a few samples or voxels is a weak finding."
    )


def methods_table(run: RunInput) -> list[ReportBlock]:
    """Every method of the run: what it is, the paper it comes from, and its options as run (config.yaml)."""
    from jascl.methods import METHODS
    from jascl.methods.registry import describe_method

    config = _config_of(run.runs[0])
    method_args = config.get("method_args") or {}
    rows = []
    for m in run.methods():
        if m not in METHODS:
            rows.append([m, "not registered in this jascl (a user module?)", "", "", ""])
            continue
        info = describe_method(m)
        given = (method_args.get(info["options_key"]) or {}) if info["options_key"] else method_args
        options = []
        for o in info["options"]:
            value = _lookup(given, o["name"])
            options.append(f"{o['name']}={o['default'] if value is None else _flat(value)}")
        fidelity = Fidelity(info["fidelity"], tuple(info["flags"]))
        rows.append([mark(m), info["doc"], info["paper"] or "—", fidelity.text(), ", ".join(options) or "none"])
    path = run.runs[0] / "config.yaml"
    return [
        _text(f"Options as run: the run's {path} (method_args), with each method's defaults where it sets none."),
        _table("methods", ["Method", "What it is", "Paper", "Fidelity", "Options as run"], rows),
    ]


def _lookup(given: object, dotted: str) -> object:
    """``given["a"]["b"]`` for ``"a.b"``; None where a level is missing."""
    for part in dotted.split("."):
        if not isinstance(given, dict) or part not in given:
            return None
        given = given[part]
    return given


def _flat(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flat(v)}" for k, v in value.items()) + "}"
    return str(value)
