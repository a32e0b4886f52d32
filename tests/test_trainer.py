"""The training loop, plugins on its events, the runner's run folder, base sharing and resume."""

import json

import pytest
import torch
from safetensors.torch import load_file

from jascl.data.synthetic import load_or_generate
from jascl.engine.checkpoint import load_model
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore
from jascl.experiments.runner import run_benchmark
from jascl.methods import METHODS, Method, Plugin
from jascl.methods.gas import GASNoise
from jascl.methods.gas_plugin import GASPlugin
from jascl.methods.registry import create_method
from jascl.methods.replay import PrototypeReplayPlugin


class Recorder(Plugin):
    """Records events, loss-term names and GAS scales seen during training."""

    name = "recorder"

    def __init__(self):
        self.events = []
        self.loss_terms = []
        self.min_scale = []
        self.trainable = []

    def before_session(self, state):
        self.events.append(("before_session", state.session.index))
        self.trainable.append(sorted(n for n, p in state.model.named_parameters() if p.requires_grad))

    def before_backward(self, state):  # after every plugin's after_forward
        self.loss_terms.append(sorted(state.losses))

    def after_update(self, state):
        scales = [m.scale().min().item() for m in state.model.modules() if isinstance(m, GASNoise)]
        self.min_scale.append(min(scales) if scales else None)

    def after_eval(self, state):
        self.events.append(("after_eval", state.session.index))

    def after_session(self, state):
        self.events.append(("after_session", state.session.index))


def test_two_session_loop_with_gas_and_replay(toy_protocol, toy_config, tmp_path):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    rec = Recorder()
    method = Method("t", [rec, GASPlugin(), PrototypeReplayPlugin(weight=0.1)])
    trainer = ContinualTrainer(toy_protocol, toy_config, method, data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    r0 = trainer.run_session(0, model, store, tmp_path / "s0")
    r1 = trainer.run_session(1, model, store, tmp_path / "s1")
    assert rec.events == [
        ("before_session", 0),
        ("after_eval", 0),
        ("after_session", 0),
        ("before_session", 1),
        ("after_eval", 1),
        ("after_session", 1),
    ]
    # session 0: no GAS, no replay (nothing stored yet); session 1: both
    n0 = len([t for t in rec.loss_terms if t == ["seg"]])
    assert n0 == 2  # 8 samples / batch 4 x 1 epoch
    assert rec.loss_terms[n0:] == [["proto", "seg"]] * 2  # 4 samples / batch 4 x 2 epochs
    assert rec.min_scale[:n0] == [None] * n0 and all(s < 1.0 for s in rec.min_scale[n0:])
    # freezing policy: only the classifier trains in incremental sessions
    assert rec.trainable[1] == ["classifier.weight"] and len(rec.trainable[0]) > 10
    # classifier grew to background + 3 classes; GAS was removed again (plain parameter)
    assert model.classifier.weight.shape[0] == 4 and not any(isinstance(m, GASNoise) for m in model.modules())
    # prototypes of (session, class) incl. background; looked up by class id
    assert set(store.entries) == {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 3)}
    # records: per-class scores over all seen classes, old/new split
    assert set(r1["per_class"]) == {"0", "1", "2", "3"} and set(r0["per_class"]) == {"0", "1", "2"}
    assert r1["new"] == pytest.approx(r1["per_class"]["3"])
    assert r1["old"] == pytest.approx((r1["per_class"]["1"] + r1["per_class"]["2"]) / 2)
    # the checkpoint is safetensors, reloadable into a fresh model, with prototypes alongside
    fresh = trainer.new_model(4)
    meta = load_model(fresh, tmp_path / "s1" / "model.safetensors")
    assert meta["seen"] == [0, 1, 2, 3] and torch.equal(fresh.classifier.weight, model.classifier.weight)
    assert set(load_file(tmp_path / "s1" / "prototypes.safetensors")) == {
        "s0.c0",
        "s0.c1",
        "s0.c2",
        "s1.c0",
        "s1.c1",
        "s1.c3",
    }


