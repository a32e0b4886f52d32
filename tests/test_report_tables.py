"""The report tables' rules on hand-made values: best cells, the other metric's mean, the seeds note."""

import math

import pytest

from jascl.results.records import SessionRecord
from jascl.results.tables import HIGHER, LOWER, best_rows, other_mean


def test_best_rows_marks_ties_skips_nan_and_needs_two_values():
    assert best_rows([0.5, math.nan, 0.7, 0.7]) == {2, 3}
    assert best_rows([40.0, 12.5, 30.0], LOWER) == {1}  # Total Drop, forgetting, time: lower is better
    assert best_rows([0.5, math.nan]) == set() and best_rows([], HIGHER) == set()


def test_other_metric_mean_averages_the_classes_all_averages():
    rec = SessionRecord(session=1, iou={"0": 0.9, "1": 0.5, "2": 0.2, "3": math.nan})
    assert other_mean(rec, "iou", background_in_mean=False) == pytest.approx(0.35)  # classes 1 and 2
    assert other_mean(rec, "iou", background_in_mean=True) == pytest.approx(1.6 / 3)
    assert math.isnan(other_mean(SessionRecord(session=0), "dice", False))  # a record from before both were saved


def test_report_refuses_zero_slices(tmp_path, capsys):
    from jascl.cli import main

    assert main(["report", str(tmp_path), "--slices", "0"]) == 2
    assert "--slices 0: must be >= 1" in capsys.readouterr().err
