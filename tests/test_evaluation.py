"""Evaluation modes on controlled predictors."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from jascl.data.types import Split
from jascl.evaluation.evaluator import evaluate


class Oracle(nn.Module):
    """Predicts a fixed label map: logits = 10 * one-hot(target rows)."""

    def __init__(self, rows: torch.Tensor, k: int) -> None:
        super().__init__()
        self.rows = rows
        self.k = k

    def forward(self, x):
        onehot = torch.nn.functional.one_hot(self.rows[: x.shape[0]], self.k).movedim(-1, 1).float()
        return 10 * onehot


def test_sliding_window_dice_iou_by_hand():
    # 1 image 2x2 (padded to 4x4 for U-Net-free evaluation): gt [[0,5],[5,5]], prediction [[0,5],[0,5]]
    gt = np.array([[[0, 5], [5, 5]]], dtype=np.uint8)
    split = Split(np.zeros((1, 1, 2, 2), np.float32), gt, ["x"])
    pred_rows = torch.tensor([[[0, 1], [0, 1]]])
    res = evaluate(Oracle(pred_rows, 2), [split], [0, 5], torch.device("cpu"))
    # class 5: TP 2, FP 0, FN 1 -> Dice 4/5, IoU 2/3; class 0: TP 1, FP 1, FN 0 -> Dice 2/3, IoU 1/2
    assert res.dice[5] == pytest.approx(0.8) and res.iou[5] == pytest.approx(2 / 3)
    assert res.dice[0] == pytest.approx(2 / 3) and res.iou[0] == pytest.approx(0.5)


def test_absent_class_is_nan_and_union_of_splits():
    a = Split(np.zeros((1, 1, 2, 2), np.float32), np.array([[[0, 1], [1, 1]]], np.uint8), ["a"])
    b = Split(np.zeros((1, 1, 2, 2), np.float32), np.array([[[0, 0], [0, 1]]], np.uint8), ["b"])
    perfect = torch.tensor([[[0, 1], [1, 1]], [[0, 0], [0, 1]]])

    class Seq(nn.Module):
        calls = 0

        def forward(self, x):
            out = 10 * torch.nn.functional.one_hot(perfect[self.calls : self.calls + 1], 3).movedim(-1, 1).float()
            self.calls += 1
            return out

    res = evaluate(Seq(), [a, b], [0, 1, 2], torch.device("cpu"), batch_size=1)
    assert res.dice[1] == 1.0 and res.dice[0] == 1.0 and math.isnan(res.dice[2])
    # support: pixels of each class over both splits (class 0: 1 + 3, class 1: 3 + 1), samples containing it
    assert res.support == {0: 4, 1: 4, 2: 0} and res.samples == {0: 2, 1: 2, 2: 0}


def test_support_leaves_ignore_out_and_counts_samples_once():
    gt = np.array([[[0, 5], [255, 5]], [[0, 0], [255, 0]]], dtype=np.uint8)
    split = Split(np.zeros((2, 1, 2, 2), np.float32), gt, ["x", "y"])
    res = evaluate(Oracle(torch.tensor([[[0, 1], [0, 1]], [[0, 0], [0, 0]]]), 2), [split], [0, 5], torch.device("cpu"))
    assert res.support == {0: 4, 5: 2} and res.samples == {0: 2, 5: 1}


def test_authors_mode_soft_dice_on_centred_crop():
    # 8^3 volume, class-1 cube at [4:8)^3 (centroid 5.5); a 6^3 crop centred on it (jitter <= 0.6 voxel)
    # starts at clip(round(5.5 - 3 +- 0.6), 0, 2) = 2, so it holds the 64 object voxels and 152 background ones
    gt = np.zeros((1, 8, 8, 8), np.uint8)
    gt[0, 4:, 4:, 4:] = 1
    split = Split(np.zeros((1, 1, 8, 8, 8), np.float32), gt, ["v"])

    class Half(nn.Module):
        def forward(self, x):  # softmax 0.5 / 0.5 everywhere
            return torch.zeros(x.shape[0], 2, *x.shape[2:])

    res = evaluate(Half(), [split], [0, 1], torch.device("cpu"), mode="authors", roi=[6, 6, 6])
    # soft Dice = 2 * sum(p g) / (sum p + sum g): class 1 = 64 / (108 + 64); class 0 = 152 / (108 + 152)
    assert res.dice[1] == pytest.approx(64 / 172, rel=1e-4)
    assert res.dice[0] == pytest.approx(152 / 260, rel=1e-4)


# --- memory-bounded (blocked) sliding window -----------------------------------------------------------------------

from monai.data.utils import dense_patch_slices  # noqa: E402
from monai.inferers import sliding_window_inference  # noqa: E402
from monai.inferers.utils import _get_scan_interval  # noqa: E402

from jascl.evaluation.evaluator import plan_blocks, window_starts  # noqa: E402
from jascl.methods.gas import GASNoise  # noqa: E402


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5, 0.8])
def test_window_starts_reproduce_monai_grid(overlap):
    for size in range(1, 60):
        for roi in (1, 4, 7, 16):
            image = (max(size, roi),)
            interval = _get_scan_interval(image, (roi,), 1, (overlap,))
            reference = [s[0].start for s in dense_patch_slices(image, (roi,), interval)]
            assert window_starts(size, roi, overlap) == reference, (size, roi)


def test_plan_blocks_tile_the_volume_within_budget():
    spatial, roi, k = (40, 33, 29), (8, 8, 8), 3
    budget = k * 20**3
    blocks = plan_blocks(spatial, roi, 0.25, k, budget)
    assert len(blocks) > 1
    cover = np.zeros(spatial, np.int32)
    for b in blocks:
        cover[b.target] += 1
        assert all(s.start <= t.start and t.stop <= s.stop for s, t in zip(b.source, b.target))
        assert k * math.prod(s.stop - s.start for s in b.source) <= budget
        for s, n, r in zip(b.source, spatial, roi):  # every source starts and ends on a window of MONAI's grid
            assert s.start in window_starts(n, r, 0.25) and (s.stop - r) in window_starts(n, r, 0.25)
    assert (cover == 1).all()  # targets tile the volume exactly once
    assert plan_blocks(spatial, roi, 0.25, k, None)[0].target == tuple(slice(0, n) for n in spatial)


class WindowSensitive(nn.Module):
    """Zero-padded conv + a per-class ramp over each window's own coordinates.

    Its stitched output depends on exactly where every window sits, so a block
    whose windows were not MONAI's whole-volume windows would predict differently.
    With ``noisy`` modes, a GAS module's train flag (set by MC evaluation) flips the ramp.
    """

    def __init__(self, dims: int, k: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.conv = conv(1, k, 3, padding=1)
        self.k = k
        self.noise = GASNoise(torch.Size([1]))
        self.noise.train(False)

    def forward(self, x):
        out = self.conv(x)
        ramp = torch.zeros_like(out[:1, :1])
        for axis in range(2, x.dim()):
            shape = [1] * x.dim()
            shape[axis] = x.shape[axis]
            ramp = ramp + torch.linspace(-1, 1, x.shape[axis]).reshape(shape)
        sign = -1.0 if self.noise.training else 1.0
        return out + sign * 0.7 * ramp * torch.arange(self.k, dtype=out.dtype).reshape(1, -1, *[1] * (x.dim() - 2))


def _confusion(pred: np.ndarray, gt: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(gt.ravel() * k + pred.ravel(), minlength=k * k).reshape(k, k)


@pytest.mark.parametrize("dims,overlap", [(2, 0.25), (3, 0.25), (3, 0.5)])
def test_blocked_sliding_window_equals_whole_volume_pass(dims, overlap):
    rng = np.random.default_rng(0)
    spatial, roi, k = ((37, 30), (8, 8), 3) if dims == 2 else ((21, 18, 23), (8, 8, 8), 3)
    image = rng.normal(size=(1, 1, *spatial)).astype(np.float32)
    gt = rng.integers(0, k, size=(1, *spatial)).astype(np.uint8)
    model = WindowSensitive(dims, k).eval()
    budget = k * 12**dims
    assert len(plan_blocks(spatial, roi, overlap, k, budget)) >= 4
    # reference: one MONAI pass over the whole sample, argmax, confusion counted with numpy
    with torch.no_grad():
        logits = sliding_window_inference(torch.from_numpy(image), list(roi), 1, model, overlap=overlap)
    cm = _confusion(logits.argmax(1).numpy(), gt.astype(np.int64), k)
    tp = np.diag(cm)
    expected_dice = 2 * tp / (cm.sum(0) + cm.sum(1))
    split = Split(image, gt, ["v"])
    blocked = evaluate(
        model,
        [split],
        list(range(k)),
        torch.device("cpu"),
        roi=roi,
        sw_batch_size=1,
        overlap=overlap,
        max_block_elements=budget,
    )
    whole = evaluate(
        model,
        [split],
        list(range(k)),
        torch.device("cpu"),
        roi=roi,
        sw_batch_size=1,
        overlap=overlap,
        max_block_elements=None,
    )
    assert [blocked.dice[c] for c in range(k)] == pytest.approx(expected_dice.tolist(), abs=0)
    assert blocked.dice == whole.dice and blocked.iou == whole.iou
    # the sensitivity is real: slabs with their own window grids would not reproduce the reference
    naive = np.concatenate(
        [
            sliding_window_inference(torch.from_numpy(image[..., a : a + 12]), list(roi), 1, model, overlap=overlap)
            .argmax(1)
            .numpy()
            for a in range(0, spatial[-1], 12)
        ],
        axis=-1,
    )
    assert not np.array_equal(naive, logits.argmax(1).numpy())


def test_mc_gas_blocked_equals_unbounded_and_switches_noise_on():
    rng = np.random.default_rng(1)
    spatial, roi, k = (20, 19, 17), (8, 8, 8), 3
    split = Split(
        rng.normal(size=(1, 1, *spatial)).astype(np.float32),
        rng.integers(0, k, size=(1, *spatial)).astype(np.uint8),
        ["v"],
    )
    model = WindowSensitive(3, k).eval()
    kw = dict(roi=roi, sw_batch_size=1, mc_samples=2)
    blocked = evaluate(model, [split], list(range(k)), torch.device("cpu"), max_block_elements=3 * k * 12**3, **kw)
    whole = evaluate(model, [split], list(range(k)), torch.device("cpu"), max_block_elements=None, **kw)
    plain = evaluate(model, [split], list(range(k)), torch.device("cpu"), roi=roi, sw_batch_size=1)
    assert blocked.dice == whole.dice
    assert blocked.dice != plain.dice  # the noisy branch (flipped ramp) was used
    assert not model.noise.training  # switched off again afterwards


def test_mc_gas_averages_softmax_not_logits():
    # draws (via a call counter): logits [0, 10], [2, 0], [2, 0]; mean softmax = [0.587, 0.413] -> class 0,
    # mean logits = [4/3, 10/3] -> class 1; deterministic (one call) -> class 1
    draws = [torch.tensor([0.0, 10.0]), torch.tensor([2.0, 0.0]), torch.tensor([2.0, 0.0])]

    class Draws(nn.Module):
        calls = 0

        def forward(self, x):
            out = draws[self.calls % 3].reshape(1, 2, 1, 1).expand(x.shape[0], 2, *x.shape[2:])
            self.calls += 1
            return out.clone()

    split = Split(np.zeros((1, 1, 2, 2), np.float32), np.ones((1, 2, 2), np.uint8), ["x"])
    mc = evaluate(Draws(), [split], [0, 1], torch.device("cpu"), mc_samples=3)
    det = evaluate(Draws(), [split], [0, 1], torch.device("cpu"))
    assert mc.dice[1] == 0.0 and mc.iou[1] == 0.0  # everything predicted background
    assert det.dice[1] == 1.0


class ListSplit:
    """A split whose samples differ in shape (as real volumes do): lists, not one array."""

    def __init__(self, images, labels):
        self.images, self.labels, self.ids = images, labels, [str(i) for i in range(len(images))]

    def __len__(self):
        return len(self.ids)


def test_variable_size_samples_are_grouped_by_shape():
    # threshold model: class 1 where the intensity is positive
    class Threshold(nn.Module):
        batches: list = []

        def forward(self, x):
            self.batches.append(tuple(x.shape))
            return torch.cat([-10 * x, 10 * x], dim=1)

    rng = np.random.default_rng(2)
    shapes = [(6, 6, 4), (6, 6, 4), (6, 5, 4), (6, 6, 4)]
    images = [rng.normal(size=(1, *s)).astype(np.float32) for s in shapes]
    labels = [rng.integers(0, 2, size=s).astype(np.uint8) for s in shapes]
    model = Threshold()
    res = evaluate(model, [ListSplit(images, labels)], [0, 1], torch.device("cpu"), batch_size=4)
    assert [b[0] for b in model.batches] == [2, 1, 1]  # same-shape neighbours batched, the odd one alone
    pred = np.concatenate([(im[0] > 0).ravel() for im in images]).astype(np.int64)
    gt = np.concatenate([lab.ravel() for lab in labels]).astype(np.int64)
    tp, fp, fn = ((pred == 1) & (gt == 1)).sum(), ((pred == 1) & (gt == 0)).sum(), ((pred == 0) & (gt == 1)).sum()
    assert res.dice[1] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    # and through the sliding-window path (ROI smaller than the samples), one sample at a time
    res_sw = evaluate(
        Threshold(),
        [ListSplit(images, labels)],
        [0, 1],
        torch.device("cpu"),
        roi=(4, 4, 4),
        max_block_elements=2 * 4**3,
    )
    assert res_sw.dice[1] == pytest.approx(res.dice[1])


def test_all_class_mean_excludes_background_unless_asked(toy_protocol):
    # the paper's class-wise tables average foreground classes only; RunConfig.background_in_mean gives the
    # authors' code's mean with background: (0.9 + 0.5 + 0.3) / 3
    from jascl.engine.defaults import session_record
    from jascl.evaluation.evaluator import EvalResult

    result = EvalResult(dice={0: 0.9, 1: 0.5, 2: 0.3}, iou={0: 0.8, 1: 0.4, 2: 0.2})
    assert session_record(toy_protocol, 0, result)["all"] == pytest.approx(0.4)
    assert session_record(toy_protocol, 0, result, background_in_mean=True)["all"] == pytest.approx(1.7 / 3)
    assert session_record(toy_protocol, 0, result, background_in_mean=True)["background"] == 0.9


def test_class_rows_is_argmax_with_first_index_on_ties():
    from jascl.evaluation.evaluator import class_rows

    # (1, 3, 1, 4) scores; voxel 1 ties classes 0 and 2 at the top, voxel 2 classes 1 and 2, voxel 3 all three
    scores = torch.tensor([[[[0.0, 2.0, 1.0, 5.0]], [[1.0, 0.0, 3.0, 5.0]], [[0.5, 2.0, 3.0, 5.0]]]])
    assert class_rows(scores).tolist() == [[[1, 0, 1, 0]]]
    rng = torch.Generator().manual_seed(0)
    rounded = torch.randint(0, 3, (2, 7, 9, 11), generator=rng).float()  # many ties
    rounded[0, :, 0, 0] = float("nan")
    assert torch.equal(class_rows(rounded), rounded.argmax(1))


def test_whole_sample_scores_come_from_logits_without_a_softmax(monkeypatch):
    # the deterministic sliding-window mode takes the argmax of the logits; the softmax is left to the authors'
    # soft Dice (and to MC-GAS): counted here
    import jascl.evaluation.evaluator as ev

    calls = []
    real = torch.softmax
    monkeypatch.setattr(ev.torch, "softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    gt = np.array([[[0, 5], [5, 5]]], dtype=np.uint8)
    split = Split(np.zeros((1, 1, 2, 2), np.float32), gt, ["x"])
    model = Oracle(torch.tensor([[[0, 1], [0, 1]]]), 2)
    result = evaluate(model, [split], [0, 5], torch.device("cpu"), roi=None)
    assert calls == []
    # gt [[0,5],[5,5]] against [[0,5],[0,5]]: class 5 Dice 2*2/(3+2) = 0.8
    assert result.dice[5] == pytest.approx(0.8)
    evaluate(model, [split], [0, 5], torch.device("cpu"), mode="authors", roi=None)
    assert calls == [1]
