"""``jascl reproduce`` targets beyond the result tables: the paper's figures and its compute table."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import toy_protocol_dict
from jascl.cli import main
from jascl.experiments.model_info import model_info
from jascl.experiments.reproduce import MethodRecords
from jascl.experiments.reproduce_compute import compute_jobs, run_compute
from jascl.experiments.reproduce_figures import (
    FIGURES,
    Figure,
    Panel,
    Series,
    figure_data,
    figure_plan,
    paper_split,
    run_figure,
    series_key,
)
from jascl.paper.tables import get_table, parse_table
from jascl.results.paper_figures import write_figure
from jascl.results.records import RunResults, SessionRecord

PNG = b"\x89PNG\r\n\x1a\n"


def _fake(t: int, method: str) -> SessionRecord:
    """A session record whose scores encode the session and the method (for checking what a panel drew)."""
    k = 0.01 * (len(method) % 7)
    return SessionRecord(session=t, all=0.5 + 0.1 * t + k, old=0.4 + k, new=0.2 + 0.05 * t, hm=0.3 + k, base=0.6 - k)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_plans_on_the_stand_in_and_draws_its_panels(name, tmp_path):
    fp = figure_plan(FIGURES[name], stand_in=True)
    assert fp.plan.jobs and all(
        j.protocol.startswith(("synthetic-2d", "constraint-")) for j in fp.plan.jobs.values()
    )  # embedded benchmarks only
    collected = {
        key: {1024: {m: MethodRecords([_fake(t, m) for t in range(fp.sessions[next(iter(fp.sessions))] + 3)]) for m in job.methods}}
        for key, job in fp.plan.jobs.items()
    }  # fmt: skip
    data = figure_data(fp, collected)
    assert [p.key for p in data.panels] == [p.key for p in FIGURES[name].panels]
    paths = write_figure(data, tmp_path)
    assert paths["png"].read_bytes().startswith(PNG)
    assert paths["svg"].read_text().lstrip().startswith("<?xml")
    rows = paths["csv"].read_text().splitlines()
    assert rows[0] == "figure,panel,title,series,x,measured_mean,measured_std,seeds,published"
    # every point drawn is the fake record's value of the panel's measure at that session
    for panel, spec in zip(data.panels, FIGURES[name].panels):
        for series, s in zip(panel.series, spec.series):
            method = str(fp.plan.table.row(series_key(s)).method)
            for x, mean, _, seeds, _ in series.points:
                assert seeds == 1 and mean == pytest.approx(_fake(int(x[1:]), method).score(spec.measure))


def test_published_seen_new_hm_come_from_the_class_tables():
    # tab:class_Sessions (JASCL, U-Net, Med-Disjoint), session 1: new = AMOS's classes 16-20
    # (0.129 + 0.043 + 0.050 + 0.053 + 0.096) / 5 = 0.0742; seen = classes 1-15, whose sum is the 20 foreground
    # classes' mean 0.4719 x 20 less the new ones' 0.371
    new = paper_split("tab:class_Sessions", "Average", 1, "new")
    assert new == pytest.approx(0.0742)
    table = get_table("tab:class_Sessions")
    seen_sum = sum(r.values[1] for r in table.rows if r.class_id is not None and 1 <= r.class_id <= 15)
    assert paper_split("tab:class_Sessions", "Average", 1, "old") == pytest.approx(seen_sum / 15)
    old = seen_sum / 15
    assert paper_split("tab:class_Sessions", "Average", 1, "hm") == pytest.approx(2 * old * new / (old + new))
    # mIoU tables (scale 100) as fractions: without_plr's printed Average of session 0
    assert paper_split("without_plr", "Average", 0, "all") == pytest.approx(table_value("without_plr", 0) / 100)


def table_value(label: str, session: int) -> float:
    t = get_table(label)
    return float(t.session_values(t.row("Average"))[session])


def test_a_figure_runs_end_to_end_on_a_toy_benchmark_and_writes_png_svg_csv(tmp_path):
    proto = tmp_path / "toy.yaml"
    proto.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    toy = Figure(
        "fig_toy", "toy", 1, "a toy figure",
        (Panel("a", "scores", "all", (Series("Vanilla", protocol=str(proto), method="vanilla"),
                                      Series("JASCL", protocol=str(proto), method="jascl-no-unlabelled"))),
         Panel("b", "new classes", "new", (Series("Vanilla", protocol=str(proto), method="vanilla"),), "bars", (1,))),
    )  # fmt: skip
    out = tmp_path / "fig"
    paths = run_figure(
        toy, [3], out, protocols=[str(proto)], echo=lambda *a: None, progress=False, cache_dir=tmp_path / "cache"
    )
    assert paths["png"].read_bytes().startswith(PNG)
    (job,) = [p for p in out.iterdir() if p.is_dir()]
    results = RunResults.read(job / "seed-3" / "results.json")
    rows = [r.split(",") for r in paths["csv"].read_text().splitlines()[1:]]
    by = {(r[1], r[3], r[4]): float(r[5]) for r in rows}
    assert by[("a", "JASCL", "S1")] == pytest.approx(results.methods["jascl-no-unlabelled"].sessions[1].all, abs=1e-6)
    assert by[("b", "Vanilla", "S1")] == pytest.approx(results.methods["vanilla"].sessions[1].new, abs=1e-6)
    assert json.loads((out / "reproduce.json").read_text())["cells_measured"] == 4  # 2 series x 2 sessions


def test_cli_plans_figures_and_the_compute_table(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in FIGURES)
    assert main(["reproduce", "fig_seen_new", "--stand-in", "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "panel (i) HM JASCL vs w/o GAS (MedFormer, Med-Mixed)" in out and "synthetic-2d-ss" in out
    assert main(["reproduce", "compute", "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # SAM trains 10 epochs per session (the paper's implementation details), the others their protocol's
    assert "natural, first 2 sessions, backbone=sam-vitb, epochs_base=10, epochs_incremental=10" in out
    assert "med-ss, first 2 sessions, backbone=medformer" in out


def test_the_compute_table_runs_on_a_cpu_at_toy_size(tmp_path):
    proto = tmp_path / "toy.yaml"
    proto.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    compute = get_table("compute")
    data = {
        "label": "compute", "caption": compute.caption, "line": 1, "kind": "compute", "metric": "params_m",
        "sessions": 2, "stand_in": str(proto),
        "columns": [{"name": c.name, "session": c.session, "metric": c.metric, "method": c.method}
                    for c in compute.columns],
        "rows": [{"name": "Med JASCL-Disjoint", "protocol": "med-disjoint", "backbone": "unet",
                  "values": [16.27, 16.27, 0.52, 0.52, 4.100, 4.083]}],
    }  # fmt: skip
    table = parse_table(data, "toy_compute.yaml")
    assert [j.protocol for j in compute_jobs(table, stand_in=True).values()] == [str(proto)]
    out = tmp_path / "compute"
    summary = run_compute(
        table, out, stand_in=True, device="cpu", echo=lambda *a: None, progress=False, cache_dir=tmp_path / "cache"
    )
    cells = {c["column"]: c for c in summary["cells"]}
    # parameters and MACs: the row's backbone at its paper-like input, with med-disjoint session 1's 21 classes
    info = model_info("unet", num_classes=21, device="meta")
    assert cells["Parameters (M) JASCL"]["measured"] == pytest.approx(info["params_m"])
    assert cells["FLOPs (T) w/o JASCL"]["measured"] == pytest.approx(info["gmacs"] / 1e3)
    # time: session 1's wall time of each method, measured on this CPU, in hours
    job = next(p for p in out.iterdir() if p.is_dir())
    for column, method in (("Training Time JASCL", "jascl"), ("Training Time w/o JASCL", "vanilla")):
        seconds = json.loads((job / "seed-1024" / method / "s1-inc" / "metrics.json").read_text())["seconds"]
        assert cells[column]["measured"] == pytest.approx(seconds / 3600) and cells[column]["published"] > 1
    md = (out / "reproduce.md").read_text()
    assert "6 of 6 cells" in md and "on cpu (" in md
    assert not any(math.isnan(c["measured"]) for c in summary["cells"])


def test_another_backbone_on_the_stand_in_drops_the_protocols_backbone_args():
    # synthetic-2d's backbone_args ({features: ...}) are its U-Net's; SwinUNETR and MedFormer refuse them
    jobs = figure_plan(FIGURES["fig_frozen"], stand_in=True).plan.jobs.values()
    overrides = {next(o for o in j.overrides if o.startswith("backbone=")): j.overrides for j in jobs}
    assert "backbone_args={}" not in overrides["backbone=unet"]
    assert overrides["backbone=swinunetr"][0] == "backbone_args={}"
    assert overrides["backbone=medformer"][0] == "backbone_args={}"
