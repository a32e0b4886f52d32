"""The sweep grids, the K-shot protocol variant and the sweep table files."""

import csv
import json

import yaml

from conftest import InProcessLauncher, toy_protocol_dict
from jascl.cli import main
from jascl.engine.config import resolve_config
from jascl.experiments.runner import run_benchmark
from jascl.experiments.sweep import GRIDS, run_sweep, with_shots, write_sweep
from jascl.protocols import get_protocol, parse_protocol


def test_grids_are_the_papers_values():
    assert [p["gas.eps"] for p in GRIDS["eps"]] == [1e-6, 1e-7, 1e-8, 1e-9]
    assert [p["gas.sigma2"] for p in GRIDS["sigma2"]] == [0.1, 1.0, 10.0]
    assert [p["shots"] for p in GRIDS["shots"]] == [3, 4, 5]
    assert len(GRIDS["tau"]) == 9 and {p["pas.tau_sim"] for p in GRIDS["tau"]} == {0.6, 0.7, 0.8}
    assert all(p["freeze_incremental"] == "none" for p in GRIDS["gas-layer"])


def test_with_shots_changes_only_incremental_sessions():
    p = with_shots(get_protocol("synthetic-2d"), 3)
    assert [s.shots for s in p.sessions] == [None, 3, 3, 3] and p.sessions[0].train == 160
    assert p.sessions[1].num_labelled == 6 and p.name == "synthetic-2d-k3"
    spec = toy_protocol_dict(2)
    spec["sessions"][0] = {
        **{k: v for k, v in spec["sessions"][0].items() if k != "train"},
        "shots": 2,
    }  # a few-shot session 0 is kept: the points share its base
    few = parse_protocol(spec, source="toy.yaml")
    k1 = with_shots(few, 1)
    assert [s.shots for s in k1.sessions] == [2, 1] and k1.session0_of == ("toy-2d",)


def test_sweep_files_quote_point_names(tmp_path):
    rows = [
        {
            "grid": "tau",
            "point": "tau_conf=0.6,tau_sim=0.7",
            "last_all": 0.35,
            "last_base": 0.4,
            "total_drop": 58.0,
            "retention_pct": 38.9,
            "precision": float("nan"),
        }
    ]
    write_sweep(rows, tmp_path, get_protocol("synthetic-2d-ss"), "jascl")
    table = list(csv.reader((tmp_path / "sweep.csv").open()))
    assert table[1] == ["tau", "tau_conf=0.6,tau_sim=0.7", "0.350", "0.400", "58.0", "38.9", "—"]
    assert "| tau | tau_conf=0.6,tau_sim=0.7 | 0.350 |" in (tmp_path / "sweep.md").read_text()
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][0]["precision"] is None


def test_the_points_share_the_methods_own_base_trained_once_with_the_results_of_a_run_of_their_own(
    toy_protocol, tmp_path
):
    """JASCL starts from the keyed base (``base-stochastic-classifier``): the sweep trains it once, links it into every
    point, and trains no vanilla base it would not use; a point gives what a run with its settings gives alone."""
    messages: list[str] = []
    kw = {"cache_dir": tmp_path / "cache", "progress": False}
    rows = run_sweep(toy_protocol, ["tau"], tmp_path / "sweep", echo=messages.append, **kw)
    trained = [m.split("training the shared base model ")[1] for m in messages if "training the shared base" in m]
    assert trained == ["base-stochastic-classifier"] and len(rows) == 9
    assert not (tmp_path / "sweep" / "base").exists()
    point = tmp_path / "sweep" / "tau" / "tau_conf=0.7,tau_sim=0.6"
    assert (point / "base-stochastic-classifier").resolve() == (tmp_path / "sweep" / "base-stochastic-classifier")
    config = resolve_config(toy_protocol.training, toy_protocol.path, overrides=["pas.tau_conf=0.7", "pas.tau_sim=0.6"])
    run_benchmark(toy_protocol, config, ["jascl"], tmp_path / "alone", echo=lambda *a: None, **kw)
    alone = json.loads((tmp_path / "alone" / "results.json").read_text())
    assert json.loads((point / "results.json").read_text())["methods"] == alone["methods"]


