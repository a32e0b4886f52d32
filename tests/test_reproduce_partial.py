"""``jascl reproduce`` when it does not finish: killed, stopped, a failed job; the quick mode; ``--report``."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import yaml

from conftest import toy_protocol_dict
from jascl.errors import TrainingError
from jascl.experiments.reproduce import report_reproduce, run_reproduce
from jascl.experiments.reproduce_plan import plan_table
from jascl.paper.tables import parse_table
from jascl.results.records import RunResults


def _two_job_table(tmp_path):
    """A toy table of two jobs: vanilla / JASCL at the toy's settings, and vanilla with a second setting."""
    proto = tmp_path / "toy.yaml"
    proto.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    data = {
        "label": "toy_two_jobs",
        "caption": "two jobs",
        "line": 1,
        "kind": "methods",
        "metric": "dice",
        "protocol": "med-disjoint",
        "stand_in": str(proto),
        "columns": [{"name": "Session 0", "session": 0}, {"name": "Session 1", "session": 1}],
        "rows": [
            {"name": "Vanilla", "method": "vanilla", "values": [0.7, 0.1]},
            {"name": "JASCL", "method": "jascl-no-unlabelled", "values": [0.7, 0.4]},
            {"name": "Vanilla lr", "method": "vanilla", "set": {"lr_incremental": 0.05}, "values": [0.7, 0.2]},
        ],
    }
    return data, str(proto)


def _killed_reproduction(data, proto, out, cache, how, stderr) -> None:
    """A reproduction in a process of its own that gets signal ``how`` once its second job starts (the first job's
    cells are finished); stopped cleanly (SIGTERM) it exits as ``jascl reproduce`` does."""
    from jascl.engine.stop import REQUEST, Stopped

    with open(stderr, "w") as fh:
        os.dup2(fh.fileno(), 2)

    def echo(message):
        if message.startswith("[reproduce] job 2/2"):
            os.kill(os.getpid(), getattr(signal, how))

    try:
        with REQUEST.installed():
            table = parse_table(data, "toy.yaml")
            run_reproduce(table, [3], out, stand_in=True, protocols=[proto], echo=echo, progress=False, cache_dir=cache)
    except Stopped as exc:
        sys.exit(exc.exit_code)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_reproduction_shows_its_finished_cells(tmp_path, how, processes):
    data, proto = _two_job_table(tmp_path)
    out, cache, stderr = tmp_path / "rep", tmp_path / "cache", tmp_path / "stderr"
    process = processes.Process(target=_killed_reproduction, args=(data, proto, out, cache, how, stderr))
    process.start()
    process.join(timeout=600)
    code = process.exitcode
    assert code == (-signal.SIGKILL if how == "SIGKILL" else 128 + signal.SIGTERM), stderr.read_text()[-2000:]
    md = (out / "reproduce.md").read_text()
    # the first job (vanilla and JASCL) is finished: 4 of the 6 cells, the second job's "—"; stopped by SIGTERM,
    # the second job had linked the shared base model (its session 0) and stopped before its session 1
    done = 4 if how == "SIGKILL" else 5
    assert f"{done} of 6 cells" in md
    (first,) = [p for p in out.iterdir() if p.is_dir() and (p / "seed-3" / "results.json").is_file()]
    results = RunResults.read(first / "seed-3" / "results.json")
    summary = json.loads((out / "reproduce.json").read_text())
    cells = {(c["row"], c["column"]): c for c in summary["cells"]}
    assert cells[("JASCL", "Session 1")]["measured"] == pytest.approx(
        results.methods["jascl-no-unlabelled"].sessions[1].all
    )
    assert cells[("Vanilla lr", "Session 1")]["status"] == "pending"
    assert cells[("Vanilla lr", "Session 0")]["status"] == ("pending" if how == "SIGKILL" else "measured")
    assert "| 0.200 | — |  |" in md.split("| Vanilla lr [")[1].splitlines()[0] + "|"
    # --report re-renders from the folders: the same cells
    again = report_reproduce(parse_table(data, "toy.yaml"), out, protocols=[proto])
    assert [c["measured"] for c in again["cells"]] == [c["measured"] for c in summary["cells"]]
    assert again["cells_measured"] == done and again["cells_total"] == 6


