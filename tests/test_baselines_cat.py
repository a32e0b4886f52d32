"""CAT (``cat``, Xu et al., IEEE TMI 2024): the class-aware temperature map, the distillation with per-pixel
temperatures, the shifted-grid pooling of SD and the unique-old classes, on hand-computed tensors; CAT-SD's
synthetic data: cut-outs, pastes and blended samples by hand, the plugin's memory of old cut-outs and the batches
it blends (old instruments pasted, labelled, and given the unique-old temperature)."""

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
    plugin = CATPlugin(CATOptions(partition="label_or_teacher"))
    plugin._unique = [1]
    assert plugin.temperatures(target, teacher)[0, 0].tolist() == [4.0, 4.0]
    by_label = CATPlugin(CATOptions())  # the default: the labels, as the authors' code
    by_label._unique = [1]
    assert by_label.temperatures(target, teacher)[0, 0].tolist() == [3.0, 4.0]
    assert plugin.loss_terms == ("cat_kd", "cat_sd")
    assert CATPlugin(CATOptions(sd_weight=0.0)).loss_terms == ("cat_kd",)


# ---------------------------------------------------------------------------- CAT-SD's synthetic data


def test_cut_instruments_crops_each_class_to_its_box():
    from jascl.methods.baselines.surgery._blend import cut_instruments

    image = torch.arange(25.0).view(1, 5, 5)
    label = torch.zeros(5, 5, dtype=torch.long)
    label[1, 1:4] = 3
    label[2, 2] = 3
    label[4, 0] = 6
    cuts = cut_instruments(image, label, [3, 6, 9])  # 9 is absent: no cut-out
    assert [c.class_id for c in cuts] == [3, 6]
    assert cuts[0].image.tolist() == [[[6.0, 7.0, 8.0], [11.0, 12.0, 13.0]]]
    assert cuts[0].mask.tolist() == [[True, True, True], [False, True, False]]
    assert cuts[1].image.tolist() == [[[20.0]]] and cuts[1].mask.tolist() == [[True]]


def test_paste_writes_the_masked_pixels_and_their_class_only():
    import numpy as np

    from jascl.methods.baselines.surgery._blend import Cutout, paste

    cut = Cutout(4, torch.tensor([[[9.0, 8.0]]]), torch.tensor([[True, False]]))
    image, label = torch.zeros(1, 1, 2), torch.zeros(1, 2, dtype=torch.long)
    # a 1x2 cut-out in a 1x2 image has one position: offset 0
    out_image, out_label = paste(image, label, cut, np.random.default_rng(0))
    assert out_image.tolist() == [[[9.0, 0.0]]] and out_label.tolist() == [[4, 0]]
    assert image.sum() == 0  # new tensors
    # larger than the image: cropped to it
    big = Cutout(2, torch.ones(1, 3, 3), torch.ones(3, 3, dtype=torch.bool))
    out_image, out_label = paste(image, label, big, np.random.default_rng(0))
    assert out_label.tolist() == [[2, 2]]


def test_pick_instruments_one_or_two_of_different_classes():
    import numpy as np

    from jascl.methods.baselines.surgery._blend import Cutout, pick_instruments

    cuts = [Cutout(c, torch.ones(1, 1, 1), torch.ones(1, 1, dtype=torch.bool)) for c in (1, 1, 2)]
    rng = np.random.default_rng(0)
    draws = [pick_instruments(cuts, rng) for _ in range(400)]
    two = [d for d in draws if len(d) == 2]
    assert 0.12 < len(two) / len(draws) < 0.28  # p = 0.2 (the authors' blend_multi: 1 instrument with p 0.8)
    assert all(d[0].class_id != d[1].class_id for d in two)
    assert all(len(pick_instruments(cuts[:2], rng)) == 1 for _ in range(20))  # no other class: always one


