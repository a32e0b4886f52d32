"""UCB (Liang et al., TIP 2025): class-balance and uncertainty weights by hand, and PLOP's loss when both are off."""

import math

import pytest
import torch

from jascl.methods.baselines.distillation.plop import weighted_pseudo_label_ce
from jascl.methods.baselines.distillation.ucb import (
    class_balance_weights,
    label_frequencies,
    running_frequency,
    ucb_pixel_weights,
    uncertainty_weights,
    weighted_ce,
)
from jascl.methods.registry import METHODS, create_method

E = math.e


def test_class_balance_weights_by_hand():
    # present: 0..3 (4 classes); foreground mean = (0.3 + 0.1 + 0.1) / 3 = 1/6
    # w = (1/6) / m -> [bg 1, 0.5556, 1.6667, 1.6667, absent inf]; clamp to [sqrt(2/3), sqrt(3/2)]
    w = class_balance_weights(torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0]), n_old=3, n_new=2)
    lo, hi = math.sqrt(2 / 3), math.sqrt(3 / 2)
    assert w.tolist() == pytest.approx([1.0, lo, hi, hi, hi])
    # wide bounds (n_old 100, n_new 1: [0.1, 10]) leave the ratios: 1/6 / 0.3, 1/6 / 0.1
    w = class_balance_weights(torch.tensor([0.5, 0.3, 0.1, 0.1]), n_old=100, n_new=1)
    assert w.tolist() == pytest.approx([1.0, 5 / 9, 5 / 3, 5 / 3])
    # more new than old classes: the sorted interval is the same
    assert torch.equal(
        class_balance_weights(torch.tensor([0.5, 0.3, 0.1, 0.1]), 2, 3),
        class_balance_weights(torch.tensor([0.5, 0.3, 0.1, 0.1]), 3, 2),
    )
    # only background present: all ones
    assert class_balance_weights(torch.tensor([1.0, 0.0, 0.0]), 2, 1).tolist() == [1.0, 1.0, 1.0]


def test_uncertainty_weights_by_hand():
    # min-max over [0.2, 0.4, 0.6, 1.0, 0.2] -> [0, 0.25, 0.5, 1, 0]; w = exp(1 - u / 0.8)
    u = torch.tensor([[0.2, 0.4, 0.6, 1.0, 0.2]])
    pseudo = torch.tensor([[True, True, True, True, False]])
    w = uncertainty_weights(u, pseudo, high=0.8)
    assert w.tolist()[0] == pytest.approx([E, math.exp(1 - 0.25 / 0.8), math.exp(1 - 0.5 / 0.8), 0.0, E])
    # the threshold itself drops the pixel; a constant map is all certain
    w = uncertainty_weights(torch.tensor([0.0, 0.8, 1.0]), torch.tensor([True, True, True]), high=0.8)
    assert w.tolist() == pytest.approx([E, 0.0, 0.0])
    assert uncertainty_weights(torch.full((2, 2), 0.3), torch.ones(2, 2, dtype=torch.bool)).tolist() == [[E, E]] * 2


def test_frequencies_ignore_void_and_run_weighted_by_batch_size():
    labels = torch.tensor([[0, 0, 1, 255]])
    assert label_frequencies(labels, 3).tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])
    freq, n = running_frequency(torch.zeros(3, dtype=torch.float64), 0, labels)
    assert n == 1 and freq.tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])
    # a batch of 3 images, all class 2: (1 * [2/3, 1/3, 0] + 3 * [0, 0, 1]) / 4
    freq, n = running_frequency(freq, n, torch.full((3, 2), 2))
    assert n == 4 and freq.tolist() == pytest.approx([1 / 6, 1 / 12, 3 / 4])


def test_pixel_weights_combine_normalise_and_drop_ignored():
    # two old rows (bg, 1) and one new row 2; teacher logits equal -> entropy 1 everywhere except pixel 0
    teacher = torch.zeros(1, 2, 4)
    teacher[0, 0, 0] = 20.0  # pixel 0: near-certain background (entropy ~ 0)
    labels = torch.tensor([[0, 1, 2, 255]])
    pseudo = torch.tensor([[True, True, False, True]])
    class_w = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    w = ucb_pixel_weights(teacher, labels, pseudo, class_w, high=0.8)
    # entropies over the valid+ignored pixels: [~0, 1, 1, 1] -> min-max [0, 1, 1, 1]
    # u-weights: pixel 0: e; pixel 1: pseudo, u = 1 >= 0.8 -> 0; pixel 2: ground truth -> e; pixel 3: ignored
    raw = torch.tensor([E * 1.0, 0.0, E * 0.5])
    expected = raw / raw.mean()
    assert w[0, :3].tolist() == pytest.approx(expected.tolist(), rel=1e-6)
    assert w[0, 3].item() == 0.0
    # both parts off: ones on valid pixels
    w = ucb_pixel_weights(teacher, labels, pseudo, None, uncertainty=False)
    assert w.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_weighted_ce_with_unit_weights_is_plops_loss():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 4, generator=g)
    labels = torch.randint(0, 3, (2, 4, 4), generator=g)
    labels[0, 0, 0] = 255
    nu = torch.tensor([0.5, 1.0])
    ours = weighted_ce(logits, labels, nu.view(2, 1, 1) * torch.ones(2, 4, 4))
    assert ours.item() == pytest.approx(weighted_pseudo_label_ce(logits, labels, nu).item(), rel=1e-6)
    # a pixel weight of 3 on one pixel: that pixel's CE counts three times
    w = torch.ones(2, 4, 4)
    w[1, 2, 2] = 3.0
    ce = torch.nn.functional.cross_entropy(logits, labels, ignore_index=255, reduction="none")
    assert weighted_ce(logits, labels, w).item() == pytest.approx(((ce.sum() + 2 * ce[1, 2, 2]) / 32).item())


def test_registered_on_plop(toy_config):
    assert "ucb" in METHODS.list()
    (plugin,) = create_method("ucb", toy_config).plugins
    assert plugin.name == "ucb" and plugin.loss_terms == ("plop_pod",)
    assert plugin.ucb.uncertainty_high == 0.8 and plugin.o.min_threshold == 0.001
