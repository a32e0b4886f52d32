"""``jascl study components``: the plan (which variants run), and a whole study at toy size, checked by hand
against the per-seed run records."""

import csv
import json
import math
import statistics

import pytest
import yaml

from conftest import toy_protocol_dict
from jascl.cli import main
from jascl.engine.config import resolve_config
from jascl.errors import ConfigError
from jascl.experiments.study import parse_components, plan_study
from jascl.protocols import get_protocol, parse_protocol

T_975_DF2 = 4.303  # Student t, two-sided 95 %, 2 degrees of freedom (3 seeds), from the printed tables


def _plan(protocol, *overrides):
    return {e["method"]: e for e in plan_study(protocol, resolve_config(protocol.training, "p.yaml", None, overrides))}


def test_plan_without_pools_leaves_out_what_equals_the_full_method(toy_protocol):
    plan = _plan(toy_protocol)
    assert [m for m, e in plan.items() if e["status"] == "run"] == ["jascl", "jascl-no-gas", "jascl-no-replay"]
    for m in ("jascl-conf", "jascl-no-unlabelled"):
        assert plan[m]["status"] == "skipped" and "no unlabelled pool" in plan[m]["note"]
    assert {plan[m]["base"] for m in ("jascl", "jascl-no-gas", "jascl-no-replay")} == {"base-stochastic-classifier"}


def test_plan_with_pools_runs_every_variant():
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    plan = _plan(parse_protocol(spec, source="toy-ss.yaml"))
    # w/o PAS keeps the teacher with confidence-only pseudo-labels; w/o unlabelled has no teacher
    assert [m for m, e in plan.items() if e["status"] == "run"] == [
        "jascl", "jascl-no-gas", "jascl-no-replay", "jascl-conf", "jascl-no-unlabelled"
    ]  # fmt: skip
    shared = _plan(parse_protocol(spec, source="toy-ss.yaml"), "method_args.jascl.base=shared")
    assert {e["base"] for e in shared.values()} == {"base"}  # the vanilla base, for every variant alike


def test_plan_on_detection_runs_what_has_a_detection_implementation():
    plan = _plan(get_protocol("synthetic-det"))
    assert [m for m, e in plan.items() if e["status"] == "run"] == [
        "jascl", "jascl-no-gas", "jascl-no-replay", "jascl-conf", "jascl-no-unlabelled"
    ]  # fmt: skip


def test_plan_refuses_switched_components_and_unshared_bases(toy_protocol):
    with pytest.raises(ConfigError, match="components.gas=false: the study switches"):
        _plan(toy_protocol, "method_args.jascl.components.gas=false")
    with pytest.raises(ConfigError, match="same session-0 model"):  # GAS in session 0: jascl's own base
        _plan(toy_protocol, "method_args.jascl.gas.in_base=true")
    assert list(_plan(toy_protocol, "preset=authors")) == [
        "jascl", "jascl-no-gas", "jascl-no-replay", "jascl-conf", "jascl-no-unlabelled"
    ]  # fmt: skip
    assert parse_components("replay, gas") == ["gas", "replay"]  # table order
    with pytest.raises(ConfigError, match="--components nope"):
        parse_components("nope")


def _interval(values):
    """Mean and 95 % half-width by hand (3 seeds: t = 4.303)."""
    return statistics.fmean(values), T_975_DF2 * statistics.stdev(values) / math.sqrt(len(values))


