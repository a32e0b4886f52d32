"""The loop's extension points for methods: freezing override, optimiser, closure, per-split
evaluation hook, plugin state saved with checkpoints, ``session_restored``, method options."""

import json
from dataclasses import dataclass

import pytest
import torch

from jascl.data.synthetic import load_or_generate
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods import Method, Plugin
from jascl.methods.options import option, read_options


class Spy(Plugin):
    name = "spy"

    def __init__(self, freeze=None, optimizer=None):
        self.freeze_incremental = freeze
        self.optimizer = optimizer
        self.split_sessions = []
        self.restored = []
        self.trainable = {}
        self.closure_checks = []
        self.counter = torch.zeros(1)

    def make_optimizer(self, state, params, lr):
        if self.optimizer == "adagrad":
            return torch.optim.Adagrad(params, lr=lr)
        return None

    def before_session(self, state):
        self.trainable[state.session.index] = sum(p.requires_grad for p in state.model.backbone.parameters())

    def before_update(self, state):
        self.used = type(state.optimizer).__name__
        if len(self.closure_checks) < 2:
            with torch.no_grad():
                again = state.closure()
            # same batch, same weights, eval of the same terms: the same total (GAS absent, no dropout)
            self.closure_checks.append((float(sum(state.losses.values())), float(again)))

    def after_update(self, state):
        self.counter += 1

    def before_eval_split(self, state):
        self.split_sessions.append((state.session.index, state.eval_session))

    def extra_state(self):
        return {"counter": self.counter.clone()}

    def load_extra_state(self, tensors):
        self.counter = tensors["counter"].clone()

    def session_restored(self, state):
        self.restored.append(state.session.index)


