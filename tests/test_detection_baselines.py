"""EWC, online EWC, LwF and MiB on the detection task (jascl.methods.detection.baselines): the distillation terms
on (RoIs, K) logits against the segmentation closed forms, the old model scoring exactly the student's RoIs, MiB's
RoI classification term on background RoIs by hand, the EWC penalty and Fisher by hand, the options a detector
cannot honour, and one tiny run of each method whose declared loss terms act in session 1."""

import copy
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from jascl.engine.config import resolve_config
from jascl.engine.plugin import Plugin
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods.baselines.distillation._shared import absorbed_rows, unbiased_cross_entropy, unbiased_kd_loss
from jascl.methods.baselines.distillation.lwf import kd_loss
from jascl.methods.detection.baselines import (
    DetectionEWCPlugin,
    DetectionLwFPlugin,
    DetectionMiBPlugin,
    DetectionOnlineEWCPlugin,
    fisher_from_losses,
    supervised_without_roi_classification,
    teacher_roi_logits,
    trainable_detector_parameters,
)
from jascl.methods.registry import METHODS, create_method
from jascl.networks.detector import create_detector
from jascl.protocols import parse_protocol

LOG = math.log


def rois(*rows):
    """Logits of RoIs, (N, K): the segmentation functions' (B, K) with B = N and no spatial dimensions."""
    return torch.tensor(rows, dtype=torch.float64)


# ============================================================================ the loss terms on (N, K) logits


def test_distillation_terms_on_roi_logits_equal_the_segmentation_closed_forms():
    # the closed forms of tests/test_baselines_distillation.py, one RoI per former pixel, plus a second RoI
    assert kd_loss(rois([0.0, 0.0, 5.0]), rois([0.0, LOG(3)])).item() == pytest.approx(LOG(2))
    value = kd_loss(rois([0.0, 2 * LOG(2), 9.0]), rois([0.0, 2 * LOG(3)]), temperature=2.0).item()
    assert value == pytest.approx(-(0.25 * LOG(1 / 3) + 0.75 * LOG(2 / 3)))
    # two RoIs: the mean of the per-RoI values (p = (1/2, 1/2) | q = (1/4, 3/4); p = (1/3, 2/3) | q = (1/2, 1/2))
    two = kd_loss(rois([0.0, 0.0, 7.0], [0.0, LOG(2), -3.0]), rois([0.0, LOG(3)], [1.0, 1.0])).item()
    assert two == pytest.approx((LOG(2) - 0.5 * LOG(1 / 3) - 0.5 * LOG(2 / 3)) / 2)
    # MiB's unbiased KD: p = (1/8, 2/8, 5/8), row 2 new -> background 6/8; q = (1/4, 3/4); mean over K_old = 2 rows
    expected = -(0.25 * LOG(6 / 8) + 0.75 * LOG(2 / 8)) / 2
    assert unbiased_kd_loss(rois([0.0, LOG(2), LOG(5)]), rois([0.0, LOG(3)])).item() == pytest.approx(expected)
    # MiB's unbiased CE: a background RoI scores background + absorbed old row 1 (3/8), a new-class RoI its own 5/8
    ce = unbiased_cross_entropy(rois([0.0, LOG(2), LOG(5)], [0.0, LOG(2), LOG(5)]), torch.tensor([0, 2]), [0, 1])
    assert ce.item() == pytest.approx((-LOG(3 / 8) - LOG(5 / 8)) / 2)


def test_supervised_without_roi_classification_sums_the_other_three():
    losses = {name: torch.tensor(v) for name, v in [("loss_classifier", 9.0), ("loss_box_reg", 0.5),
              ("loss_objectness", 0.25), ("loss_rpn_box_reg", 0.125)]}  # fmt: skip
    assert supervised_without_roi_classification(losses).item() == 0.875


# ============================================================================ the old model on the student's RoIs


