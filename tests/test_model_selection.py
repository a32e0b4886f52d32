"""Validation samples and model selection (issue 18, item 4): the protocol's ``validation`` key, validation splits
of synthetic and dataset protocols (disjoint from training and test samples, in the manifest), and the
``model-selection`` default plugin (the kept epoch is the best-scoring one; a resumed session keeps it)."""

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import toy_protocol_dict  # noqa: E402
from jascl.data.check import check_protocol  # noqa: E402
from jascl.data.real import load_real  # noqa: E402
from jascl.data.sessions import load_sessions  # noqa: E402
from jascl.data.synthetic import SyntheticRenderer, protocol_digest  # noqa: E402
from jascl.data.types import SessionData, Split  # noqa: E402
from jascl.engine.config import resolve_config  # noqa: E402
from jascl.engine.defaults import ModelSelection  # noqa: E402
from jascl.engine.prototypes import PrototypeStore  # noqa: E402
from jascl.engine.state import LoopState  # noqa: E402
from jascl.errors import ConfigError, DataError  # noqa: E402
from jascl.evaluation.evaluator import evaluate  # noqa: E402
from jascl.evaluation.metrics import summarise  # noqa: E402
from jascl.experiments.runner import check_reusable, ensure_base, run_benchmark  # noqa: E402
from jascl.methods import Plugin  # noqa: E402
from jascl.networks.base import create_segmenter  # noqa: E402
from jascl.protocols import parse_protocol  # noqa: E402
from test_real_protocols import fake_protocol, write_fake  # noqa: E402


def _quiet(*args):
    pass


def _toy(validation: int | None = 1, **training) -> dict:
    spec = toy_protocol_dict(2)
    if validation is not None:
        for session in spec["sessions"]:
            session["validation"] = validation
    spec["training"].update(training)
    return spec


# --------------------------------------------------------------------------------------------- schema and config


def test_validation_key_is_parsed_with_default_zero():
    assert [s.validation for s in parse_protocol(_toy(None), "toy.yaml").sessions] == [0, 0]
    assert [s.validation for s in parse_protocol(_toy(3), "toy.yaml").sessions] == [3, 3]


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "toy.yaml: sessions[1].validation: must be >= 0 (got -1)"),
        ("3", "toy.yaml: sessions[1].validation: must be an integer (got '3')"),
        (True, "toy.yaml: sessions[1].validation: must be an integer (got True)"),
        (1.5, "toy.yaml: sessions[1].validation: must be an integer (got 1.5)"),
    ],
)
def test_bad_validation_is_one_line_naming_the_key(value, message):
    spec = _toy(None)
    spec["sessions"][1]["validation"] = value
    with pytest.raises(ConfigError) as info:
        parse_protocol(spec, "toy.yaml")
    assert str(info.value) == message


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model_selection=best",
            "--set: model_selection: must be one of last, best_val_new, best_val_all (got 'best')",
        ),
        ("validate_every=0", "--set: validate_every: must be >= 1 epoch (got 0)"),
        (
            "validation_eval_mode=crop",
            "--set: validation_eval_mode: must be one of same, sliding-window, authors (got 'crop')",
        ),
        ("model_selection=3", "--set: model_selection: must be a string (got 3)"),
    ],
)
def test_bad_model_selection_options_are_one_line(override, message):
    with pytest.raises(ConfigError) as info:
        resolve_config({}, "toy.yaml", overrides=[override])
    assert str(info.value) == message


def test_model_selection_defaults_and_protocol_training_section():
    assert (resolve_config().model_selection, resolve_config().validate_every) == ("last", 1)
    assert resolve_config().validation_eval_mode == "same"
    assert resolve_config(overrides=["preset=authors"]).validation_eval_mode == "authors"  # as the authors selected
    cfg = resolve_config({"model_selection": "best_val_all", "validate_every": 5}, "p.yaml")
    assert (cfg.model_selection, cfg.validate_every) == ("best_val_all", 5)


