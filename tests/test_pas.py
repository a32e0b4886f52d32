"""PAS (eqs. 3-5) on hand-made tensors, the EMA update, the counters and the noisy-pool degradation."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from jascl.data.noise import boundary_mask, degrade, degrade_pool
from jascl.data.types import Split
from jascl.engine.config import resolve_config
from jascl.engine.prototypes import PrototypeAccumulator, PrototypeStore, class_prototypes
from jascl.methods.mean_teacher import MeanTeacherPlugin
from jascl.methods.pas import (
    FilterCounters,
    asymptotic_error,
    consistency_loss,
    ema_update,
    pas_filter,
    prototype_matrix,
)
from jascl.methods.registry import create_method


def _logits_for(probs):
    return torch.log(torch.tensor(probs))


def test_validity_mask_by_hand():
    # 1 image, 2 classes, 1x3 pixels: softmax confidences 0.9 / 0.65 / 0.8 (class 0, 0, 1)
    probs = torch.tensor([[0.9, 0.65, 0.2], [0.1, 0.35, 0.8]]).reshape(1, 2, 1, 3)
    logits = torch.log(probs)
    # features (D = 2): pixel 0 along class-0 prototype, pixel 1 along it too, pixel 2 at 90 deg to class 1's
    feats = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]).reshape(1, 2, 1, 3)
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = pas_filter(logits, feats, protos, tau_conf=0.7, tau_sim=0.7)
    assert out.pred.tolist() == [[[0, 0, 1]]]
    assert torch.allclose(out.conf, torch.tensor([[[0.9, 0.65, 0.8]]]))
    assert torch.allclose(out.sim, torch.tensor([[[1.0, 1.0, 0.0]]]))
    # pixel 0 passes both; pixel 1 fails confidence; pixel 2 fails similarity
    assert out.valid.tolist() == [[[True, False, False]]]
    conf_only = pas_filter(logits, feats, None, 0.7, 0.7)
    assert conf_only.valid.tolist() == [[[True, False, True]]]


def test_class_without_prototype_is_never_valid():
    logits = torch.tensor([[[[5.0]], [[0.0]]]])  # class 0, very confident
    feats = torch.ones(1, 2, 1, 1)
    protos = torch.tensor([[float("nan"), float("nan")], [0.0, 1.0]])
    assert not pas_filter(logits, feats, protos, 0.7, 0.0).valid.any()


def test_prototype_lookup_by_class_id():
    store = PrototypeStore()
    store.add(0, {0: torch.tensor([1.0, 0.0]), 4: torch.tensor([0.0, 1.0])})
    store.add(1, {0: torch.tensor([0.6, 0.8])})
    m = prototype_matrix([0, 4, 9], current={9: torch.tensor([0.5, 0.5])}, store=store, dim=2)
    assert m.shape == (3, 1, 2)
    assert torch.allclose(m[0, 0], torch.tensor([0.6, 0.8]))  # newest stored background
    assert torch.allclose(m[1, 0], torch.tensor([0.0, 1.0]))  # class 4 by id, not by position
    assert torch.allclose(m[2, 0], torch.tensor([0.5, 0.5]))  # the session's own prototype


def test_prototype_matrix_with_per_sample_anchors_pads_with_nan():
    store = PrototypeStore()
    store.add(0, {4: torch.tensor([0.0, 1.0])})
    anchors = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, -1.0]])  # three labelled samples of background
    m = prototype_matrix([0, 4, 7], current={0: anchors}, store=store, dim=2)
    assert m.shape == (3, 3, 2)
    assert torch.equal(m[0], anchors)
    assert torch.allclose(m[1, 0], torch.tensor([0.0, 1.0])) and torch.isnan(m[1, 1:]).all()
    assert torch.isnan(m[2]).all()  # class 7: no prototype anywhere


def test_sim_is_the_best_matching_anchor():
    # 1x3 pixels, all predicted class 0 with conf 0.9; class 0 has anchors (1, 0) and (0, 1) plus a NaN pad,
    # class 1 has only NaN anchors
    logits = torch.log(torch.tensor([[0.9, 0.9, 0.9], [0.1, 0.1, 0.1]])).reshape(1, 2, 1, 3)
    feats = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, -1.0]]).reshape(1, 2, 1, 3)
    nan = float("nan")
    anchors = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [nan, nan]], [[nan, nan]] * 3])
    out = pas_filter(logits, feats, anchors, tau_conf=0.7, tau_sim=0.7)
    # pixel 0 matches anchor 0, pixel 1 anchor 1 (cos 1); pixel 2 (-1, -1)/sqrt(2): best cos -1/sqrt(2)
    assert torch.allclose(out.sim, torch.tensor([[[1.0, 1.0, -(0.5**0.5)]]]), atol=1e-6)
    assert out.valid.tolist() == [[[True, True, False]]]
    # with only the first anchor (eq. 3 with one prototype), pixel 1 is at 90 degrees and rejected
    single = pas_filter(logits, feats, anchors[:, 0], tau_conf=0.7, tau_sim=0.7)
    assert single.valid.tolist() == [[[True, False, False]]]
    # a class whose anchors are all NaN never validates
    flipped = pas_filter(logits.flip(1), feats, anchors, tau_conf=0.7, tau_sim=0.0)
    assert not flipped.valid.any() and torch.isnan(flipped.sim).all()


def _background_with_bright_distractor():
    """One labelled image, D = 2, 1x4 pixels, all labelled background (0).

    Three true-background pixels point along (1, 0) with norm 1; one unlabelled
    old-class object, labelled background as untaught classes are, points along
    (0, 1) with norm 9 (as dark objects do under inverted contrast in synthetic-2d-ss).
    """
    feats = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 9.0]]).reshape(1, 2, 1, 4)
    return feats, torch.zeros(1, 1, 4, dtype=torch.long)


def test_pixel_normalised_prototype_by_hand():
    feats, labels = _background_with_bright_distractor()
    # eq. 2 literally: mean (0.75, 2.25) -> (1, 3) / sqrt(10): dominated by the one bright pixel
    raw = class_prototypes(feats, labels, [0])[0]
    assert torch.allclose(raw, torch.tensor([1.0, 3.0]) / 10**0.5, atol=1e-6)
    # pixels normalised first (authors' get_prototype): mean (0.75, 0.25) -> (3, 1) / sqrt(10)
    normed = class_prototypes(feats, labels, [0], normalize_pixels=True)[0]
    assert torch.allclose(normed, torch.tensor([3.0, 1.0]) / 10**0.5, atol=1e-6)
    # the streaming accumulator gives the same (two batches: the prototype is the mean of per-sample ones)
    acc = PrototypeAccumulator([0], normalize_pixels=True, keep_samples=True)
    acc.update(feats, labels)
    acc.update(feats, labels)
    assert torch.allclose(acc.compute()[0], normed, atol=1e-6)
    # and keeps the summands of eq. 2, one unit vector per sample
    assert torch.allclose(acc.samples()[0], torch.stack([normed, normed]), atol=1e-6)
    with pytest.raises(RuntimeError, match="keep_samples"):
        PrototypeAccumulator([0]).samples()


def test_pixel_normalised_prototype_keeps_background_and_rejects_missed_object():
    feats, labels = _background_with_bright_distractor()
    # unlabelled pixels, both confidently predicted background (conf 0.9): a true-background
    # feature (1, 0) and a missed object (0, 1)
    logits = torch.log(torch.tensor([[0.9, 0.9], [0.1, 0.1]])).reshape(1, 2, 1, 2)
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    other = torch.tensor([[0.0, -1.0]])  # class 1's prototype, unused here
    for normalize, sims, valid in (
        (False, [0.1**0.5, 0.9**0.5], [False, True]),
        (True, [0.9**0.5, 0.1**0.5], [True, False]),
    ):
        bg = class_prototypes(feats, labels, [0], normalize_pixels=normalize)[0]
        out = pas_filter(logits, query, torch.cat([bg[None], other]), tau_conf=0.7, tau_sim=0.7)
        assert torch.allclose(out.sim, torch.tensor([[sims]]), atol=1e-6)
        assert out.valid.tolist() == [[valid]]


def test_presets_wire_the_anchor_options():
    def mean_teacher(method):
        return next(p for p in method.plugins if isinstance(p, MeanTeacherPlugin))

    # jascl follows eqs. 2-3 literally: plain feature means, one class prototype
    default = mean_teacher(create_method("jascl", resolve_config()))
    assert default.normalize_pixels is False and default.anchors == "mean"
    config = resolve_config(overrides=["pas.normalize_pixels=false", "pas.anchors=per-sample"])
    plugin = mean_teacher(create_method("jascl", config))
    assert plugin.normalize_pixels is False and plugin.anchors == "per-sample"
    # jascl-anchors: the per-sample anchors on normalised pixels, unless the options say otherwise
    variant = mean_teacher(create_method("jascl-anchors", resolve_config()))
    assert variant.normalize_pixels is True and variant.anchors == "per-sample"
    assert mean_teacher(create_method("jascl-anchors", config)).normalize_pixels is False


def test_consistency_loss_by_hand_and_empty_set():
    # student softmax (0.5, 0.5) vs teacher (1, 0) (almost): squared difference 0.25 + 0.25 = 0.5 per pixel
    s = torch.zeros(1, 2, 1, 2, requires_grad=True)
    t = torch.tensor([[[[30.0, 30.0]], [[0.0, 0.0]]]])
    valid = torch.tensor([[[True, False]]])
    loss = consistency_loss(s, t, valid)
    assert loss.item() == pytest.approx(0.5, rel=1e-6)
    loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0  # the student gets a gradient
    # empty valid set: exactly 0, no NaN, and backward still works
    s2 = torch.zeros(1, 2, 1, 2, requires_grad=True)
    empty = consistency_loss(s2, t, torch.zeros(1, 1, 2, dtype=torch.bool))
    assert empty.item() == 0.0 and not math.isnan(empty.item())
    empty.backward()


def test_ema_update_by_hand():
    teacher, student = nn.Linear(1, 1), nn.Linear(1, 1)
    with torch.no_grad():
        teacher.weight.fill_(1.0), teacher.bias.fill_(0.0)
        student.weight.fill_(3.0), student.bias.fill_(2.0)
    ema_update(teacher, student.state_dict(), decay=0.99)
    assert teacher.weight.item() == pytest.approx(0.99 * 1 + 0.01 * 3)
    assert teacher.bias.item() == pytest.approx(0.02)


def test_counters_coverage_and_precision():
    c = FilterCounters()
    valid = torch.tensor([True, True, True, False, False, True])
    pred = torch.tensor([1, 2, 0, 0, 5, 3])
    truth = torch.tensor([1, 2, 1, 0, 5, 255])  # last pixel: unknown ground truth
    c.update(valid, pred, truth)
    assert c.stats().coverage == pytest.approx(4 / 6)
    assert c.stats().precision == pytest.approx(2 / 3)  # of 3 kept pixels with known truth, 2 correct
    # per pseudo-label class: class 1 kept once and right, 2 once and right, 0 once and wrong
    assert c.stats().per_class() == {0: (1, 0.0), 1: (1, 1.0), 2: (1, 1.0)}
    c.update(torch.tensor([True, True]), torch.tensor([0, 0]), torch.tensor([0, 0]))
    assert c.stats().per_class()[0] == (3, pytest.approx(2 / 3))


def test_asymptotic_error_theorem_edge_cases():
    # rho = 0 recovers eps0; rho = 1 gives (1 - f gamma) eps0; decreasing in rho
    assert asymptotic_error(0.5, 0.0, 0.4, 0.2) == pytest.approx(0.2)
    assert asymptotic_error(0.5, 1.0, 0.4, 0.2) == pytest.approx(0.8 * 0.2)
    assert asymptotic_error(0.5, 0.9, 0.4, 0.2) < asymptotic_error(0.5, 0.5, 0.4, 0.2)


def test_degradation_mostly_near_boundaries():
    img = torch.zeros(1, 48, 48)
    img[0, 12:36, 12:36] = 1.0
    mask = boundary_mask(img)
    assert mask.max() == pytest.approx(1.0) and mask[24, 24] < 0.05 and mask[2, 2] < 0.05
    out = degrade(img, np.random.default_rng(0), "heavy")
    change = (out - img).abs()[0]
    near = mask > 0.5
    far = mask < 0.05
    assert change[near].mean() > 5 * change[far].mean()


def test_pool_degrades_seventy_percent():
    rng = np.random.default_rng(0)
    images = np.zeros((10, 1, 32, 32), np.float32)
    images[:, :, 8:24, 8:24] = 1.0
    images += rng.normal(0, 0.01, size=images.shape).astype(np.float32)
    split = Split(images, np.zeros((10, 32, 32), np.uint8), [str(i) for i in range(10)])
    out = degrade_pool(split, "moderate", seed=1)
    changed = [not np.array_equal(a, b) for a, b in zip(split.images, out.images)]
    assert sum(changed) == 7 and out.ids == split.ids and out.labels is split.labels
    assert degrade_pool(split, "none", seed=1) is split


def test_best_anchor_similarity_matches_a_direct_computation_in_blocks(monkeypatch):
    import jascl.methods.pas as pas

    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 4, 3, 5, generator=g)
    anchors = torch.randn(3, 4, 4, generator=g)
    anchors[1, 2:] = float("nan")  # class 1 has two anchors, padded
    anchors[2] = float("nan")  # class 2 has none
    pred = torch.randint(0, 3, (2, 3, 5), generator=g)
    f = torch.nn.functional.normalize(features, dim=1).movedim(1, -1)  # (B, H, W, D)
    p = torch.nn.functional.normalize(anchors, dim=-1)
    expected = torch.stack(
        [
            torch.stack(
                [
                    torch.stack(
                        [(f[b, i, j] * p[pred[b, i, j]]).sum(-1).nan_to_num(float("-inf")).max() for j in range(5)]
                    )
                    for i in range(3)
                ]
            )
            for b in range(2)
        ]
    )
    expected = expected.masked_fill(expected == float("-inf"), float("nan"))
    for block in (2**26, 1):  # all anchors at once, and one anchor per block
        monkeypatch.setattr(pas, "ANCHOR_BLOCK_ELEMENTS", block)
        got = pas.best_anchor_similarity(features, anchors, pred)
        assert torch.allclose(got, expected, atol=1e-6, equal_nan=True)
    assert torch.isnan(got[pred == 2]).all() and not torch.isnan(got[pred != 2]).any()


def test_select_anchors_keeps_a_spread_out_subset():
    from jascl.methods.pas import select_anchors

    # unit vectors at 0, 10, 20, 90 and 180 degrees: the mean points near 20-40 degrees
    angles = torch.tensor([0.0, 10.0, 20.0, 90.0, 180.0]) * math.pi / 180
    anchors = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    assert select_anchors(anchors, 5) is anchors and select_anchors(anchors, 0) is anchors
    # the mean points at about 38 deg: start at 20 deg (nearest), add 180 (farthest from 20), then 90
    # (70 deg from its nearest chosen anchor; 0 and 10 are within 20 deg of 20)
    picked = select_anchors(anchors, 3)
    assert torch.equal(picked, anchors[[2, 3, 4]])
    store = PrototypeStore()
    m = prototype_matrix([0], current={0: anchors}, store=store, dim=2, max_anchors=2)
    assert m.shape == (1, 2, 2)


def test_counters_several_filters_match_one_counter_each():
    valid = torch.tensor([[True, True, True, False, False, True], [False, True, True, True, True, False]])
    pred = torch.tensor([1, 2, 0, 0, 5, 3])
    truth = torch.tensor([1, 2, 1, 0, 5, 255])
    both = FilterCounters(filters=2)
    both.update(valid, pred, truth)
    for f in range(2):
        one = FilterCounters()
        one.update(valid[f], pred, truth)
        assert both.stats(f) == one.stats()
    second = both.stats(1)  # kept by hand: pixel 1 (class 2, right), 2 (0, truth 1: wrong), 3 (0, right), 4 (5, right)
    assert (second.kept, second.evaluated, second.correct, second.coverage) == (4, 4, 3, pytest.approx(4 / 6))
    assert second.per_class() == {0: (2, 0.5), 2: (1, 1.0), 5: (1, 1.0)}
    with pytest.raises(ValueError, match="2 filter"):
        both.update(valid[0], pred, truth)


def test_pool_error_counts_only_pixels_with_a_known_label():
    from jascl.methods.mean_teacher import pixel_errors

    pred = torch.tensor([[1, 2, 0, 1], [3, 3, 0, 0]])
    truth = torch.tensor([[1, 0, 0, 255], [255, 255, 255, 255]])  # the second sample: no ground truth
    # known pixels: 3 (1, 0, 0), of which one is wrong (predicted 2, truth 0)
    assert pixel_errors(pred, truth).tolist() == [1, 3]
    assert pixel_errors(pred[1:], truth[1:]).tolist() == [0, 0]
