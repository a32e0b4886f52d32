"""The ``authors`` configuration preset: the preset as data, and each item of the authors' training path by hand.

Every item has a test that fails when the item is dropped: the preset must set its keys, and each key must
change what the loop computes in the way the authors' code does.
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from jascl.data.synthetic import load_or_generate
from jascl.engine.config import RunConfig, resolve_config
from jascl.engine.config_presets import AUTHORS, preset_mapping
from jascl.engine.defaults import ClassifierGrowth, session_loss
from jascl.engine.loop import ContinualTrainer
from jascl.engine.losses import SegmentationLoss, authors_class_weights
from jascl.engine.prototypes import PrototypeStore, class_prototypes, per_sample_prototypes
from jascl.errors import ConfigError
from jascl.methods import Method, Plugin
from jascl.methods.gas import attach_gas
from jascl.methods.gas_plugin import GASPlugin
from jascl.methods.mean_teacher import TeacherPhases
from jascl.methods.options import read_options
from jascl.methods.presets import JasclOptions
from jascl.methods.registry import create_method
from jascl.methods.replay import PrototypeReplayPlugin, base_sample_indices, prototype_replay_loss
from jascl.networks.classifier import PixelClassifier
from jascl.protocols.schema import IGNORE_INDEX

# ------------------------------------------------------------------ the preset as configuration


def _flat(mapping, prefix=""):
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _value(cfg: RunConfig, key: str):
    if key.startswith("method_args."):
        node = cfg.method_args
        for part in key.split(".")[1:]:
            node = node.get(part, None) if isinstance(node, dict) else None
        return node
    return getattr(cfg, key)


def test_preset_sets_every_item_and_each_key_changes_the_default():
    plain, preset = resolve_config(), resolve_config(overrides=["preset=authors"])
    assert preset.preset == "authors" and plain.preset is None
    keys = [k for item in AUTHORS for k in item.values]
    assert len(keys) == len(set(keys)) >= 11
    jascl_plain, jascl_preset = read_options(JasclOptions, plain, "jascl"), read_options(JasclOptions, preset, "jascl")
    for item in AUTHORS:
        for key, value in item.values.items():
            assert _value(preset, key) == value, key
            if key.startswith("method_args.jascl."):  # the method's options read it, and it is not the default
                path = key.split(".")[2:]
                got = jascl_preset
                default = jascl_plain
                for part in path:
                    got, default = getattr(got, part), getattr(default, part)
                assert got == value and default != value, key
            else:
                assert getattr(plain, key) != value, key
    # every item is documented in full
    assert all(item.item and item.preset and item.default and item.why for item in AUTHORS)


def test_preset_layering_and_errors():
    # protocol < preset < --set: the protocol's own model_selection is overridden by the preset, --set wins over it
    cfg = resolve_config({"model_selection": "last", "epochs_base": 3}, overrides=["preset=authors", "dice=monai"])
    assert cfg.model_selection == "best_val_new" and cfg.dice == "monai" and cfg.epochs_base == 3
    assert cfg.class_weights == "authors"
    # a protocol may name the preset itself
    assert resolve_config({"preset": "authors"}).frozen_mode == "train"
    with pytest.raises(ConfigError, match="preset 'nope': unknown; presets: authors"):
        resolve_config(overrides=["preset=nope"])
    # each key on its own
    assert resolve_config(overrides=["frozen_mode=train"]).class_weights == "none"
    with pytest.raises(ConfigError, match="frozen_mode: must be one of eval, train"):
        resolve_config(overrides=["frozen_mode=frozen"])
    with pytest.raises(ConfigError, match="lambda_ce_base: must be a number >= 0 or null"):
        resolve_config(overrides=["lambda_ce_base=-1"])
    assert preset_mapping("authors")["method_args"]["jascl"]["replay"]["base_samples"] == 10


def test_preset_file_round_trip(tmp_path):
    """A run folder's config.yaml (the resolved values, preset included) resolves to the same configuration."""
    import yaml

    cfg = resolve_config({"epochs_base": 3}, overrides=["preset=authors", "lambda_ce_base=0.7"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert resolve_config({"epochs_base": 3}, config_file=path) == cfg


@pytest.mark.parametrize(
    ("protocol", "weight"),
    [
        ("med-disjoint", 0.1), ("med-mixed", 0.1), ("med-ss", 0.1),  # the authors' medical code
        ("natural", 0.2), ("natural-cil", 0.2), ("natural-dil", 0.2), ("natural-cdil", 0.2),  # natural code
        ("natural-ss", 0.01),  # natural semi-supervised code
        ("synthetic-3d", 0.03),  # jascl's trade-off, kept under the preset
    ],
)  # fmt: skip
def test_the_l_proto_weight_under_the_preset_is_the_protocols(protocol, weight):
    """The L_proto weight item: the preset leaves the weight to the protocol, and the paper protocols carry the
    authors' weight of their domain; ``--set`` gives synthetic-3d the medical 0.1."""
    from jascl.protocols import get_protocol

    spec = get_protocol(protocol)
    cfg = resolve_config(spec.training, spec.path, overrides=["preset=authors"])
    assert read_options(JasclOptions, cfg, "jascl").replay.weight == weight
    if protocol == "synthetic-3d":
        cfg = resolve_config(
            spec.training, spec.path, overrides=["preset=authors", "method_args.jascl.replay.weight=0.1"]
        )
        assert read_options(JasclOptions, cfg, "jascl").replay.weight == 0.1


# ------------------------------------------------------------------ item 1: replay prototype values


def _one_sample():
    # D = 2, a 2x2 map in raster order: labels 1, 1, 0, ignore; pixel features (3, 4), (1, 0), (0, 2), (5, 5)
    f = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    return f.t().reshape(1, 2, 2, 2), torch.tensor([[1, 1, 0, IGNORE_INDEX]]).reshape(1, 2, 2)


def test_authors_prototype_values_by_hand():
    feats, labels = _one_sample()
    r = 0.5**0.5
    # authors: unit pixels (0.6, 0.8), (1, 0) -> mean (0.8, 0.4), NOT renormalised
    assert torch.allclose(class_prototypes(feats, labels, [1], form="authors")[1], torch.tensor([0.8, 0.4]))
    # eq. 2: raw mean (2, 2) -> unit (r, r)
    assert torch.allclose(class_prototypes(feats, labels, [1])[1], torch.tensor([r, r]))
    # complement, authors: every pixel that is not 1, ignore included: unit (0, 1) and (r, r) -> ((r)/2, (1 + r)/2)
    comp = class_prototypes(feats, labels, [1], complement=True, form="authors")[1]
    assert torch.allclose(comp, torch.tensor([r / 2, (1 + r) / 2]))
    # complement, eq. 2: ignore left out: (0, 2) -> (0, 1)
    assert torch.allclose(class_prototypes(feats, labels, [1], complement=True)[1], torch.tensor([0.0, 1.0]))
    # over two samples the per-sample means are averaged as they are: ((0.8, 0.4) + (0, 1)) / 2
    f2 = torch.cat([feats, torch.tensor([[0.0, 0.0], [0.0, 3.0], [1.0, 0.0], [1.0, 0.0]]).t().reshape(1, 2, 2, 2)])
    l2 = torch.cat([labels, torch.tensor([[0, 1, 0, 0]]).reshape(1, 2, 2)])
    assert torch.allclose(class_prototypes(f2, l2, [1], form="authors")[1], torch.tensor([0.4, 0.7]))
    # a sample made of class c (and ignore) only does not count for the authors (they need c and not-c pixels)
    only = torch.tensor([[[1, 1], [1, 1]]])
    assert per_sample_prototypes(feats, only, [1], form="authors")[1] == []
    assert len(per_sample_prototypes(feats, only, [1])[1]) == 1
    with pytest.raises(ValueError, match="prototype form must be one of eq2, authors"):
        per_sample_prototypes(feats, labels, [1], form="paper")


def test_base_sample_indices():
    assert base_sample_indices(4, 0, 1024, 0, 1).tolist() == [0, 1, 2, 3]
    assert base_sample_indices(4, 10, 1024, 0, 1).tolist() == [0, 1, 2, 3]
    chosen = base_sample_indices(40, 10, 1024, 0, 1)
    assert len(set(chosen.tolist())) == 10 and chosen.tolist() == sorted(chosen.tolist()) and chosen.max() < 40
    assert torch.equal(chosen, base_sample_indices(40, 10, 1024, 0, 1))  # seeded
    assert not torch.equal(chosen, base_sample_indices(40, 10, 1024, 0, 2))  # per class


def test_replay_values_authors_replays_its_own_prototypes():
    """values=authors: the plugin's own (session, class) prototypes and complements, 10 of the base samples."""
    per_sample = {1: torch.arange(24.0).reshape(12, 2), 2: torch.ones(3, 2)}
    complement = {1: -torch.arange(24.0).reshape(12, 2), 2: -torch.ones(3, 2)}
    calls = []

    def compute(classes, per_sample=False, complement=False, form="eq2"):
        calls.append((tuple(classes), per_sample, complement, form))
        return {c: (complements if complement else samples)[c] for c in classes}

    passes = []

    def compute_requests(requests):  # the loop's: several calls in one pass over the data
        passes.append(len(requests))
        return [compute(r.classes, r.per_sample, r.complement, r.form) for r in requests]

    samples, complements = per_sample, complement
    state = SimpleNamespace(
        session=SimpleNamespace(index=0, classes=[1, 2]),
        seed=1024,
        compute_prototypes=compute,
        compute_prototype_requests=compute_requests,
    )
    plugin = PrototypeReplayPlugin(values="authors", base_samples=10)
    plugin.before_eval(state)
    assert calls == [((1, 2), True, False, "authors"), ((1, 2), True, True, "authors")] and passes == [2]
    chosen = base_sample_indices(12, 10, 1024, 0, 1)
    assert torch.allclose(plugin.own[(0, 1)], per_sample[1][chosen].mean(0))
    assert torch.allclose(plugin.complements[(0, 1)], complement[1][chosen].mean(0))
    assert torch.allclose(plugin.own[(0, 2)], torch.ones(2)) and torch.allclose(
        plugin.complements[(0, 2)], -torch.ones(2)
    )
    # saved and restored with the session
    other = PrototypeReplayPlugin(values="authors")
    other.load_extra_state(plugin.extra_state())
    assert other.own.keys() == plugin.own.keys() and torch.equal(other.own[(0, 1)], plugin.own[(0, 1)])
    # in session 1 it replays those, not the store's eq. 2 prototypes
    store = SimpleNamespace(before=lambda t: SimpleNamespace(entries={(0, 1): torch.tensor([9.0, 9.0])}))
    classifier = nn.Linear(2, 3, bias=False)
    s1 = SimpleNamespace(
        session=SimpleNamespace(index=1),
        prototypes=store,
        device=torch.device("cpu"),
        model=SimpleNamespace(classifier=classifier),
        class_index=lambda ids: ids,
    )
    plugin.before_session(s1)
    assert plugin._targets.tolist() == [1, 0, 2, 0]
    assert torch.allclose(plugin._protos[0], per_sample[1][chosen].mean(0))


# ------------------------------------------------------------------ item 2: GAS noise draws on replayed prototypes


def test_replay_noise_draws_once_per_prototype():
    torch.manual_seed(0)
    classifier = PixelClassifier(2, 3, cosine=True)
    protos = torch.tensor([[1.0, 0.0]] * 4)  # four identical prototypes, one target
    targets = torch.zeros(4, dtype=torch.long)
    # deterministic classifier: the two modes give the same sum; CE by hand: T * cos(row, p) logits
    rows = torch.nn.functional.normalize(classifier.weight.detach().flatten(1), dim=1)
    logits = 10.0 * rows[:, 0]
    by_hand = 4 * (torch.logsumexp(logits, 0) - logits[0])
    for per_prototype in (False, True):
        got = prototype_replay_loss(classifier, protos, targets, "sum", per_prototype=per_prototype)
        assert torch.allclose(got, by_hand, atol=1e-5)
    # with GAS attached (training mode): one draw shared by the four, or four draws
    attach_gas(classifier)
    classifier.train()
    shared = prototype_replay_loss(classifier, protos, targets, "none", per_prototype=False)
    drawn = prototype_replay_loss(classifier, protos, targets, "none", per_prototype=True)
    assert torch.allclose(shared, shared[0].expand(4)) and not torch.allclose(drawn, drawn[0].expand(4))
    plugin = create_method("jascl", resolve_config(overrides=["preset=authors"]))
    replay = next(p for p in plugin.plugins if isinstance(p, PrototypeReplayPlugin))
    assert (replay.noise_draws, replay.values, replay.base_samples) == ("per-prototype", "authors", 10)


# ------------------------------------------------------------------ item 3: loss weights and Dice form


def _loss_case():
    # two pixels: logits (0, 0) -> p = (1/2, 1/2), target 0; logits (ln 3, 0) -> p = (3/4, 1/4), target 1
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]]).reshape(1, 2, 1, 2)
    return logits, torch.tensor([[[0, 1]]])