def test_k_shot_points_start_from_the_shared_base_of_their_source_protocol(toy_protocol, tmp_path):
    """A K-shot variant is a protocol of its own (``toy-2d-k3``) with the same session 0 (``session0_of``): its run
    loads the base trained for ``toy-2d`` (linking it made the run fail, its checkpoint made for another protocol)."""
    messages: list[str] = []
    run_sweep(toy_protocol, ["shots", "eps"], tmp_path / "s", "vanilla", echo=messages.append, progress=False,
              cache_dir=tmp_path / "cache")  # fmt: skip
    assert sum("training the shared base model" in m for m in messages) == 1
    for point in ("shots/shots=3", "shots/shots=5", "eps/eps=1e-07"):
        assert (tmp_path / "s" / point / "base").resolve() == tmp_path / "s" / "base"
    k3 = json.loads((tmp_path / "s" / "shots" / "shots=3" / "results.json").read_text())
    assert k3["protocol"] == "toy-2d-k3"
    base = json.loads((tmp_path / "s" / "base" / "metrics.json").read_text())
    assert k3["methods"]["vanilla"]["sessions"][0]["all"] == base["all"]
    # with --split-manifest the base's session 0 comes from the file and a K-shot point selects its own: its own base
    manifest = tmp_path / "s" / "eps" / "eps=1e-07" / "manifest.json"
    run_sweep(toy_protocol, ["shots"], tmp_path / "m", "vanilla", echo=lambda *a: None, progress=False,
              cache_dir=tmp_path / "cache", split_manifest=manifest)  # fmt: skip
    own = tmp_path / "m" / "shots" / "shots=3" / "base"
    assert not own.is_symlink() and (own / "metrics.json").exists()


def test_a_launcher_trains_the_shared_base_then_every_point_as_jobs_to_the_sequential_table(toy_protocol, tmp_path):
    """``--launcher``: one job for the base every point links to, then one per point, each with the point's own
    settings; the sweep then only collects (every session reused) the table a sweep without a launcher writes."""
    kw = {"cache_dir": tmp_path / "cache", "progress": False}
    sequential = run_sweep(toy_protocol, ["sigma2"], tmp_path / "seq", echo=lambda *a: None, **kw)
    messages: list[str] = []
    launcher = InProcessLauncher("local", poll_s=0)
    rows = run_sweep(toy_protocol, ["sigma2"], tmp_path / "jobs", echo=messages.append, launcher=launcher, **kw)
    assert [m for m in messages if m.startswith("[launcher] submitted")] == [
        "[launcher] submitted base-stochastic-classifier for every point: job 1",
        "[launcher] submitted jascl sigma2 sigma2=0.1: job 2",
        "[launcher] submitted jascl sigma2 sigma2=1.0: job 3",
        "[launcher] submitted jascl sigma2 sigma2=10.0: job 4",
    ]
    assert not [m for m in messages if "training" in m]  # the sweep itself trained nothing
    assert not (tmp_path / "jobs" / "jascl").exists()  # the base job wrote no method folder beside the points
    assert json.dumps(rows) == json.dumps(sequential)
    point = tmp_path / "jobs" / "sigma2" / "sigma2=10.0"
    assert (point / "base-stochastic-classifier").resolve() == tmp_path / "jobs" / "base-stochastic-classifier"
    assert yaml.safe_load((point / "config.yaml").read_text())["method_args"]["jascl"]["gas"]["sigma2"] == 10.0
    messages.clear()
    run_sweep(toy_protocol, ["sigma2"], tmp_path / "jobs", echo=messages.append, launcher=launcher, **kw)
    assert not [m for m in messages if m.startswith("[launcher] submitted")]  # a rerun: nothing is missing


def test_under_a_split_manifest_a_launcher_trains_each_k_shot_point_its_own_base(toy_protocol, tmp_path):
    kw = {"cache_dir": tmp_path / "cache", "progress": False}
    run_benchmark(toy_protocol, resolve_config(toy_protocol.training, toy_protocol.path), ["vanilla"], tmp_path / "run",
                  echo=lambda *a: None, **kw)  # fmt: skip
    messages: list[str] = []
    run_sweep(toy_protocol, ["shots"], tmp_path / "s", "vanilla", echo=messages.append,
              launcher=InProcessLauncher("local", poll_s=0), split_manifest=tmp_path / "run" / "manifest.json", **kw)  # fmt: skip
    submitted = [m.split(": job")[0] for m in messages if m.startswith("[launcher] submitted")]
    assert submitted == [
        *(f"[launcher] submitted base shots shots={k}" for k in (3, 4, 5)),
        *(f"[launcher] submitted vanilla shots shots={k}" for k in (3, 4, 5)),
    ]  # no base for every point: none starts from it
    assert not (tmp_path / "s" / "base").exists()


def test_sweep_takes_the_launcher_options(toy_protocol, tmp_path, capsys, monkeypatch):
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    code = main(["sweep", "--protocol", str(protocol), "--grid", "eps", "--launcher-opt", "parallel=2",
                 "--out", str(tmp_path / "s")])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err == "jascl: error: --launcher-opt needs --launcher local or --launcher slurm\n"
    assert not (tmp_path / "s").exists()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no srun: not a SLURM node
    code = main(
        ["sweep", "--protocol", str(protocol), "--grid", "eps", "--launcher", "slurm", "--out", str(tmp_path / "s")]
    )
    assert code == 2 and '--launcher slurm: Could not detect "srun"' in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before the sweep's folder or any point was prepared
