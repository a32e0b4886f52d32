"""The guide's worked example (docs/examples/l2_sp.py, "Writing your own method"): a method defined entirely
through the public API -- options dataclass, pure function, plugin, registration -- runs on the toy protocol,
from Python and from the command line."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_cli, toy_protocol_dict
from jascl.cli import main
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods import METHODS, Plugin
from jascl.methods.registry import create_method, describe_method

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "l2_sp.py"


@pytest.fixture
def example():
    """The example module, imported as a user would; its registration is undone afterwards."""
    spec = importlib.util.spec_from_file_location("l2_sp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as any import does (dataclasses look their module up there)
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        METHODS.unregister("l2-sp")
        del sys.modules[spec.name]


def test_the_penalty_by_hand(example):
    params = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])}  # a third row added since: not anchored
    anchors = {"w": torch.tensor([[0.0, 2.0], [3.0, 2.0]])}
    # 0.5 * 0.1 * (1^2 + 0 + 0 + 2^2) = 0.25
    assert example.l2_sp_penalty(params, anchors, 0.1).item() == pytest.approx(0.25)


class Terms(Plugin):
    name = "terms"

    def __init__(self):
        self.l2sp = []

    def before_backward(self, state):
        if "l2sp" in state.losses:
            self.l2sp.append(float(state.losses["l2sp"].detach()))


def test_the_example_registers_runs_and_is_configured_like_every_method(example, toy_protocol, toy_config, tmp_path):
    assert "l2-sp" in METHODS.list()
    info = describe_method("l2-sp")
    assert info["paper"] == "Li, Grandvalet & Davoine, ICML 2018"
    assert [(r["name"], r["default"], r["allowed"]) for r in info["options"]] == [
        ("alpha", "0.01", ">= 0"),
        ("scope", "'all'", "one of all, classifier"),
        ("freeze", "'config'", "one of config, none, all_but_classifier"),
    ]
    toy_config.method_args = {"l2-sp": {"alpha": 5.0}}
    probe = Terms()
    results = run_benchmark(
        toy_protocol,
        toy_config,
        ["vanilla", "l2-sp"],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda m: None,
        extra_plugins=[probe],
    )
    assert set(results["methods"]) == {"vanilla", "l2-sp"}
    # session 1 starts at the anchors (penalty 0), then moves away from them
    assert probe.l2sp[0] == 0.0 and max(probe.l2sp) > 0.0
    # the pull changes what session 1 learns; session 0 is the shared base model
    vanilla, l2sp = (results["methods"][m]["sessions"] for m in ("vanilla", "l2-sp"))
    assert vanilla[0] == l2sp[0] and vanilla[1]["per_class"] != l2sp[1]["per_class"]
    toy_config.method_args = {"l2-sp": {"alpha": -1}}
    with pytest.raises(ConfigError, match=r"^method_args\.l2-sp\.alpha: must be >= 0 \(got -1\.0\)$"):
        create_method("l2-sp", toy_config)


@pytest.mark.slow
def test_the_example_from_the_command_line(tmp_path, capsys, monkeypatch, processes):
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    # the run in this process, with the command's own entry point (a new interpreter would add only its imports);
    # the resume below is a process of its own (forked from the tests' forkserver), one that never imported the
    # example
    threads = torch.get_num_threads()
    try:
        code = main(
            [
                *("run", "--import", str(EXAMPLE), "--protocol", str(protocol), "--methods", "l2-sp"),
                *("--set", "method_args.l2-sp.scope=classifier", "--device", "cpu"),
                *("--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), "--no-progress"),
            ]
        )
    finally:
        torch.set_num_threads(threads)
        METHODS.unregister("l2-sp")
        sys.modules.pop(EXAMPLE.stem, None)
    assert code == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [s["session"] for s in results["methods"]["l2-sp"]["sessions"]] == [0, 1]
    # the run folder records the module, so that a resumed run (from another folder, no --import) finds l2-sp
    assert json.loads((tmp_path / "run" / "run.json").read_text())["imports"] == [str(EXAMPLE.resolve())]
    resumed = run_cli(processes, ["run", "--resume", str(tmp_path / "run"), "--no-progress"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == results
    # `jascl methods l2-sp --import ...` and the refusal of a missing file, in this process (the command's entry
    # point, without a new interpreter's imports); the registration --import makes is undone afterwards
    monkeypatch.setenv("COLUMNS", "200")
    try:
        assert main(["methods", "l2-sp", "--import", str(EXAMPLE)]) == 0
    finally:
        METHODS.unregister("l2-sp")
        sys.modules.pop(EXAMPLE.stem, None)
    shown = capsys.readouterr().out
    assert "method_args.l2-sp" in shown and "alpha" in shown
    assert main(["methods", "--import", str(tmp_path / "nope.py")]) == 2
    assert capsys.readouterr().err.strip() == f"jascl: error: --import {tmp_path / 'nope.py'}: no such file"
