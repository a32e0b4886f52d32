"""Every registered method, on the toy two-session protocol with an unlabelled pool:
it trains, evaluates, and each loss term its plugins declare is non-zero in session 1
(``loss_terms``), or in session 0 for terms of methods that train their own base (``base_loss_terms``)."""

import math
import shutil

import pytest

from conftest import TINY_DIFFUSION, toy_protocol_dict
from jascl.data.sessions import load_sessions
from jascl.engine.config import resolve_config
from jascl.experiments.runner import ensure_base, run_benchmark
from jascl.methods import METHODS, Plugin
from jascl.methods.registry import create_method
from jascl.protocols import parse_protocol


class LossProbe(Plugin):
    """Records, per session, the largest magnitude of every loss term seen (after all plugins added theirs)."""

    name = "probe"

    def __init__(self):
        self.seen: dict[int, dict[str, float]] = {}

    def before_backward(self, state):
        terms = self.seen.setdefault(state.session.index, {})
        for key, value in state.losses.items():
            v = float(value.detach())
            assert math.isfinite(v), f"loss term {key} is not finite"
            terms[key] = max(terms.get(key, 0.0), abs(v))


@pytest.fixture(scope="module")
def toy_ss(tmp_path_factory):
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    protocol = parse_protocol(spec, source="toy-ss.yaml")
    config = resolve_config(
        protocol.training, "toy-ss.yaml", overrides=["pas.start_epoch=0", "pas.every=1", *TINY_DIFFUSION]
    )
    root = tmp_path_factory.mktemp("registry")
    data = load_sessions(protocol, root / "cache", echo=lambda *a: None)
    ensure_base(protocol, config, data, root / "base", progress=False, echo=lambda *a: None)
    keyed = create_method("jascl", config)  # the JASCL family's shared base, trained once for all of them
    ensure_base(protocol, config, data, root / f"base-{keyed.base_key}", False, lambda *a: None, keyed.base_method())
    return protocol, config, root


@pytest.mark.parametrize("name", METHODS.list())
def test_every_method_trains_evaluates_and_its_loss_terms_act(name, toy_ss, tmp_path):
    protocol, config, root = toy_ss
    probe = LossProbe()
    out = tmp_path / "run"
    for base in root.glob("base*"):
        shutil.copytree(base, out / base.name)
    results = run_benchmark(
        protocol,
        config,
        [name],
        out,
        cache_dir=root / "cache",
        progress=False,
        echo=lambda *a: None,
        extra_plugins=[probe],
    )
    sessions = results["methods"][name]["sessions"]
    assert len(sessions) == 2
    for record in sessions:
        assert 0.0 <= record["all"] <= 1.0
    plugins = create_method(name, config).plugins
    declared = [t for p in plugins for t in p.loss_terms]
    assert 1 in probe.seen, "session 1 ran no training iteration"
    for term in declared:
        assert probe.seen[1].get(term, 0.0) > 0.0, f"{name}: loss term {term!r} never non-zero in session 1"
    base_terms = [t for p in plugins for t in p.base_loss_terms]
    if base_terms:
        assert any(p.changes_base_session for p in plugins), f"{name}: base_loss_terms without its own base"
        for term in base_terms:
            assert probe.seen[0].get(term, 0.0) > 0.0, f"{name}: base loss term {term!r} never non-zero in session 0"
    assert (out / name / "s1-inc" / "metrics.json").exists()


def test_registry_has_the_jascl_preset_and_vanilla():
    assert {"vanilla", "jascl"} <= set(METHODS.list())
    assert [type(p).__name__ for p in create_method("jascl", resolve_config()).plugins] == [
        "StochasticBasePlugin",
        "GASPlugin",
        "PrototypeReplayPlugin",
        "MeanTeacherPlugin",
    ]
