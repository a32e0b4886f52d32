"""Class-incremental segmentation baselines: LwF, ILT, MiB, PLOP, Saving100x (STAR), Adapt_replay (Adapter).

Losses and rules are checked against values computed by hand on 1-4 pixel
inputs; every method then runs session 1 of the toy protocol from a shared base.
"""

import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import toy_protocol_dict
from jascl.data.sessions import load_sessions
from jascl.engine.checkpoint import load_tensors
from jascl.engine.config import resolve_config
from jascl.errors import ConfigError
from jascl.experiments.runner import ensure_base, run_benchmark
from jascl.methods import Plugin
from jascl.methods.baselines.distillation._shared import (
    FeatureTap,
    absorbed_rows,
    background_merged_loss,
    merge_absorbed_probabilities,
    mib_init_new_rows,
    unbiased_cross_entropy,
    unbiased_kd_loss,
)
from jascl.methods.baselines.distillation.ilt import feature_distillation_loss
from jascl.methods.baselines.distillation.lwf import kd_loss
from jascl.methods.baselines.distillation.plop import (
    EntropyHistogram,
    entropy_thresholds,
    local_pod,
    merge_new_logits,
    normalized_entropy,
    plop_pseudo_labels,
    pod_distance,
    weighted_pseudo_label_ce,
)
from jascl.methods.baselines.replay._shared import (
    ClassStatistics,
    FeatureStatistics,
    ReplayStore,
    compensate_prototypes,
    ocfm_loss,
    replay_balanced_ce,
    sad_loss,
    sample_replay_features,
    uncertainty_constraint_loss,
)
from jascl.methods.common import frozen_copy
from jascl.methods.registry import create_method
from jascl.networks.base import create_segmenter
from jascl.networks.classifier import PixelClassifier
from jascl.protocols import parse_protocol

LOG = math.log
OURS = ["lwf", "ilt", "mib", "plop", "saving100x", "adapt-replay"]


def pixel(*values):
    """Logits of one pixel, shaped (1, K, 1, 1)."""
    return torch.tensor(values, dtype=torch.float64).view(1, -1, 1, 1)


# ============================================================================ LwF / ILT / MiB losses


def test_kd_loss_is_the_cross_entropy_of_old_rows_with_temperature():
    student = pixel(0.0, 0.0, 5.0)  # the new row (5.0) is left out: p = (1/2, 1/2)
    teacher = pixel(0.0, LOG(3))  # q = (1/4, 3/4)
    assert kd_loss(student, teacher).item() == pytest.approx(LOG(2))
    assert kd_loss(student, teacher, class_mean=True).item() == pytest.approx(LOG(2) / 2)
    # T = 2 divides both: teacher (0, 2 log 3) / 2 -> q = (1/4, 3/4); student (0, 2 log 2) / 2 -> p = (1/3, 2/3)
    value = kd_loss(pixel(0.0, 2 * LOG(2), 9.0), pixel(0.0, 2 * LOG(3)), temperature=2.0).item()
    assert value == pytest.approx(-(0.25 * LOG(1 / 3) + 0.75 * LOG(2 / 3)))


def test_kd_loss_has_zero_gradient_when_student_equals_teacher():
    teacher = torch.randn(2, 3, 2, 2, dtype=torch.float64)
    student = torch.cat([teacher, torch.randn(2, 1, 2, 2, dtype=torch.float64)], dim=1).requires_grad_(True)
    loss = kd_loss(student, teacher, temperature=2.0)
    loss.backward()
    assert student.grad.abs().max().item() < 1e-12  # the KL part is 0; what is left is the teacher's entropy
    q = F.softmax(teacher / 2, dim=1)
    assert loss.item() == pytest.approx(-(q * q.log()).sum(1).mean().item())
    assert feature_distillation_loss(teacher, teacher).item() == 0.0
    assert feature_distillation_loss(teacher + 2, teacher).item() == pytest.approx(4.0)


