"""Typed records of results.json: what readers get, and the one-line errors for a malformed file."""

import json
import math

import pytest

from jascl.errors import ConfigError
from jascl.results.records import SPLITS, MethodResults, RunResults, SessionRecord
from jascl.results.report import comparison_table, per_class_table, session_detail_table, table_title

RESULTS = {
    "protocol": "toy",
    "metric": "iou",
    "eval_mode": "whole-image",
    "background": "excluded from means",
    "seed": 7,
    "classes": {"0": "background", "1": "liver", "2": "tumour"},
    "methods": {
        "vanilla": {
            "sessions": [
                {"session": 0, "name": "base", "all": 0.8, "old": None, "new": 0.8, "base": 0.8, "background": 0.99,
                 "per_class": {"0": 0.99, "1": 0.8}, "domains": ["ct"], "written_at": "noon",
                 "dice": {"0": 0.995, "1": 0.89}, "iou": {"0": 0.99, "1": 0.8}, "support": {"0": 900, "1": 100},
                 "samples": {"0": 2, "1": 2}},
                {"session": 1, "name": "mri", "all": 0.5, "old": 0.4, "new": 0.6, "base": 0.4, "background": 0.98,
                 "per_class": {"0": 0.98, "1": 0.4, "2": None}, "domains": ["ct", "mri"],
                 "pseudo_labels": {"filter": "pas", "coverage": 0.25, "precision": None}},
            ],
            "total_drop": 37.5,
            "forgetting": {"1": 0.4},
        },
        "short": {"sessions": [{"name": "base", "all": 0.7}], "total_drop": None},
    },
    "written_by": "a newer jascl",
}  # fmt: skip


def test_records_read_every_entry_with_nan_for_missing():
    r = RunResults.from_json(RESULTS)
    assert (r.protocol, r.metric, r.eval_mode, r.seed, r.is_iou) == ("toy", "iou", "whole-image", 7, True)
    assert r.classes["2"] == "tumour"
    assert list(r.methods) == ["vanilla", "short"]
    v = r.methods["vanilla"]
    s0, s1 = v.sessions
    assert (s0.session, s0.name, s0.all, s0.new, s0.background) == (0, "base", 0.8, 0.8, 0.99)
    assert math.isnan(s0.old) and math.isnan(s1.per_class["2"])
    assert s0.per_class == {"0": 0.99, "1": 0.8}
    assert s1.domains == ("ct", "mri")
    assert s0.extra == {"written_at": "noon"} and s0.pseudo_labels is None
    # both metrics and the support behind them; empty for records written before they were saved
    assert s0.dice == {"0": 0.995, "1": 0.89} and s0.iou == s0.per_class
    assert s0.support == {"0": 900, "1": 100} and s0.samples == {"0": 2, "1": 2}
    assert s1.support == {} and s1.dice == {}
    assert s1.pseudo_label_value("coverage") == 0.25
    assert math.isnan(s1.pseudo_label_value("precision")) and math.isnan(s0.pseudo_label_value("coverage"))
    # hm (not in this older record) from old 0.4 and new 0.6: 2 * 0.4 * 0.6 / 1.0 = 0.48
    assert [s1.score(k) for k in SPLITS] == pytest.approx([0.5, 0.4, 0.6, 0.48, 0.4, 0.98])
    assert math.isnan(s0.hm)  # session 0 has no old classes
    assert v.total_drop == 37.5 and v.forgetting == {"1": 0.4} and v.last is s1
    short = r.methods["short"]
    assert short.sessions[0].session == 0  # the position stands in for a missing index
    assert math.isnan(short.total_drop) and math.isnan(short.sessions[0].base)
    assert r.extra == {"written_by": "a newer jascl"}
    assert r.session_names() == [(0, "base"), (1, "mri")]
    assert MethodResults().last is None
    with pytest.raises(KeyError, match="unknown split 'dice'"):
        s0.score("dice")


def test_tables_read_records_and_dicts_alike():
    typed = RunResults.from_json(RESULTS)
    assert RunResults.from_json(typed) is typed
    header, rows = comparison_table(typed)
    assert header == ["Method", "S0 (base)", "S1 (mri)", "Base@last", "Total Drop (%)"]
    # IoU is shown x100 with one decimal; a missing value is a dash
    # each method with its fidelity mark ("short" is no registered method)
    assert rows == [["vanilla [F]", "80.0", "50.0", "40.0", "37.5"], ["short [?]", "70.0", "—", "—", "—"]]
    assert comparison_table(RESULTS) == (header, rows)
    assert session_detail_table(typed, "vanilla")[1][0] == ["0", "base", "80.0", "—", "80.0", "—", "80.0", "99.0"]
    _, per_class = per_class_table(typed)
    assert per_class[2][:3] == ["2 tumour", "—", "—"]
    assert per_class[1][:3] == ["1 liver", "40.0", "40.0"]
    assert table_title(typed).endswith("eval: whole-image · seed 7")


@pytest.mark.parametrize(
    ("path", "value", "key"),
    [
        (("methods", "vanilla", "sessions", 1, "per_class", "1"), "high", "methods.vanilla.sessions[1].per_class.1"),
        (("methods", "vanilla", "sessions", 0, "all"), [0.5], "methods.vanilla.sessions[0].all"),
        (("methods", "vanilla", "total_drop"), True, "methods.vanilla.total_drop"),
        (("methods", "vanilla", "sessions"), {"0": {}}, "methods.vanilla.sessions"),
        (("methods", "vanilla", "sessions", 0, "session"), "0", "methods.vanilla.sessions[0].session"),
        (("methods", "vanilla", "sessions", 0, "support", "1"), -3, "methods.vanilla.sessions[0].support.1"),
        (("methods", "vanilla", "sessions", 0, "samples", "1"), 1.5, "methods.vanilla.sessions[0].samples.1"),
        (("seed",), "7", "seed"),
        (("methods",), [], "methods"),
    ],
)
def test_a_malformed_entry_is_one_line_naming_file_and_key(tmp_path, path, value, key):
    data = json.loads(json.dumps(RESULTS))
    target = data
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    file = tmp_path / "results.json"
    file.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        RunResults.read(file)
    assert str(err.value).startswith(f"{file}.{key}: must be")
    assert "\n" not in str(err.value)


def test_an_unreadable_file_names_itself(tmp_path):
    with pytest.raises(ConfigError, match=r"results.json: cannot read .*finished jascl run folder"):
        RunResults.read(tmp_path / "results.json")
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        RunResults.read(tmp_path / "results.json")


def test_session_record_defaults():
    rec = SessionRecord.from_json({}, index=3)
    assert rec.session == 3 and rec.name == "" and rec.per_class == {} and rec.domains == ()
    assert all(math.isnan(rec.score(k)) for k in SPLITS)
