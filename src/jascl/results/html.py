"""``jascl report``: one self-contained HTML page and a Markdown file for run folders.

Inputs are run folders written by :func:`jascl.experiments.runner.run_benchmark`
(``results.json``, ``config.yaml``, ``protocol-resolved.json``, ``manifest.json``,
``environment.json``, per-session checkpoints) or multi-seed folders
(``seed-<s>/`` run folders, plus ``compare.json``, as written by ``jascl compare``
and ``jascl run --seeds``). A multi-seed folder is reported as mean ± std over
its seeds (sample standard deviation, as in :mod:`jascl.experiments.compare`).

Every input folder becomes one part of the report with these sections
(HTML ids ``p<i>-<section>``, Markdown ``##`` headings):

* ``summary``: all-class mean per session, Base@last, HM@last and Total Drop, one row per
  method, the best of each column marked, with how many seeds the numbers rest on;
* ``sessions``: per method, all / old / new / HM / base-class / background scores per
  session, the other metric's all-class mean (IoU beside Dice), the training time and
  the Total Drop (paper: Total Drop = 100 * sum of session-to-session falls / S_0);
* ``per-class``: per method, every class's score after each session, its forgetting and
  the support of its last score (test pixels / voxels and samples);
* ``curves``: line plot of the all-class (and base-class) mean per session per method;
* ``heatmaps``: per-class score by session, one heat map per method (forgetting at a glance);
* ``losses``: training loss per epoch per method, the sessions in order (from each run's ``log.txt``);
* ``qualitative``: input, ground truth and each method's prediction for a few test
  samples of every session (the model after that session, and after the last one); on a detection run the
  ground-truth boxes and the detections scoring at least 0.5 (:mod:`jascl.results.box_overlays`);
* ``pseudo-labels``: coverage and precision of the kept pseudo-labels per session
  (semi-supervised methods); on a detection run the teacher's boxes, the kept boxes and their precision at
  IoU 0.5;
* ``methods``: each method's description, paper and options as run;
* ``config``: the resolved run configuration and the protocol's sessions;
* ``versions``: library versions, devices, seeds and batch sizes;
* ``manifest``: the K-shot split manifest, summarised.

A section that cannot be produced (data roots that moved, a missing run-folder file, a model that does not
load) raises :class:`SectionError` and nothing is written, unless its id is in ``skip`` (``--skip``).
Dataset roots: ``--root`` > ``--roots`` > recorded in the run folder > ``JASCL_ROOT_<NAME>``
(:func:`jascl.results.runs.run_roots`).

A detection run (metric ``map``) is reported with the same sections in its own words: mAP / AP for the scores,
mAP@0.5 beside mAP, test boxes and images as the support, no background column.

Tables print the numbers of ``results.json`` with the formatting of
:func:`jascl.results.report.format_score` (IoU ×100 with one decimal, otherwise
three decimals). The HTML embeds every figure as a base64 PNG and has no external
assets; the Markdown file links PNG files written next to it.
"""

from __future__ import annotations

import base64
import datetime
import html
import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from jascl import __version__
from jascl.errors import ConfigError, JasclError
from jascl.fileio import atomic_write_bytes, atomic_write_text
from jascl.results.blocks import ReportBlock, _table, _text
from jascl.results.losses import losses_section
from jascl.results.overlays import qualitative_section
from jascl.results.report import md_table
from jascl.results.runs import TOTAL_DROP_ROW, RootOptions, RunInput, check_root_names, open_run
from jascl.results.sections import (
    config_section,
    curves_section,
    heatmaps_section,
    manifest_section,
    methods_section,
    per_class_section,
    pseudo_label_section,
    sessions_section,
    summary_section,
    versions_section,
)

__all__ = ["SECTIONS", "SectionError", "build_part", "render", "write_report"]


#: section ids and titles of every report part, in order
SECTIONS: dict[str, str] = {
    "reproduce": "Published beside measured (jascl reproduce)",
    "summary": "Summary: all-class mean per session",
    "sessions": "Per-session results",
    "per-class": "Per-class scores, forgetting and support",
    "curves": "All-class mean per session",
    "heatmaps": "Per-class score by session",
    "losses": "Training loss per epoch",
    "qualitative": "Qualitative results",
    "pseudo-labels": "Pseudo-labels (semi-supervised)",
    "methods": "Methods as run",
    "config": "Configuration",
    "versions": "Versions",
    "manifest": "Split manifest",
}