def test_freeze_override_optimizer_closure_and_split_hook(toy_protocol, toy_config, tmp_path):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    spy = Spy(freeze="none", optimizer="adagrad")
    trainer = ContinualTrainer(toy_protocol, toy_config, Method("m", [spy]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    trainer.run_session(1, model, store, tmp_path / "s1")
    n_backbone = sum(1 for _ in model.backbone.parameters())
    # toy config freezes all but the classifier in session 1; the plugin's "none" overrides it
    assert toy_config.freeze_incremental == "all_but_classifier"
    assert spy.trainable == {0: n_backbone, 1: n_backbone}
    assert spy.used == "Adagrad"
    for first, again in spy.closure_checks:
        assert again == pytest.approx(first, rel=1e-5)
    assert spy.split_sessions == [(0, 0), (1, 0), (1, 1)]


def test_default_freeze_policy_applies_without_override(toy_protocol, toy_config, tmp_path):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    spy = Spy()
    trainer = ContinualTrainer(toy_protocol, toy_config, Method("m", [spy]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    trainer.run_session(1, model, store, tmp_path / "s1")
    assert spy.trainable[1] == 0
    assert spy.used == "SGD"


def test_conflicting_freeze_policies_are_refused():
    method = Method("m", [Spy(freeze="none"), Spy(freeze="all_but_classifier")])
    with pytest.raises(ValueError, match="different freezing policies"):
        method.freeze_policy("none")


def test_plugin_state_saved_and_restored_on_resume(toy_protocol, toy_config, tmp_path):
    first = Spy()
    run_benchmark(
        toy_protocol,
        toy_config,
        [Method("spy-method", [first])],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    # the shared base model was reused, not trained by the method: session_restored fired for session 0
    assert first.restored == [0]
    steps = float(first.counter)
    assert steps > 0
    second = Spy()
    run_benchmark(
        toy_protocol,
        toy_config,
        [Method("spy-method", [second])],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    assert second.restored == [0, 1]  # both sessions reused
    assert float(second.counter) == steps  # state from session 1's plugins.safetensors


def test_changed_configuration_refuses_to_reuse_run_folder(toy_protocol, toy_config, tmp_path):
    run_benchmark(toy_protocol, toy_config, ["vanilla"], tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    toy_config.lr_incremental = 0.5
    with pytest.raises(ConfigError, match=r"different configuration \(lr_incremental\)"):
        run_benchmark(
            toy_protocol, toy_config, ["vanilla"], tmp_path / "run", cache_dir=tmp_path / "cache", progress=False
        )


def test_changed_method_options_refuse_to_reuse_that_methods_sessions(toy_protocol, toy_config, tmp_path):
    run, cache = tmp_path / "run", tmp_path / "cache"
    toy_config.method_args = {"ewc": {"weight": 7.0}}
    run_benchmark(toy_protocol, toy_config, ["ewc"], run, cache_dir=cache, progress=False)
    saved = json.loads((run / "ewc" / "options.json").read_text())
    assert saved["weight"] == 7.0 and saved["fisher_labels"] == "empirical"
    toy_config.method_args = {"ewc": {"weight": 8.0}}
    with pytest.raises(ConfigError) as info:
        run_benchmark(toy_protocol, toy_config, ["ewc"], run, cache_dir=cache, progress=False)
    assert f"{run / 'ewc'}: its sessions were trained with method_args.ewc.weight=7.0 (now 8.0)" in str(info.value)
    # an option the file lacks (added to the method later) matches its default; the file then gains it
    del saved["gamma"]
    (run / "ewc" / "options.json").write_text(json.dumps(saved))
    toy_config.method_args = {"ewc": {"weight": 7.0}}
    run_benchmark(toy_protocol, toy_config, ["ewc"], run, cache_dir=cache, progress=False)
    assert json.loads((run / "ewc" / "options.json").read_text())["gamma"] == 1.0
    toy_config.method_args = {"ewc": {"weight": 7.0, "gamma": 0.5}}
    with pytest.raises(ConfigError, match=r"method_args.ewc.gamma=1.0 \(now 0.5\)"):
        run_benchmark(toy_protocol, toy_config, ["ewc"], run, cache_dir=cache, progress=False)


@dataclass
class _Opts:
    weight: float = option(1.0, ge=0)
    mode: str = option("a", choices=("a", "b"))


def test_read_options_defaults_overrides_and_one_line_errors():
    cfg = resolve_config(overrides=["method_args.ewc.weight=500"])
    assert read_options(_Opts, cfg, "ewc") == _Opts(weight=500.0)
    assert read_options(_Opts, cfg, "other") == _Opts()
    for override, message in [
        ("method_args.ewc.wieght=5", "method_args.ewc.wieght: unknown configuration key; valid keys: mode, weight"),
        ("method_args.ewc.weight=big", "method_args.ewc.weight: must be a number (got 'big')"),
        ("method_args.ewc.weight=-1", "method_args.ewc.weight: must be >= 0 (got -1.0)"),
        ("method_args.ewc.mode=c", "method_args.ewc.mode: must be one of a, b (got 'c')"),
        ("method_args.ewc=3", "method_args.ewc: must be a mapping of option: value (got 3)"),
    ]:
        with pytest.raises(ConfigError) as info:
            read_options(_Opts, resolve_config(overrides=[override]), "ewc")
        assert str(info.value) == message


def test_method_options_compare_nested_keys_and_allow_an_untrained_folder(tmp_path):
    from jascl.engine.config import RunConfig
    from jascl.experiments.runner import check_method_options

    folder = tmp_path / "jascl"
    check_method_options(folder, "jascl", RunConfig())
    saved = json.loads((folder / "options.json").read_text())
    # a nested option the file lacks (added later) matches its default; the file gains it
    del saved["gas"]["variant"]
    (folder / "options.json").write_text(json.dumps(saved))
    (folder / "s1-inc").mkdir()
    (folder / "s1-inc" / "metrics.json").write_text("{}")
    check_method_options(folder, "jascl", RunConfig())
    assert json.loads((folder / "options.json").read_text())["gas"]["variant"] == "paper"
    # a changed nested option of a trained folder is named by its full path
    changed = RunConfig(method_args={"jascl": {"pas": {"anchors": "per-sample"}}})
    with pytest.raises(ConfigError, match=r"method_args.jascl.pas.anchors='mean' \(now 'per-sample'\)"):
        check_method_options(folder, "jascl", changed)
    # a folder whose file was written but no session trained (a run stopped early) takes the new options
    (folder / "s1-inc" / "metrics.json").unlink()
    check_method_options(folder, "jascl", changed)
    assert json.loads((folder / "options.json").read_text())["pas"]["anchors"] == "per-sample"