def test_authors_loss_by_hand():
    logits, target = _loss_case()
    ce = [math.log(2), math.log(4)]  # -ln p_target per pixel
    w = [0.25, 0.75]
    weighted_ce = (w[0] * ce[0] + w[1] * ce[1]) / (w[0] + w[1])
    s = 1e-5
    # the authors' Dice: per class over the batch, (2 sum p y + s) / (sum p^2 + sum y^2 + s), weighted, / K
    d0 = 1 - (2 * 0.5 + s) / (0.5**2 + 0.75**2 + 1 + s)
    d1 = 1 - (2 * 0.25 + s) / (0.5**2 + 0.25**2 + 1 + s)
    dice = (w[0] * d0 + w[1] * d1) / 2
    authors = resolve_config(overrides=["preset=authors"])
    assert authors_class_weights(3).tolist() == [0.25, 0.75, 0.75]
    incremental = SegmentationLoss.for_session(authors, 1, 2)(logits, target)
    assert incremental.item() == pytest.approx(weighted_ce + dice, rel=1e-5)
    base = SegmentationLoss.for_session(authors, 0, 2)(logits, target)
    assert base.item() == pytest.approx(0.5 * weighted_ce + 0.5 * dice, rel=1e-5)
    # jascl's default: unweighted CE + per-sample Dice (sum p + sum y in the denominator), same in session 0
    dm0 = 1 - (2 * 0.5 + s) / (0.5 + 0.75 + 1 + s)
    dm1 = 1 - (2 * 0.25 + s) / (0.5 + 0.25 + 1 + s)
    default = SegmentationLoss.for_session(resolve_config(), 0, 2)(logits, target)
    assert default.item() == pytest.approx(sum(ce) / 2 + (dm0 + dm1) / 2, rel=1e-5)
    # with an ignore pixel the masked path applies the same weights and Dice form
    ignored = torch.tensor([[[0, IGNORE_INDEX]]])
    one = SegmentationLoss.for_session(authors, 1, 2)(logits, ignored)
    e0 = 1 - (2 * 0.5 + s) / (0.5**2 + 1 + s)
    e1 = 1 - s / (0.5**2 + s)
    assert one.item() == pytest.approx(ce[0] + (w[0] * e0 + w[1] * e1) / 2, rel=1e-4)
    assert session_loss(authors, 1, 2) is session_loss(authors, 1, 2)  # made once