# --------------------------------------------------------------------------------------------- synthetic data


def test_synthetic_validation_is_its_own_split_and_leaves_the_others_bit_identical(tmp_path):
    without = parse_protocol(_toy(None), "toy.yaml")
    zero = parse_protocol(_toy(0), "toy.yaml")
    with_val = parse_protocol(_toy(2), "toy.yaml")
    # the cache key of a protocol without validation samples does not change (its cached data stays valid)
    assert protocol_digest(zero) == protocol_digest(without) != protocol_digest(with_val)

    plain = load_sessions(without, tmp_path / "cache", echo=_quiet)
    data = load_sessions(with_val, tmp_path / "cache", echo=_quiet)
    cached = load_sessions(with_val, tmp_path / "cache", echo=_quiet)  # read back from the npz cache
    for p, d, c in zip(plain, data, cached):
        assert p.validation is None
        for split in ("train", "test"):
            a, b = getattr(p, split), getattr(d, split)
            assert a.ids == b.ids
            assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
        val = d.validation
        session = d.session
        assert len(val) == 2 * len(session.classes)  # 2 per taught class (new and recurring)
        assert not set(val.ids) & (set(d.train.ids) | set(d.test.ids))
        assert c.validation.ids == val.ids and np.array_equal(c.validation.images, val.images)
        # sample i shows its class (the plan: 2 per class in class order) and no other foreground class
        for i, cls in enumerate(c for c in session.classes for _ in range(2)):
            assert set(np.unique(val.labels[i]).tolist()) == {0, cls}
    # the renderer is a pure function of (protocol, session, split, index): the same pixels again
    again = SyntheticRenderer(with_val).session(with_val.sessions[1]).validation
    assert np.array_equal(again.images, data[1].validation.images)


def test_synthetic_manifest_lists_validation_and_an_old_manifest_still_loads(tmp_path):
    from jascl.data.real import manifest_dict

    protocol = parse_protocol(_toy(1), "toy.yaml")
    data = load_sessions(protocol, tmp_path / "cache", echo=_quiet)
    manifest = manifest_dict(protocol, data)
    assert manifest["sessions"][1]["validation"] == data[1].validation.ids
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    assert load_sessions(protocol, tmp_path / "cache", echo=_quiet, split_manifest=path)[1].validation is not None
    for entry in manifest["sessions"]:  # a manifest written before validation samples existed
        del entry["validation"]
    path.write_text(json.dumps(manifest))
    load_sessions(protocol, tmp_path / "cache", echo=_quiet, split_manifest=path)
    manifest["sessions"][1]["validation"] = ["s1-inc/validation/00099"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"sessions\[1\]\.validation lists other samples"):
        load_sessions(protocol, tmp_path / "cache", echo=_quiet, split_manifest=path)


# --------------------------------------------------------------------------------------------- the plugin alone


def _fixed(scores):
    """A stand-in for :meth:`ModelSelection.score`: the hand-chosen score of each epoch."""

    def score(plugin, state, splits):
        return scores[state.epoch]

    return score


def _state(protocol, config, data, model):
    session = protocol.sessions[1]
    return LoopState(
        protocol, config, "m", session, data[1], model, torch.device("cpu"), PrototypeStore(), protocol.seen_classes(1)
    )


def _tiny_data(protocol, validation=True):
    split = Split(np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 4, 4), np.uint8), ["x"])
    return [SessionData(s, split, split, None, split if validation else None) for s in protocol.sessions]


