"""Optimiser choice and the poly learning-rate schedule: rates per epoch by hand, resume continues the
schedule exactly, bad values are one-line errors, and older run folders without these keys stay reusable."""

import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import toy_protocol_dict
from jascl.data.sessions import load_sessions
from jascl.engine.config import resolve_config
from jascl.errors import ConfigError
from jascl.experiments.runner import check_reusable, ensure_base, run_benchmark
from jascl.methods import Plugin
from jascl.protocols import parse_protocol


class RecordLR(Plugin):
    """Records (session, epoch, optimiser class, every group's lr) at each epoch's start."""

    name = "record-lr"

    def __init__(self, log):
        self.log = log

    def before_epoch(self, state):
        self.log.append(
            (
                state.session.index,
                state.epoch,
                type(state.optimizer).__name__,
                [g["lr"] for g in state.optimizer.param_groups],
            )
        )


class Stop(Exception):
    pass


class StopBefore(Plugin):
    name = "stop"

    def before_epoch(self, state):
        if state.session.index == 1 and state.epoch == 2:
            raise Stop


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    spec = toy_protocol_dict(2)
    spec["training"].update(epochs_incremental=4, lr_incremental=0.02)
    protocol = parse_protocol(spec, source="toy-sched.yaml")
    root = tmp_path_factory.mktemp("sched")
    data = load_sessions(protocol, root / "cache", echo=lambda *a: None)
    return protocol, data, root


def _config(protocol, *overrides):
    return resolve_config(protocol.training, "toy-sched.yaml", overrides=list(overrides))


def _run(protocol, config, name, out, root, *plugins):
    return run_benchmark(
        protocol,
        config,
        [name],
        out,
        cache_dir=root / "cache",
        progress=False,
        echo=lambda *a: None,
        extra_plugins=plugins,
    )


def test_poly_schedule_rates_by_hand_and_adam(toy, tmp_path):
    protocol, data, root = toy
    config = _config(protocol, "lr_schedule=poly", "lr_power=0.9", "optimizer=adam")
    log = []
    _run(protocol, config, "vanilla", tmp_path / "run", root, RecordLR(log))
    incremental = [(epoch, opt, lrs) for session, epoch, opt, lrs in log if session == 1]
    assert [e for e, _, _ in incremental] == [0, 1, 2, 3]
    assert {opt for _, opt, _ in incremental} == {"Adam"}
    # lr_incremental * (1 - e / 4) ** 0.9: 0.02, 0.015438, 0.010718, 0.005743
    expected = [0.02, 0.02 * 0.75**0.9, 0.02 * 0.5**0.9, 0.02 * 0.25**0.9]
    assert [lrs[0] for _, _, lrs in incremental] == pytest.approx(expected, rel=1e-12)
    assert [round(v, 6) for v in expected] == [0.02, 0.015438, 0.010718, 0.005743]


def test_constant_schedule_leaves_rates_alone(toy, tmp_path):
    protocol, data, root = toy
    log = []
    _run(protocol, _config(protocol), "vanilla", tmp_path / "run", root, RecordLR(log))
    assert {(opt, lrs[0]) for session, _, opt, lrs in log if session == 1} == {("SGD", 0.02)}


def test_resume_continues_the_poly_schedule_bit_identically(toy, tmp_path):
    protocol, data, root = toy
    config = _config(protocol, "lr_schedule=poly", "optimizer=adamw")
    ensure_base(protocol, config, data, root / "base-poly", progress=False, echo=lambda *a: None)
    reference, broken = tmp_path / "reference", tmp_path / "broken"
    for out in (reference, broken):
        shutil.copytree(root / "base-poly", out / "base")
    expected = _run(protocol, config, "jascl", reference, root)
    with pytest.raises(Stop):
        _run(protocol, config, "jascl", broken, root, StopBefore())
    resumed = _run(protocol, config, "jascl", broken, root)
    assert resumed["methods"]["jascl"] == expected["methods"]["jascl"]
    left = load_file(str(reference / "jascl" / "s1-inc" / "model.safetensors"))
    right = load_file(str(broken / "jascl" / "s1-inc" / "model.safetensors"))
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.parametrize(
    "override, key",
    [("optimizer=rmsprop", "optimizer"), ("lr_schedule=cosine", "lr_schedule"), ("lr_power=0", "lr_power")],
)
def test_bad_values_are_one_line_errors(toy, override, key):
    protocol, _, _ = toy
    with pytest.raises(ConfigError) as info:
        _config(protocol, override)
    message = str(info.value)
    assert "\n" not in message and f"{key}:" in message, message


def test_run_folder_from_before_these_keys_is_still_reusable(toy, tmp_path):
    protocol, _, _ = toy
    config = _config(protocol)
    old = config.to_dict()
    for key in ("optimizer", "lr_schedule", "lr_power"):
        del old[key]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    check_reusable(tmp_path, config, protocol)  # defaults: same results as before the keys existed
    with pytest.raises(ConfigError, match="lr_schedule"):
        check_reusable(tmp_path, _config(protocol, "lr_schedule=poly"), protocol)
