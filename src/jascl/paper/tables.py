"""The paper's result tables as data: one YAML file per table in ``jascl/paper/tables/``.

Each file transcribes one table of the JASCL paper (``../shared/seeds``, LaTeX source)
with what a run needs to reproduce it. A *cell* of a table is a published number; what
produced it is the merge of three levels, the most specific winning:

* the table: ``protocol``, ``backbone``, ``method``, ``eval_mode``, ``metric``, ``set``;
* the row: usually a method (``method``: its jascl name), sometimes a setting or a class;
* the column: usually a session (``session``), sometimes a setting or another protocol.

So the main baseline table has method rows and session columns; the sensitivity table
one ``jascl`` row and columns that each set ``method_args.jascl.epsilon`` (and similar);
a class-wise table ``class`` rows (global class ids) for one ``method``; the CIL/DIL/CDIL
table columns that each name their own ``protocol``.

File format (keys not listed are refused, with the file and the key named)::

    label: tab_set1_part          # the table's \\label in the paper (an id of ours where it has none)
    caption: "..."                # the paper's caption, shortened if long
    line: 374                     # the line of \\begin{table} in the LaTeX source
    kind: methods                 # methods | classes | settings | compute | other
    metric: dice                  # dice | miou | map | total_drop | retention | params_m | tflops | hours
    scale: 1                      # published = measured score * scale (100 for mIoU in percent)
    protocol: med-disjoint        # a jascl protocol name (built-in), or null where none fits
    sessions: 3                   # the protocol's first N sessions are run (default: all)
    backbone: unet3d-authors      # null: the protocol's default
    method: jascl                 # only where every row is the same method (classes, settings)
    eval_mode: authors            # sliding-window | authors
    stand_in: synthetic-2d        # the embedded protocol ``--stand-in`` runs instead
    set: {}                       # config overrides for every cell, e.g. {epochs: 100}
    columns:
      - {name: Session 0, session: 0}
    rows:
      - {name: UCL, method: ucl, values: [0.700, 0.430, 0.325]}
    notes: ["what in the paper is inconsistent or unclear, with the evidence"]

Row keys: ``name`` (as printed), ``method``, ``class`` (a global class id, classes
tables), ``aggregate: mean`` (a printed average row), ``set``, ``protocol``, ``backbone``,
``values`` (one per column; ``null`` where the paper prints "--" or nothing),
``note``. Column keys: ``name``, ``session``, ``set``, ``protocol``, ``backbone``,
``sessions``, ``metric``, ``method``. A method name that jascl does not register (yet)
is allowed: ``jascl reproduce`` marks its cells "not registered".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from jascl.errors import ConfigError
from jascl.fileio import load_yaml
from jascl.protocols.reader import _Reader

KINDS = ("methods", "classes", "settings", "compute", "other")
METRICS = ("dice", "miou", "map", "total_drop", "retention", "params_m", "tflops", "hours")
EVAL_MODES = ("sliding-window", "authors")

_TABLE_KEYS = {
    "label",
    "caption",
    "line",
    "kind",
    "metric",
    "scale",
    "protocol",
    "sessions",
    "backbone",
    "method",
    "eval_mode",
    "stand_in",
    "set",
    "columns",
    "rows",
    "notes",
}
_COLUMN_KEYS = {"name", "session", "set", "protocol", "backbone", "sessions", "metric", "method"}
_ROW_KEYS = {"name", "method", "class", "aggregate", "set", "protocol", "backbone", "values", "note"}


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    session: int | None = None
    set: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    protocol: str | None = None
    backbone: str | None = None
    sessions: int | None = None
    metric: str | None = None
    method: str | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    values: tuple[float | None, ...]
    method: str | None = None
    class_id: int | None = None
    aggregate: str | None = None
    set: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    protocol: str | None = None
    backbone: str | None = None
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class Cell:
    """One published number and everything that produced it (table, row and column merged)."""

    table: str
    row: str
    column: str
    value: float | None
    method: str | None
    protocol: str | None
    sessions: int | None
    session: int | None
    backbone: str | None
    metric: str
    eval_mode: str | None
    set: Mapping[str, Any]
    class_id: int | None = None
    aggregate: str | None = None


@dataclasses.dataclass(frozen=True)
class PaperTable:
    label: str
    caption: str
    line: int
    kind: str
    metric: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    scale: float = 1.0
    protocol: str | None = None
    sessions: int | None = None
    backbone: str | None = None
    method: str | None = None
    eval_mode: str | None = None
    stand_in: str | None = None
    set: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    source: str = ""

    def cells(self) -> Iterator[Cell]:
        """Every (row, column) cell with its merged configuration, row by row."""
        for row in self.rows:
            for col, value in zip(self.columns, row.values):
                yield Cell(
                    table=self.label,
                    row=row.name,
                    column=col.name,
                    value=value,
                    method=row.method or col.method or self.method,
                    protocol=row.protocol or col.protocol or self.protocol,
                    sessions=col.sessions if col.sessions is not None else self.sessions,
                    session=col.session,
                    backbone=row.backbone or col.backbone or self.backbone,
                    metric=col.metric or self.metric,
                    eval_mode=self.eval_mode,
                    set={**self.set, **col.set, **row.set},
                    class_id=row.class_id,
                    aggregate=row.aggregate,
                )

    def row(self, name: str) -> Row:
        """The row printed as ``name`` (case-insensitive)."""
        for r in self.rows:
            if r.name.lower() == name.lower():
                return r
        raise ConfigError(f"table {self.label}: no row {name!r}; its rows: {', '.join(r.name for r in self.rows)}")

    def session_values(self, row: Row) -> list[float | None]:
        """The row's values in the session columns, ordered by session."""
        pairs = sorted((c.session, v) for c, v in zip(self.columns, row.values) if c.session is not None)
        return [v for _, v in pairs]


