"""``jascl reproduce``: a paper table planned into compare jobs, run, and printed published beside measured."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import InProcessLauncher, toy_protocol_dict
from jascl.cli import main
from jascl.engine.loop import ContinualTrainer
from jascl.experiments.reproduce import run_reproduce
from jascl.experiments.reproduce_plan import base_key, job_protocol, plan_table
from jascl.paper.tables import get_table, parse_table
from jascl.results.records import RunResults
from jascl.results.reproduce_table import reproduce_table


def _no_check(protocol, overrides):
    return None


def test_plan_of_the_main_table_groups_cells_into_one_job():
    t = get_table("tab_set1_part")
    plan = plan_table(
        t, methods=["ucl", "jascl", "mib"], protocols=["med-disjoint", "synthetic-2d"], check_config=_no_check
    )
    assert list(plan.jobs) == ["med-disjoint_backbone=unet3d-authors_eval_mode=authors_first3"]
    job = plan.jobs["med-disjoint_backbone=unet3d-authors_eval_mode=authors_first3"]
    assert job.methods == ["ucl", "mib", "jascl"] and job.sessions == 3
    status = {(p.cell.row, p.cell.column): p.status for p in plan.cells}
    assert status[("UCL", "Session 2")] == "planned"
    assert status[("PIFS", "Session 0")] == "not registered"
    assert sum(s == "planned" for s in status.values()) == 9
    # the stand-in keeps the row and column settings only: no paper backbone, the benchmark's own sessions
    stand = plan_table(
        t, stand_in=True, methods=["ucl"], protocols=["med-disjoint", "synthetic-2d"], check_config=_no_check
    )
    assert [(j.protocol, j.overrides, j.sessions) for j in stand.jobs.values()] == [
        ("synthetic-2d", ("eval_mode=authors",), 3)
    ]


def test_plan_of_a_settings_table_makes_one_job_per_setting_and_refuses_unknown_keys():
    t = get_table("sen_rob")
    plan = plan_table(t, stand_in=True, methods=["jascl", "vanilla"], protocols=["synthetic-2d"])
    assert len(plan.jobs) == 10
    shots = sorted(j.shots for j in plan.jobs.values() if j.shots is not None)
    assert shots == [3, 4, 5]
    assert any("gas.eps=1e-09" in j.overrides for j in plan.jobs.values())
    noisy = get_table("tab:noise_results")
    refused = plan_table(noisy, stand_in=True, methods=["jascl", "uad-ce"], protocols=["synthetic-2d-ss"])
    reasons = {p.cell.row: (p.status, p.reason) for p in refused.cells}
    assert {s for s, _ in reasons.values()} == {"planned"}
    # the noise schedule is a protocol key: one job per schedule, the protocol's pools degraded
    assert sorted(j.noise or "none" for j in refused.jobs.values()) == ["heavy", "moderate", "none"]
    # extra unlabelled data from the earlier sessions' sources: a protocol key, resolved into session 4's
    # unlabelled_sources (42 = 11 + 11 + 10 + 10 over TS, AMOS, BCV, MOTS; MOTS's 10 over its three tasks)
    extra = plan_table(get_table("tab:unlabeled_effect"), methods=["jascl"], protocols=["med-ss", "med-disjoint"])
    status = {p.cell.row: (p.status, p.job) for p in extra.cells}
    assert {s for s, _ in status.values()} == {"planned"}
    job = extra.jobs[status["JASCL (42 unlabeled samples)"][1]]
    assert job.key == "med-ss_backbone=unet3d-authors_eval_mode=authors_first5_s4extra42"
    assert job.unlabelled_extra == (4, 42) and job.overrides == ("backbone=unet3d-authors", "eval_mode=authors")
    assert job.borrowed == (
        ("ts", 11), ("amos", 11), ("bcv", 10), ("mots_hepaticvessel", 4), ("mots_colon", 3), ("mots_lung", 3)
    )  # fmt: skip
    assert base_key(job) == base_key(extra.jobs[status["JASCL (15 unlabeled samples)"][1]])  # one session-0 base
    protocol = job_protocol(job)
    assert protocol.name == "med-ss-first5-s4extra42" and len(protocol.sessions) == 5
    assert protocol.sessions[4].unlabelled == 15 and protocol.sessions[4].unlabelled_extra == 42
    # the stand-in has sessions 0-3 only, so the table's session-4 cells are not in it
    stand = plan_table(get_table("tab:unlabeled_effect"), stand_in=True, methods=["jascl"])
    assert {p.status for p in stand.cells} == {"not in stand-in"}


def _reproduce_toy_extra(tmp_path, out, rows: list[dict], **kwargs) -> dict:
    """``jascl reproduce --stand-in`` of a settings table on med-ss whose stand-in is the toy protocol (seed 3),
    ``jascl-no-unlabelled`` at session 1, with ``rows``, into ``out``; returns the summary. ``kwargs``: more of
    ``run_reproduce``'s (``echo``, ``launcher``)."""
    proto = tmp_path / "toy.yaml"
    proto.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    toy = parse_table(
        {
            "label": "toy_extra", "caption": "c", "line": 1, "kind": "settings", "metric": "dice",
            "protocol": "med-ss", "method": "jascl-no-unlabelled", "stand_in": str(proto),
            "columns": [{"name": "Session 1", "session": 1}], "rows": rows,
        },
        "toy_extra.yaml",
    )  # fmt: skip
    return run_reproduce(
        toy, [3], out, stand_in=True, protocols=[str(proto)], progress=False, cache_dir=tmp_path / "cache",
        **{"echo": lambda *a: None, **kwargs},
    )  # fmt: skip