def reproduce_section(path: Path) -> list[ReportBlock]:
    """The ``jascl reproduce`` table of ``reproduce.json``: published, measured, Δ; what was not measured; notes."""
    from jascl.results.reproduce_table import not_measured, reproduce_table, reproduce_title

    summary = _read_reproduce(path)
    header, rows = reproduce_table(summary)
    blocks = [_text(reproduce_title(summary)), _table("reproduce", header, rows)]
    reasons = not_measured(summary)
    if reasons:
        blocks.append(_text("Not measured: " + "; ".join(reasons)))
    if summary.get("notes"):
        blocks.append(_text("Notes on the paper's table: " + " ".join(summary["notes"])))
    return blocks


def _read_reproduce(path: Path) -> dict:
    import json

    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
            raise ValueError("no 'cells' list")
        return data
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a jascl reproduce summary ({exc})") from None


class SectionError(JasclError):
    """A report section that cannot be produced: one line naming the section and the cause; exit code 2.

    The report is not written (a previous one stays as it was) unless the section is left out
    with ``--skip SECTION``.
    """

    def __init__(self, section: str, cause: BaseException) -> None:
        reason = str(cause) if isinstance(cause, JasclError) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"report: {section}: {reason.strip()}; --skip {section} leaves the section out")
        self.section = section


#: what a section raises when its inputs cannot be read (data, models, run-folder files); any other exception
#: is a bug and keeps its traceback
_INPUT_ERRORS = (JasclError, OSError, RuntimeError, ValueError)


def _section(sid: str, build: Callable[[], list[ReportBlock]], skip: Collection[str]) -> list[ReportBlock]:
    if sid in skip:
        return [_text(f"Left out (--skip {sid}).")]
    try:
        return build()
    except _INPUT_ERRORS as exc:
        raise SectionError(sid, exc) from exc


def check_skip(skip: Collection[str]) -> None:
    """Refuse a ``--skip`` value that is not a section id of :data:`SECTIONS`."""
    unknown = [s for s in skip if s not in SECTIONS]
    if unknown:
        raise ConfigError(f"--skip {unknown[0]}: not a report section; choose from {', '.join(SECTIONS)}")


def build_part(
    run: RunInput,
    index: int,
    samples: int = 2,
    device: str = "cpu",
    cache_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
    skip: Collection[str] = (),
    slices: int = 1,
) -> list[tuple[str, list[ReportBlock]]]:
    """The sections of one input folder: ``[(section id, blocks), ...]`` in :data:`SECTIONS` order.

    Sections named in ``skip`` hold one sentence saying so; ``slices``: slices per volume in the overlays.

    Raises:
        SectionError: a section that cannot be produced (not in ``skip``).
    """
    prefix = f"p{index}"
    builders: list[tuple[str, Callable[[], list[ReportBlock]]]] = [
        ("summary", lambda: summary_section(run)),
        ("sessions", lambda: sessions_section(run)),
        ("per-class", lambda: per_class_section(run)),
        ("curves", lambda: curves_section(run, prefix)),
        ("heatmaps", lambda: heatmaps_section(run, prefix)),
        ("losses", lambda: losses_section(run, prefix)),
        ("qualitative", lambda: qualitative_section(run, prefix, samples, device, cache_dir, echo, slices)),
        ("pseudo-labels", lambda: pseudo_label_section(run, prefix)),
        ("methods", lambda: methods_section(run)),
        ("config", lambda: config_section(run)),
        ("versions", lambda: versions_section(run)),
        ("manifest", lambda: manifest_section(run)),
    ]
    return [(sid, _section(sid, build, skip)) for sid, build in builders]