def test_study_end_to_end_matches_the_run_records(tmp_path, capsys):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    out = tmp_path / "study"
    argv = ["study", "components", "--protocol", str(path), "--seeds", "3,4,5", "--components", "gas,pas",
            "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "no unlabelled pool" in printed  # w/o PAS is not run on a protocol without pools, and says so
    runs = {s: json.loads((out / f"seed-{s}" / "results.json").read_text())["methods"] for s in (3, 4, 5)}
    assert set(runs[3]) == {"jascl", "jascl-no-gas"}
    summary = json.loads((out / "study.json").read_text())
    assert summary["seeds"] == [3, 4, 5] and summary["same_base"] == {"3": True, "4": True, "5": True}
    assert [s["method"] for s in summary["skipped"]] == ["jascl-conf"]
    rows = {v["method"]: v for v in summary["variants"]}

    def seeds_of(method, pick):
        return [pick(runs[s][method]) for s in (3, 4, 5)]

    for method in ("jascl", "jascl-no-gas"):
        for key, pick in [
            ("total_drop", lambda m: m["total_drop"]),
            ("base_last", lambda m: m["sessions"][-1]["base"]),
        ]:
            mean, half = _interval(seeds_of(method, pick))
            assert rows[method][key]["mean"] == pytest.approx(mean, rel=1e-9)
            assert rows[method][key]["half_width"] == pytest.approx(half, rel=2e-4)  # 4.303 is rounded
        for t in (0, 1):
            mean, half = _interval(seeds_of(method, lambda m: m["sessions"][t]["all"]))
            assert rows[method]["all"][t]["mean"] == pytest.approx(mean, rel=1e-9)
            assert rows[method]["all"][t]["half_width"] == pytest.approx(half, rel=2e-4)
        mean, _ = _interval(seeds_of(method, lambda m: m["sessions"][1]["new"]))
        assert rows[method]["new"][0]["mean"] == pytest.approx(mean, rel=1e-9)
    # paired differences: full minus ablation, seed by seed
    diffs = {d["quantity"]: d for d in summary["differences"]}
    per_seed = [runs[s]["jascl"]["total_drop"] - runs[s]["jascl-no-gas"]["total_drop"] for s in (3, 4, 5)]
    assert diffs["total_drop"]["values"] == pytest.approx(per_seed)
    mean, half = _interval(per_seed)
    assert (diffs["total_drop"]["mean"], diffs["total_drop"]["half_width"]) == pytest.approx((mean, half), rel=2e-4)
    last = [runs[s]["jascl"]["sessions"][1]["all"] - runs[s]["jascl-no-gas"]["sessions"][1]["all"] for s in (3, 4, 5)]
    assert diffs["last_all"]["values"] == pytest.approx(last)
    # the Markdown table shows the same numbers
    md = (out / "study.md").read_text()
    td_mean, td_half = _interval(seeds_of("jascl", lambda m: m["total_drop"]))
    assert f"{td_mean:.1f} ± {td_half:.1f} |" in md
    assert "95 % confidence interval over seeds (Student t" in md and "jascl study components --protocol" in md
    _, difference_row = [line for line in md.splitlines() if line.startswith("| w/o GAS |")]
    assert difference_row.endswith("| 3 |")  # 3 seed pairs
    # the figure and the CSV behind it
    assert (out / "seen-new-hm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "seen-new-hm.csv") as f:
        bars = list(csv.DictReader(f))
    assert len(bars) == 2 * 3  # 2 variants x (seen, new, hm) x 1 incremental session
    for bar in bars:
        key = {"seen": "old", "new": "new", "hm": "hm"}[bar["measure"]]
        mean, half = _interval(seeds_of(bar["method"], lambda m: m["sessions"][1][key]))
        assert float(bar["mean"]) == pytest.approx(mean, rel=1e-8)
        assert float(bar["half_width"]) == pytest.approx(half, rel=2e-4)
    with open(out / "compute.csv") as f:
        compute = list(csv.DictReader(f))
    assert {(r["seed"], r["run"]) for r in compute} == {
        (str(s), r) for s in (3, 4, 5) for r in ("base-stochastic-classifier", "jascl", "jascl-no-gas")
    }
    assert all(float(r["seconds"]) >= 0 for r in compute)
    plan = json.loads((out / "study-plan.json").read_text())
    assert plan["commands"][0]["finished"] and plan["commands"][0]["command"].startswith("jascl study components")

    # a study cut short: seed 5's table is gone; --report leaves it out and says so
    (out / "seed-5" / "results.json").unlink()
    before = (out / "variants.csv").read_text()
    assert main([*argv, "--report"]) == 0
    partial = json.loads((out / "study.json").read_text())
    assert partial["seeds"] == [3, 4] and "5" in partial["incomplete_seeds"]
    # rerunning the command continues: every session is reused, the tables come back as they were
    assert main(argv) == 0
    assert "reusing" in capsys.readouterr().out
    assert (out / "variants.csv").read_text() == before
    assert len(json.loads((out / "study-plan.json").read_text())["commands"]) == 2
    # --report over named seeds (seeds run by different commands into one folder), in the order given
    assert main([*argv, "--report", "--seeds", "5,3"]) == 0
    chosen = json.loads((out / "study.json").read_text())
    assert chosen["seeds"] == [5, 3] and chosen["incomplete_seeds"] == {}
    drop = next(v for v in chosen["variants"] if v["method"] == "jascl")["total_drop"]
    assert drop["values"] == pytest.approx([runs[5]["jascl"]["total_drop"], runs[3]["jascl"]["total_drop"]])
    assert {r["seed"] for r in chosen["compute"]["runs"]} == {5, 3}
    assert main([*argv, "--report", "--seeds", "3,9"]) == 0
    assert json.loads((out / "study.json").read_text())["incomplete_seeds"] == {"9": "no results.json (not finished)"}
    no_seeds = argv[:4] + argv[6:]
    assert main([*no_seeds, "--report"]) == 0 and (out / "variants.csv").read_text() == before  # the plan's seeds
    # another configuration into the same folder is refused before the plan is touched or anything trains
    assert main([*argv, "--set", "epochs_incremental=3"]) == 2
    assert "different configuration (epochs_incremental)" in capsys.readouterr().err
    assert len(json.loads((out / "study-plan.json").read_text())["commands"]) == 2


def test_report_of_a_folder_that_is_not_a_study(tmp_path, capsys):
    assert main(["study", "components", "--report", "--out", str(tmp_path)]) == 2
    assert "not a study folder" in capsys.readouterr().err


def test_differences_table_marks_intervals_that_exclude_zero_and_short_cells():
    from jascl.results.study import differences_table

    def diff(quantity, mean, half, n):
        return {"label": "w/o GAS", "method": "jascl-no-gas", "quantity": quantity, "mean": mean,
                "half_width": half, "n": n}  # fmt: skip

    summary = {
        "metric": "dice",
        "differences": [
            diff("total_drop", -4.25, 1.5, 3),  # (-5.75, -2.75): excludes 0
            diff("last_all", 0.0123, 0.02, 3),
            diff("base_last", 0.05, 0.01, 3),
            diff("mean_new", -0.01, 0.5, 2),  # one seed had no new class
        ],
    }
    header, rows = differences_table(summary)
    assert header[-1] == "pairs"
    assert rows == [
        ["w/o GAS", "`jascl-no-gas`", "-4.2 ± 1.5 *", "+0.012 ± 0.020", "+0.050 ± 0.010 *", "-0.010 ± 0.500 (n=2)", "3"]
    ]
