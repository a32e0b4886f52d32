"""Methods composed by name (``a+b``): the plugins of each part in order, each part with its own options, the
conflicts refused in one line naming both parts, ``--ablate`` on a composition, and a composed run."""

import argparse

import pytest

from jascl.cli.common import _protocol_and_overrides
from jascl.engine.config import resolve_config
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods import METHODS
from jascl.methods.registry import composed_parts, create_method, describe_method, resolved_options


def _types(method):
    return [type(p).__name__ for p in method.plugins]


def test_a_composition_is_the_plugins_of_its_parts_in_order():
    config = resolve_config()
    composed = create_method("jascl+gaps", config)
    jascl, gaps = create_method("jascl", config), create_method("gaps", config)
    assert composed.name == "jascl+gaps"
    assert (
        _types(composed)
        == _types(jascl) + _types(gaps)
        == ["StochasticBasePlugin", "GASPlugin", "PrototypeReplayPlugin", "MeanTeacherPlugin", "GAPSPlugin"]
    )
    # GAPS leaves session 0 alone, so the composition starts from JASCL's shared stochastic base
    assert composed.base_key == jascl.base_key == "stochastic-classifier"
    assert _types(create_method("gaps+jascl", config)) == _types(gaps) + _types(jascl)


def test_composed_names_resolve_without_registration_and_unknown_parts_are_named():
    assert composed_parts("jascl+gaps") == ["jascl", "gaps"] and composed_parts("jascl") is None
    assert "jascl+gaps" in METHODS.list()  # registered: listed and run by the registry-wide tests
    assert "ewc+lwf" in METHODS and "ewc+lwf" not in METHODS.list()
    assert "ewc+nope" not in METHODS and "ewc+ewc" not in METHODS and "ewc+" not in METHODS
    with pytest.raises(ConfigError, match=r"^unknown method 'nope' in 'ewc\+nope'"):
        METHODS.get("ewc+nope")
    with pytest.raises(ConfigError, match="names a part twice"):
        METHODS.get("ewc+ewc")
    info = METHODS.info("ewc+lwf")
    assert info.parts == ("ewc", "lwf") and info.options_key == ""
    assert info.paper == f"{METHODS.info('ewc').paper}; {METHODS.info('lwf').paper}"


def test_the_same_component_in_two_parts_is_refused_naming_both():
    with pytest.raises(ConfigError) as err:
        create_method("jascl+jascl-conf", resolve_config())
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("method jascl+jascl-conf: jascl (plugin 'stochastic-base') and jascl-conf")
    assert "StochasticBasePlugin" in message


def test_two_parts_replacing_the_same_default_plugin_are_refused():
    with pytest.raises(ConfigError, match=r"mib \(plugin 'mib'\) and plop \(plugin 'plop'\) both replace the loop's "):
        create_method("mib+plop", resolve_config())


class _OwnOptimizer(Plugin):
    def make_optimizer(self, state, params, lr):
        return None


class _OtherOptimizer(Plugin):
    name = "other"

    def make_optimizer(self, state, params, lr):
        return None


class _Freezes(Plugin):
    name = "freezer"
    freeze_incremental = "none"


@pytest.fixture
def toy_methods():
    """Three throw-away methods: two that supply the optimiser, one that unfreezes every layer."""
    METHODS.register("opt-a")(lambda config: Method("opt-a", [_OwnOptimizer()]))
    METHODS.register("opt-b")(lambda config: Method("opt-b", [_OtherOptimizer()]))
    METHODS.register("thaw")(lambda config: Method("thaw", [_Freezes()]))
    yield
    for name in ("opt-a", "opt-b", "thaw"):
        METHODS.unregister(name)


def test_two_optimisers_or_two_freezing_policies_are_refused(toy_methods):
    config = resolve_config()
    with pytest.raises(ConfigError, match=r"opt-a \(plugin 'plugin'\) and opt-b \(plugin 'other'\) both supply the "):
        create_method("opt-a+opt-b", config)
    assert _types(create_method("opt-a+thaw", config)) == ["_OwnOptimizer", "_Freezes"]  # nothing shared
    # gaps's freeze option set to all_but_classifier against thaw's "none"
    gaps_frozen = resolve_config(overrides=["method_args.gaps.freeze=all_but_classifier"])
    with pytest.raises(ConfigError, match=r"freezes 'all_but_classifier' and thaw \(plugin 'freezer'\) freezes 'none'"):
        create_method("gaps+thaw", gaps_frozen)


def test_each_part_reads_its_own_options_and_ablate_acts_on_the_composition():
    args = argparse.Namespace(
        protocol="synthetic-2d-ss",
        seed=None,
        set=["method_args.gaps.pastes=3"],
        backbone=None,
        device=None,
        eval_mode=None,
        weights=None,
        ablate="pas",
    )
    protocol, overrides = _protocol_and_overrides(args)
    config = resolve_config(protocol.training, "synthetic-2d-ss", overrides=overrides)
    composed = create_method("jascl+gaps", config)
    assert _types(composed) == ["StochasticBasePlugin", "GASPlugin", "PrototypeReplayPlugin", "GAPSPlugin"]
    assert composed.plugins[-1].options.pastes == 3
    options = resolved_options("jascl+gaps", config)
    assert set(options) == {"jascl", "gaps"}
    assert options["gaps"]["pastes"] == 3 and options["jascl"]["components"]["pas"] is False
    rows = {r["name"]: r for r in describe_method("jascl+gaps")["options"]}
    assert {"jascl.gas.eps", "gaps.pastes"} <= set(rows) and rows["gaps.pastes"]["default"] == "2"


class _Probe(Plugin):
    name = "probe"

    def __init__(self):
        self.terms: set[str] = set()

    def before_backward(self, state):
        if state.session.index == 1:
            self.terms |= {k for k, v in state.losses.items() if float(v.detach()) != 0.0}


def test_an_unregistered_composition_runs_with_both_parts_acting(toy_protocol, toy_config, tmp_path):
    probe = _Probe()
    results = run_benchmark(
        toy_protocol,
        toy_config,
        ["ewc+lwf"],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda *a: None,
        extra_plugins=[probe],
    )
    assert [s["session"] for s in results["methods"]["ewc+lwf"]["sessions"]] == [0, 1]
    assert {"ewc", "lwf_kd"} <= probe.terms
    assert (tmp_path / "run" / "ewc+lwf" / "s1-inc" / "metrics.json").exists()


def test_the_command_line_refuses_an_overlapping_composition_before_any_work(tmp_path, capsys):
    from jascl.cli import main

    for command in (["run"], ["compare", "--seeds", "1,2"]):
        out = tmp_path / command[0]
        assert main([*command, "--methods", "vanilla,mib+plop", "--out", str(out), "--no-progress"]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip().startswith("jascl: error: method mib+plop: mib (plugin 'mib') and plop")
        assert "output" not in captured.out and not out.exists()