def test_unbiased_cross_entropy_merges_background_and_old_classes():
    # rows: 0 background, 1 old class (untaught), 2 new class; p = (1/8, 2/8, 5/8) at every pixel
    logits = pixel(0.0, LOG(2), LOG(5)).expand(1, 3, 2, 2)
    target = torch.tensor([[[0, 2], [255, 0]]])
    value = unbiased_cross_entropy(logits, target, [0, 1]).item()
    assert value == pytest.approx((-LOG(3 / 8) - LOG(5 / 8) - LOG(3 / 8)) / 3)
    # without absorbed old classes it is the plain cross-entropy
    plain = F.cross_entropy(logits, target, ignore_index=255).item()
    assert unbiased_cross_entropy(logits, target, [0]).item() == pytest.approx(plain)
    with pytest.raises(ValueError):
        unbiased_cross_entropy(logits, target, [1])


def test_merged_probabilities_and_the_background_merged_loss():
    logits = pixel(0.0, LOG(2), LOG(5)).expand(1, 3, 1, 3)
    target = torch.tensor([[[0, 2, 255]]])
    probs, mapped = merge_absorbed_probabilities(logits, target, [0, 1])
    assert probs[0, :, 0, 0].tolist() == pytest.approx([3 / 8, 5 / 8])
    assert mapped.tolist() == [[[0, 1, 255]]]
    ce_only = background_merged_loss(logits, target, [0, 1], lambda_ce=2.0, lambda_dice=0.0).item()
    assert ce_only == pytest.approx(2 * unbiased_cross_entropy(logits, target, [0, 1]).item())
    with_dice = background_merged_loss(logits, target, [0, 1], lambda_ce=0.0, lambda_dice=1.0).item()
    # soft Dice (smooth 1e-5) on the two valid pixels, merged channel 0 then channel 1, averaged
    p0, p1 = [3 / 8, 3 / 8], [5 / 8, 5 / 8]
    d0 = 1 - (2 * p0[0] + 1e-5) / (1 + sum(p0) + 1e-5)
    d1 = 1 - (2 * p1[1] + 1e-5) / (1 + sum(p1) + 1e-5)
    assert with_dice == pytest.approx((d0 + d1) / 2, rel=1e-4)


def test_unbiased_kd_counts_new_classes_as_background():
    student = pixel(0.0, LOG(2), LOG(5))  # p = (1/8, 2/8, 5/8); row 2 is new
    teacher = pixel(0.0, LOG(3))  # q = (1/4, 3/4)
    expected = -(0.25 * LOG(6 / 8) + 0.75 * LOG(2 / 8)) / 2
    assert unbiased_kd_loss(student, teacher).item() == pytest.approx(expected)


def test_unbiased_kd_has_zero_gradient_at_the_teacher():
    teacher = torch.randn(1, 3, 2, 2, dtype=torch.float64)
    # no new-class mass: the student's old rows equal the teacher, new rows at -inf in effect
    student = torch.cat([teacher, torch.full((1, 2, 2, 2), -60.0, dtype=torch.float64)], 1).requires_grad_(True)
    loss = unbiased_kd_loss(student, teacher)
    loss.backward()
    assert student.grad[:, :3].abs().max().item() < 1e-10
    q = F.softmax(teacher, dim=1)
    assert loss.item() == pytest.approx(-(q * q.log()).sum(1).mean().item() / 3)


def test_mib_init_keeps_old_probabilities_with_a_linear_classifier():
    torch.manual_seed(0)
    clf = PixelClassifier(4, 3, cosine=False)
    features = torch.randn(5, 4)
    before = F.softmax(clf(features), dim=1)
    clf.grow(2)
    mib_init_new_rows(clf, 3)
    after = F.softmax(clf(features), dim=1)
    assert torch.allclose(after[:, 1:3], before[:, 1:3], atol=1e-6)  # old classes unchanged
    assert torch.allclose(after[:, [0, 3, 4]].sum(1), before[:, 0], atol=1e-6)  # background split 3 ways
    assert torch.allclose(after[:, 3], after[:, 0])
    cos = PixelClassifier(4, 2, cosine=True)
    cos.grow(1, torch.randn(1, 4))
    mib_init_new_rows(cos, 2)
    assert torch.equal(cos.weight[2], cos.weight[0])


# ============================================================================ PLOP