def _images_and_targets():
    """Two hand-made one-channel images (one 32x32, one 40x48 that the small detector resizes to 27x32) with one box
    each: a bright square of class row 3 (new) and a disc-free dark square of class row 1."""
    a = torch.zeros(1, 32, 32)
    a[:, 4:20, 6:22] = 1.0
    b = torch.full((1, 40, 48), 0.2)
    b[:, 10:30, 20:44] = 0.7
    targets = [
        {"boxes": torch.tensor([[6.0, 4.0, 22.0, 20.0]]), "labels": torch.tensor([3])},
        {"boxes": torch.tensor([[20.0, 10.0, 44.0, 30.0]]), "labels": torch.tensor([1])},
    ]
    return [a, b], targets


@pytest.fixture(scope="module")
def pair():
    """(teacher K=3, student = the teacher grown to K=4, images, targets, the student's training output)."""
    torch.manual_seed(0)
    teacher = create_detector("small", 1, 3, image_size=32).eval().requires_grad_(False)
    student = copy.deepcopy(teacher).train().requires_grad_(True)
    student.grow(1)
    images, targets = _images_and_targets()
    torch.manual_seed(1)
    out = student.forward_train(images, targets)
    return teacher, student, images, targets, out


def _state(student, images, out, classes=(3,)):
    return SimpleNamespace(
        session=SimpleNamespace(index=1, classes=list(classes)),
        seen=[0, 1, 2, 3],
        previous_seen=[0, 1, 2],
        model=student,
        device=torch.device("cpu"),
        batch={"image": images},
        output=out,
        losses={},
    )


def _with_teacher(plugin, teacher, state):
    plugin.teacher, plugin.num_old = teacher, 3
    if isinstance(plugin, DetectionMiBPlugin):
        plugin._absorbed = absorbed_rows(state)
    return plugin


def test_the_old_model_scores_exactly_the_students_rois(pair):
    teacher, student, images, targets, out = pair
    # one box list per image, in class_logits' row order, in input-image pixels (the ground-truth box is among the
    # sampled RoIs, torchvision adds it to the proposals: found again in the 40x48 image's own coordinates)
    assert [len(b) for b in out.roi_boxes] == torch.bincount(out.roi_batch).tolist()
    for boxes, target in zip(out.roi_boxes, targets):
        assert (boxes - target["boxes"]).abs().sum(dim=1).min().item() < 1e-4
    # same boxes -> the same features as box_features on them (the teacher's box head equals the student's here)
    same = torch.cat(teacher.box_features(images, out.roi_boxes))
    assert torch.allclose(same, out.roi_features, atol=1e-5)
    logits = teacher_roi_logits(teacher, images, out.roi_boxes)
    assert torch.equal(logits, teacher.classifier(same))
    assert torch.allclose(logits, out.class_logits[:, :3], atol=1e-5)  # old rows grown bit-exactly
    # the plugin's teacher logits are those (old rows only)
    state = _state(student, images, out)
    plugin = _with_teacher(DetectionLwFPlugin(weight=1.0, temperature=2.0), teacher, state)
    assert torch.equal(plugin.teacher_logits(state), logits)
    # and without the boxes it refuses rather than score other regions
    state.output = SimpleNamespace(**{**vars(out), "roi_boxes": []})
    with pytest.raises(RuntimeError, match="roi_boxes"):
        plugin.teacher_logits(state)


def test_lwf_term_is_the_teachers_entropy_when_the_student_matches_it(pair):
    teacher, student, images, _, out = pair
    state = _state(student, images, out)
    plugin = _with_teacher(DetectionLwFPlugin(weight=3.0, temperature=2.0), teacher, state)
    plugin.after_forward(state)
    q = F.softmax(out.class_logits.detach()[:, :3].double() / 2.0, dim=1)  # student's old rows == teacher's logits
    entropy = -(q * q.log()).sum(dim=1).mean().item()  # LwF's cross-entropy at q = p is the entropy of q
    assert state.losses["lwf_kd"].item() == pytest.approx(3.0 * entropy, rel=1e-5)
    assert set(state.losses) == {"lwf_kd"}  # the detector's own loss stays the task's