def test_unlabelled_extra_on_the_stand_in_borrows_from_the_earlier_domains_and_reaches_the_run(tmp_path):
    table = parse_table(
        {
            "label": "toy_extra", "caption": "c", "line": 1, "kind": "settings", "metric": "dice",
            "protocol": "med-ss", "method": "jascl", "stand_in": "synthetic-2d-ss",
            "columns": [{"name": "Session 3", "session": 3}],
            "rows": [{"name": "more", "set": {"unlabelled_extra": 42}, "values": [None]},
                     {"name": "bad", "set": {"unlabelled_extra": -1}, "values": [None]}],
        },
        "toy_extra.yaml",
    )  # fmt: skip
    plan = plan_table(table, stand_in=True, methods=["jascl"], protocols=["synthetic-2d-ss"], check_config=_no_check)
    (job,) = plan.jobs.values()
    assert job.borrowed == (("ct", 14), ("mri", 14), ("us", 14)) and job.unlabelled_extra == (3, 42)
    bad = [p for p in plan.cells if p.cell.row == "bad"][0]
    assert bad.status == "not supported" and "non-negative" in bad.reason
    # through a run: the toy stand-in's session 1 borrows 3 images of domain a, listed in the run's manifest
    out = tmp_path / "rep"
    summary = _reproduce_toy_extra(tmp_path, out, [{"name": "more", "set": {"unlabelled_extra": 3}, "values": [0.2]}])
    assert summary["cells"][0]["status"] == "measured"
    manifest = json.loads((out / "toy_s1extra3" / "seed-3" / "manifest.json").read_text())
    assert manifest["protocol"] == "toy-2d-s1extra3"
    ids = [f"s1-inc/extra-a/{i:05d}" for i in range(3)]
    assert manifest["sessions"][1]["unlabelled"] == ids
    assert manifest["sessions"][1]["unlabelled_sources"] == [{"domain": "a", "ids": ids}]


def test_rows_with_and_without_borrowed_unlabelled_data_share_one_base_and_both_are_measured(tmp_path):
    """The two jobs share one session-0 base (base_key); the borrowing job's protocol is renamed (toy-2d-s1extra3),
    and loading the base linked from the other job failed with "made for protocol 'toy-2d'" (the paper's
    tab:unlabeled_effect on med-ss: the 42-sample rows). It loads now: the variant keeps session 0 (session0_of)."""
    out = tmp_path / "rep"
    rows = [
        {"name": "less", "set": {}, "values": [0.2]},
        {"name": "more", "set": {"unlabelled_extra": 3}, "values": [0.2]},
    ]
    summary = _reproduce_toy_extra(tmp_path, out, rows)
    assert [c["status"] for c in summary["cells"]] == ["measured", "measured"]
    (less,), (more,) = (sorted((out / job / "seed-3").glob("base*")) for job in ("toy", "toy_s1extra3"))
    assert more.is_symlink() and more.resolve() == less.resolve()
    results = json.loads((out / "toy_s1extra3" / "seed-3" / "results.json").read_text())
    assert results["protocol"] == "toy-2d-s1extra3"