def test_local_pod_on_a_known_map():
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    # squared: [[1, 4], [9, 16]]; width pooling (per row) 2.5, 12.5; height pooling (per column) 5, 10
    assert local_pod(x.pow(2), [1]).tolist() == [[2.5, 12.5, 5.0, 10.0]]
    zero = torch.zeros_like(x)
    assert pod_distance(x, zero, [1]).item() == pytest.approx(math.sqrt(2.5**2 + 12.5**2 + 5**2 + 10**2))
    # scale 2 adds four 1-pixel regions, each pooled twice
    assert pod_distance(x, zero, [1, 2]).item() == pytest.approx(math.sqrt(287.5 + 2 * (1 + 16 + 81 + 256)))
    assert pod_distance(x, x, [1, 2, 4]).item() == 0.0
    assert local_pod(x, [4]).shape == (1, 0)  # a 2x2 map has no 4x4 partition: that scale is skipped
    cube = torch.ones(2, 3, 4, 4, 4)
    assert local_pod(cube, [1, 2]).shape == (2, 1 * 3 * 3 * 4 + 8 * 3 * 3 * 2)  # regions x axes x (C x length)


def test_local_pod_3d_pools_each_axis_over_the_others():
    x = torch.arange(8.0).view(1, 1, 2, 2, 2)
    emb = local_pod(x, [1])
    expected = [x[0, 0].mean(dim=(1, 2)), x[0, 0].mean(dim=(0, 2)), x[0, 0].mean(dim=(0, 1))]
    assert emb[0].tolist() == torch.cat(expected).tolist()


def test_merge_new_logits_sums_new_rows_into_background():
    logits = pixel(1.0, 2.0, 3.0, 4.0)
    assert merge_new_logits(logits, 2).flatten().tolist() == [8.0, 2.0]


def test_entropy_histogram_median_and_thresholds():
    hist = EntropyHistogram(3, bins=10)
    hist.update(torch.tensor([0.05, 0.15, 0.25]), torch.tensor([1, 1, 1]))
    medians = hist.medians()
    assert math.isnan(medians[0]) and medians[1].item() == pytest.approx(0.15)
    fine = EntropyHistogram(2, bins=1000)
    fine.update(torch.tensor([0.0001, 0.0001, 0.0001, 0.4]), torch.tensor([1, 1, 1, 0]))
    tau = entropy_thresholds(fine.medians(), min_threshold=0.001)
    assert tau[1].item() == pytest.approx(0.001)  # median 0.0005 raised to the floor
    assert tau[0].item() == pytest.approx(0.4005, abs=1e-6)
    assert entropy_thresholds(medians, 0.001).tolist() == pytest.approx([0.001, 0.15, 0.001])


def test_normalized_entropy_is_in_unit_range():
    assert normalized_entropy(torch.full((1, 4, 1, 1), 0.25)).item() == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)).item() == pytest.approx(0.0)


def test_plop_pseudo_label_rule():
    # 2x2 image; old model rows (background, old class 1)
    teacher = torch.zeros(1, 2, 2, 2)
    teacher[0, :, 0, 0] = torch.tensor([0.0, 10.0])  # confident old class 1
    teacher[0, :, 0, 1] = torch.tensor([0.0, 0.0])  # maximally uncertain
    teacher[0, :, 1, 1] = torch.tensor([10.0, 0.0])  # confident background
    target = torch.tensor([[[0, 0], [2, 0]]])  # pixel (1, 0) is a labelled new class
    u = normalized_entropy(F.softmax(torch.tensor([0.0, 10.0]), 0).view(1, 2, 1, 1)).item()
    assert u < 0.01
    labels, nu = plop_pseudo_labels(teacher, target, torch.tensor([0.5, 0.5]))
    assert labels.tolist() == [[[1, 255], [2, 0]]]
    assert nu.tolist() == pytest.approx([2 / 3])
    # a threshold below the pixel's uncertainty rejects it
    labels, _ = plop_pseudo_labels(teacher, target, torch.tensor([0.5, u / 2]))
    assert labels[0, 0, 0].item() == 255
    # an old-model prediction of a class taught in this session is not used: the pixel stays background
    labels, nu = plop_pseudo_labels(teacher, target, torch.tensor([0.5, 0.5]), taught=[1])
    assert labels.tolist() == [[[0, 255], [2, 0]]] and nu.tolist() == pytest.approx([2 / 3])
    # an image without background pixels keeps its full weight
    _, nu = plop_pseudo_labels(teacher, torch.full((1, 2, 2), 2), torch.tensor([0.5, 0.5]))
    assert nu.tolist() == [1.0]


