"""Compare grids as jobs (submitit's local executor): same numbers as the sequential compare, and a rerun
submits only the cells that are missing."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from jascl.errors import ConfigError
from jascl.experiments.compare import run_compare
from jascl.experiments.launcher import Launcher, parse_launcher


def test_launcher_options_parse_and_refuse_bad_keys():
    assert parse_launcher(None) is None
    lau = parse_launcher("slurm", ["partition=gpu", "time_min=600", "parallel=8", "gpus_per_job=2"])
    assert (lau.kind, lau.partition, lau.time_min, lau.parallel, lau.gpus_per_job) == ("slurm", "gpu", 600, 8, 2)
    assert parse_launcher("local", ["gpus=0,1,3"]).slots == 3
    assert Launcher("local").slots == 1
    for kind, opts, message in (
        ("pbs", [], "--launcher pbs: choose local or slurm"),
        ("slurm", ["partion=gpu"], "--launcher-opt partion: unknown key"),
        ("slurm", ["time_min=ten"], "--launcher-opt time_min=ten: time_min takes an integer"),
        ("local", ["parallel"], "--launcher-opt parallel: write KEY=VALUE"),
        (None, ["parallel=2"], "--launcher-opt needs --launcher"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_launcher(kind, opts)


def _scores(folder):
    run = json.loads((folder / "results.json").read_text())
    return {m: [s["all"] for s in r["sessions"]] for m, r in run["methods"].items()}


@pytest.mark.slow
def test_local_launcher_gives_the_sequential_results_and_reruns_only_missing_cells(toy_protocol, toy_config, tmp_path):
    config = dataclasses.replace(toy_config, threads=1)
    methods = ["vanilla", "jascl-no-unlabelled"]
    kw = {"cache_dir": tmp_path / "cache", "progress": False, "echo": lambda *a: None}
    sequential = run_compare(toy_protocol, config, methods, [3], tmp_path / "seq", **kw)
    messages: list[str] = []
    launched = run_compare(
        toy_protocol, config, methods, [3], tmp_path / "jobs", launcher=Launcher("local", parallel=2, poll_s=0.2),
        **{**kw, "echo": messages.append},
    )  # fmt: skip
    assert sum(m.startswith("[launcher] submitted") for m in messages) == 2
    assert _scores(tmp_path / "seq" / "seed-3") == _scores(tmp_path / "jobs" / "seed-3")
    assert launched["methods"] == sequential["methods"]
    assert (tmp_path / "jobs" / "launcher").is_dir()  # submitit's job logs
    # delete one cell's last session: the rerun submits that cell only and gives the same table
    shutil.rmtree(tmp_path / "jobs" / "seed-3" / "vanilla" / "s1-inc")
    messages.clear()
    again = run_compare(
        toy_protocol, config, methods, [3], tmp_path / "jobs", launcher=Launcher("local", parallel=2, poll_s=0.2),
        **{**kw, "echo": messages.append},
    )  # fmt: skip
    assert [m for m in messages if m.startswith("[launcher] submitted")] == [
        next(m for m in messages if m.startswith("[launcher] submitted vanilla seed 3"))
    ]
    assert again["methods"] == sequential["methods"]


def test_slurm_executor_gets_the_options(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("PATH", str(tmp_path / "empty"))
        with pytest.raises(ConfigError, match='--launcher slurm: Could not detect "srun"'):
            Launcher("slurm").executor(tmp_path / "logs")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    lau = parse_launcher("slurm", ["partition=gpu", "time_min=600", "parallel=8", "mem_gb=64", "gpus_per_job=2"])
    params = lau.executor(tmp_path / "logs")._executor.parameters
    assert params["partition"] == "gpu" and params["time"] == 600 and params["array_parallelism"] == 8
    assert params["gpus_per_node"] == 2 and params["mem"] == "64GB" and params["cpus_per_task"] == 8