@pytest.mark.parametrize(
    "scores, every, expected, history_epochs",
    [
        ([0.2, 0.5, 0.4], 1, 1, [0, 1, 2]),
        ([0.5, 0.5, 0.3], 1, 0, [0, 1, 2]),  # a tie keeps the earlier epoch
        ([math.nan, 0.1, math.nan], 1, 1, [0, 1, 2]),  # NaN never wins
        ([0.9, 0.1, 0.95, 0.3, 0.2], 2, 3, [1, 3, 4]),  # epochs 0 and 2 are not scored; the last always is
        ([math.nan, math.nan], 1, None, [0, 1]),  # no finite score: the last epoch is kept
    ],
)
def test_the_kept_weights_are_those_of_the_best_scored_epoch(monkeypatch, scores, every, expected, history_epochs):
    protocol = parse_protocol(_toy(1), "toy.yaml")
    config = resolve_config(
        protocol.training,
        "toy.yaml",
        overrides=["model_selection=best_val_new", f"validate_every={every}", f"epochs_incremental={len(scores)}"],
    )
    monkeypatch.setattr(ModelSelection, "score", _fixed(scores))
    model = torch.nn.Linear(2, 2)
    plugin = ModelSelection(_tiny_data(protocol), contextlib.nullcontext)
    state = _state(protocol, config, plugin.data, model)
    plugin.before_session(state)
    for epoch in range(len(scores)):
        state.epoch = epoch
        with torch.no_grad():
            model.weight.fill_(epoch)  # the "training" of this epoch
        plugin.after_epoch(state)
    plugin.after_training(state)
    kept = expected if expected is not None else len(scores) - 1
    assert torch.equal(model.weight, torch.full((2, 2), float(kept)))
    selection = state.report["selection"]
    assert selection["epoch"] == kept and selection["mode"] == "best_val_new"
    assert [e for e, _ in selection["history"]] == history_epochs
    if expected is None:
        assert selection["score"] is None and selection["kept"] == "last epoch"
    else:
        assert selection["score"] == scores[expected] and selection["kept"] == "best validation"


def test_without_validation_samples_the_last_epoch_is_kept_with_one_warning(monkeypatch, caplog):
    protocol = parse_protocol(_toy(None), "toy.yaml")
    config = resolve_config(protocol.training, "toy.yaml", overrides=["model_selection=best_val_all"])
    monkeypatch.setattr(ModelSelection, "score", lambda *a: pytest.fail("nothing to score"))
    model = torch.nn.Linear(2, 2)
    plugin = ModelSelection(_tiny_data(protocol, validation=False), contextlib.nullcontext)
    state = _state(protocol, config, plugin.data, model)
    with caplog.at_level(logging.WARNING, logger="jascl"):
        plugin.before_session(state)
        for epoch in range(2):
            state.epoch = epoch
            plugin.after_epoch(state)
        plugin.after_training(state)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no validation samples" in warnings[0] and "last epoch" in warnings[0]
    assert state.report["selection"] == {
        "mode": "best_val_all",
        "epoch": 1,
        "score": None,
        "kept": "last epoch",
        "history": [],
    }


def test_best_val_all_scores_every_session_so_far_and_best_val_new_the_session_alone():
    protocol = parse_protocol(_toy(1), "toy.yaml")
    data = _tiny_data(protocol)
    plugin = ModelSelection(data, contextlib.nullcontext)
    for mode, expected in (("best_val_new", [data[1].validation]), ("best_val_all", [d.validation for d in data])):
        config = resolve_config(protocol.training, "toy.yaml", overrides=[f"model_selection={mode}"])
        got = plugin.splits(_state(protocol, config, data, torch.nn.Linear(1, 1)))
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected))