# ------------------------------------------------------------------ item 4: frozen modules' mode


class _Modes(Plugin):
    name = "modes"

    def __init__(self):
        self.seen = []

    def before_iteration(self, state):
        if state.session.index == 1:
            self.seen.append(state.model.backbone.training)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_frozen_modules_mode(toy_protocol, toy_config, tmp_path, mode):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    probe = _Modes()
    config = dataclasses.replace(toy_config, frozen_mode=mode, epochs_base=0)
    trainer = ContinualTrainer(toy_protocol, config, Method("m", [probe]), data, progress=False)
    model = trainer.new_model(3)
    store = PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    trainer.run_session(1, model, store, tmp_path / "s1")
    # 2 epochs x 1 step; the frozen backbone trains in train mode only under frozen_mode=train
    assert probe.seen == [mode == "train"] * 2


# ------------------------------------------------------------------ item 5: the mean teacher's EMA


class _Teacher(TeacherPhases):
    start_epoch, every = 1, 2


def _teacher_state(epoch):
    return SimpleNamespace(epoch=epoch)


@pytest.mark.parametrize("ema", ["step", "phase"])
def test_teacher_ema_per_step_or_per_phase(ema):
    from jascl.methods.pas import EMAPairs

    teacher, student = nn.BatchNorm1d(1), nn.BatchNorm1d(1)
    with torch.no_grad():
        teacher.weight.fill_(0.0)
        student.weight.fill_(1.0)
        student.running_mean.fill_(2.0)
    plugin = _Teacher()
    plugin.ema = ema
    plugin.teacher = teacher
    plugin._ema = EMAPairs(teacher, student.state_dict(), buffers=ema == "step")
    for epoch in range(3):  # epochs 0, 1, 2; epoch 1 is the only unlabelled phase
        for _ in range(2):  # two optimiser steps per epoch
            plugin.after_update(_teacher_state(epoch))
        plugin.after_epoch(_teacher_state(epoch))
    if ema == "step":  # six steps: 1 - 0.99^6, buffers too
        assert teacher.weight.item() == pytest.approx(1 - 0.99**6)
        assert teacher.running_mean.item() == pytest.approx(2 * (1 - 0.99**6))
    else:  # one step at the end of the phase, parameters only
        assert teacher.weight.item() == pytest.approx(0.01)
        assert teacher.running_mean.item() == 0.0
    jascl = create_method("jascl", resolve_config(overrides=["preset=authors"]))
    assert next(p for p in jascl.plugins if isinstance(p, TeacherPhases)).ema == "phase"