def test_mib_on_background_rois_is_the_log_of_the_summed_background_and_old_probability(pair):
    teacher, student, images, _, out = pair
    background = SimpleNamespace(**{**vars(out), "roi_targets": torch.zeros_like(out.roi_targets)})
    state = _state(student, images, background)  # session teaches row 3 only: rows 1, 2 hidden in the background
    plugin = _with_teacher(DetectionMiBPlugin(kd_weight=10.0, alpha=1.0), teacher, state)
    assert plugin._absorbed == [0, 1, 2]
    plugin.after_forward(state)
    p = F.softmax(out.class_logits.detach().double(), dim=1)
    by_hand = -torch.log(p[:, 0] + p[:, 1] + p[:, 2]).mean().item()
    others = sum(out.losses[k].item() for k in ("loss_box_reg", "loss_objectness", "loss_rpn_box_reg"))
    assert state.losses["det"].item() == pytest.approx(others + by_hand, rel=1e-5)
    assert by_hand < -torch.log(p[:, 0]).mean().item()  # torchvision's RoI term would push old classes down
    # unbiased KD on the same RoIs (teacher == student's old rows): student background = rows 0 and 3
    q = F.softmax(out.class_logits.detach()[:, :3].double(), dim=1)
    log_p = torch.stack([torch.log(p[:, 0] + p[:, 3]), torch.log(p[:, 1]), torch.log(p[:, 2])], dim=1)
    kd = -(q * log_p).sum(dim=1).mean().item() / 3
    assert state.losses["mib_kd"].item() == pytest.approx(10.0 * kd, rel=1e-5)
    # a recurring old class is labelled, not absorbed
    assert absorbed_rows(_state(student, images, out, classes=(1, 3))) == [0, 2]


# ============================================================================ EWC


def test_detection_fisher_is_the_mean_squared_gradient_of_each_images_loss(pair):
    teacher, _, images, targets, _ = pair
    model = copy.deepcopy(teacher).requires_grad_(True)
    model.grow(1)
    params = trainable_detector_parameters(model, "all_but_classifier")
    assert sorted(params) == [
        "roi_heads.box_predictor.box_regressor.bias",
        "roi_heads.box_predictor.box_regressor.weight",
        "roi_heads.box_predictor.classifier.bias",
        "roi_heads.box_predictor.classifier.weight",
    ]
    assert len(trainable_detector_parameters(model, "none")) == len(list(model.parameters()))

    def loss(i):
        torch.manual_seed(10 + i)  # the samplers' draws, the same for both computations
        return sum(model.forward_train([images[i]], [targets[i]]).losses.values())

    fisher = fisher_from_losses((loss(i) for i in range(2)), params)
    squares = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(2):
        model.zero_grad()
        loss(i).backward()
        for n, p in params.items():
            squares[n] += p.grad**2 / 2
    for n in params:
        assert torch.allclose(fisher[n], squares[n], rtol=1e-5, atol=1e-12)
    assert fisher["roi_heads.box_predictor.classifier.weight"].abs().sum() > 0


def test_ewc_penalty_is_zero_at_the_anchor_and_sum_f_shift_squared_after_a_shift(pair):
    teacher, _, _, _, _ = pair
    model = copy.deepcopy(teacher).requires_grad_(True)
    named = dict(model.named_parameters())
    w, b = "roi_heads.box_predictor.classifier.weight", "roi_heads.box_head.fc6.bias"
    fisher = {w: torch.rand_like(named[w]), b: torch.rand_like(named[b])}
    anchors = {n: named[n].detach().clone() for n in fisher}
    plugin = DetectionEWCPlugin(weight=4.0)
    plugin.sessions = [(fisher, anchors)]
    state = SimpleNamespace(model=model, session=SimpleNamespace(index=1), losses={})
    plugin.after_forward(state)
    assert state.losses["ewc"].item() == 0.0
    with torch.no_grad():
        named[w][1, :5] += 0.5
        named[b][7] -= 2.0
    model.grow(1)  # a new row is not penalised: the anchor covers the first rows
    plugin.after_forward(state)
    by_hand = 0.25 * fisher[w][1, :5].sum() + 4.0 * fisher[b][7]
    assert state.losses["ewc"].item() == pytest.approx(0.5 * 4.0 * by_hand.item(), rel=1e-5)


# ============================================================================ options and registration


