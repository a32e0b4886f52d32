"""CAT (``cat``, Xu et al., IEEE TMI 2024): the class-aware temperature map, the distillation with per-pixel
temperatures, the shifted-grid pooling of SD and the unique-old classes, on hand-computed tensors."""

import math
from types import SimpleNamespace

import pytest
import torch

from jascl.methods.baselines.distillation.lwf import kd_loss
from jascl.methods.baselines.surgery.cat import (
    CATOptions,
    CATPlugin,
    cat_kd_loss,
    cat_temperature_map,
    pixel_classes,
    sd_loss,
    shifted_pod,
    unique_old_rows,
)


def test_temperature_map_gives_unique_old_pixels_their_own_temperature():
    classes = torch.tensor([[[0, 2], [1, 2]]])  # (1, 2, 2)
    temps = cat_temperature_map(classes, unique_old=[2], t_unique=4.0, t_rest=3.0)
    assert temps.shape == (1, 1, 2, 2)
    assert temps[0, 0].tolist() == [[3.0, 4.0], [3.0, 4.0]]
    assert cat_temperature_map(classes, [], 4.0, 3.0).eq(3.0).all()


def test_pixel_classes_take_the_old_model_where_the_label_hides_the_class():
    target = torch.tensor([[0, 1, 255, 3]])
    teacher = torch.zeros(1, 3, 4)
    teacher[0, 2] = 1.0  # the old model predicts row 2 everywhere
    assert pixel_classes(target, teacher).tolist() == [[2, 1, 2, 3]]
    assert pixel_classes(target, None).tolist() == [[0, 1, 255, 3]]


def test_kd_with_per_pixel_temperatures_by_hand():
    # pixel 1: T = 2, teacher (2, 0) -> q = softmax(1, 0); student (1, -1) -> p = softmax(0.5, -0.5) = q
    #   loss = -(1/2) (0.731059 ln 0.731059 + 0.268941 ln 0.268941) = 0.291103
    # pixel 2: T = 1, teacher (0, 0) -> q = (1/2, 1/2); student (ln 3, 0) -> p = (3/4, 1/4)
    #   loss = -(1/4) (ln 0.75 + ln 0.25) = 0.418494
    teacher = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]])  # (B=1, K_old=2, P=2)
    student = torch.tensor([[[1.0, math.log(3.0)], [-1.0, 0.0], [5.0, 5.0]]])  # a third (new) row, ignored
    temps = torch.tensor([[[2.0, 1.0]]])
    assert cat_kd_loss(student, teacher, temps).item() == pytest.approx((0.291103 + 0.418494) / 2, abs=1e-6)
    # one temperature everywhere: ILT's class-averaged distillation at that temperature
    torch.manual_seed(0)
    s, t = torch.randn(2, 4, 3, 3), torch.randn(2, 3, 3, 3)
    assert cat_kd_loss(s, t, torch.full((2, 1, 3, 3), 3.0)).item() == pytest.approx(
        kd_loss(s, t, 3.0, class_mean=True).item(), rel=1e-6
    )


def test_shifted_grid_pooling_by_hand():
    x = torch.arange(64.0).view(1, 1, 8, 8)  # x[i, j] = 8 i + j; cuts at 2 and 6 on both axes
    emb = shifted_pod(x)
    assert emb.shape == (1, 3 * 8 + 3 * 8)  # nine regions, each with its height- and width-pooled strips
    # region rows 0-1 x cols 0-1: row means (0.5, 8.5), column means (4, 5); then rows 0-1 x cols 2-5
    assert emb[0, :10].tolist() == [0.5, 8.5, 4.0, 5.0, 3.5, 11.5, 6.0, 7.0, 8.0, 9.0]
    # a 2 x 2 map has no shifted cut: one region, its row and column means
    assert shifted_pod(torch.tensor([[[[1.0, 2.0], [3.0, 5.0]]]])).tolist() == [[1.5, 4.0, 2.0, 3.5]]
    # 3D: 3 x 3 x 3 regions of a 4^3 map, three strips each
    assert shifted_pod(torch.zeros(2, 3, 4, 4, 4)).shape == (2, 3 * (9 * 3 * 4))


def test_sd_loss_zero_for_equal_features_and_two_for_a_unit_shift():
    torch.manual_seed(0)
    f = torch.randn(2, 3, 8, 8)
    assert sd_loss(f, f.clone()).item() == 0.0
    # every pooled entry shifts by 1 too: MSE 1 on the features + MSE 1 on the embedding
    assert sd_loss(f + 1.0, f).item() == pytest.approx(2.0, abs=1e-5)


def test_unique_old_rows_are_previous_classes_the_session_does_not_teach():
    state = SimpleNamespace(previous_seen=[0, 5, 7, 9], session=SimpleNamespace(classes=(7, 11)))
    assert unique_old_rows(state) == [1, 3]


def test_plugin_partition_option_and_declared_terms():
    target = torch.tensor([[0, 1]])
    teacher = torch.tensor([[[0.0, 9.0], [9.0, 0.0]]])  # predicts row 1 at pixel 0
    plugin = CATPlugin(CATOptions())
    plugin._unique = [1]
    assert plugin.temperatures(target, teacher)[0, 0].tolist() == [4.0, 4.0]
    by_label = CATPlugin(CATOptions(partition="label"))
    by_label._unique = [1]
    assert by_label.temperatures(target, teacher)[0, 0].tolist() == [3.0, 4.0]
    assert plugin.loss_terms == ("cat_kd", "cat_sd")
    assert CATPlugin(CATOptions(sd_weight=0.0)).loss_terms == ("cat_kd",)