def test_a_launcher_runs_every_rows_cells_as_one_set_of_jobs_and_a_failed_row_only_fails_its_cells(
    tmp_path, monkeypatch
):
    """With a launcher the two rows' bases and cells are one set of jobs, submitted before any row's compare
    runs: one base for both (the second row links the first's), both rows' cells side by side; the rows' compares
    then only collect, to the numbers of a reproduction without a launcher. A row whose job fails is failed,
    not trained in this process, and the other is measured."""
    rows = [
        {"name": "less", "set": {}, "values": [0.2]},
        {"name": "more", "set": {"unlabelled_extra": 3}, "values": [0.2]},
    ]
    sequential = _reproduce_toy_extra(tmp_path, tmp_path / "seq", rows)
    messages: list[str] = []
    launcher = InProcessLauncher("local", poll_s=0)
    summary = _reproduce_toy_extra(tmp_path, tmp_path / "jobs", rows, echo=messages.append, launcher=launcher)
    submitted = [m.split(": job")[0] for m in messages if m.startswith("[launcher] submitted")]
    assert submitted == [
        "[launcher] submitted base-stochastic-classifier toy seed 3",
        "[launcher] submitted jascl-no-unlabelled toy seed 3",
        "[launcher] submitted jascl-no-unlabelled toy_s1extra3 seed 3",
    ]
    first_row = next(i for i, m in enumerate(messages) if m.startswith("[reproduce] job 1/2"))
    assert max(i for i, m in enumerate(messages) if m.startswith("[launcher] submitted")) < first_row
    assert not [m for m in messages[first_row:] if "training" in m]  # the rows' compares trained nothing
    assert [c["measured"] for c in summary["cells"]] == [c["measured"] for c in sequential["cells"]]

    run_session = ContinualTrainer.run_session

    def more_fails(self, *args, **kwargs):
        if self.protocol.name == "toy-2d-s1extra3":
            raise RuntimeError("out of memory")
        return run_session(self, *args, **kwargs)

    messages.clear()
    monkeypatch.setattr(ContinualTrainer, "run_session", more_fails)
    summary = _reproduce_toy_extra(tmp_path, tmp_path / "fails", rows, echo=messages.append, launcher=launcher)
    assert [c["status"] for c in summary["cells"]] == ["measured", "failed"]
    assert summary["cells"][1]["reason"].startswith("TrainingError: its launcher jobs did not all finish: 1 of 3 jobs")
    assert not (tmp_path / "fails" / "toy_s1extra3" / "seed-3" / "results.json").exists()


def _toy_table(tmp_path):
    proto = tmp_path / "toy.yaml"
    proto.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    data = {
        "label": "toy_table",
        "caption": "a toy table",
        "line": 1,
        "kind": "methods",
        "metric": "dice",
        "protocol": "med-disjoint",
        "stand_in": str(proto),
        "set": {"epochs_base": 300},
        "columns": [{"name": "Session 0", "session": 0}, {"name": "Session 1", "session": 1}],
        "rows": [
            {"name": "Vanilla", "method": "vanilla", "values": [0.7, 0.1]},
            {"name": "JASCL", "method": "jascl-no-unlabelled", "values": [0.7, 0.4]},
            {"name": "Future", "method": "not-yet", "values": [0.5, None]},
        ],
    }
    return parse_table(data, "toy_table.yaml"), str(proto)


