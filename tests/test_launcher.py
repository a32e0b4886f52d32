"""Compare grids as jobs (submitit's local executor): same numbers as the sequential compare, and a rerun
submits only the cells that are missing."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import InProcessLauncher
from jascl import distributed
from jascl.engine.loop import ContinualTrainer
from jascl.errors import ConfigError, TrainingError
from jascl.experiments.compare import run_compare
from jascl.experiments.launcher import JobSpec, Launcher, parse_launcher, run_jobs
from jascl.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]


def _at(messages: list[str], start: str) -> int:
    """The index of the first message that starts with ``start``."""
    return next(i for i, m in enumerate(messages) if m.startswith(start))


def _refuse(*args, **kwargs):
    raise AssertionError("the calling process of a launcher trained a session")


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
    # --devices N: N processes per cell job; the local GPU pool hands each job N GPUs
    assert parse_launcher("local", ["gpus=0,1,2,3"], 2).slots == 2
    assert parse_launcher("local", [], 2).devices == 2 and parse_launcher("local", [], 2).slots == 1
    for kind, opts, devices, message in (
        ("local", ["gpus=0"], 2, "--devices 2 with --launcher-opt gpus=0: each job needs 2 GPUs"),
        ("local", [], 0, "--devices 0: must be >= 1"),
        (None, [], 2, "--devices 2 without --launcher: give --launcher local or slurm"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_launcher(kind, opts, devices)


def _scores(folder):
    run = json.loads((folder / "results.json").read_text())
    return {m: [s["all"] for s in r["sessions"]] for m, r in run["methods"].items()}


@pytest.mark.slow
def test_local_launcher_gives_the_sequential_results_and_reruns_only_missing_cells(
    toy_protocol, toy_config, tmp_path, monkeypatch
):
    config = dataclasses.replace(toy_config, threads=1)
    methods = ["vanilla", "jascl-no-unlabelled"]
    kw = {"cache_dir": tmp_path / "cache", "progress": False, "echo": lambda *a: None}
    sequential = run_compare(toy_protocol, config, methods, [3], tmp_path / "seq", **kw)
    messages: list[str] = []
    with monkeypatch.context() as m:  # this process trains nothing: the two bases and the two cells are jobs
        m.setattr(ContinualTrainer, "run_session", _refuse)
        launched = run_compare(
            toy_protocol, config, methods, [3], tmp_path / "jobs", launcher=Launcher("local", parallel=2, poll_s=0.2),
            **{**kw, "echo": messages.append},
        )  # fmt: skip
    submitted = [m.split(":")[0].removeprefix("[launcher] submitted ") for m in messages if "submitted" in m]
    # the bases first; each cell once its base has finished (which base finishes first varies)
    assert submitted[:2] == ["base seed 3", "base-stochastic-classifier seed 3"]
    assert sorted(submitted[2:]) == ["jascl-no-unlabelled seed 3", "vanilla seed 3"]
    for cell, base in (("vanilla", "base"), ("jascl-no-unlabelled", "base-stochastic-classifier")):
        assert _at(messages, f"[launcher] {base} seed 3: finished") < _at(messages, f"[launcher] submitted {cell} seed")
    assert "[launcher] 2 base models and 2 cells as local jobs, at most 2 at once" in messages
    assert _scores(tmp_path / "seq" / "seed-3") == _scores(tmp_path / "jobs" / "seed-3")
    for base in ("base", "base-stochastic-classifier"):  # the jobs' bases are the sequential run's, bit for bit
        a = load_file(tmp_path / "seq" / "seed-3" / base / "model.safetensors")
        b = load_file(tmp_path / "jobs" / "seed-3" / base / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert launched["methods"] == sequential["methods"]
    assert (tmp_path / "jobs" / "launcher").is_dir()  # submitit's job logs
    # delete one cell's last session: the rerun submits that cell only and gives the same table (its job runs in
    # this process: what is submitted does not depend on where jobs run, and a process costs 5 s of imports)
    shutil.rmtree(tmp_path / "jobs" / "seed-3" / "vanilla" / "s1-inc")
    messages.clear()
    again = run_compare(
        toy_protocol, config, methods, [3], tmp_path / "jobs", launcher=InProcessLauncher("local", parallel=2, poll_s=0),
        **{**kw, "echo": messages.append},
    )  # fmt: skip
    assert [m for m in messages if m.startswith("[launcher] submitted")] == [
        next(m for m in messages if m.startswith("[launcher] submitted vanilla seed 3"))
    ]
    assert again["methods"] == sequential["methods"]


def test_a_failed_base_holds_back_its_cells_only_and_a_rerun_submits_what_is_missing(
    toy_protocol, toy_config, tmp_path, monkeypatch
):
    config = dataclasses.replace(toy_config, threads=1)
    methods = ["vanilla", "jascl-no-unlabelled"]
    kw = {"cache_dir": tmp_path / "cache", "progress": False}
    run_session = ContinualTrainer.run_session

    def keyed_fails(self, *args, **kwargs):  # the keyed base's training (its method is named after the base)
        if self.method.name == "base-stochastic-classifier":
            raise RuntimeError("out of memory")
        return run_session(self, *args, **kwargs)

    messages: list[str] = []
    launcher = InProcessLauncher("local", parallel=2, poll_s=0)
    with monkeypatch.context() as m:
        m.setattr(ContinualTrainer, "run_session", keyed_fails)
        with pytest.raises(TrainingError) as err:
            run_compare(
                toy_protocol, config, methods, [3], tmp_path / "jobs", echo=messages.append, launcher=launcher, **kw
            )
    log = tmp_path / "jobs" / "launcher" / "2_log.err"
    assert str(err.value) == (
        f"1 of 4 jobs failed (base-stochastic-classifier seed 3); the first's log: {log}; 1 cells were not "
        "submitted, their base model missing; rerun the same command to resubmit only what is missing"
    )
    assert f"[launcher] base-stochastic-classifier seed 3: failed (out of memory); log {log}" in messages
    # the vanilla cell ran on its base; the JASCL cell was not submitted
    assert [m for m in messages if m.startswith("[launcher] submitted")] == [
        "[launcher] submitted base seed 3: job 1",
        "[launcher] submitted base-stochastic-classifier seed 3: job 2",
        "[launcher] submitted vanilla seed 3: job 3",
    ]
    folder = tmp_path / "jobs" / "seed-3"
    assert (folder / "vanilla" / "s1-inc" / "metrics.json").exists()
    assert not (folder / "base-stochastic-classifier" / "metrics.json").exists()
    assert not list((folder / "jascl-no-unlabelled").glob("s*"))  # (its options.json only)

    messages.clear()
    summary = run_compare(
        toy_protocol, config, methods, [3], tmp_path / "jobs", echo=messages.append, launcher=launcher, **kw
    )
    assert [m for m in messages if m.startswith("[launcher] submitted")] == [
        "[launcher] submitted base-stochastic-classifier seed 3: job 1",
        "[launcher] submitted jascl-no-unlabelled seed 3: job 2",
    ]
    assert set(summary["methods"]) == set(methods)


class _Slow:
    """A submitted job that does nothing and has finished after ``polls`` looks."""

    def __init__(self, job_id: str, polls: int) -> None:
        self.job_id, self.polls = job_id, polls

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def exception(self) -> None:
        return None


#: the ``threads`` of every configuration a :class:`_SlowLauncher` job was given
THREADS: list[int] = []


@dataclasses.dataclass(frozen=True)
class _SlowLauncher(Launcher):
    """Jobs named by what they train (a base's name, else the method) and the seed folder, each finished after
    its number of polls in ``polls``."""

    polls: tuple[tuple[str, int], ...] = ()

    def executor(self, folder):
        polls = dict(self.polls)

        class Executor:
            def submit(self, fn, protocol, config, methods, folder, kwargs, share, devices, stage, bases):
                name = f"{(bases or methods)[0]}@{Path(folder).name}"
                THREADS.append(config.threads)
                return _Slow(name, polls[name])

        return Executor()


def test_a_cell_starts_when_its_own_bases_are_complete_not_every_seeds(toy_protocol, toy_config, tmp_path, monkeypatch):
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: set(range(6)))  # a 6-core machine
    THREADS.clear()

    def spec(what: str, seed: int, stage: str, after: tuple[str, ...] = ()) -> JobSpec:
        p = dataclasses.replace(toy_protocol, seed=seed)
        bases = (what,) if stage == "bases" else None
        return JobSpec(p, ("jascl",), tmp_path / f"seed-{seed}", stage, f"{what} seed {seed}", bases, after)

    jobs = [
        spec("base-x", 1, "bases"),
        spec("base-x", 2, "bases"),
        spec("jascl", 1, "cell", ("base-x seed 1",)),
        spec("jascl", 2, "cell", ("base-x seed 2",)),
        spec("ewc", 2, "cell", ("never seed 2",)),  # waits for a job that is not in the list: not submitted
    ]
    polls = (("base-x@seed-1", 1), ("base-x@seed-2", 6), ("jascl@seed-1", 1), ("jascl@seed-2", 1))
    messages: list[str] = []
    launcher = _SlowLauncher("local", parallel=3, poll_s=0, polls=polls)
    failed, skipped = run_jobs(launcher, jobs, toy_config, tmp_path, {}, messages.append)
    assert (failed, skipped) == ([], [jobs[4]])
    # 3 jobs at a time on 6 cores: 2 threads each (torch's default would give each all 6); seed 2's cell starts
    # alone, and no job can start before it ends (only an end readies a job): all 6
    assert messages[0] == (
        "[launcher] 2 base models and 3 cells as local jobs, at most 3 at once, 2 CPU threads per process "
        "(every core for a job that runs alone)"
    )
    assert THREADS == [2, 2, 2, 6]
    assert [m for m in messages if "submitted" in m or "finished" in m] == [
        "[launcher] submitted base-x seed 1: job base-x@seed-1",
        "[launcher] submitted base-x seed 2: job base-x@seed-2",
        "[launcher] base-x seed 1: finished (1/5)",
        "[launcher] submitted jascl seed 1: job jascl@seed-1",  # seed 2's base still trains
        "[launcher] jascl seed 1: finished (2/5)",
        "[launcher] base-x seed 2: finished (3/5)",
        "[launcher] submitted jascl seed 2: job jascl@seed-2",
        "[launcher] jascl seed 2: finished (4/5)",
    ]


def test_local_jobs_share_the_cores_unless_threads_is_set(toy_config, monkeypatch):
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert toy_config.threads == 0
    assert Launcher("local", parallel=2).job_config(toy_config, 5).threads == 4  # 2 jobs at once on 8 cores
    assert Launcher("local", parallel=2).job_config(toy_config, 1).threads == 8  # one job: every core
    assert Launcher("local", parallel=3).job_config(toy_config, 5).threads == 2  # 8 // 3
    assert Launcher("local", parallel=2, devices=2).job_config(toy_config, 5).threads == 2  # 4 processes at once
    assert Launcher("local", parallel=16).job_config(toy_config, 20).threads == 1
    assert Launcher("local", gpus=(0, 1, 2, 3)).job_config(toy_config, 9).threads == 2  # one job per GPU
    given = dataclasses.replace(toy_config, threads=3)
    assert Launcher("local", parallel=2).job_config(given, 5) is given  # threads set: the user's
    assert Launcher("slurm", parallel=2).job_config(toy_config, 5) is toy_config  # SLURM: cpus_per_job


def test_the_files_stage_lists_the_missing_bases_and_a_base_job_trains_only_its_methods_bases(
    toy_protocol, toy_config, tmp_path
):
    from jascl.experiments.runner import run_benchmark

    kw = {"cache_dir": tmp_path / "cache", "progress": False, "echo": lambda *a: None}
    out = tmp_path / "run"
    assert run_benchmark(toy_protocol, toy_config, ["vanilla", "jascl", "ewc"], out, stage="files", **kw) == {
        "bases": {"base": ["vanilla", "ewc"], "base-stochastic-classifier": ["jascl"]}
    }
    with pytest.raises(ConfigError, match=f"{out}: base-stochastic-classifier is not a shared base of the methods "
                       "vanilla \\(theirs: base\\)"):  # fmt: skip
        run_benchmark(
            toy_protocol, toy_config, ["vanilla"], out, stage="bases", bases=["base-stochastic-classifier"], **kw
        )
    # bases=None: every base the methods start from; then none is missing, and the folder has no session else
    assert run_benchmark(toy_protocol, toy_config, ["vanilla", "jascl", "ewc"], out, stage="bases", **kw) == {}
    assert run_benchmark(toy_protocol, toy_config, ["vanilla", "jascl", "ewc"], out, stage="files", **kw) == {
        "bases": {}
    }
    assert sorted(p.parent.name for p in out.glob("*/metrics.json")) == ["base", "base-stochastic-classifier"]
    assert not list(out.glob("*/s*/metrics.json")) and not (out / "results.json").exists()


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
    assert params["ntasks_per_node"] == 1
    assert lau.executor(tmp_path / "logs")._executor.max_num_timeout == 3  # requeues at the time limit
    assert parse_launcher("slurm", ["requeues=0"]).executor(tmp_path / "logs")._executor.max_num_timeout == 0
    # --devices 4: four tasks (processes) per job and, unless gpus_per_job says otherwise, four GPUs
    params = parse_launcher("slurm", [], 4).executor(tmp_path / "logs")._executor.parameters
    assert params["ntasks_per_node"] == 4 and params["gpus_per_node"] == 4
    params = parse_launcher("slurm", ["gpus_per_job=0"], 4).executor(tmp_path / "logs")._executor.parameters
    assert params["ntasks_per_node"] == 4 and params["gpus_per_node"] == 0


PROBE = """
import json, os
from jascl import distributed
from jascl.methods import METHODS, Method, Plugin


class WorldProbe(Plugin):
    name = "world-probe"
    changes_base_session = True  # so that its session 0 is a keyed base (base-probe), trained as a job of its own
    base_key = "probe"

    def before_session(self, state):
        from submitit import JobEnvironment

        job = JobEnvironment()
        path = os.path.join(os.environ["JASCL_PROBE_DIR"], f"rank{distributed.rank()}-s{state.session.index}.json")
        with open(path, "w") as f:
            meet = (job.paths.folder / f"{job.job_id}_rendezvous").exists()  # a local job's ranks meet in a file
            json.dump({"world": distributed.world_size(), "device": str(state.device), "file": meet}, f)


@METHODS.register("world-probe", doc="test: records the process group each session trains in")
def world_probe(config):
    return Method("world-probe", [WorldProbe()], "test probe")
"""


@pytest.mark.slow
def test_local_launcher_trains_each_cell_with_n_processes(toy_protocol, toy_config, tmp_path, monkeypatch, request):
    probe = tmp_path / "probe_method.py"
    probe.write_text(PROBE)
    spec = importlib.util.spec_from_file_location("probe_method", probe)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # this process plans the jobs
    request.addfinalizer(lambda: METHODS.unregister("world-probe"))  # the probe is forgotten afterwards
    (tmp_path / "probe").mkdir()
    monkeypatch.setenv("JASCL_PROBE_DIR", str(tmp_path / "probe"))
    config = dataclasses.replace(toy_config, threads=1, device="cpu")
    messages: list[str] = []
    summary = run_compare(
        toy_protocol, config, ["world-probe"], [3], tmp_path / "jobs", cache_dir=tmp_path / "cache",
        progress=False, echo=messages.append, imports=[str(probe)],
        launcher=Launcher("local", devices=2, poll_s=0.2),
    )  # fmt: skip
    assert any(m.endswith(", 2 processes") and "submitted base-probe seed 3" in m for m in messages)
    assert any(m.endswith(", 2 processes") and "submitted world-probe seed 3" in m for m in messages)
    # session 0 (the keyed base, its own job) and session 1 (the cell) each ran in a group of two gloo ranks
    files = ["rank0-s0.json", "rank0-s1.json", "rank1-s0.json", "rank1-s1.json"]
    assert sorted(f.name for f in (tmp_path / "probe").iterdir()) == files
    for name in files:
        assert json.loads((tmp_path / "probe" / name).read_text()) == {"world": 2, "device": "cpu", "file": True}
    assert len(summary["methods"]["world-probe"]["sessions"]) == 2


#: makes the first task of a local submitit job send itself submitit's time-limit signal (USR2) right after its
#: first optimiser step, once per test (the marker file), as SLURM does ``signal_delay_s`` before the limit
TIME_LIMIT = """
import os
if os.environ.get("SUBMITIT_LOCAL_GLOBALID") == "0" and os.environ.get("JASCL_TIME_LIMIT_MARK"):
    import signal
    from jascl.engine.loop import ContinualTrainer
    fire = ContinualTrainer.fire

    def fire_and_signal(self, event, state):
        fire(self, event, state)
        mark = os.environ["JASCL_TIME_LIMIT_MARK"]
        if event == "after_update" and not os.path.exists(mark):
            with open(mark, "w") as f:
                f.write(f"session {state.session.index} iteration {state.iteration}")
            os.kill(os.getpid(), signal.SIGUSR2)

    ContinualTrainer.fire = fire_and_signal
"""


@pytest.mark.slow
def test_a_job_at_its_time_limit_stops_after_the_step_and_is_requeued_to_the_same_model(
    toy_protocol, toy_config, tmp_path, monkeypatch
):
    from jascl.experiments.runner import run_benchmark

    config = dataclasses.replace(toy_config, threads=1, epochs_base=2)  # 8 images, batch 4: 2 steps per epoch
    kw = {"cache_dir": tmp_path / "cache", "progress": False, "echo": lambda *a: None}
    run_benchmark(toy_protocol, config, ["vanilla"], tmp_path / "seq", stage="bases", **kw)  # uninterrupted
    jobs = tmp_path / "jobs"
    assert run_benchmark(toy_protocol, config, ["vanilla"], jobs, stage="files", **kw) == {
        "bases": {"base": ["vanilla"]}
    }
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(TIME_LIMIT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src")]))
    monkeypatch.setenv("JASCL_TIME_LIMIT_MARK", str(tmp_path / "signalled"))
    # time_min=1: submitit counts any signal as the time limit (a job that is not checkpointable is then not
    # requeued: "timed-out and not checkpointable"), and its local executor ends an attempt after a minute
    launcher = Launcher("local", time_min=1, poll_s=0.2)
    spec = JobSpec(toy_protocol, ("vanilla",), jobs, "bases", "base seed 3", ("base",))
    messages: list[str] = []
    failed, skipped = run_jobs(launcher, [spec], config, jobs, {"cache_dir": tmp_path / "cache"}, messages.append)
    logs = "\n".join(p.read_text() for p in sorted((jobs / "launcher").glob("*_0_log.*")))
    assert (failed, skipped) == ([], []), logs[-3000:]
    assert (tmp_path / "signalled").read_text() == "session 0 iteration 0"  # after the first of 4 steps
    # the job stopped there with a checkpoint, submitit requeued it, and the requeued job resumed and finished
    assert (
        "[launcher] stopped on SIGUSR2 in base session 0 (base): its training state inside epoch 0, after step 1"
        in logs
    )
    assert "Job has timed out" in logs and "Requeued job" in logs
    a = load_file(tmp_path / "seq" / "base" / "model.safetensors")
    b = load_file(jobs / "base" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        json.loads((jobs / "base" / "metrics.json").read_text())["per_class"]
        == json.loads((tmp_path / "seq" / "base" / "metrics.json").read_text())["per_class"]
    )


def test_a_job_is_what_submitit_requeues_the_same_call(toy_protocol, toy_config):
    from submitit.helpers import DelayedSubmission

    from jascl.experiments.launcher import SessionsJob, _job, timeout_signal

    args = (toy_protocol, toy_config, ("vanilla",), "/runs/x", {}, (), 1, "cell", None)
    again = _job.checkpoint(*args)
    assert isinstance(again, DelayedSubmission) and again.function is _job and again.args == args
    assert isinstance(_job, SessionsJob) and timeout_signal() == signal.SIGUSR2
    assert parse_launcher("slurm", ["requeues=5"]).requeues == 5 and Launcher("local").requeues == 3
    with pytest.raises(ConfigError, match="requeues >= 0"):
        Launcher("local", requeues=-1)
