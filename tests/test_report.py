"""Checks for jascl.results.report writers."""

from __future__ import annotations

import copy
import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from jascl.results.report import (
    comparison_table,
    print_tables,
    session_detail_table,
    to_csv,
    to_markdown,
    write_all,
    write_json,
)


def _results(metric: str = "dice") -> dict[str, Any]:
    def sessions(s0: float, s1: float, s2: float) -> list[dict[str, Any]]:
        return [
            {
                "session": 0,
                "name": "base",
                "all": s0,
                "old": math.nan,
                "new": s0,
                "base": s0,
                "background": 0.99,
                "per_class": {"1": 0.8, "2": 0.7},
            },
            {
                "session": 1,
                "name": "step1",
                "all": s1,
                "old": 0.5,
                "new": 0.4,
                "base": 0.45,
                "background": 0.98,
                "per_class": {"1": 0.5, "2": 0.4, "3": 0.4},
            },
            {
                "session": 2,
                "name": "step2",
                "all": s2,
                "old": 0.4,
                "new": 0.3,
                "base": 0.35,
                "background": 0.97,
                "per_class": {"1": 0.4, "2": 0.3, "3": 0.4, "4": 0.3},
            },
        ]

    return {
        "protocol": "synthetic-2d",
        "metric": metric,
        "eval_mode": "sliding-window",
        "background": "excluded from means",
        "seed": 1024,
        "methods": {
            "ucl": {"sessions": sessions(0.700, 0.430, 0.325), "total_drop": 53.5714, "forgetting": {"1": 0.4}},
            "jascl": {
                "sessions": sessions(0.736, 0.460, 0.398),
                "total_drop": 45.9239,
                "forgetting": {"1": 0.3, "2": math.nan},
            },
        },
    }


def test_comparison_table_dice() -> None:
    header, rows = comparison_table(_results())
    assert header == ["Method", "S0 (base)", "S1 (step1)", "S2 (step2)", "Base@last", "Total Drop (%)"]
    assert rows == [
        ["ucl [F]", "0.700", "0.430", "0.325", "0.350", "53.6"],  # each name with its fidelity mark
        ["jascl [F]", "0.736", "0.460", "0.398", "0.350", "45.9"],
    ]


def test_comparison_table_iou_is_percent() -> None:
    _, rows = comparison_table(_results("iou"))
    assert rows[1][:4] == ["jascl [F]", "73.6", "46.0", "39.8"]


def test_session_detail_table_marks_missing() -> None:
    header, rows = session_detail_table(_results(), "jascl")
    assert header == ["Session", "Name", "All", "Old", "New", "HM", "Base", "Background"]
    assert rows[0] == ["0", "base", "0.736", "—", "0.736", "—", "0.736", "0.990"]
    # a record without "hm" (written before it was saved) gets it from old and new: 2 * 0.5 * 0.4 / 0.9
    assert rows[1][5] == "0.444"
    assert len(rows) == 3


def test_markdown_contents() -> None:
    md = to_markdown(_results())
    first = md.splitlines()[0]
    assert "Dice (mean over foreground classes; background excluded)" in first
    assert "eval: sliding-window" in first and "seed 1024" in first
    assert "| jascl [F] | 0.736 | 0.460 | 0.398 | 0.350 | 45.9 |" in md
    assert "| ucl [F] | 0.700 | 0.430 | 0.325 | 0.350 | 53.6 |" in md
    assert "- [F] ucl: faithful" in md and "- Fidelity marks: F faithful" in md  # the footnotes under the table
    assert "### jascl: per-session detail" in md


def test_json_nan_becomes_null_and_round_trips(tmp_path: Path) -> None:
    res = _results()
    path = write_json(res, tmp_path / "r.json")
    text = path.read_text()
    assert "NaN" not in text and '"old": null' in text
    loaded = json.loads(text)
    assert loaded["methods"]["jascl"]["sessions"][0]["old"] is None
    assert loaded["methods"]["jascl"]["forgetting"]["2"] is None
    assert loaded["methods"]["jascl"]["sessions"][1]["all"] == 0.460
    # tables render identically from the reloaded (None instead of NaN) dict
    assert to_markdown(loaded) == to_markdown(res)
    assert not [p for p in tmp_path.iterdir() if p.name != "r.json"]  # no temp left


def test_csv_long_format(tmp_path: Path) -> None:
    path = to_csv(_results(), tmp_path / "r.csv")
    rows = list(csv.reader(path.open()))
    assert rows[0] == ["method", "session", "session_name", "split", "value"]
    # per method: sessions have 6 splits + 2, 3, 4 classes = 8 + 9 + 10 = 27; two methods
    assert len(rows) == 1 + 2 * 27
    assert ["jascl", "0", "base", "old", ""] in rows  # NaN -> empty field
    assert ["jascl", "2", "step2", "hm", str(2 * 0.4 * 0.3 / 0.7)] in rows  # from old and new
    assert ["jascl", "2", "step2", "class:4", "0.3"] in rows


def test_write_all_and_print(tmp_path: Path) -> None:
    paths = write_all(_results(), tmp_path / "out")
    assert {p.name for p in paths.values()} == {"results.json", "results.csv", "results.md"}
    assert all(p.is_file() for p in paths.values())
    console = Console(file=io.StringIO(), width=200)
    print_tables(_results(), console=console)
    out = console.file.getvalue()
    assert "45.9" in out and "Base@last" in out


def test_missing_session_cells() -> None:
    res = copy.deepcopy(_results())
    res["methods"]["ucl"]["sessions"] = res["methods"]["ucl"]["sessions"][:2]
    _, rows = comparison_table(res)
    assert rows[0] == ["ucl [F]", "0.700", "0.430", "—", "0.450", "53.6"]


def test_unknown_method_detail_raises() -> None:
    with pytest.raises(KeyError):
        session_detail_table(_results(), "nope")
