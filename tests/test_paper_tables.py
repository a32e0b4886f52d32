"""The paper's tables as data (jascl/paper/tables/*.yaml): they parse, their numbers agree with each other where
the paper prints the same quantity twice, and the averaging convention of the class-wise tables is the one the
evaluator uses (foreground classes only)."""

from __future__ import annotations

import itertools
import math

import pytest

from jascl.errors import ConfigError
from jascl.evaluation.metrics import summarise, total_drop
from jascl.paper.tables import KINDS, METRICS, get_table, methods_in_tables, paper_tables, parse_table

TABLES = paper_tables()


def test_every_result_table_of_the_paper_is_shipped():
    # every labelled result table of the LaTeX source (dataset-split tables and figures without numbers excluded),
    # plus the unlabelled class-wise tables of the appendix
    labelled = {
        "tab_set1_part", "tab_set1_full", "SAM_natural", "compute", "backbone_set2", "Semi_natural_gaps",
        "semi_med", "sen_rob", "prl_hyper", "f_loc", "det:methods_session1", "tab:gni_comparison",
        "tab:unlabeled_effect", "tab:noise_results", "abl_robo", "auto_abl", "t_drop", "tab:class_Sessions",
        "tab:class_Sessions_0to4", "per_2d_robot", "tab:class_performance", "sam_d",
        "tab:per_class_performance_Sessions", "abl_gni", "without_plr", "clip_d",
    }  # fmt: skip
    assert labelled <= set(TABLES)
    assert len([t for t in TABLES if t.startswith("nolabel_")]) == 9
    assert len(TABLES) == 35


@pytest.mark.parametrize("label", sorted(TABLES))
def test_table_is_well_formed(label):
    t = TABLES[label]
    assert t.kind in KINDS and t.metric in METRICS
    assert all(len(r.values) == len(t.columns) for r in t.rows)
    if t.kind == "classes":
        assert t.method and sum(r.aggregate == "mean" for r in t.rows) == 1
    values = [v for r in t.rows for v in r.values if v is not None]
    assert values, "a table without a single number"
    if t.metric == "dice" and t.kind in ("methods", "classes"):
        assert all(0 <= v <= 1 for r in t.rows for c, v in zip(t.columns, r.values) if v is not None and not c.metric)
    if t.metric == "miou":
        assert t.scale == 100 and max(values) > 1  # printed in percent


def test_tables_are_in_the_papers_order_and_list_their_methods():
    lines = [t.line for t in TABLES.values()]
    assert lines == sorted(lines)
    used = methods_in_tables()
    assert used["jascl"][:2] == ["tab_set1_part", "tab_set1_full"]
    assert "tab_set1_part" in used["ucl"] and "t_drop" in used["ucl"]


def test_main_table_row_as_printed():
    t = get_table("tab_set1_part")
    assert t.row("UCL").values == (0.700, 0.430, 0.325)
    assert t.row("JASCL (U-Net)").values == (0.736, 0.460, 0.398)
    cells = [c for c in t.cells() if c.row == "C-FSCIL"]
    assert [(c.session, c.value, c.method, c.protocol, c.sessions) for c in cells] == [
        (0, 0.787, "c-fscil", "med-disjoint", 3),
        (1, 0.334, "c-fscil", "med-disjoint", 3),
        (2, 0.297, "c-fscil", "med-disjoint", 3),
    ]


def _drop_interval(values: list[float], half_unit: float = 0.0005) -> tuple[float, float]:
    """The range of Total Drop over every set of scores that rounds to the printed ``values``."""
    grid = [[v - half_unit, v, v + half_unit] for v in values]
    drops = [total_drop(list(p)) for p in itertools.product(*grid)]
    return min(drops), max(drops)


def test_total_drop_recomputed_from_the_main_table():
    """t_drop against tab_set1_part: a printed Total Drop is consistent when some scores that round to the printed
    session values give a drop that rounds to it. Five rows are not, so the paper computed them from other
    numbers; the test names them (t_drop's notes say so too)."""
    drops, main = get_table("t_drop"), get_table("tab_set1_part")
    by_method = {r.method: r for r in main.rows}
    inconsistent = []
    for row in drops.rows:
        lo, hi = _drop_interval(main.session_values(by_method[row.method]))
        printed = row.values[0]
        if not (lo - 0.05 <= printed <= hi + 0.05):
            inconsistent.append(row.name)
    assert len(drops.rows) == 28
    assert inconsistent == ["STAR", "Saving100x", "YoooP", "UCB", "Adapt_replay"]
    # their drops recomputed from the main table's rows, as t_drop's notes give them (printed: 96.9, 92.6, 96.9,
    # 81.6, 96.4); e.g. YoooP 100 * ((0.700 - 0.176) + (0.176 - 0.028)) / 0.700 = 96.0
    recomputed = {n: round(total_drop(main.session_values(main.row(n))), 1) for n in inconsistent}
    assert recomputed == {"STAR": 97.1, "Saving100x": 92.4, "YoooP": 96.0, "UCB": 81.9, "Adapt_replay": 96.1}
    for name, value in recomputed.items():
        assert f"{name} {value:.1f} (" in " ".join(drops.notes)
        assert (
            drops.row(name).note
            == f"recomputed from tab_set1_part: {value:.1f} (printed {drops.row(name).values[0]:.1f})"
        )
    # hand-computed: PIFS 100 * ((0.700 - 0.129) + (0.129 - 0.078)) / 0.700 = 88.857; JASCL (0.276 + 0.062) / 0.736
    assert total_drop(main.session_values(main.row("PIFS"))) == pytest.approx(88.857, abs=1e-3)
    assert total_drop(main.session_values(main.row("JASCL (U-Net)"))) == pytest.approx(45.924, abs=1e-3)