def test_validation_is_scored_in_validation_eval_mode():
    """``validation_eval_mode`` scores validation as ``eval_mode`` would with that value ("same": as ``eval_mode``);
    on images larger than the patch the two modes score differently (sliding windows, hard Dice; the authors'
    soft Dice), so the key is seen to act."""
    protocol = parse_protocol(_toy(1), "toy.yaml")
    rng = np.random.default_rng(0)
    images = rng.random((2, 1, 32, 32), dtype=np.float32)
    labels = rng.choice(np.array([0, 1, 3], np.uint8), size=(2, 32, 32))
    split = Split(images, labels, ["a", "b"])
    data = [SessionData(s, split, split, None, split) for s in protocol.sessions]
    torch.manual_seed(0)
    model = create_segmenter("unet", 2, 1, 4, features=[4, 4, 8, 8, 8, 8])

    def score(*overrides):
        config = resolve_config(protocol.training, "toy.yaml", overrides=["patch_size=[16,16]", *overrides])
        plugin = ModelSelection(data, contextlib.nullcontext)
        return plugin.score(_state(protocol, config, data, model), [split])

    assert score("validation_eval_mode=authors") == score("eval_mode=authors")
    assert score("validation_eval_mode=sliding-window", "eval_mode=authors") == score()
    assert score("eval_mode=authors", "validation_eval_mode=same") == score("eval_mode=authors")
    assert score("validation_eval_mode=authors") != score()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize(
    "trained, validated, epochs, every, warned",
    [
        # 200 validations of 50 s: 2.8 h against 0.6 h of training
        (
            10.0,
            50.0,
            200,
            1,
            "took 50.0 s, 5.0x the epoch's training (10.0 s); the session's 200 validations "
            "(validate_every=1) will take about 2.8 h against 0.6 h of training",
        ),
        (10.0, 50.0, 200, 10, None),  # one validation per 10 epochs of training: 50 s against 100 s
        (10.0, 12.0, 200, 1, "took 12.0 s, 1.2x the epoch's training (10.0 s)"),
        (10.0, 5.0, 200, 1, None),  # cheaper than the training
        (1.0, 2.0, 300, 1, None),  # 600 s in all: not worth a warning
        (1.0, 2.0, 301, 1, "301 validations"),
        (None, 50.0, 200, 1, None),  # the epoch was resumed inside: no training time to compare with
    ],
)
def test_a_validation_dearer_than_the_training_is_one_warning(
    monkeypatch, caplog, trained, validated, epochs, every, warned
):
    protocol = parse_protocol(_toy(1), "toy.yaml")
    config = resolve_config(
        protocol.training,
        "toy.yaml",
        overrides=["model_selection=best_val_new", f"validate_every={every}", f"epochs_incremental={epochs}"],
    )
    clock = FakeClock()

    def stand_in(plugin, state, splits):  # a validation of `validated` seconds
        clock.now += validated
        return 0.5

    monkeypatch.setattr(ModelSelection, "score", stand_in)
    plugin = ModelSelection(_tiny_data(protocol), contextlib.nullcontext)
    plugin.clock = clock
    state = _state(protocol, config, plugin.data, torch.nn.Linear(2, 2))
    plugin.before_session(state)
    with caplog.at_level(logging.WARNING, logger="jascl"):
        for epoch in range(2 * every):  # two validations: only the first may warn
            state.epoch = epoch
            if trained is None and epoch == 0:
                plugin.resume_epoch(state)
            else:
                plugin.before_epoch(state)
            clock.now += trained or 1.0  # the epoch's training
            plugin.after_epoch(state)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0], warnings
        assert warnings[0].startswith("m session 1 (inc): one validation (1 samples, sliding-window) took ")
        assert "--set validate_every=N" in warnings[0] and "--set validation_eval_mode=authors" in warnings[0]


# --------------------------------------------------------------------------------------------- in a run


class Snapshots(Plugin):
    """Copies of the model's weights at the end of every epoch of session 1 (not part of the checkpoint)."""

    name = "snapshots"

    def __init__(self):
        self.weights = {}

    def state_dict(self):
        return {}

    def after_epoch(self, state):
        if state.session.index == 1:
            self.weights[state.epoch] = {k: v.detach().clone() for k, v in state.model.state_dict().items()}


class Stop(Exception):
    """Stands in for the process dying."""


