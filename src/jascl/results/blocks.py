"""The pieces a report is made of: text, tables and figures, each renderable as HTML and as Markdown."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class ReportBlock:
    """One piece of a report section, rendered to both HTML and Markdown.

    ``kind`` is ``"text"`` (``text``), ``"table"`` (``header``, ``rows``, ``name``
    for the HTML ``data-table`` attribute, ``best``: the (row, column) cells to mark
    as the best of their column), ``"figure"`` (``png``, ``name`` = file stem,
    ``text`` = caption) or ``"pre"`` (``text`` preformatted).
    """

    kind: str
    text: str = ""
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    name: str = ""
    png: bytes = b""
    heading: str = ""
    best: set[tuple[int, int]] = field(default_factory=set)


def _text(text: str) -> ReportBlock:
    return ReportBlock("text", text=text)


def _table(name: str, header: list[str], rows: list[list[str]], heading: str = "") -> ReportBlock:
    return ReportBlock("table", header=header, rows=rows, name=name, heading=heading)


def _figure(name: str, png: bytes, caption: str) -> ReportBlock:
    return ReportBlock("figure", png=png, name=name, text=caption)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