def test_weighted_pseudo_label_ce_averages_over_all_pixels():
    logits = torch.zeros(1, 2, 1, 2)  # CE = log 2 everywhere
    value = weighted_pseudo_label_ce(logits, torch.tensor([[[0, 255]]]), torch.tensor([0.5]))
    assert value.item() == pytest.approx(0.5 * LOG(2) / 2)


# ============================================================================ Saving100x / Adapter


def test_feature_statistics_by_hand():
    # class 1 at two pixels with features (3, 4) and (0, 2); class 2 absent
    features = torch.tensor([[3.0, 0.0, 9.0], [4.0, 2.0, 9.0]]).view(1, 2, 1, 3)
    labels = torch.tensor([[[1, 1, 0]]])
    acc = FeatureStatistics([1, 2], dim=2)
    acc.update(features, labels)
    stats = acc.compute()
    assert set(stats) == {1}
    s = stats[1]
    units = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    proto = F.normalize(units.sum(0), dim=0)
    assert s.count == 2 and s.prototype.tolist() == pytest.approx(proto.tolist(), abs=1e-6)
    assert s.noise.tolist() == pytest.approx(((units - proto) ** 2).mean(0).sqrt().tolist(), abs=1e-6)
    assert s.norm_mean == pytest.approx(3.5) and s.norm_std == pytest.approx(math.sqrt(4.5))


def test_class_statistics_merge_pools_counts_and_norms_exactly():
    torch.manual_seed(1)
    a, b = torch.randn(1, 3, 1, 5) * 2, torch.randn(1, 3, 1, 7) + 1
    stats = []
    for f in (a, b, torch.cat([a, b], dim=3)):
        acc = FeatureStatistics([1], 3)
        acc.update(f, torch.ones(1, 1, f.shape[3], dtype=torch.long))
        stats.append(acc.compute()[1])
    merged = stats[0].merged(stats[1])
    assert merged.count == 12
    assert merged.norm_mean == pytest.approx(stats[2].norm_mean)
    assert merged.norm_std == pytest.approx(stats[2].norm_std)
    assert merged.prototype.norm().item() == pytest.approx(1.0)


def test_replay_store_round_trip():
    store = ReplayStore()
    store.add(2, ClassStatistics(10.0, torch.tensor([1.0, 0.0]), torch.tensor([0.1, 0.2]), 3.0, 0.5))
    store.background = 42.0
    back = ReplayStore.from_tensors(store.to_tensors())
    assert back.background == 42.0 and list(back.classes) == [2]
    assert back.classes[2].prototype.tolist() == [1.0, 0.0] and back.classes[2].norm_std == 0.5
    assert ReplayStore.from_tensors(ReplayStore().to_tensors()).classes == {}


def test_replay_features_follow_the_stored_statistics():
    proto, noise = torch.tensor([0.6, 0.8]), torch.zeros(2)
    exact = sample_replay_features(proto, noise, 2.0, 0.0, 3)
    assert exact.flatten().tolist() == pytest.approx([1.2, 1.6] * 3)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = sample_replay_features(proto, torch.tensor([0.1, 0.1]), 2.0, 0.3, 4000, g1)
    assert torch.equal(a, sample_replay_features(proto, torch.tensor([0.1, 0.1]), 2.0, 0.3, 4000, g2))
    assert a.mean(0).tolist() == pytest.approx([1.2, 1.6], abs=0.05)


def test_replay_balanced_ce_matches_stars_weighting():
    cur, rep = replay_balanced_ce(torch.tensor(1.0), torch.tensor(6.0), 3, torch.tensor(2.0), 1, 2.0, 4)
    # STAR: (mean_cur + mean_fake * 3/4 + mean_bg * 2 * 1/4) / (1 + 3/4 + 2/4), mean_fake = 2, mean_bg = 2
    assert (cur + rep).item() == pytest.approx((1 + 2 * 0.75 + 2 * 0.5) / 2.25)
    assert cur.item() == pytest.approx(1 / 2.25)