def _set_mapping(r: _Reader, value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise r.fail(key, f"must be a mapping of config keys to values (got {value!r})")
    return {str(k): v for k, v in value.items()}


def _optional_str(r: _Reader, value: Any, key: str, choices: tuple[str, ...] | None = None) -> str | None:
    return None if value is None else r.string(value, key, choices)


def _value(r: _Reader, value: Any, key: str) -> float | None:
    if value is None:
        return None
    v = r.number(value, key)
    if not math.isfinite(v):
        raise r.fail(key, f"must be a finite number or null (got {value!r})")
    return v


def parse_table(data: Any, source: str) -> PaperTable:
    """Check one table's YAML mapping and build the :class:`PaperTable` (one-line errors naming ``source``)."""
    r = _Reader(source)
    d = r.mapping(data, "", _TABLE_KEYS, required={"label", "caption", "line", "kind", "metric", "columns", "rows"})
    columns = d["columns"]
    if not isinstance(columns, list) or not columns:
        raise r.fail("columns", "must be a non-empty list")
    cols = []
    for i, c in enumerate(columns):
        key = f"columns[{i}]"
        c = r.mapping(c, key, _COLUMN_KEYS, required={"name"})
        cols.append(
            Column(
                name=r.string(c["name"], f"{key}.name"),
                session=None if c.get("session") is None else r.integer(c["session"], f"{key}.session", minimum=0),
                set=_set_mapping(r, c.get("set"), f"{key}.set"),
                protocol=_optional_str(r, c.get("protocol"), f"{key}.protocol"),
                backbone=_optional_str(r, c.get("backbone"), f"{key}.backbone"),
                sessions=None if c.get("sessions") is None else r.integer(c["sessions"], f"{key}.sessions", 1),
                metric=_optional_str(r, c.get("metric"), f"{key}.metric", METRICS),
                method=_optional_str(r, c.get("method"), f"{key}.method"),
            )
        )
    rows_in = d["rows"]
    if not isinstance(rows_in, list) or not rows_in:
        raise r.fail("rows", "must be a non-empty list")
    rows = []
    for i, row in enumerate(rows_in):
        key = f"rows[{i}]"
        row = r.mapping(row, key, _ROW_KEYS, required={"name", "values"})
        values = row["values"]
        if not isinstance(values, list) or len(values) != len(cols):
            raise r.fail(f"{key}.values", f"must be a list of {len(cols)} values, one per column (got {values!r})")
        aggregate = _optional_str(r, row.get("aggregate"), f"{key}.aggregate", ("mean",))
        rows.append(
            Row(
                name=r.string(row["name"], f"{key}.name"),
                values=tuple(_value(r, v, f"{key}.values[{j}]") for j, v in enumerate(values)),
                method=_optional_str(r, row.get("method"), f"{key}.method"),
                class_id=None if row.get("class") is None else r.integer(row["class"], f"{key}.class", minimum=0),
                aggregate=aggregate,
                set=_set_mapping(r, row.get("set"), f"{key}.set"),
                protocol=_optional_str(r, row.get("protocol"), f"{key}.protocol"),
                backbone=_optional_str(r, row.get("backbone"), f"{key}.backbone"),
                note=_optional_str(r, row.get("note"), f"{key}.note"),
            )
        )
    names = [row.name for row in rows]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise r.fail("rows", f"row names must be unique (repeated: {', '.join(dup)})")
    notes = d.get("notes") or []
    if not isinstance(notes, list):
        raise r.fail("notes", "must be a list of strings")
    table = PaperTable(
        label=r.string(d["label"], "label"),
        caption=r.string(d["caption"], "caption"),
        line=r.integer(d["line"], "line", minimum=1),
        kind=r.string(d["kind"], "kind", KINDS),
        metric=r.string(d["metric"], "metric", METRICS),
        columns=tuple(cols),
        rows=tuple(rows),
        scale=r.number(d.get("scale", 1), "scale", lo=1e-9),
        protocol=_optional_str(r, d.get("protocol"), "protocol"),
        sessions=None if d.get("sessions") is None else r.integer(d["sessions"], "sessions", minimum=1),
        backbone=_optional_str(r, d.get("backbone"), "backbone"),
        method=_optional_str(r, d.get("method"), "method"),
        eval_mode=_optional_str(r, d.get("eval_mode"), "eval_mode", EVAL_MODES),
        stand_in=_optional_str(r, d.get("stand_in"), "stand_in"),
        set=_set_mapping(r, d.get("set"), "set"),
        notes=tuple(r.string(n, f"notes[{i}]") for i, n in enumerate(notes)),
        source=source,
    )
    if table.kind == "classes" and not all(row.class_id is not None or row.aggregate for row in rows):
        raise r.fail("rows", "a classes table needs 'class' (a global class id) or 'aggregate' on every row")
    return table


def load_table_file(path: str | Path) -> PaperTable:
    """Read one table file (a path), with one-line errors naming it."""
    p = Path(path)
    try:
        data = load_yaml(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML ({str(exc).splitlines()[0]})") from None
    return parse_table(data, str(p))


@cache
def paper_tables() -> dict[str, PaperTable]:
    """Every table shipped in the package, by label, in the paper's order (by source line)."""
    folder = resources.files("jascl.paper") / "tables"
    tables: list[PaperTable] = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            data = load_yaml(entry.read_text(encoding="utf-8"))
            tables.append(parse_table(data, f"jascl/paper/tables/{entry.name}"))
    by_label: dict[str, PaperTable] = {}
    for t in sorted(tables, key=lambda t: t.line):
        if t.label in by_label:
            raise ConfigError(f"{t.source}: label {t.label!r} is used by {by_label[t.label].source} too")
        by_label[t.label] = t
    return by_label


def get_table(label: str) -> PaperTable:
    """The shipped table ``label``; a one-line error listing the labels otherwise."""
    tables = paper_tables()
    if label not in tables:
        raise ConfigError(f"no paper table {label!r}; `jascl reproduce --list` lists them: {', '.join(tables)}")
    return tables[label]


def methods_in_tables(tables: Sequence[PaperTable] | None = None) -> dict[str, list[str]]:
    """jascl method name -> the labels of the tables it appears in."""
    out: dict[str, list[str]] = {}
    for t in tables if tables is not None else paper_tables().values():
        for cell in t.cells():
            if cell.method and t.label not in out.setdefault(cell.method, []):
                out[cell.method].append(t.label)
    return out