def _printed_mean_tolerance(scale: float) -> float:
    # class rows and the mean are printed to 3 decimals (fractions) or 2 (percent): half a unit each
    return 1.01e-3 if scale == 1 else 1.01e-2


def test_class_wise_averages_are_foreground_means():
    """jascl's mean (summarise: foreground classes, NaN ignored) of each class-wise table's class rows against its
    printed Average row. Most columns match; the ones that do not match either convention are listed exactly."""
    neither: dict[str, list[int]] = {}
    with_background_only: dict[str, list[int]] = {}
    for t in TABLES.values():
        if t.kind != "classes":
            continue
        average = next(r for r in t.rows if r.aggregate == "mean")
        tol = _printed_mean_tolerance(t.scale)
        for j, col in enumerate(t.columns):
            per_class = {r.class_id: r.values[j] for r in t.rows if r.class_id is not None and r.values[j] is not None}
            assert col.session is not None
            fg = summarise(per_class, list(per_class), [])["all"]
            bg = summarise(per_class, list(per_class), [], include_background=True)["all"]
            if abs(fg - average.values[j]) <= tol:
                continue
            if 0 in per_class and abs(bg - average.values[j]) <= tol:
                with_background_only.setdefault(t.label, []).append(col.session)
            else:
                neither.setdefault(t.label, []).append(col.session)
    matching = [t.label for t in TABLES.values() if t.kind == "classes" and t.label not in neither]
    assert {"clip_d", "sam_d", "nolabel_classwise_genreplay_disjoint", "nolabel_classwise_mdil_disjoint"} <= set(
        matching
    )
    assert with_background_only == {"nolabel_classwise_vanilla_medformer_mixed": [2, 4]}
    assert neither == {
        "tab:class_Sessions": [0, 1, 2, 3, 4, 5],
        "nolabel_classwise_jascl_swinunetr_mixed": [4],
        "tab:class_performance": [0, 2, 5],
        "tab:per_class_performance_Sessions": [1, 2, 3],
        "abl_gni": [0],
        "nolabel_classwise_vanilla_medformer_mixed": [0, 1, 3],
        "without_plr": [3],
        "nolabel_classwise_cfscil_disjoint": [2],
    }


def test_foreground_mean_of_a_class_table_by_hand():
    # Gen-Replay on Med-Disjoint, session 0: the mean of its 15 foreground rows is the printed 0.700
    t = get_table("nolabel_classwise_genreplay_disjoint")
    fg = [r.values[0] for r in t.rows if r.class_id not in (None, 0) and r.values[0] is not None]
    assert len(fg) == 15
    assert sum(fg) / 15 == pytest.approx(t.row("Average").values[0], abs=1e-3)
    assert t.row("Average").values[0] == get_table("tab_set1_part").row("Gen-Replay").values[0] == 0.700


def test_a_bad_table_file_is_one_line_naming_the_key():
    base = {
        "label": "x",
        "caption": "c",
        "line": 1,
        "kind": "methods",
        "metric": "dice",
        "columns": [{"name": "Session 0", "session": 0}],
        "rows": [{"name": "A", "method": "vanilla", "values": [0.5]}],
    }
    assert parse_table(base, "x.yaml").rows[0].values == (0.5,)
    cases = [
        ({"rows": [{"name": "A", "values": [0.5, 0.4]}]}, "x.yaml: rows[0].values: must be a list of 1 values"),
        ({"metric": "accuracy"}, "x.yaml: metric: must be one of"),
        ({"rows": [{"name": "A", "values": ["0.5"]}]}, "x.yaml: rows[0].values[0]: must be a number"),
        ({"columns": [{"name": "S0", "sesion": 0}]}, "x.yaml: columns[0].sesion: unknown key"),
        (
            {"rows": [{"name": "A", "values": [0.5]}, {"name": "A", "values": [0.1]}]},
            "x.yaml: rows: row names must be unique (repeated: A)",
        ),
        ({"kind": "classes"}, "x.yaml: rows: a classes table needs 'class'"),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError) as err:
            parse_table({**base, **change}, "x.yaml")
        assert str(err.value).startswith(message), str(err.value)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no paper table 'tab_nope'; `jascl reproduce --list`"):
        get_table("tab_nope")


def test_values_keep_the_printed_nulls():
    t = get_table("tab:gni_comparison")
    row = t.row("Adagrad")
    assert row.values[2] is None and not math.isnan(row.values[1])