def test_ocfm_is_a_masked_mean_squared_error():
    student = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 2, 1, 2)  # pixel 0: (1, 3); pixel 1: (2, 4)
    region = torch.tensor([[[True, False]]])
    assert ocfm_loss(student, torch.zeros_like(student), region).item() == pytest.approx((1 + 9) / 2)
    assert ocfm_loss(student, student, region).item() == 0.0
    assert ocfm_loss(student, torch.zeros_like(student), torch.zeros_like(region)).item() == 0.0


def test_sad_pushes_new_centres_from_the_nearest_old_prototype():
    features = torch.tensor([[2.0, 0.0], [0.0, 0.0]]).t().reshape(1, 2, 1, 2)  # pixel 0 = (2, 0), pixel 1 = (0, 0)
    labels = torch.tensor([[[3, 0]]])
    protos = torch.tensor([[0.0, 1.0], [0.6, 0.8]])
    assert sad_loss(features, labels, [3], protos).item() == pytest.approx(1 / math.sqrt(0.8))
    assert sad_loss(features, labels, [4], protos).item() == 0.0  # class 4 absent from the batch


def test_uncertainty_constraint_by_hand():
    logits = torch.log(torch.tensor([[0.8, 0.1, 0.1], [0.5, 0.3, 0.2]])).t().reshape(1, 3, 1, 2)
    target = torch.tensor([[[0, 1]]])  # pixel 0 correct; pixel 1 wrong and not confident (0.5 <= 0.7)
    assert uncertainty_constraint_loss(logits, target, 0.7).item() == pytest.approx((1 - 0.2) ** 2 / 2)
    assert uncertainty_constraint_loss(logits, torch.tensor([[[0, 0]]]), 0.7).item() == 0.0


def test_adaptive_deviation_compensation_by_hand():
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    noise = torch.full((2, 2), 0.1)
    before = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    after = torch.tensor([[0.0, 3.0], [0.0, 0.0]])
    moved, grown = compensate_prototypes(
        protos, noise, before, after, torch.tensor([5.0, 0.0]), torch.tensor([10.0, 10.0])
    )
    assert moved.flatten().tolist() == pytest.approx([0.5, 0.5, 0.0, 1.0])  # half the shift (-1, 1); row 2 kept
    assert grown.flatten().tolist() == pytest.approx([0.6, 0.6, 0.1, 0.1])


# ============================================================================ plumbing


def test_frozen_copy_leaves_the_rng_alone_and_taps_hook_layers():
    model = create_segmenter("unet", 2, 1, 3, features=[4, 4, 8, 8, 8, 8])
    state = SimpleNamespace(
        device=torch.device("cpu"),
        model=model,
        new_model=lambda k: create_segmenter("unet", 2, 1, k, features=[4, 4, 8, 8, 8, 8]),
    )
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    teacher = frozen_copy(state)
    assert torch.equal(torch.rand(3), expected)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    tap = FeatureTap(teacher, ["encoder"])
    x = torch.randn(1, 1, 32, 32)
    teacher(x)
    assert tap["encoder"].dim() == 4 and tap["encoder"].shape[-1] < 32
    tap.remove()
    assert tap.outputs == {}


def test_teacher_is_copied_before_mibs_initialisation():
    from jascl.methods.baselines.distillation._shared import TeacherPlugin

    torch.manual_seed(0)
    make = lambda k: create_segmenter("unet", 2, 1, k, cosine=False, features=[4, 4, 8, 8, 8, 8])  # noqa: E731
    model = make(3)
    x = torch.randn(2, 1, 32, 32)
    model.eval()
    before = model(x)
    model.classifier.grow(1)
    state = SimpleNamespace(
        session=SimpleNamespace(index=1),
        previous_seen=[0, 1, 2],
        device=torch.device("cpu"),
        model=model,
        new_model=make,
    )
    plugin = TeacherPlugin(freeze="none", init="mib")
    plugin.before_session(state)
    assert torch.allclose(plugin.teacher(x)[:, :3], before, atol=1e-5)  # the old model, untouched
    assert model.classifier.bias[0].item() == pytest.approx(plugin.teacher.classifier.bias[0].item() - LOG(2))
    after = F.softmax(model(x), dim=1)
    assert torch.allclose(after[:, 1:3], F.softmax(before, dim=1)[:, 1:3], atol=1e-5)