_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1360px;color:#222;
line-height:1.45;padding:0 16px}
h1{font-size:1.7em;border-bottom:2px solid #444;padding-bottom:4px}
h2{font-size:1.35em;margin-top:1.6em;border-bottom:1px solid #ccc;padding-bottom:2px}
h3{font-size:1.1em;margin:1.1em 0 .3em}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:14px}
th,td{border:1px solid #ccc;padding:3px 9px;text-align:right;white-space:nowrap}
th{background:#f0f0f0} td:first-child,th:first-child,td.t{text-align:left} td.t{white-space:normal}
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
    for r, row in enumerate(block.rows):
        cls = ' class="total"' if row and row[0] == TOTAL_DROP_ROW else ""
        cells = []
        for c, cell in enumerate(row):
            text = f"<strong>{e(cell)}</strong>" if (r, c) in block.best else e(cell)
            cells.append(f"<td>{text}</td>" if _NUMERIC.match(cell) else f'<td class="t">{text}</td>')
        lines.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
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
    rows = [[f"**{v}**" if (r, c) in block.best else v for c, v in enumerate(row)] for r, row in enumerate(block.rows)]
    return head + md_table(block.header, rows)


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
    roots: RootOptions | None = None,
    skip: Collection[str] = (),
    slices: int = 1,
) -> dict[str, Path]:
    """Write ``report.html`` (self-contained) and ``report.md`` (+ its PNG figures) into ``out``.

    Every section is built before anything is written, so a report that fails leaves ``out`` as it was.

    Args:
        run_dirs: run folders and/or multi-seed folders; each becomes one part of the report.
        out: output folder (created).
        samples: test samples per session in the qualitative overlays (0 = no overlays).
        device: where the saved models run for the overlays ("cpu", "cuda", ...).
        cache_dir: data cache (default: the run's recorded one if it exists, else ``$JASCL_CACHE`` or
            ``~/.cache/jascl``).
        roots: dataset roots over those each run recorded (``--root`` / ``--roots``; see
            :func:`jascl.results.runs.run_roots` for the precedence).
        skip: section ids (:data:`SECTIONS`) to leave out.
        slices: slices shown per test volume in the overlays (the one with the most foreground first).

    Returns:
        ``{"html": path, "markdown": path}``.

    Raises:
        ConfigError: a folder is not a finished run or multi-seed folder; an unknown ``skip`` section or
            ``roots`` name.
        SectionError: a section that cannot be produced and is not in ``skip``.
    """
    if not run_dirs:
        raise ConfigError("report: give at least one run folder")
    if slices < 1:
        raise ConfigError(f"--slices {slices}: must be >= 1")
    check_skip(skip)
    roots = roots or RootOptions()
    # a jascl reproduce folder: its table first, then each of its jobs (compare folders) as a part
    leading: dict[int, tuple[str, list[ReportBlock]]] = {}
    folders: list[Path] = []
    for given in run_dirs:
        folder = Path(given)
        if (folder / "reproduce.json").is_file():
            jobs = sorted(p for p in folder.iterdir() if p.is_dir() and any(p.glob("seed-*/results.json")))
            if not jobs:
                raise ConfigError(f"{folder}: a jascl reproduce folder without finished jobs; rerun jascl reproduce")
            summary = folder / "reproduce.json"
            leading[len(folders)] = ("reproduce", _section("reproduce", lambda: reproduce_section(summary), skip))
            folders += jobs
        else:
            folders.append(folder)
    runs = [open_run(p) for p in folders]
    for run in runs:
        run.roots = roots
    check_root_names(runs, roots)
    parts = []
    for i, run in enumerate(runs):
        echo(f"[report] {run.path}: {len(run.methods())} methods, {len(run.seeds)} seed(s)")
        sections = build_part(run, i, samples, device, cache_dir, echo, skip, slices)
        if i in leading:
            sections.insert(0, leading[i])
        parts.append((run, sections))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, str] = {}
    for _, sections in parts:
        for _, blocks in sections:
            for b in blocks:
                if b.kind == "figure":
                    figures[b.name] = f"{b.name}.png"
                    atomic_write_bytes(out / figures[b.name], b.png)
    page, md = render(parts, figures)
    atomic_write_text(out / "report.html", page)
    atomic_write_text(out / "report.md", md)
    return {"html": out / "report.html", "markdown": out / "report.md"}