def test_vanilla_changes_nothing_but_the_loss(toy_protocol, toy_config, tmp_path):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    rec = Recorder()
    method = create_method("vanilla", toy_config)
    method.plugins.append(rec)
    trainer = ContinualTrainer(toy_protocol, toy_config, method, data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    trainer.run_session(1, model, store, tmp_path / "s1")
    assert all(t == ["seg"] for t in rec.loss_terms)
    assert all(s is None for s in rec.min_scale)


def test_runner_shares_base_writes_outputs_and_resumes(toy_protocol, toy_config, tmp_path):
    toy_config.method_args = {"jascl": {"base": "shared"}}  # JASCL on the vanilla base: one base for both
    out = tmp_path / "run"
    messages = []
    results = run_benchmark(
        toy_protocol,
        toy_config,
        ["vanilla", "jascl"],
        out,
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=messages.append,
    )
    v, j = results["methods"]["vanilla"], results["methods"]["jascl"]
    assert v["sessions"][0] == j["sessions"][0]  # one shared base session
    assert sum("training the shared base model" in m for m in messages) == 1
    for name in (
        "results.json",
        "results.csv",
        "results.md",
        "config.yaml",
        "manifest.json",
        "log.txt",
        "environment.json",
        "base/model.safetensors",
        "jascl/s1-inc/prototypes.safetensors",
        "vanilla/s1-inc/metrics.json",
    ):
        assert (out / name).exists(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sessions"][1]["train"] == [
        "s1-inc/train/00000",
        "s1-inc/train/00001",
        "s1-inc/train/00002",
        "s1-inc/train/00003",
    ]
    saved = json.loads((out / "results.json").read_text())
    assert saved["methods"]["jascl"]["sessions"][1]["all"] == pytest.approx(j["sessions"][1]["all"])
    drop = v["total_drop"]
    s = [r["all"] for r in v["sessions"]]
    assert drop == pytest.approx(100 * max(0.0, s[0] - s[1]) / s[0])
    # resume: a second run in the same folder retrains nothing and gives the same numbers
    stamp = (out / "jascl/s1-inc/metrics.json").stat().st_mtime_ns
    messages.clear()
    again = run_benchmark(
        toy_protocol,
        toy_config,
        ["vanilla", "jascl"],
        out,
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=messages.append,
    )
    assert not any("training" in m for m in messages)
    assert (out / "jascl/s1-inc/metrics.json").stat().st_mtime_ns == stamp
    assert again["methods"]["jascl"]["sessions"] == j["sessions"]


@pytest.fixture(scope="module")
def toy_bases(tmp_path_factory):
    """The toy protocol (no unlabelled pool) with its shared bases trained once: vanilla's and the JASCL family's."""
    from conftest import toy_protocol_dict
    from jascl.data.sessions import load_sessions
    from jascl.engine.config import resolve_config
    from jascl.experiments.runner import ensure_base
    from jascl.protocols import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml")
    root = tmp_path_factory.mktemp("toy-bases")
    data = load_sessions(protocol, root / "cache", echo=lambda *a: None)
    ensure_base(protocol, config, data, root / "base", progress=False, echo=lambda *a: None)
    keyed = create_method("jascl", config)
    ensure_base(protocol, config, data, root / f"base-{keyed.base_key}", False, lambda *a: None, keyed.base_method())
    return protocol, config, root


def _reads_the_pool(name: str) -> bool:
    """Whether a plugin of ``name`` (or a class it derives from) reads the session's unlabelled pool: only those
    methods take another code path when a protocol has none; the others run as in the registry-wide test."""
    import inspect

    from jascl.engine.config import resolve_config

    classes = {c for p in create_method(name, resolve_config()).plugins for c in type(p).__mro__}
    return any("data.unlabelled" in inspect.getsource(c) for c in classes if c.__module__.startswith("jascl.methods"))


POOL_READERS = [name for name in METHODS.list() if _reads_the_pool(name)]


def test_the_pool_readers_are_the_semi_supervised_methods():
    assert {"jascl", "uad-ce", "csl", "retrieve", "nncsl", "halo", "fscil-ss", "mean-teacher-conf"} <= set(POOL_READERS)
    assert not {"vanilla", "ewc", "mib", "gas"} & set(POOL_READERS)


@pytest.mark.parametrize("name", POOL_READERS)
def test_every_method_that_reads_the_pool_runs_on_the_toy_protocol_without_one(name, toy_bases, tmp_path):
    import shutil

    protocol, config, root = toy_bases
    for base in root.glob("base*"):
        shutil.copytree(base, tmp_path / "run" / base.name)
    results = run_benchmark(
        protocol, config, [name], tmp_path / "run", cache_dir=root / "cache", progress=False, echo=lambda m: None
    )
    sessions = results["methods"][name]["sessions"]
    assert [s["session"] for s in sessions] == [0, 1]
    assert all(0.0 <= s["background"] <= 1.0 for s in sessions)


def test_gas_on_a_frozen_layer_is_a_config_error(toy_protocol, toy_config, tmp_path):
    from jascl.errors import ConfigError

    toy_config.method_args = {"jascl": {"gas": {"layer": "encoder"}}}
    with pytest.raises(ConfigError, match=r"method_args\.jascl\.gas\.layer='encoder' is frozen"):
        run_benchmark(
            toy_protocol,
            toy_config,
            ["jascl"],
            tmp_path / "run",
            cache_dir=tmp_path / "cache",
            progress=False,
            echo=lambda m: None,
        )


def test_gas_on_encoder_layer_when_unfrozen(toy_protocol, toy_config, tmp_path):
    toy_config.method_args = {"jascl": {"gas": {"layer": "encoder"}}}
    toy_config.freeze_incremental = "none"
    results = run_benchmark(
        toy_protocol,
        toy_config,
        ["jascl"],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda m: None,
    )
    assert len(results["methods"]["jascl"]["sessions"]) == 2


def test_monte_carlo_evaluation_differs_from_deterministic(toy_protocol, toy_config, tmp_path):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    from jascl.evaluation.evaluator import evaluate
    from jascl.methods.gas import attach_gas

    trainer = ContinualTrainer(toy_protocol, toy_config, Method("x"), data, progress=False)
    model = trainer.new_model(3)
    noise = attach_gas(model.classifier)  # zero buffer: full-scale noise when switched on
    args = (model, [data[0].test], [0, 1, 2], torch.device("cpu"))
    det1, det2 = evaluate(*args), evaluate(*args)
    assert det1.dice == det2.dice  # deterministic by default
    torch.manual_seed(0)
    mc = evaluate(*args, mc_samples=3)
    assert mc.iou != det1.iou and not noise.training  # noise switched off again afterwards


def test_3d_toy_protocol_runs_with_authors_evaluation(toy_protocol_3d, tmp_path):
    from jascl.engine.config import resolve_config

    config = resolve_config(
        toy_protocol_3d.training, "toy-3d.yaml", overrides=["eval_mode=authors", "patch_size=[32,32,32]"]
    )
    results = run_benchmark(
        toy_protocol_3d,
        config,
        ["vanilla", "jascl"],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda m: None,
    )
    # the paper's tables average foreground classes only, in the authors' evaluation mode too
    assert results["background"] == "excluded from means"
    last = results["methods"]["jascl"]["sessions"][-1]
    fg = [v for k, v in last["per_class"].items() if k != "0" and v == v]
    assert last["all"] == pytest.approx(sum(fg) / len(fg))


def test_patch_size_that_does_not_fit_the_backbone_is_a_config_error(toy_protocol, toy_config, tmp_path):
    from jascl.errors import ConfigError

    toy_config.patch_size = [24, 24]
    with pytest.raises(ConfigError, match=r"patch_size=\[24, 24\]: .* multiple of 16"):
        run_benchmark(
            toy_protocol,
            toy_config,
            ["vanilla"],
            tmp_path / "run",
            cache_dir=tmp_path / "cache",
            progress=False,
            echo=lambda m: None,
        )


def test_mean_teacher_with_pas_on_an_unlabelled_pool(tmp_path):
    from conftest import toy_protocol_dict
    from jascl.engine.config import resolve_config
    from jascl.protocols import parse_protocol

    d = toy_protocol_dict()
    d["sessions"][1]["unlabelled"] = 6
    d["training"]["pas"] = {"start_epoch": 0, "every": 1, "weight": 0.5}
    protocol = parse_protocol(d, "toy-ss.yaml")
    config = resolve_config(protocol.training, "toy-ss.yaml")
    rec = Recorder()
    method = create_method("jascl", config)
    method.plugins.append(rec)
    data = load_or_generate(protocol, tmp_path / "cache")
    assert len(data[1].unlabelled) == 6
    trainer = ContinualTrainer(protocol, config, method, data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    record = trainer.run_session(1, model, store, tmp_path / "s1")
    # 2 epochs, each an unlabelled phase: max(1 labelled batch, 2 unlabelled batches of 4) = 2 steps
    inc_terms = rec.loss_terms[2:]
    assert inc_terms == [["cons", "proto", "seg"]] * 4  # GAS adds no loss term
    pl = record["pseudo_labels"]
    assert pl["filter"] == "pas" and pl["phases"] == 2
    assert 0.0 <= pl["coverage"] <= 1.0 and pl["gamma"] == pytest.approx(0.5 / 1.5)
    if pl["coverage"] > 0:
        from jascl.methods.pas import asymptotic_error

        assert 0.0 <= pl["precision"] <= 1.0
        assert pl["eps_inf_predicted"] == pytest.approx(
            asymptotic_error(pl["coverage"], pl["precision"], pl["gamma"], pl["eps0"])
        )
    saved = json.loads((tmp_path / "s1" / "metrics.json").read_text())
    assert saved["pseudo_labels"]["phases"] == 2


def test_ablate_flag_maps_to_component_switches():
    import argparse

    from jascl.cli.common import _protocol_and_overrides

    args = argparse.Namespace(
        protocol="synthetic-2d",
        seed=None,
        set=["epochs_base=3"],
        backbone=None,
        device=None,
        eval_mode=None,
        weights=None,
        ablate="gas,proto",
    )
    protocol, overrides = _protocol_and_overrides(args)
    assert overrides == [
        "epochs_base=3",
        "method_args.jascl.components.gas=false",
        "method_args.jascl.components.replay=false",
    ]
    from jascl.engine.config import resolve_config

    cfg = resolve_config(protocol.training, protocol.path, None, overrides)
    method = create_method("jascl", cfg)
    assert [p.name for p in method.plugins] == ["stochastic-base", "cons"]  # session 0 stays the authors'
    # the spelling of earlier versions switches the same components
    old = resolve_config(protocol.training, protocol.path, None, ["jascl.gas=false", "jascl.replay=false"])
    assert [p.name for p in create_method("jascl", old).plugins] == ["stochastic-base", "cons"]


def test_other_backbone_drops_protocol_backbone_args_and_bad_args_are_config_errors():
    import argparse

    from jascl.cli.common import _protocol_and_overrides
    from jascl.errors import ConfigError
    from jascl.networks import create_segmenter

    def args(backbone, sets):
        return argparse.Namespace(
            protocol="synthetic-2d",
            seed=None,
            set=sets,
            backbone=backbone,
            device=None,
            eval_mode=None,
            weights=None,
            ablate=None,
        )

    assert _protocol_and_overrides(args("deeplabv3plus", []))[1] == ["backbone_args={}", "backbone=deeplabv3plus"]
    # the reset comes before --set, so a key set there survives it
    one = _protocol_and_overrides(args("swinunetr", ["backbone_args.feature_size=12"]))[1]
    assert one == ["backbone_args={}", "backbone_args.feature_size=12", "backbone=swinunetr"]
    from jascl.engine.config import parse_overrides

    assert parse_overrides(one)["backbone_args"] == {"feature_size": 12}
    assert _protocol_and_overrides(args("unet", []))[1] == ["backbone=unet"]  # the protocol's own backbone
    kept = _protocol_and_overrides(args("swinunetr", ["backbone_args={feature_size: 12}"]))[1]
    assert kept == ["backbone_args={feature_size: 12}", "backbone=swinunetr"]
    with pytest.raises(ConfigError, match=r"backbone_args \['foo'\] do not fit backbone 'unet'"):
        create_segmenter("unet", 2, 1, 3, foo=1)