def test_a_failed_job_keeps_the_others_and_says_why(tmp_path, monkeypatch):
    from jascl.experiments import compare

    data, proto = _two_job_table(tmp_path)
    real = compare.run_compare

    def flaky(protocol, config, methods, seeds, out, **kw):
        if config.lr_incremental == 0.05:
            raise TrainingError("loss is NaN in session 1")
        return real(protocol, config, methods, seeds, out, **kw)

    monkeypatch.setattr(compare, "run_compare", flaky)
    out = tmp_path / "rep"
    summary = run_reproduce(
        parse_table(data, "toy.yaml"), [3], out, stand_in=True, protocols=[proto], echo=lambda *a: None,
        progress=False, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    status = {(c["row"], c["column"]): (c["status"], c["reason"]) for c in summary["cells"]}
    assert status[("Vanilla lr", "Session 1")] == ("failed", "TrainingError: loss is NaN in session 1")
    assert status[("Vanilla lr", "Session 0")][0] == "measured"  # the shared base model, linked before the job ran
    assert status[("Vanilla", "Session 1")][0] == "measured"
    md = (out / "reproduce.md").read_text()
    assert "5 of 6 cells" in md and md.split("| Vanilla lr [")[1].splitlines()[0].endswith("| 0.200 | failed |  |")
    assert "failed: TrainingError: loss is NaN in session 1 (Vanilla lr)" in md


def test_quick_mode_trains_a_quarter_of_the_epochs_on_one_seed_and_says_so(tmp_path):
    data, proto = _two_job_table(tmp_path)
    data["rows"] = data["rows"][:1]
    toy = toy_protocol_dict(2)
    toy["training"].update(epochs_base=8, epochs_incremental=6)
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(toy))
    table = parse_table(data, "toy.yaml")
    assert plan_table(table, stand_in=True, quick=True, protocols=[proto]).quick
    out = tmp_path / "rep"
    summary = run_reproduce(
        table, [3, 4], out, stand_in=True, quick=True, protocols=[proto], echo=lambda *a: None, progress=False,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert summary["seeds"] == [3] and summary["quick"] is True
    config = (out / "toy" / "seed-3" / "config.yaml").read_text()
    assert "epochs_base: 2" in config and "epochs_incremental: 1" in config  # 8 // 4, 6 // 4
    assert not (out / "toy" / "seed-4").exists()
    md = (out / "reproduce.md").read_text()
    assert "QUICK mode (1/4 of the epochs, one seed" in md and "2 of 2 cells" in md


def test_a_method_that_cannot_be_built_is_left_out_and_the_job_runs(tmp_path, monkeypatch):
    # a fresh `pip install -e .` has no diffusers: Gen-Replay's default generator is refused when it is built, which
    # used to fail the whole job (every method of tab_set1_part's stand-in); now only its own cells fail
    from jascl.errors import ConfigError
    from jascl.methods.baselines.replay import gen_replay

    def missing():
        raise ConfigError("method gen-replay: ... needs the diffusers package (pip install 'jascl[diffusion]')")

    monkeypatch.setattr(gen_replay, "require_diffusers", missing)
    data, proto = _two_job_table(tmp_path)
    data["rows"] = [data["rows"][0], {"name": "Gen-Replay", "method": "gen-replay", "values": [0.7, 0.3]}]
    echoed = []
    summary = run_reproduce(
        parse_table(data, "toy.yaml"), [3], tmp_path / "rep", stand_in=True, protocols=[proto], echo=echoed.append,
        progress=False, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    status = {(c["row"], c["column"]): (c["status"], c["reason"]) for c in summary["cells"]}
    reason = "method gen-replay: ... needs the diffusers package (pip install 'jascl[diffusion]')"
    assert status[("Gen-Replay", "Session 1")] == ("failed", reason)
    assert status[("Vanilla", "Session 0")][0] == status[("Vanilla", "Session 1")][0] == "measured"
    assert any(m.startswith("[reproduce] gen-replay left out of job ") and m.endswith(reason) for m in echoed)