def test_options_a_detector_cannot_honour_are_refused_in_one_line():
    assert {"ewc", "online-ewc", "lwf", "mib"} <= set(METHODS.task_methods("detection"))
    sampled = resolve_config({}, "x.yaml", overrides=["method_args.ewc.fisher_labels=sampled"])
    with pytest.raises(ConfigError, match=r"method_args\.ewc\.fisher_labels='sampled'"):
        create_method("ewc", sampled, "detection")
    dice = resolve_config({}, "x.yaml", overrides=["method_args.mib.dice=true"])
    with pytest.raises(ConfigError, match=r"method_args\.mib\.dice=true"):
        create_method("mib", dice, "detection")
    plain = resolve_config({}, "x.yaml", overrides=["method_args.mib.dice=false"])
    plugins = create_method("mib", plain, "detection").plugins
    assert [type(p).__name__ for p in plugins] == ["DetectionMiBPlugin"]
    assert set(plugins[0].replaces) == {"supervised-loss", "classifier-growth"}  # MiB's own initialisation
    assert create_method("mib", resolve_config({}, "x.yaml"), "detection").plugins[0].init == "mib"
    online = create_method("online-ewc", resolve_config({}, "x.yaml"), "detection").plugins
    assert isinstance(online[0], DetectionOnlineEWCPlugin)
    assert type(online[0]).session_fisher is DetectionEWCPlugin.session_fisher  # the detector's Fisher for both


# ============================================================================ one tiny run each


def protocol_dict() -> dict:
    return {
        "name": "toy-det-baselines",
        "task": "detection",
        "seed": 3,
        "spatial_dims": 2,
        "synthetic": {"size": 32, "objects_per_image": [1, 2], "object_radius": [0.2, 0.3], "distractors": 1},
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "disc", "shape": "disc"},
            {"id": 2, "name": "square", "shape": "square"},
            {"id": 3, "name": "cross", "shape": "cross"},
        ],
        "domains": {"a": {"appearance": {"class_intensity": [0.5, 0.9]}}, "b": {"appearance": {"invert": True}}},
        "sessions": [
            {"name": "base", "domains": ["a"], "new_classes": [1, 2], "shots": "all", "train": 8, "test": 2},
            # a recurring class makes 4 labelled images: two steps, so EWC's penalty leaves its anchor
            {"name": "inc", "domains": ["b"], "new_classes": [3], "recurring_classes": [1], "shots": 2, "test": 2},
        ],
        "training": {
            "backbone": "fasterrcnn-small",
            "epochs_base": 1,
            "epochs_incremental": 1,
            "batch_size": 2,
            "method_args": {"ewc": {"fisher_samples": 2}, "online-ewc": {"fisher_samples": 2}},
        },
    }


class LossProbe(Plugin):
    """The largest magnitude of every loss term, per session (after every plugin added its own)."""

    name = "probe"

    def __init__(self):
        self.seen: dict[int, dict[str, float]] = {}

    def before_backward(self, state):
        terms = self.seen.setdefault(state.session.index, {})
        for key, value in state.losses.items():
            v = float(value.detach())
            assert math.isfinite(v), f"loss term {key} is not finite"
            terms[key] = max(terms.get(key, 0.0), abs(v))


def test_each_baseline_trains_on_boxes_and_its_loss_terms_act(tmp_path):
    protocol = parse_protocol(protocol_dict(), source="toy-det-baselines.yaml")
    config = resolve_config(protocol.training, "toy-det-baselines.yaml")
    names = ["lwf", "mib", "ewc"]  # online-ewc differs from ewc only in OnlineEWCPlugin's bookkeeping (CI time)
    probes = {name: LossProbe() for name in names}
    out = tmp_path / "run"
    for name in names:
        results = run_benchmark(
            protocol, config, [name], out, cache_dir=tmp_path / "cache", progress=False, echo=lambda *a: None,
            extra_plugins=[probes[name]],
        )  # fmt: skip
        sessions = results["methods"][name]["sessions"]
        assert len(sessions) == 2 and all(math.isfinite(r["all"]) for r in sessions)
        declared = [t for p in create_method(name, config, "detection").plugins for t in p.loss_terms]
        assert declared and 1 in probes[name].seen
        for term in declared:
            assert probes[name].seen[1].get(term, 0.0) > 0.0, f"{name}: {term} never non-zero in session 1"
        assert probes[name].seen[1]["det"] > 0.0
    assert (out / "base").exists()  # one base for the three (none changes session 0)
    shutil.rmtree(out)