# ------------------------------------------------------------------ item 6: GAS at the start of a session


def test_preset_gas_first_step_is_noise_free():
    jascl = create_method("jascl", resolve_config(overrides=["preset=authors"]))
    gas = next(p for p in jascl.plugins if isinstance(p, GASPlugin))
    assert gas.variant == "authors"
    layer = nn.Linear(2, 2, bias=False)
    noise = attach_gas(layer, variant=gas.variant)
    assert torch.equal(noise.scale(), torch.zeros(2, 2))  # float32: 1 + 1e8 rounds to 1e8, minus min -> 0
    paper = attach_gas(nn.Linear(2, 2, bias=False))
    assert torch.equal(paper.scale(), torch.ones(2, 2))  # eq. 1 as printed


# ------------------------------------------------------------------ item 7: imprinting


def test_imprint_form_follows_the_configuration():
    forms = []

    def compute(classes, form="eq2"):
        forms.append(form)
        return {c: torch.tensor([1.0, 0.0]) if form == "authors" else torch.tensor([0.0, 1.0]) for c in classes}

    for imprint, row in (("eq2", [0.0, 1.0]), ("authors", [1.0, 0.0])):
        classifier = PixelClassifier(2, 2, cosine=True)
        model = SimpleNamespace(num_classes=2, classifier=classifier)
        state = SimpleNamespace(
            seen=[0, 1, 2],
            model=model,
            compute_prototypes=compute,
            config=resolve_config(overrides=[f"imprint={imprint}"]),
        )
        model.num_classes = classifier.num_classes
        ClassifierGrowth().setup_model(state)
        assert torch.allclose(classifier.weight.detach().flatten(1)[2], torch.tensor(row))
    assert forms == ["eq2", "authors"]
    assert resolve_config(overrides=["preset=authors"]).imprint == "authors"