@pytest.mark.parametrize("size", [(24, 24), (12, 12, 12)])
def test_blended_sample_keeps_shapes_and_labels_every_pasted_pixel(size):
    import numpy as np

    from jascl.methods.baselines.surgery._blend import augment_foreground, blend_sample, cut_instruments

    image = torch.rand(1, *size, generator=torch.Generator().manual_seed(0))
    label = torch.zeros(size, dtype=torch.long)
    box = tuple(slice(2, 7) for _ in size)
    label[box] = 3
    source_image = torch.full((1, *size), 5.0)  # the instrument is the only place with intensity 5
    (cut,) = cut_instruments(source_image, label, [3])
    rng = np.random.default_rng(1)
    for _ in range(10):
        moved = augment_foreground(cut, rng)
        assert moved.class_id == 3 and moved.mask.any() and moved.image.shape[1:] == moved.mask.shape
        x, y = blend_sample(image, torch.zeros(size, dtype=torch.long), [cut], rng)
        assert x.shape == image.shape and y.shape == label.shape
        assert (y == 3).any()  # the instrument was pasted and labelled
        assert set(torch.unique(y).tolist()) <= {0, 3, 255}


def _cat_state(images, labels, classes, seen, index=1, synthetic=True):
    from jascl.data.types import Split

    split = Split(images.numpy(), labels.numpy().astype("uint8"), [f"s{i}" for i in range(len(images))])

    def class_index(ids):
        lut = torch.full((256,), -1, dtype=torch.long)
        lut[255] = 255
        for r, c in enumerate(seen):
            lut[c] = r
        return lut[ids.long()]

    return SimpleNamespace(
        seed=3,
        session=SimpleNamespace(index=index, classes=classes, other_classes="background"),
        data=SimpleNamespace(train=split),
        config=SimpleNamespace(patch_size=None),
        report={},
        class_index=class_index,
        seen=seen,
    )


def test_plugin_keeps_old_cutouts_and_blends_them_into_the_batches_labelled(tmp_path):
    """CAT-SD's defining synthetic data: in an incremental session the batches are blended, and old instruments
    (class 1, taught in session 0 and hidden from session 1's labels) come back, labelled, from the memory."""
    from safetensors.torch import load_file, save_file

    from jascl.methods.baselines.surgery._blend import Cutout

    plugin = CATPlugin(CATOptions(memory=2, old_share=1.0))
    # session 0 ends: its instruments (class 1) are cut from its labelled images, 2 kept
    images = torch.rand(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(3, 16, 16, dtype=torch.long)
    labels[:, 3:8, 3:8] = 1
    plugin.harvest(_cat_state(images, labels, (1,), [0, 1], index=0))
    assert [c.class_id for c in plugin.memory] == [1, 1] and plugin.harvested == [0]
    plugin.harvest(_cat_state(images, labels, (1,), [0, 1], index=0))  # a session is harvested once
    assert len(plugin.memory) == 2
    # kept across sessions through safetensors
    path = tmp_path / "extra.safetensors"
    save_file(plugin.extra_state(), path)
    other = CATPlugin(CATOptions(memory=2, old_share=1.0))
    other.load_extra_state(load_file(path))
    assert other.harvested == [0] and torch.equal(other.memory[1].image, plugin.memory[1].image)
    assert isinstance(other.memory[0], Cutout)
    # session 1 teaches class 2; its batch labels show no class 1
    labels1 = torch.zeros(2, 16, 16, dtype=torch.long)
    labels1[:, 9:14, 9:14] = 2
    state = _cat_state(images[:2], labels1, (2,), [0, 1, 2])
    plugin.teacher = object()  # an incremental session (the synthetic data needs no teacher forward)
    plugin._current = plugin._session_cutouts(state)
    import numpy as np

    plugin._rng = np.random.default_rng(0)
    state.batch = {"image": images[:2].clone(), "label": labels1.clone(), "id": ["a", "b"]}
    plugin.before_iteration(state)
    assert plugin.blended == 2 and state.batch["id"] == ["a", "b"]
    assert (state.batch["label"] == 1).any()  # the old instrument is back, labelled
    assert not torch.equal(state.batch["image"], images[:2])
    # its pixels get the unique-old temperature from the labels alone (partition "label")
    plugin._unique = [1]
    rows = state.class_index(state.batch["label"])
    temps = plugin.temperatures(rows, torch.zeros(2, 2, 16, 16))
    assert torch.equal(temps[:, 0] == 4.0, rows == 1)
    # synthetic=0: the batches are left alone (CAT + SD on the real data)
    off = CATPlugin(CATOptions(synthetic=0.0))
    off.teacher, off._rng = object(), np.random.default_rng(0)
    state.batch = {"image": images[:2].clone(), "label": labels1.clone()}
    off.before_iteration(state)
    assert torch.equal(state.batch["label"], labels1)
