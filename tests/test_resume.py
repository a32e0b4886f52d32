"""Crash-safe resume: a session interrupted after an epoch and resumed from its in-session checkpoint
ends bit-identically to an uninterrupted one, for every registered method (so every plugin's state is
in the checkpoint); progress checkpoints are safetensors and refuse other runs' or pickled files."""

import dataclasses
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_DIFFUSION, toy_protocol_dict
from jascl.data.sessions import load_sessions
from jascl.engine.checkpoint import load_progress, save_progress
from jascl.engine.config import resolve_config
from jascl.engine.plugin import Method
from jascl.engine.snapshot import capture_object, pack, restore_object, unpack
from jascl.errors import CheckpointError, TrainingError
from jascl.experiments.runner import ensure_base, run_benchmark
from jascl.methods import METHODS, Plugin
from jascl.protocols import parse_protocol


class Stop(Exception):
    """Stands in for the process dying."""


class StopBefore(Plugin):
    """Interrupts session ``session`` when epoch ``epoch`` is about to start (its predecessors are checkpointed)."""

    name = "stop"

    def __init__(self, session: int, epoch: int):
        self.session, self.epoch = session, epoch

    def before_epoch(self, state):
        if state.session.index == self.session and state.epoch == self.epoch:
            raise Stop


def _toy_with_base(tmp_path_factory, name: str, **training):
    """The toy protocol with a 4-image pool, 3 incremental epochs, PAS in every epoch, and its base trained once."""
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    spec["training"].update({"epochs_incremental": 3, "augment": True, **training})
    protocol = parse_protocol(spec, source=f"{name}.yaml")
    config = resolve_config(
        protocol.training, f"{name}.yaml", overrides=["pas.start_epoch=0", "pas.every=1", *TINY_DIFFUSION]
    )
    root = tmp_path_factory.mktemp(name)
    data = load_sessions(protocol, root / "cache", echo=lambda *a: None)
    ensure_base(protocol, config, data, root / "base", progress=False, echo=lambda *a: None)
    return protocol, config, root


@pytest.fixture(scope="module")
def toy_resume(tmp_path_factory):
    return _toy_with_base(tmp_path_factory, "toy-resume")


@pytest.fixture(scope="module")
def toy_resume_short(tmp_path_factory):
    """Two incremental epochs: what the every-method resume tests need (an epoch before the stop, one after)."""
    return _toy_with_base(tmp_path_factory, "toy-resume-short", epochs_incremental=2)


def _run(protocol, config, method, out, root, *plugins):
    """Run one method (a registered name or a :class:`Method`), with ``plugins`` added after its own."""
    return run_benchmark(
        protocol,
        config,
        [method],
        out,
        cache_dir=root / "cache",
        progress=False,
        echo=lambda *a: None,
        extra_plugins=plugins,
    )