def test_reproduce_on_a_stand_in_measures_every_cell_from_the_runs(tmp_path):
    table, proto = _toy_table(tmp_path)
    out = tmp_path / "rep"
    summary = run_reproduce(
        table,
        [3],
        out,
        stand_in=True,
        protocols=[proto],
        echo=lambda *a: None,
        progress=False,
        cache_dir=tmp_path / "cache",
    )
    (job,) = [p for p in out.iterdir() if p.is_dir()]
    assert job.name == "toy"  # an embedded protocol is named by its file stem
    results = RunResults.read(job / "seed-3" / "results.json")
    cells = {(c["row"], c["column"]): c for c in summary["cells"]}
    for row, method in (("Vanilla", "vanilla"), ("JASCL", "jascl-no-unlabelled")):
        for t in (0, 1):
            c = cells[(row, f"Session {t}")]
            measured = results.methods[method].sessions[t].all
            assert c["status"] == "measured" and c["measured"] == pytest.approx(measured)
            assert c["delta"] == pytest.approx(measured - c["published"])
    # the table-level paper setting (300 base epochs) is not applied to the stand-in: the toy's 1 epoch is
    assert json.loads((job / "seed-3" / "run.json").read_text()) is not None
    assert "epochs_base: 1" in (job / "seed-3" / "config.yaml").read_text()
    assert cells[("Future", "Session 0")]["status"] == "not registered"
    md = (out / "reproduce.md").read_text()
    assert "| Future [?] | 0.500 | not registered |" in md
    assert "not registered: not-yet is not a registered method (Future)" in md
    csv = (out / "reproduce.csv").read_text().splitlines()
    assert csv[0].startswith("table,row,column,method,published,measured_mean")
    assert len(csv) == 1 + 6
    # jascl report on the reproduce folder: the table first, then the job's compare folder
    from jascl.results.html import write_report

    paths = write_report([out], tmp_path / "report", samples=0, echo=lambda *a: None)
    md = paths["markdown"].read_text()
    assert md.index("## Published beside measured (jascl reproduce)") < md.index("## Summary")
    assert "| Future [?] | 0.500 | not registered |" in md and "Not measured: not registered: not-yet" in md
    # a rerun reuses every finished session: the same numbers
    again = run_reproduce(
        table, [3], out, stand_in=True, protocols=[proto], echo=lambda *a: None, progress=False,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert [c["measured"] for c in again["cells"]] == [c["measured"] for c in summary["cells"]]


def test_reproduce_table_formats_like_the_paper():
    summary = {
        "table": "t",
        "caption": "c",
        "metric": "miou",
        "scale": 100.0,
        "seeds": [1, 2],
        "cells": [
            {"row": "A", "column": "S0", "metric": "miou", "published": 47.76, "status": "measured",
             "measured": 50.0, "std": 1.234, "delta": 2.24},
            {"row": "A", "column": "TD", "metric": "total_drop", "published": 45.9, "status": "measured",
             "measured": 40.04, "std": 0.5, "delta": -5.86},
            {"row": "B", "column": "S0", "metric": "miou", "published": None, "status": "not registered",
             "measured": None, "std": None, "delta": None},
        ],
    }  # fmt: skip
    header, rows = reproduce_table(summary)
    assert header == ["Row", "S0 paper", "S0 jascl", "S0 Δ", "TD paper", "TD jascl", "TD Δ"]
    assert rows[0] == ["A", "47.76", "50.00 ± 1.23", "+2.24", "45.9", "40.0 ± 0.5", "-5.9"]
    assert rows[1] == ["B", "—", "not registered", "", "", "", ""]


def test_cli_lists_tables_and_prints_a_plan(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    assert "tab_set1_part" in out and "t_drop" in out and "clip_d" in out
    assert main(["reproduce", "t_drop", "--dry-run", "--num-seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "28 cells, 28 to measure; seeds 1024, 1025" in out and "skipped" not in out  # every method registered
    # sessions costed by labelled samples x epochs against the timed Med-Disjoint session 1 (25 volumes x 200
    # epochs = 4.1 h): the base (200 volumes x 200 epochs) 32.8 h, session 1 (AMOS 5 x 5 shots) 4.1 h, session 2
    # (BCV 6 x 5) 4.92 h. Bases per seed: the vanilla one, JASCL's keyed one and 6 of methods training their own
    # (8 x 32.8 = 262.4 h); every one of the 28 methods trains sessions 1-2 (28 x 9.02 = 252.56 h): 514.96 h per
    # seed, 1029.92 h for 2
    assert "about 1030 GPU-hours" in out and "base sessions 16 x 32.8 h = 525 h" in " ".join(out.split())
    # with a launcher and GPUs to spare: one base, then sessions 1-2 (32.8 + 4.1 + 4.92 = 41.82 h)
    assert "a GPU for every job at once: at least 42 h of wall time" in " ".join(out.split())
    assert "share the stochastic-classifier session-0 base: jascl" in out
    # JASCL's keyed base counted once per base: med-disjoint 32.8 + sessions 1-4 (4.1 + 4.92 + 3.28 + 2.46) h, med-ss
    # at the semi-supervised rate (5.3 h per 25 x 200): 42.4 + (5.3 + 6.36 + 4.24 + 3.18) h, and the med-ss job
    # with borrowed unlabelled data reuses med-ss's base: 19.08 h; 47.56 + 61.48 + 19.08 = 128.12
    assert main(["reproduce", "tab:unlabeled_effect", "--dry-run", "--seeds", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "about 128 GPU-hours" in out and "at least 61 h of wall time" in out  # med-ss: 42.4 + 19.08 h
    assert main(["reproduce", "tab_nope"]) == 2
    assert "no paper table 'tab_nope'" in capsys.readouterr().err


def test_every_paper_plan_trains_the_epochs_the_paper_states():
    """SAM: 10 epochs per session (implementation details, line 2285); DeepLab and the other backbones keep their
    protocol's, which are the paper's: medical 200, natural and surgery 100 (COCO-O: its protocol's 100 / 36)."""
    from jascl.engine.config import resolve_config
    from jascl.experiments.reproduce_plan import job_protocol
    from jascl.paper.tables import paper_tables

    seen = set()
    for table in paper_tables().values():
        for job in plan_table(table).jobs.values():
            protocol = job_protocol(job)
            config = resolve_config(protocol.training, protocol.path, None, list(job.overrides))
            epochs = (config.epochs_base, config.epochs_incremental)
            if config.backbone == "sam-vitb":
                expected = (10, 10)
            elif job.protocol == "coco-o":
                expected = (100, 36)
            elif job.protocol.startswith("med"):
                expected = (200, 200)
            else:
                assert job.protocol.startswith(("natural", "surgery")), job.protocol
                expected = (100, 100)
            assert epochs == expected, (table.label, job.key, epochs)
            seen.add(config.backbone)
    assert {"sam-vitb", "deeplabv3plus", "unet3d-authors", "medformer"} <= seen


def test_dry_run_checks_root_names_as_the_run_does(capsys, tmp_path):
    # the real run refuses a root no protocol of the table reads; the dry run now says so too
    assert main(["reproduce", "tab_set1_part", "--dry-run", "--root", f"totalsegmentator={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "--root totalsegmentator=...: no job of tab_set1_part reads a root of that name" in err
    assert "ts" in err.split("read ")[-1]
    assert main(["reproduce", "tab_set1_part", "--dry-run", "--root", f"ts={tmp_path}"]) == 0
    capsys.readouterr()
    assert main(["reproduce", "tab_set1_part", "--stand-in", "--dry-run", "--root", f"ts={tmp_path}"]) == 2
    assert "the stand-in benchmarks read no dataset" in capsys.readouterr().err


def test_each_job_gets_the_roots_its_protocol_reads():
    # abl_robo spans surgery-cil (CholecSeg8k only) and surgery-dil / -cdil (CholecSeg8k and m2caiSeg): the run
    # used to pass --root m2caiseg=... to every job, which surgery-cil's refuses
    from jascl.experiments.reproduce_plan import check_roots, roots_for

    plan = plan_table(get_table("abl_robo"))
    roots = {"cholecseg8k": "/c", "m2caiseg": "/m"}
    check_roots(plan, roots)
    given = {job.protocol: roots_for(job, roots) for job in plan.jobs.values()}
    assert given == {"surgery-cil": {"cholecseg8k": "/c"}, "surgery-dil": roots, "surgery-cdil": roots}
    assert roots_for(next(iter(plan.jobs.values())), None) is None