class StopBefore(Plugin):
    name = "stop"

    def __init__(self, epoch):
        self.epoch = epoch

    def before_epoch(self, state):
        if state.session.index == 1 and state.epoch == self.epoch:
            raise Stop


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """The toy protocol with one validation sample per class, 4 incremental epochs, and its base trained once."""
    protocol = parse_protocol(_toy(1, epochs_incremental=4), "toy-selection.yaml")
    root = tmp_path_factory.mktemp("selection")
    config = resolve_config(protocol.training, "toy-selection.yaml")
    data = load_sessions(protocol, root / "cache", echo=_quiet)
    ensure_base(protocol, config, data, root / "base", progress=False, echo=_quiet)
    return protocol, root


def _run(protocol, root, out, *plugins, selection="best_val_new"):
    shutil.copytree(root / "base", out / "base", dirs_exist_ok=True)
    config = resolve_config(protocol.training, "toy-selection.yaml", overrides=[f"model_selection={selection}"])
    results = run_benchmark(
        protocol, config, ["vanilla"], out, cache_dir=root / "cache", progress=False, echo=_quiet, extra_plugins=plugins
    )
    record = json.loads((out / "vanilla" / "s1-inc" / "metrics.json").read_text())
    return results, record, load_file(out / "vanilla" / "s1-inc" / "model.safetensors")


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_run_keeps_the_best_validation_epoch_and_records_it(toy_run, tmp_path, monkeypatch):
    protocol, root = toy_run
    scores = {1: [0.2, 0.5, 0.4, 0.3]}
    monkeypatch.setattr(ModelSelection, "score", lambda self, state, splits: scores[state.session.index][state.epoch])
    snapshots = Snapshots()
    _, record, saved = _run(protocol, root, tmp_path / "run", snapshots)
    assert record["selection"] == {
        "mode": "best_val_new",
        "epoch": 1,
        "score": 0.5,
        "kept": "best validation",
        "history": [[0, 0.2], [1, 0.5], [2, 0.4], [3, 0.3]],
    }
    assert _same(saved, snapshots.weights[1])  # epoch 1's weights are the session's model
    assert not _same(saved, snapshots.weights[3])  # (and not the last epoch's: training changed them)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["sessions"][1]["validation"] == ["s1-inc/validation/00000", "s1-inc/validation/00001"]


def test_resume_after_the_best_epoch_keeps_it(toy_run, tmp_path, monkeypatch):
    protocol, root = toy_run
    scores = [0.2, 0.5, 0.4, 0.3]
    monkeypatch.setattr(
        ModelSelection, "score", lambda self, state, splits: scores[state.epoch] if state.session.index else 0.0
    )
    snapshots = Snapshots()
    expected, reference, reference_model = _run(protocol, root, tmp_path / "reference", snapshots)
    broken = tmp_path / "broken"
    with pytest.raises(Stop):  # killed before epoch 3: the checkpoint after epoch 2 holds a model that is not the best
        _run(protocol, root, broken, StopBefore(3))
    progress = broken / "vanilla" / "s1-inc" / "progress.safetensors"
    assert progress.exists()
    resumed_results, resumed, resumed_model = _run(protocol, root, broken)
    assert resumed["selection"] == reference["selection"] and resumed["selection"]["epoch"] == 1
    assert json.dumps(resumed_results, sort_keys=True) == json.dumps(expected, sort_keys=True)
    assert _same(resumed_model, reference_model) and _same(resumed_model, snapshots.weights[1])
    assert not progress.exists()