@pytest.mark.parametrize("name", METHODS.list())
def test_interrupted_session_resumes_bit_identically(name, toy_resume_short, tmp_path):
    protocol, config, root = toy_resume_short
    reference, broken = tmp_path / "reference", tmp_path / "broken"
    for out in (reference, broken):
        shutil.copytree(root / "base", out / "base")
    expected = _run(protocol, config, name, reference, root)

    with pytest.raises(Stop):
        _run(protocol, config, name, broken, root, StopBefore(1, 1))
    progress = broken / name / "s1-inc" / "progress.safetensors"
    assert progress.exists() and not (broken / name / "s1-inc" / "metrics.json").exists()
    meta, _ = load_progress(progress)
    assert meta["epoch"] == 0 and meta["method"] == name

    resumed = _run(protocol, config, name, broken, root)
    assert json.dumps(resumed, sort_keys=True) == json.dumps(expected, sort_keys=True)
    assert (broken / "results.json").read_text() == (reference / "results.json").read_text()
    a = load_file(reference / name / "s1-inc" / "model.safetensors")
    b = load_file(broken / name / "s1-inc" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not progress.exists(), "a complete session keeps no progress checkpoint"


class StopAtStep(Plugin):
    """Interrupts session ``session`` in its ``step``-th optimiser step of epoch ``epoch`` (before that step is
    checkpointed)."""

    name = "stop-step"

    def __init__(self, session: int, epoch: int, step: int):
        self.session, self.epoch, self.step, self.seen = session, epoch, step, 0

    def after_update(self, state):
        if state.session.index == self.session and state.epoch == self.epoch:
            self.seen += 1
            if self.seen == self.step:
                raise Stop


@pytest.fixture(scope="module")
def toy_steps(tmp_path_factory):
    """The resume protocol with one sample per batch: session 1's epochs have several steps."""
    return _toy_with_base(tmp_path_factory, "toy-steps", batch_size=1)


@pytest.fixture(scope="module")
def toy_steps_short(tmp_path_factory):
    """``toy_steps`` with two incremental epochs (the every-method test stops inside the second)."""
    return _toy_with_base(tmp_path_factory, "toy-steps-short", batch_size=1, epochs_incremental=2)


@pytest.mark.parametrize("name", METHODS.list())
def test_session_interrupted_inside_an_epoch_resumes_there_bit_identically(name, toy_steps_short, tmp_path):
    protocol, config, root = toy_steps_short
    stepped = dataclasses.replace(config, checkpoint_steps=1)
    reference, broken = tmp_path / "reference", tmp_path / "broken"
    for out in (reference, broken):
        shutil.copytree(root / "base", out / "base")
    expected = _run(protocol, config, name, reference, root)  # no checkpoints inside epochs

    with pytest.raises(Stop):
        _run(protocol, stepped, name, broken, root, StopAtStep(1, 1, 3))
    meta, _ = load_progress(broken / name / "s1-inc" / "progress.safetensors")
    if METHODS.get(name)(config).mid_epoch_blockers():
        assert (meta["epoch"], meta.get("step")) == (0, None)  # this method keeps to epoch ends
    else:
        assert (meta["epoch"], meta.get("step")) == (1, 2)

    resumed = _run(protocol, stepped, name, broken, root)
    assert json.dumps(resumed, sort_keys=True) == json.dumps(expected, sort_keys=True)
    a = load_file(reference / name / "s1-inc" / "model.safetensors")
    b = load_file(broken / name / "s1-inc" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_registered_method_keeps_to_epoch_ends(toy_steps):
    """Every built-in plugin that sets an epoch up declares that its set-up is checkpointed (a new one that does not
    silently loses mid-epoch checkpoints: this test names it)."""
    _, config, _ = toy_steps
    assert {
        name: METHODS.get(name)(config).mid_epoch_blockers()
        for name in METHODS.list()
        if METHODS.get(name)(config).mid_epoch_blockers()
    } == {}


class EpochCache(Plugin):
    """Sets something up per epoch that no checkpoint holds (does not declare mid_epoch_resume)."""

    name = "epoch-cache"

    def before_epoch(self, state):
        self.cache = iter(range(3))


def test_a_plugin_that_cannot_resume_inside_an_epoch_keeps_checkpoints_at_epoch_ends(toy_steps, tmp_path, caplog):
    protocol, config, root = toy_steps
    stepped = dataclasses.replace(config, checkpoint_steps=1)
    out = tmp_path / "run"
    shutil.copytree(root / "base", out / "base")
    with pytest.raises(Stop):
        _run(protocol, stepped, Method("vanilla", [EpochCache(), StopAtStep(1, 1, 3)]), out, root)
    assert (
        "vanilla session 1: checkpoint_steps=1 ignored, checkpoints at epoch ends only: plugin(s) epoch-cache "
        "cannot resume inside an epoch" in caplog.text
    )
    meta, _ = load_progress(out / "vanilla" / "s1-inc" / "progress.safetensors")
    assert (meta["epoch"], meta.get("step")) == (0, None)


def test_a_checkpoint_inside_an_epoch_is_refused_by_a_method_that_cannot_resume_there(toy_steps, tmp_path):
    protocol, config, root = toy_steps
    stepped = dataclasses.replace(config, checkpoint_steps=1)
    out = tmp_path / "run"
    shutil.copytree(root / "base", out / "base")
    with pytest.raises(Stop):
        _run(protocol, stepped, "vanilla", out, root, StopAtStep(1, 1, 3))
    progress = out / "vanilla" / "s1-inc" / "progress.safetensors"
    assert load_progress(progress)[0]["step"] == 2
    with pytest.raises(
        CheckpointError,
        match=r"progress.safetensors: taken inside epoch 1, but plugin\(s\) "
        r"epoch-cache of vanilla cannot resume there; delete it",
    ):
        _run(protocol, stepped, "vanilla", out, root, EpochCache())
    assert progress.exists(), "the refused checkpoint is kept"


def test_a_step_checkpoint_due_at_an_epoch_end_is_written_as_that_epoch_s(toy_steps, tmp_path):
    protocol, config, root = toy_steps

    class Count(Plugin):
        name = "count"
        steps = {}

        def after_update(self, state):
            if state.session.index == 1:
                Count.steps[state.epoch] = Count.steps.get(state.epoch, 0) + 1

    out = tmp_path / "count"
    shutil.copytree(root / "base", out / "base")
    _run(protocol, config, "vanilla", out, root, Count())
    n = Count.steps[0]
    assert n >= 3 and set(Count.steps.values()) == {n}

    # checkpoint_every=0: no epoch checkpoints of their own; the n-th step, the epoch's last, is due
    stepped = dataclasses.replace(config, checkpoint_every=0, checkpoint_steps=n)
    out = tmp_path / "run"
    shutil.copytree(root / "base", out / "base")
    with pytest.raises(Stop):
        _run(protocol, stepped, "vanilla", out, root, StopAtStep(1, 1, 2))
    meta, _ = load_progress(out / "vanilla" / "s1-inc" / "progress.safetensors")
    assert (meta["epoch"], meta.get("step")) == (0, None)


def test_non_finite_loss_stops_the_session_and_keeps_the_last_good_checkpoint(toy_resume, tmp_path):
    protocol, config, root = toy_resume

    class PoisonAt(Plugin):
        name = "poison"
        first_ids = None

        def after_forward(self, state):
            if state.session.index == 1 and state.epoch == 2:
                state.losses["poison"] = torch.tensor(float("nan"))
                if self.first_ids is None:
                    self.first_ids = list(state.batch["id"])

    out = tmp_path / "run"
    shutil.copytree(root / "base", out / "base")
    poison = PoisonAt()
    with pytest.raises(TrainingError) as info:
        _run(protocol, config, "vanilla", out, root, poison)
    assert poison.first_ids and all(isinstance(i, str) for i in poison.first_ids)
    assert str(info.value).startswith(
        "vanilla session 1 (inc) epoch 2: the training loss became nan, first at step 1 of the epoch, in the "
        f"batch of samples {', '.join(poison.first_ids)}; the session stopped and its last good checkpoint "
        "(after epoch 1)"
    )
    assert "check those samples ('jascl data check')" in str(info.value)
    meta, payload = load_progress(out / "vanilla" / "s1-inc" / "progress.safetensors")
    assert meta["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in payload["model"].values())
    assert TrainingError.exit_code == 3


def test_non_finite_loss_inside_an_epoch_is_never_checkpointed(toy_steps, tmp_path):
    protocol, config, root = toy_steps

    class PoisonStep(Plugin):
        name = "poison"
        seen = 0

        def after_forward(self, state):
            if state.session.index == 1 and state.epoch == 1:
                self.seen += 1
                if self.seen == 2:
                    state.losses["poison"] = torch.tensor(float("inf"))

    out = tmp_path / "run"
    shutil.copytree(root / "base", out / "base")
    with pytest.raises(
        TrainingError,
        match=r"vanilla session 1 \(inc\) epoch 1: the training loss became inf, first at step 2 of the epoch, "
        r"in the batch of samples [^;]+; the session stopped and its last good checkpoint \(inside epoch 1, after "
        r"step 1\) is kept",
    ):
        _run(protocol, dataclasses.replace(config, checkpoint_steps=1), "vanilla", out, root, PoisonStep())
    meta, payload = load_progress(out / "vanilla" / "s1-inc" / "progress.safetensors")
    assert (meta["epoch"], meta["step"]) == (1, 1)
    assert all(torch.isfinite(v).all() for v in payload["model"].values())


def test_progress_checkpoint_from_another_run_is_refused(tmp_path):
    path = tmp_path / "progress.safetensors"
    save_progress(path, {"protocol": "toy-2d", "backbone": "unet", "session": 1}, {"epoch": 0, "w": torch.ones(2)})
    meta, payload = load_progress(path, {"protocol": "toy-2d", "backbone": "unet"})
    assert payload["epoch"] == 0 and torch.equal(payload["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match="made for backbone 'unet', but this run has backbone 'swinunetr'"):
        load_progress(path, {"protocol": "toy-2d", "backbone": "swinunetr"})
    with pytest.raises(CheckpointError, match="made for protocol 'toy-2d', but this run has protocol 'other'"):
        load_progress(path, {"protocol": "other"})


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_pickled_progress_checkpoint_is_refused_without_running_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "progress.safetensors"
    path.write_bytes(pickle.dumps({"model": _Evil()}))
    with pytest.raises(CheckpointError, match="not a readable jascl progress checkpoint"):
        load_progress(path)
    torch.save({"model": _Evil()}, tmp_path / "p2.safetensors")
    with pytest.raises(CheckpointError):
        load_progress(tmp_path / "p2.safetensors")
    assert not (tmp_path / "pwned").exists()


def test_pack_roundtrip_keeps_structure_types_and_int_keys():
    state = {
        "state": {0: {"momentum_buffer": torch.arange(3.0)}, 5: {"step": torch.tensor(2.0)}},
        "param_groups": [{"lr": 0.01, "params": [0, 5], "nesterov": True, "betas": (0.9, 0.99)}],
        "none": None,
        "nan": float("nan"),
        "array": torch.zeros(0).numpy(),
    }
    tensors = {}
    skeleton = pack(state, "p", tensors)
    json.dumps(skeleton)  # the skeleton is plain JSON
    back = unpack(json.loads(json.dumps(skeleton)), tensors)
    assert set(back["state"]) == {0, 5} and torch.equal(back["state"][0]["momentum_buffer"], torch.arange(3.0))
    assert back["param_groups"][0]["betas"] == (0.9, 0.99) and back["param_groups"][0]["params"] == [0, 5]
    assert back["none"] is None and back["nan"] != back["nan"]


def test_capture_restores_generators_counters_and_modules_in_place():
    import numpy as np

    from jascl.methods.pas import FilterCounters

    class P(Plugin):
        def __init__(self):
            self.g = torch.Generator().manual_seed(1)
            self.rng = np.random.default_rng(2)
            self.counts = FilterCounters()
            self.teacher = torch.nn.Linear(2, 2)
            self.items = [torch.ones(2), 3]
            self.loader = iter([])  # not data: left to the session to rebuild

    a = P()
    torch.rand(3, generator=a.g), a.rng.random()
    a.counts.update(torch.tensor([True, False]), torch.tensor([1, 1]), torch.tensor([1, 2]))
    snap = capture_object(a)
    assert "loader" not in snap
    expected = (torch.rand(2, generator=a.g), a.rng.random())
    b = P()
    teacher = b.teacher
    restore_object(b, unpack(json.loads(json.dumps(pack(snap, "p", tensors := {}))), tensors))
    assert b.teacher is teacher and torch.equal(b.teacher.weight, a.teacher.weight)
    assert torch.equal(torch.rand(2, generator=b.g), expected[0]) and b.rng.random() == expected[1]
    assert (b.counts.stats().kept, b.counts.stats().correct, b.counts.total) == (1, 1, 2)