def test_options_freeze_and_errors(toy_config):
    assert [p.freeze_incremental for p in create_method("mib", toy_config).plugins] == ["none"]
    cfg = resolve_config(overrides=["method_args.mib.freeze=config", "method_args.plop.pod_scales=[1, 2]"])
    assert create_method("mib", cfg).plugins[0].freeze_incremental is None
    assert create_method("plop", cfg).plugins[0].o.pod_scales == [1, 2]
    with pytest.raises(
        ConfigError, match=r"^method_args\.lwf\.freeze: must be one of config, none, all_but_classifier \(got 'some'\)$"
    ):
        create_method("lwf", resolve_config(overrides=["method_args.lwf.freeze=some"]))
    with pytest.raises(ConfigError, match=r"^method_args\.mib\.init: must be one of mib, imprint \(got 'random'\)$"):
        create_method("mib", resolve_config(overrides=["method_args.mib.init=random"]))
    with pytest.raises(ConfigError, match="method_args.ilt.kd"):
        create_method("ilt", resolve_config(overrides=["method_args.ilt.kd=1"]))
    with pytest.raises(ConfigError, match="pod_scales"):
        create_method("plop", resolve_config(overrides=["method_args.plop.pod_scales=[0]"]))


# ============================================================================ end to end


@pytest.fixture(scope="module")
def toy_base(tmp_path_factory):
    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml")
    root = tmp_path_factory.mktemp("baselines")
    data = load_sessions(protocol, root / "cache", echo=lambda *a: None)
    ensure_base(protocol, config, data, root / "base", progress=False, echo=lambda *a: None)
    return protocol, config, root


class Probe(Plugin):
    """Runs after the method's plugins: records loss terms, the seg loss it expects, and row initialisation."""

    name = "probe"

    def __init__(self):
        self.terms: dict[str, float] = {}
        self.absorbed = None
        self.new_rows_copy_background = None
        self.merged_seg_gap = []

    def before_session(self, state):
        if state.session.index == 1:
            self.absorbed = absorbed_rows(state)
            w = state.model.classifier.weight
            self.new_rows_copy_background = bool(torch.equal(w[3], w[0]))

    def after_forward(self, state):
        if state.session.index != 1:
            return
        for key, value in state.losses.items():
            self.terms[key] = max(self.terms.get(key, 0.0), abs(float(value.detach())))
        target = state.class_index(state.batch["label"])
        expected = background_merged_loss(state.output.logits, target, self.absorbed, 1.0, 1.0)
        self.merged_seg_gap.append(abs(float((expected - state.losses["seg"]).detach())))


@pytest.mark.parametrize("name", OURS)
def test_method_runs_session_one_with_its_terms_active(name, toy_base, tmp_path):
    protocol, config, root = toy_base
    probe = Probe()
    method = create_method(name, config)
    out = tmp_path / "run"
    shutil.copytree(root / "base", out / "base")
    results = run_benchmark(
        protocol,
        config,
        [method.with_plugins([probe])],
        out,
        cache_dir=root / "cache",
        progress=False,
        echo=lambda *a: None,
    )
    assert [s["session"] for s in results["methods"][name]["sessions"]] == [0, 1]
    plugin = method.plugins[0]
    for term in plugin.loss_terms:
        assert probe.terms.get(term, 0.0) > 0.0, f"{name}: {term} never non-zero in session 1"
    assert probe.absorbed == [0, 2]  # class 1 recurs (labelled), class 2 is hidden in the background
    if name == "mib":
        assert probe.new_rows_copy_background  # MiB's initialisation replaced the prototype imprinting
        assert max(probe.merged_seg_gap) < 1e-5  # "seg" is the unbiased loss
    if name == "plop":
        assert plugin.thresholds.shape == (3,) and plugin.thresholds.min().item() >= 0.001
        assert probe.new_rows_copy_background  # PLOP uses MiB's initialisation
    if name in ("lwf", "ilt"):
        assert max(probe.merged_seg_gap) > 1e-3 and not probe.new_rows_copy_background  # loop's DiceCE, imprinting
    if name in ("saving100x", "adapt-replay"):
        saved = load_tensors(out / name / "s1-inc" / "plugins.safetensors")
        prefix = f"0.{plugin.name}."
        assert saved[prefix + "class_ids"].tolist() == [1, 2, 3]
        assert saved[prefix + "counts"][2].item() > 0
        assert saved[prefix + "background"].item() > 0
