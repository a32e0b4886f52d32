"""The report's figures: fitted ranges, slice and plane choice, class colours, legible layouts, loss curves from
the log. Hand-made arrays and tiny files only (no training)."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.text import Text

from jascl.results import charts, figure_style, plots
from jascl.results.losses import TOTAL, loss_series, parse_log, session_log_names
from jascl.results.overlays import array_axis_codes
from jascl.results.records import RunResults
from jascl.results.runs import RunInput

# --- fitted ranges ----------------------------------------------------------------------------------------------


def test_fitted_range_shows_a_difference_of_one_hundredth():
    lo, hi = figure_style.fitted_range([0.50, 0.51, 0.505])
    assert 0.49 <= lo < 0.50 and 0.51 < hi <= 0.52
    assert (lo, hi) == pytest.approx((0.495, 0.515))  # widened to the smallest span, 0.02, around the centre


def test_fitted_range_margin_clipping_and_empty_input():
    assert figure_style.fitted_range([0.2, 0.7]) == pytest.approx((0.2 - 0.04, 0.7 + 0.04))  # 8 % of the span each side
    assert figure_style.fitted_range([0.995, 1.0]) == pytest.approx((0.98, 1.0))  # clipped at 1, extended downwards
    assert figure_style.fitted_range([0.0, 0.001]) == pytest.approx((0.0, 0.02))
    assert figure_style.fitted_range([math.nan]) == (0.0, 1.0)
    assert figure_style.fitted_range([2.0, 4.0], bounds=(0.0, math.inf)) == pytest.approx((1.84, 4.16))


def test_curves_range_covers_the_band_over_seeds():
    # seeds 0.5 and 0.6: mean 0.55, sample std 0.0707; a second method at 0.58 exactly
    panels = {"all": {"a": [[0.5, 0.6]], "b": [[0.58]]}}
    lo, hi = charts.curves_range(panels)
    std = 0.1 / math.sqrt(2)
    span = 2 * std
    assert (lo, hi) == pytest.approx((0.55 - std - 0.08 * span, 0.55 + std + 0.08 * span))


def test_format_range_has_enough_decimals():
    assert figure_style.format_range(0.495, 0.515) == "0.495–0.515"
    assert figure_style.format_range(0.0, 0.98) == "0.00–0.98"
    assert figure_style.format_range(0.1, 0.35, scale=100) == "10–35"


def test_heatmap_numbers_are_readable_on_both_ends_of_the_colour_map():
    from matplotlib import colormaps

    viridis = colormaps["viridis"]
    assert figure_style.text_colour_on(viridis(0.0)) == "white"  # dark purple
    assert figure_style.text_colour_on(viridis(1.0)) == "black"  # yellow


# --- slices and planes ------------------------------------------------------------------------------------------


def test_plane_from_a_hand_made_affine():
    ras = plots.axis_codes(np.eye(4))
    assert ras == ("R", "A", "S")
    assert plots.slice_axis(ras, "axial") == (2, "axial")
    assert plots.slice_axis(ras, "coronal") == (1, "coronal")
    assert plots.slice_axis(ras, "sagittal") == (0, "sagittal")
    # array axis 0 runs to posterior, 1 to superior, 2 to the patient's left
    permuted = np.array([[0, 0, -2, 10], [-2, 0, 0, 5], [0, 3, 0, 0], [0, 0, 0, 1]], dtype=float)
    codes = plots.axis_codes(permuted)
    assert codes == ("P", "S", "L")
    assert plots.slice_axis(codes, "axial") == (1, "axial")
    assert plots.slice_axis(codes, "coronal") == (0, "coronal")
    assert plots.axis_codes(None) is None
    assert plots.slice_axis(None) == (2, "")  # no affine: the last array axis, no plane name


def test_the_slice_shown_has_the_most_foreground():
    label = np.zeros((5, 6, 7), dtype=np.uint8)
    label[0, 0, 1] = 1
    label[:2, :2, 4] = 2  # 4 voxels: the fullest axial slice is z = 4
    label[:, :, 6] = 255  # ignore is not foreground
    view = plots.choose_slices(label, label.shape, ("R", "A", "S"))[0]
    assert (view.axis, view.index, view.plane) == (2, 4, "axial")
    assert view.describe() == "axial slice 4/7"
    # the same label along array axis 0 (no affine: last axis is axis 2, so transpose the volume instead)
    coronal = plots.choose_slices(label, label.shape, ("R", "A", "S"), plane="coronal")[0]
    assert (coronal.axis, coronal.index) == (1, 0)  # y = 0 holds 3 of the 5 foreground voxels
    blank = plots.choose_slices(np.zeros((4, 4, 6)), (4, 4, 6))[0]
    assert (blank.index, blank.describe()) == (3, "slice 3/6 along array axis 2")  # no foreground: middle


def test_several_slices_spread_over_the_foreground():
    label = np.zeros((4, 4, 20), dtype=np.uint8)
    label[:2, :2, 5:16] = 1  # z = 5..15 hold some foreground
    label[:, :, 9] = 2  # z = 9 the most
    views = plots.choose_slices(label, label.shape, count=3)
    # z = 5..15 in three parts of 11/3 slices, centred on floor(6.83, 10.5, 14.17) = 6, 10, 14; 10 replaced by
    # the fullest, shown first
    assert [v.index for v in views] == [9, 6, 14]
    # two parts centred on floor(7.75, 13.25) = 7, 13 (not the edge slice 15); 7 replaced by the fullest
    assert [v.index for v in plots.choose_slices(label, label.shape, count=2)] == [9, 13]
    assert [v.index for v in plots.choose_slices(label, label.shape)] == [9]
    assert len(plots.choose_slices(label, label.shape, count=50)) == 11  # no more than the extent holds


def test_axial_slice_is_shown_in_radiological_convention():
    x, y, z = np.meshgrid(np.arange(4), np.arange(5), np.arange(3), indexing="ij")
    view = plots.SliceView(axis=2, index=1, depth=3, plane="axial", codes=("R", "A", "S"))
    rows_hold = view.take(y.astype(float))  # y grows towards anterior: anterior on top
    assert rows_hold.shape == (5, 4) and rows_hold[0, 0] == 4 and rows_hold[-1, 0] == 0
    cols_hold = view.take(x.astype(float))  # x grows towards the patient's right: right on the image's left
    assert cols_hold[0, 0] == 3 and cols_hold[0, -1] == 0
    # without axis codes the slice is the array's, untouched
    plain = plots.SliceView(axis=2, index=1, depth=3)
    assert np.array_equal(plain.take(x), x[:, :, 1])


def test_volume_orientation_comes_from_the_dataset_preprocessing():
    def protocol(preprocess):
        return SimpleNamespace(uses_datasets=True, datasets={"brain": SimpleNamespace(preprocess=preprocess)})

    assert array_axis_codes(protocol({}), "brain/sub-01") == ("R", "A", "S")  # the loader's default
    assert array_axis_codes(protocol({"orientation": "lps"}), "brain/sub-01") == ("L", "P", "S")
    assert array_axis_codes(protocol({"orientation": None}), "brain/sub-01") is None  # as stored: unknown
    assert array_axis_codes(protocol({"orientation": "RAR"}), "brain/sub-01") is None
    assert array_axis_codes(SimpleNamespace(uses_datasets=False), "s0-base/test/0") is None  # synthetic


# --- colours and layout -----------------------------------------------------------------------------------------


def test_every_class_gets_its_own_colour():
    colours = plots.class_colours(range(0, 21))
    assert 0 not in colours and len(colours) == 20 and len(set(colours.values())) == 20
    rgb = {c: np.asarray(to_rgb(v)) for c, v in colours.items()}
    dist = {pair: float(np.linalg.norm(rgb[pair[0]] - rgb[pair[1]])) for pair in itertools.combinations(rgb, 2)}
    assert min(dist.values()) > 0.15  # no two of the 20 near-identical
    assert min(d for (a, b), d in dist.items() if a <= 7 and b <= 7) > 0.35  # the first seven far apart
    many = plots.class_colours(range(1, 120))
    assert len(set(many.values())) == 119
    assert plots.class_colours([4])[4] == colours[4]  # fixed per id, whatever else is drawn


def test_a_wide_overlay_grid_wraps_and_keeps_its_fonts():
    columns = ["input", "ground truth", *[f"m{i} after S{s}" for i in range(3) for s in (1, 3)]]
    label = np.zeros((16, 16), dtype=np.uint8)
    label[4:9, 4:9] = 1
    label[10:14, 2:6] = 7
    rows = [{"image": np.random.default_rng(0).random((16, 16)), "label": f"sample {i}"} for i in range(2)]
    for row in rows:
        row.update({c: label for c in columns[1:]})
    fig = plots.overlay_figure(rows, columns, plots.class_colours(range(10)), {1: "disc", 7: "bar"}, "title")
    width_px = fig.get_size_inches()[0] * plots.DPI
    assert width_px <= plots.EMBED_WIDTH_PX  # shown unscaled in the page: fonts keep their size
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text()]
    assert min(sizes) >= plots.MIN_FONT_PT
    shown = [ax for sub in fig.subfigs for ax in sub.axes if ax.axison]
    assert len(shown) == 2 * 8
    assert {ax.get_subplotspec().get_gridspec().ncols for ax in shown} == {4}  # 8 panels: two rows of four
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["1 disc", "7 bar", "outline: ground truth"]
    five = plots.overlay_figure(rows[:1], columns[:5], plots.class_colours(range(10)), {}, "")
    assert [ax.get_subplotspec().get_gridspec().get_geometry() for ax in five.subfigs[0].axes][0] == (2, 3)


# --- losses from the log ----------------------------------------------------------------------------------------

_LOG = """\
2026-01-01 10:00:00,000 INFO run out: protocol toy seed 3 methods vanilla,own
2026-01-01 10:00:01,000 INFO base session 0 epoch 0: loss 1.5000 (seg 1.4000)
2026-01-01 10:00:02,000 INFO base session 0 epoch 1: loss 1.2000 (seg 1.1000)
2026-01-01 10:00:03,000 INFO base session 0 epoch 2: loss 1.0000 (seg 0.9000)
2026-01-01 10:00:04,000 INFO vanilla session 1 epoch 0: loss 2.0000 (seg 1.5000, kd 0.5000)
2026-01-01 10:00:05,000 INFO vanilla session 1 epoch 1: loss 9.0000 (seg 8.0000, kd 1.0000)
2026-01-01 10:00:06,000 INFO vanilla session 1 base=0.1000 all=0.2000
2026-01-01 10:00:07,000 INFO vanilla session 1 epoch 1: loss 1.8000 (seg 1.4000, kd 0.4000)
2026-01-01 10:00:08,000 INFO own session 0 epoch 0: loss 3.0000 (seg 3.0000)
2026-01-01 10:00:09,000 INFO own session 1 epoch 0: loss nan (seg nan)
"""


def test_parse_log_keeps_the_last_line_of_an_epoch():
    parsed = parse_log(_LOG.splitlines())
    assert set(parsed) == {("base", 0), ("vanilla", 1), ("own", 0), ("own", 1)}
    assert [(e.epoch, e.total) for e in parsed[("base", 0)]] == [(0, 1.5), (1, 1.2), (2, 1.0)]
    vanilla = parsed[("vanilla", 1)]
    assert [e.total for e in vanilla] == [2.0, 1.8]  # the resumed epoch 1 replaced the first
    assert vanilla[1].terms == {"seg": 1.4, "kd": 0.4}
    assert math.isnan(parsed[("own", 1)][0].total)


def _record(t: int, name: str, score: float) -> dict:
    return {"session": t, "name": name, "all": score, "per_class": {"0": 0.9, "1": score}}


def _write_run(folder, base_score: float, log: str) -> RunResults:
    """A run folder with two shared bases (``base`` scoring 0.6, ``base-other`` 0.123), a vanilla method whose
    session 0 scores ``base_score``, and a method ("own") that trained its session 0."""
    data = {
        "protocol": "toy",
        "metric": "dice",
        "seed": 3,
        "methods": {
            "vanilla": {"sessions": [_record(0, "base", base_score), _record(1, "inc", 0.3)]},
            "own": {"sessions": [_record(0, "base", 0.7), _record(1, "inc", 0.2)]},
        },
    }
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(data))
    (folder / "log.txt").write_text(log)
    for sub, score in (("base", 0.6), ("base-other", 0.123)):
        (folder / sub).mkdir()
        (folder / sub / "metrics.json").write_text(json.dumps({**_record(0, "base", score), "seconds": 1.0}))
    (folder / "own" / "s0-base").mkdir(parents=True)
    (folder / "own" / "s0-base" / "metrics.json").write_text(json.dumps(_record(0, "base", 0.7)))
    return RunResults.read(folder / "results.json")


def test_each_session_is_read_under_the_name_that_trained_it(tmp_path):
    results = _write_run(tmp_path / "run", 0.6, _LOG)
    assert session_log_names(tmp_path / "run", "vanilla", results.methods["vanilla"].sessions) == ["base", "vanilla"]
    assert session_log_names(tmp_path / "run", "own", results.methods["own"].sessions) == ["own", "own"]
    # a keyed base is found by its scores: vanilla's session 0 equals base-other's metrics.json
    other = _write_run(tmp_path / "keyed", 0.123, _LOG)
    assert session_log_names(tmp_path / "keyed", "vanilla", other.methods["vanilla"].sessions)[0] == "base-other"


def test_loss_series_has_one_point_per_logged_epoch(tmp_path):
    results = _write_run(tmp_path / "run", 0.6, _LOG)
    run = RunInput(tmp_path / "run", [tmp_path / "run"], [3], [results])
    parsed = [parse_log(_LOG.splitlines())]
    vanilla = loss_series(run, "vanilla", parsed)
    assert [label for label, _ in vanilla] == ["S0 base · shared model base", "S1 inc"]
    assert vanilla[0][1] == {TOTAL: [[1.5], [1.2], [1.0]]}  # one logged term: no term lines
    assert vanilla[1][1] == {TOTAL: [[2.0], [1.8]], "seg": [[1.5], [1.4]], "kd": [[0.5], [0.4]]}
    own = loss_series(run, "own", parsed)
    assert [len(series[TOTAL]) for _, series in own] == [1, 1]


def test_loss_series_over_seeds_pads_a_shorter_seed_with_nan(tmp_path):
    short = "\n".join(line for line in _LOG.splitlines() if "epoch 2" not in line)
    runs = [_write_run(tmp_path / "seed-3", 0.6, _LOG), _write_run(tmp_path / "seed-4", 0.6, short)]
    run = RunInput(tmp_path, [tmp_path / "seed-3", tmp_path / "seed-4"], [3, 4], runs, multi_seed=True)
    parsed = [parse_log(_LOG.splitlines()), parse_log(short.splitlines())]
    base = loss_series(run, "vanilla", parsed)[0][1][TOTAL]
    assert base[:2] == [[1.5, 1.5], [1.2, 1.2]] and base[2][0] == 1.0 and math.isnan(base[2][1])
    png = charts.loss_curves({"vanilla": loss_series(run, "vanilla", parsed)}, total=TOTAL)
    assert png[:4] == b"\x89PNG"
