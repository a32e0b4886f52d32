"""``jascl report`` on a detection run: mAP words, box pseudo-label statistics and box overlays, on a tiny
two-session detection run (one epoch per session)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from matplotlib.patches import Rectangle
from torch import nn

from jascl.data.sessions import load_sessions
from jascl.engine.config import resolve_config
from jascl.experiments.runner import run_benchmark
from jascl.protocols import parse_protocol
from jascl.results import box_overlays, plots
from jascl.results.box_overlays import MAX_BOXES, DrawnBox, box_overlay_figure, predicted_boxes, truth_boxes
from jascl.results.html import SECTIONS, write_report
from jascl.results.report import format_score
from jascl.results.runs import open_run
from jascl.results.sections import pseudo_label_section, sessions_section
from test_detection_task import toy_detection_dict

METHODS = ["vanilla", "jascl"]


@pytest.fixture(scope="module")
def det_run(tmp_path_factory):
    """vanilla and jascl (shared base) on the toy detection protocol, one epoch per session, and its report (one
    overlay image per session), with
    what the report's box overlays were given to draw (``drawn``: per figure, its rows and columns)."""
    root = tmp_path_factory.mktemp("report-det")
    protocol = parse_protocol(toy_detection_dict(), source="toy-det.yaml")
    config = resolve_config(
        protocol.training, "toy-det.yaml", overrides=["epochs_incremental=1", "method_args.jascl.base=shared"]
    )
    run = root / "run"
    run_benchmark(protocol, config, METHODS, run, cache_dir=root / "cache", progress=False, echo=lambda *a: None)
    drawn: list[tuple[list, list]] = []
    grid = box_overlays.box_overlay_grid

    def recording_grid(rows, columns, *args, **kwargs):
        drawn.append((list(rows), list(columns)))
        return grid(rows, columns, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(box_overlays, "box_overlay_grid", recording_grid)
        paths = write_report([run], root / "report", samples=1, cache_dir=root / "cache", echo=lambda *a: None)
    return {
        "drawn": drawn,
        "protocol": protocol,
        "cache": root / "cache",
        "root": root,
        "run": run,
        "results": json.loads((run / "results.json").read_text()),
        "md": paths["markdown"].read_text(),
        "out": root / "report",
    }


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def test_the_report_names_map_and_links_the_box_overlays(det_run):
    md, results = det_run["md"], det_run["results"]
    headings = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert headings == [title for sid, title in SECTIONS.items() if sid != "reproduce"]
    assert "toy-det · mAP (COCO AP at IoU 0.50:0.95, mean over the classes seen so far) · seed 5" in md
    assert "Dice" not in md and "IoU ×100" not in md and "Test pixels/voxels" not in md and "eval: sliding" not in md
    assert "All-class mean (mAP) after each session" in md and "per-class AP by session" in md
    # the sessions table: no background column, mAP@0.5 beside mAP (the records' map_50)
    for name in METHODS:
        header = ["Session", "Name", "Domains", "All", "Old", "New", "HM", "Base classes", "All (mAP@0.5)"]
        assert _md_row([*header, "Train time (s)"]) in md
        rows = next(b for b in sessions_section(open_run(det_run["run"])) if b.name == f"sessions:{name}").rows
        for row, record in zip(rows, results["methods"][name]["sessions"]):
            assert row[3] == format_score(record["all"], "map") and row[8] == format_score(record["map_50"], "map")
        per_class = results["methods"][name]["sessions"][-1]
        for key in ("1", "2", "3"):  # support: test boxes and images of the class after the last session
            assert f"| {per_class['support'][key]} | {per_class['samples'][key]} |" in md
    assert "| Test boxes | Test images |" in md
    linked = sorted(line.split("](")[1].rstrip(")") for line in md.splitlines() if line.startswith("!["))
    assert [n for n in linked if "qualitative" in n] == ["p0-qualitative-s0.png", "p0-qualitative-s1.png"]
    for name in linked:
        assert (det_run["out"] / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "its ground-truth boxes" in md and "detections with score ≥ 0.5" in md


def test_the_pseudo_label_section_shows_the_records_kept_boxes(det_run):
    stats = det_run["results"]["methods"]["jascl"]["sessions"][1]["pseudo_labels"]
    assert stats["teacher_boxes"] > 0 and stats["kept"] > 0  # tau 0: the toy run keeps boxes
    expected = [
        "1",
        "inc",
        "pas",
        str(stats["phases"]),
        str(stats["teacher_boxes"]),
        str(stats["kept"]),
        str(stats["confidence_only_kept"]),
        f"{stats['kept'] / stats['teacher_boxes']:.3f}",
        f"{stats['precision']:.3f}",
        f"{stats['confidence_only_precision']:.3f}",
    ]
    blocks = pseudo_label_section(open_run(det_run["run"]), "p0")
    table = next(b for b in blocks if b.kind == "table")
    assert table.name == "pseudo-labels:jascl" and table.rows == [expected]  # vanilla keeps none: no table
    assert table.header[4:7] == ["Teacher boxes", "Kept boxes", "Conf.-only kept"]
    assert _md_row(expected) in det_run["md"]
    figure = next(b for b in blocks if b.kind == "figure")
    assert "kept boxes matching a hidden ground-truth box of the same class at IoU ≥ 0.5" in figure.text
    assert "pixels" not in figure.text


def test_a_session_without_an_unlabelled_phase_lists_zero_boxes_and_draws_no_plot(det_run, tmp_path):
    folder = tmp_path / "no-phase"
    shutil.copytree(det_run["run"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    results = json.loads((folder / "results.json").read_text())
    results["methods"]["jascl"]["sessions"][1]["pseudo_labels"] = {
        "filter": "pas", "phases": 0, "teacher_boxes": 0, "kept": 0, "coverage": None, "precision": None,
        "confidence_only_kept": 0, "confidence_only_precision": None,
    }  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results))
    blocks = pseudo_label_section(open_run(folder), "p0")
    assert [b.kind for b in blocks] == ["table", "text"]
    assert blocks[0].rows == [["1", "inc", "pas", "0", "0", "0", "0", "—", "—", "—"]]
    assert blocks[1].text.startswith("No plot: no pseudo-label was kept or measured")


def _axes(fig, title: str) -> list:
    return [ax for sub in fig.subfigs for ax in sub.axes if ax.get_title().split(" (")[0] == title]


def _rectangles(ax) -> list[tuple[float, float, float, float]]:
    rects = [p for p in ax.patches if isinstance(p, Rectangle)]
    return [(r.get_x(), r.get_y(), r.get_x() + r.get_width(), r.get_y() + r.get_height()) for r in rects]


def test_the_overlays_draw_the_test_splits_boxes_and_each_models_confident_detections(det_run):
    protocol, drawn = det_run["protocol"], det_run["drawn"]
    data = load_sessions(protocol, det_run["cache"], echo=lambda *a: None)  # the run's cached data
    assert [columns for _, columns in drawn] == [
        ["input", "ground truth", "vanilla after S0", "vanilla after S1", "jascl after S0", "jascl after S1"],
        ["input", "ground truth", "vanilla after S1", "jascl after S1"],
    ]  # one figure per session
    colours = plots.class_colours([c.id for c in protocol.classes])
    names = {c.id: c.name for c in protocol.classes}
    for session, (rows, columns) in enumerate(drawn):
        test = data[session].test
        assert [row["label"] for row in rows] == [test.ids[0]]  # --samples 1: the first test image
        fig = box_overlay_figure(rows, columns, colours, names)
        truth_axes = _axes(fig, "ground truth")
        assert len(truth_axes) == len(rows)
        for row, ax in zip(rows, truth_axes):
            target = test.targets[test.ids.index(row["label"])]
            drawn = np.array(_rectangles(ax)).reshape(-1, 4)
            assert len(target["boxes"]) > 0
            np.testing.assert_allclose(drawn, np.asarray(target["boxes"], dtype=float))
            edges = [plots.to_rgba(p.get_edgecolor()) for p in ax.patches]
            assert edges == [plots.to_rgba(colours[int(c)]) for c in target["labels"]]
            assert [b.class_id for b in row["ground truth"]] == [int(c) for c in target["labels"]]
        for column in columns[2:]:
            s = int(column.rsplit("S", 1)[1])
            seen = protocol.seen_classes(s)
            for row, ax in zip(rows, _axes(fig, column)):
                boxes = row[column]
                assert all(b.score is not None and b.score >= 0.5 and b.class_id in seen[1:] for b in boxes)
                assert [b.score for b in boxes] == sorted((b.score for b in boxes), reverse=True)
                expected = [b.box for b in boxes[:MAX_BOXES]]
                np.testing.assert_allclose(np.array(_rectangles(ax)).reshape(-1, 4), np.array(expected).reshape(-1, 4))


class _StubDetector(nn.Module):
    """Three hand-made detections, classifier rows 1, 2, 1, scores 0.9, 0.4, 0.5."""

    def predict(self, images):
        assert not self.training  # predictions in eval mode
        return [
            {
                "boxes": torch.tensor([[1.0, 2.0, 5.0, 6.0], [0.0, 0.0, 3.0, 3.0], [2.0, 2.0, 4.0, 7.0]]),
                "scores": torch.tensor([0.9, 0.4, 0.5]),
                "labels": torch.tensor([1, 2, 1]),
            }
        ]


def test_predicted_boxes_keep_scores_of_at_least_one_half_as_global_ids():
    got = predicted_boxes(_StubDetector(), np.zeros((1, 8, 8), np.float32), seen=[0, 4, 7])
    assert got == [DrawnBox((1.0, 2.0, 5.0, 6.0), 4, pytest.approx(0.9)), DrawnBox((2.0, 2.0, 4.0, 7.0), 4, 0.5)]
    assert truth_boxes({"boxes": np.array([[0, 1, 2, 3]]), "labels": np.array([7]), "iscrowd": np.array([1])}) == [
        DrawnBox((0.0, 1.0, 2.0, 3.0), 7, None, True)
    ]


def test_a_crowded_panel_draws_its_first_boxes_and_says_how_many_there_are():
    boxes = [DrawnBox((float(i), 0.0, float(i) + 2, 2.0), 1, 0.9 - i / 100) for i in range(MAX_BOXES + 5)]
    row = {"image": np.zeros((1, 32, 32)), "label": "x", "ground truth": boxes[:1], "m after S0": boxes}
    fig = box_overlay_figure([row], ["input", "ground truth", "m after S0"], {1: "#E6194B"}, {1: "disc"})
    (ax,) = _axes(fig, "m after S0")
    assert ax.get_title() == f"m after S0 ({MAX_BOXES} of {MAX_BOXES + 5})"
    assert _rectangles(ax) == [b.box for b in boxes[:MAX_BOXES]]
    (gt,) = _axes(fig, "ground truth")
    assert gt.get_title() == "ground truth" and _rectangles(gt) == [boxes[0].box]