def test_validation_scores_the_kept_model_and_leaves_training_untouched(toy_run, tmp_path):
    protocol, root = toy_run
    last, selected = Snapshots(), Snapshots()
    _, record_last, _ = _run(protocol, root, tmp_path / "last", last, selection="last")
    _, record, saved = _run(protocol, root, tmp_path / "selected", selected, selection="best_val_all")
    assert "selection" not in record_last
    # scoring the validation samples draws no random numbers and changes no weights: epoch by epoch the
    # models are those of a run that keeps the last epoch
    assert last.weights.keys() == selected.weights.keys()
    assert all(_same(last.weights[e], selected.weights[e]) for e in last.weights)
    selection = record["selection"]
    finite = [(s, -e) for e, s in selection["history"] if math.isfinite(s)]
    assert selection["history"] and [e for e, _ in selection["history"]] == [0, 1, 2, 3]
    assert (selection["score"], -selection["epoch"]) == max(finite)
    # the recorded score is that of the saved model, scored again from scratch on every session's validation samples
    config = resolve_config(protocol.training, "toy-selection.yaml")
    data = load_sessions(protocol, root / "cache", echo=_quiet)
    seen = protocol.seen_classes(1)
    model = create_segmenter(
        config.backbone, 2, 1, len(seen), cosine=config.classifier == "cosine", **config.backbone_args
    )
    model.load_state_dict(saved)
    result = evaluate(model, [d.validation for d in data], seen, torch.device("cpu"), batch_size=config.batch_size)
    assert summarise(result.dice, [c for c in seen if c], [])["all"] == selection["score"]


# --------------------------------------------------------------------------------------------- dataset protocols


# Sample -> (split, native labels). Class 2 (native 2) is in a, b, c, g, i; class 3 in c, d, e, h, i.
FAKE = {
    "a": ("train", [1, 2]),
    "b": ("train", [2]),
    "c": ("train", [2, 3]),
    "d": ("train", [1, 3]),
    "e": ("train", [3, 4]),
    "f": ("train", [1]),
    "g": ("train", [2]),
    "h": ("train", [3]),
    "i": ("train", [2, 3]),
    "k": ("train", [1]),
    "t1": ("test", [1, 2]),
    "t2": ("test", [3]),
    "u1": ("nolabel", []),
}


def _ids(split):
    return sorted(i.split("/", 2)[-1] for i in split.ids) if split is not None else None


def test_dataset_validation_is_disjoint_from_shots_test_and_pool_and_leaves_them_unchanged(tmp_path):
    root = write_fake(tmp_path / "fake", FAKE)

    def load(**overrides):
        protocol = parse_protocol(fake_protocol(**overrides), "fake.yaml")
        return load_real(protocol, {"fakeroot": root}, tmp_path / "cache", echo=_quiet)

    plain, _ = load(unlabelled=2)
    data, manifest = load(unlabelled=2, validation=2)
    inc, before = data[1], plain[1]
    # the K shots, the test samples and the unlabelled pool are those of V = 0
    assert (inc.train.ids, inc.test.ids, inc.unlabelled.ids) == (
        before.train.ids,
        before.test.ids,
        before.unlabelled.ids,
    )
    val = _ids(inc.validation)
    presence = {k: set(v[1]) for k, v in FAKE.items()}
    for native in (2, 3):  # at least V = 2 validation samples contain each taught class
        assert sum(native in presence[i] for i in val) >= 2
    assert not set(val) & (set(_ids(inc.train)) | set(_ids(inc.test)) | set(_ids(inc.unlabelled)))
    assert data[0].validation is None and manifest["sessions"][0].get("validation") is None
    assert manifest["sessions"][1]["validation"] == inc.validation.ids
    # validation labels are the session's full ground truth in global ids, as the test split's
    assert set(np.unique(np.asarray(inc.validation.labels[0])).tolist()) <= {0, 1, 2, 3, 255}

    # the manifest round-trips through --split-manifest; without its validation lists (an older manifest) it loads
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    protocol = parse_protocol(fake_protocol(unlabelled=2, validation=2), "fake.yaml")
    reused, _ = load_real(protocol, {"fakeroot": root}, tmp_path / "cache", echo=_quiet, split_manifest=path)
    assert reused[1].validation.ids == inc.validation.ids
    old = json.loads(path.read_text())
    del old["sessions"][1]["validation"]
    path.write_text(json.dumps(old))
    reused, _ = load_real(protocol, {"fakeroot": root}, tmp_path / "cache", echo=_quiet, split_manifest=path)
    assert reused[1].validation is None and reused[1].train.ids == inc.train.ids

    def broken(edit, fragment, proto=protocol):
        m = json.loads(json.dumps(manifest))
        edit(m)
        path.write_text(json.dumps(m))
        with pytest.raises(DataError) as info:
            load_real(proto, {"fakeroot": root}, tmp_path / "cache", echo=_quiet, split_manifest=path)
        assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)

    broken(lambda m: m["sessions"][1]["validation"].append(m["sessions"][1]["train"][0]), "is also a training sample")
    broken(lambda m: m["sessions"][1]["validation"].append("fake/test/t1"), "is also a test sample")
    broken(lambda m: m["sessions"][1].update(validation="fake/train/a"), "must be a list of sample ids")
    no_val = parse_protocol(fake_protocol(unlabelled=2), "fake.yaml")
    broken(lambda m: None, "the protocol asks for none (validation=0)", no_val)


def test_dataset_base_session_takes_validation_first_and_a_shortfall_is_a_warning(tmp_path):
    root = write_fake(tmp_path / "fake", FAKE)
    spec = fake_protocol()
    spec["sessions"][0]["validation"] = 1
    protocol = parse_protocol(spec, "fake.yaml")
    data, _ = load_real(protocol, {"fakeroot": root}, tmp_path / "cache", echo=_quiet)
    base_val, base_train = _ids(data[0].validation), _ids(data[0].train)
    # shots "all" (no cap): one sample with class 1 is held out for validation, training gets the others
    assert len(base_val) == 1 and base_val[0] in {"a", "d", "f", "k"}
    assert sorted(base_val + base_train) == ["a", "d", "f", "k"]
    # never more than half the samples showing the session's classes: training keeps the other half
    spec["sessions"][0]["validation"] = 3
    lines = []
    data, _ = load_real(parse_protocol(spec, "fake.yaml"), {"fakeroot": root}, tmp_path / "cache", echo=lines.append)
    assert len(data[0].validation) == 2 and len(data[0].train) == 2
    assert not set(data[0].validation.ids) & set(data[0].train.ids)
    assert any("session 0 (base): class 1 (one) is in only 2 validation sample(s)" in line for line in lines)

    too_many = parse_protocol(fake_protocol(validation=9), "fake.yaml")
    lines = []
    data, _ = load_real(too_many, {"fakeroot": root}, tmp_path / "cache", echo=lines.append)
    assert any(
        "warning: session 1 (inc): class 2 (two)" in line and "fewer than validation=9" in line for line in lines
    )
    assert len(data[1].validation) > 0  # the session keeps what there is
    report = check_protocol(too_many, {"fakeroot": root}, cache_dir=tmp_path / "cache", echo=_quiet)
    assert report.ok and any("fewer than validation=9" in w for w in report.warnings)
    row = next(line for line in report.lines() if line.startswith("  1 inc"))
    assert row.endswith(f", validation {len(data[1].validation)}")


def test_a_run_folder_written_before_validation_samples_still_resumes(tmp_path):
    protocol = parse_protocol(_toy(None), "toy.yaml")
    config = resolve_config(protocol.training, "toy.yaml")
    resolved = json.loads(json.dumps(dataclasses.asdict(protocol), default=list))
    for session in resolved["sessions"]:
        del session["validation"]  # as written by jascl before the key existed
    (tmp_path / "protocol-resolved.json").write_text(json.dumps(resolved))
    check_reusable(tmp_path, config, protocol)
    with pytest.raises(ConfigError, match="different protocol \\(sessions\\)"):
        check_reusable(tmp_path, config, parse_protocol(_toy(1), "toy.yaml"))
