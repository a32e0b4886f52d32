"""HALO (Franco et al., ICML 2024): Poincare-ball maps and hyperbolic MLR against closed forms and geoopt, the
acquisition score and the greedy region picking by hand."""

import math

import pytest
import torch

from jascl.methods.baselines.semi._hyperbolic import HyperbolicHead, dist0, expmap0, feature_reweighting, hyperbolic_mlr
from jascl.methods.baselines.semi.halo import (
    halo_scores,
    minmax_per_image,
    region_entropy,
    regions_per_round,
    select_regions,
)
from jascl.methods.registry import METHODS, create_method

geoopt_math = pytest.importorskip("geoopt.manifolds.stereographic.math")


def test_expmap0_and_radius_closed_forms():
    # |u| = 0.5, c = 0.5: expmap0(u) = tanh(sqrt(c) |u|) u / (sqrt(c) |u|); radius 2 artanh(sqrt(c)|x|)/sqrt(c) = 2|u|
    u = torch.tensor([[0.3, -0.4]], dtype=torch.float64)
    x = expmap0(u, c=0.5)
    s = math.sqrt(0.5)
    assert x[0].tolist() == pytest.approx((math.tanh(s * 0.5) / (s * 0.5) * u[0]).tolist(), rel=1e-12)
    assert dist0(x, c=0.5).item() == pytest.approx(1.0, rel=1e-9)
    # channel-first maps: (B, D, H, W), radius per pixel
    maps = torch.zeros(1, 2, 1, 2, dtype=torch.float64)
    maps[0, :, 0, 1] = torch.tensor([0.6, 0.8], dtype=torch.float64)  # |u| = 1, c = 1: radius 2
    assert dist0(expmap0(maps, c=1.0), c=1.0)[0, 0].tolist() == pytest.approx([0.0, 2.0], abs=1e-9)


def test_mlr_at_the_origin_offset_by_hand():
    # p = 0: m = x; c = 1, x = (0.5, 0), a = (1, 0): 2 |a| asinh(2 * 0.5 / (1 - 0.25)) = 2 asinh(4/3) = 2 ln 3
    x = torch.tensor([0.5, 0.0], dtype=torch.float64).view(1, 2, 1, 1)
    logits = hyperbolic_mlr(x, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    assert logits.item() == pytest.approx(2 * math.log(3), rel=1e-12)
    # |a| scales the logit, its sign flips it, and a pixel on the hyperplane gets 0
    a2 = torch.tensor([[-3.0, 0.0]], dtype=torch.float64)
    assert hyperbolic_mlr(x, torch.zeros(1, 2, dtype=torch.float64), a2).item() == pytest.approx(-6 * math.log(3))
    on_plane = torch.tensor([0.0, 0.7], dtype=torch.float64).view(1, 2, 1, 1)
    assert hyperbolic_mlr(on_plane, torch.zeros(1, 2, dtype=torch.float64), a2).item() == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("c", [1.0, 0.3])
def test_mlr_equals_twice_norm_times_geoopt_signed_distance_to_hyperplane(c):
    g = torch.Generator().manual_seed(1)
    x = expmap0(torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64), c)
    p = expmap0(torch.randn(3, 5, generator=g, dtype=torch.float64), c)
    a = torch.randn(3, 5, generator=g, dtype=torch.float64)
    ours = hyperbolic_mlr(x, p, a, c)  # (2, 3, 3, 4)
    k = torch.tensor(-c, dtype=torch.float64)
    ref = 2 * a.norm(dim=1) * geoopt_math.dist2plane(x.movedim(1, -1).unsqueeze(-2), p, a, k=k, signed=True)
    # geoopt's arsinh is log(x + sqrt(1 + x^2)), which loses ~1e-8 to cancellation for negative x
    assert torch.allclose(ours, ref.movedim(-1, 1), rtol=1e-6, atol=1e-6)
    # and the Mobius addition inside it is geoopt's
    m = geoopt_math.mobius_add(-p[0], x[0, :, 0, 0], k=k)
    a_hat = a[0] / a[0].norm()
    by_hand = 2 * a[0].norm() / math.sqrt(c) * torch.asinh(2 * math.sqrt(c) * (m @ a_hat) / (1 - c * m.pow(2).sum()))
    assert ours[0, 0, 0, 0].item() == pytest.approx(by_hand.item(), rel=1e-10)


def test_feature_reweighting_sets_each_channel_norm_to_its_weight():
    class Two(torch.nn.Module):
        def forward(self, v):
            return torch.full_like(v, 2.0)

    f = torch.randn(2, 3, 4, 5)
    out = feature_reweighting(f, Two())
    norms = out.reshape(2, 3, -1).norm(dim=-1)
    assert torch.allclose(norms, torch.full((2, 3), 2.0), atol=1e-6)


def test_head_shapes_and_embeddings_inside_the_ball():
    torch.manual_seed(0)
    head = HyperbolicHead(in_channels=6, num_classes=4, channels=5, c=2.0)
    logits, z = head(torch.randn(2, 6, 7, 3) * 50)
    assert logits.shape == (2, 4, 7, 3) and logits.dtype == torch.float32 and z.shape == (2, 5, 7, 3)
    assert z.norm(dim=1).max().item() < 1 / math.sqrt(2.0)
    logits.sum().backward()
    assert head.reduce.weight.grad is not None and head.mlr.normal.grad.abs().sum() > 0


def test_region_entropy_window_sum_by_hand():
    # K = 2, 3x4 image: pixel (0, 0) uniform (H = 1), the rest one-hot (H = 0); the 3x3 window sum is 1 on the
    # four pixels within one step of (0, 0), 0 elsewhere
    probs = torch.zeros(1, 2, 3, 4)
    probs[0, 0] = 1.0
    probs[0, :, 0, 0] = 0.5
    box = region_entropy(probs, radius=1)
    expected = torch.zeros(1, 3, 4)
    expected[0, :2, :2] = 1.0
    assert torch.allclose(box, expected, atol=1e-6)
    assert torch.allclose(
        region_entropy(probs, radius=0), (expected * 0).index_put_((torch.tensor([0]),) * 3, torch.tensor([1.0]))
    )


def test_halo_score_is_the_product_of_min_max_maps():
    # radius 0: entropies of (0.5, 0.5), (1, 0), (0.8, 0.2), (0.5, 0.5) = [1, 0, h, 1]; radii [1, 2, 3, 5]
    h = -(0.8 * math.log(0.8) + 0.2 * math.log(0.2)) / math.log(2)
    probs = torch.tensor([[0.5, 1.0, 0.8, 0.5], [0.5, 0.0, 0.2, 0.5]], dtype=torch.float64).view(1, 2, 2, 2)
    radii = torch.tensor([[1.0, 2.0], [3.0, 5.0]]).view(1, 2, 2)
    score = halo_scores(probs, radii, radius=0)
    assert score.flatten().tolist() == pytest.approx([0.0, 0.0, 0.5 * h, 1.0], abs=1e-9)
    assert minmax_per_image(torch.full((2, 3), 4.0)).tolist() == [[0.0] * 3] * 2


def test_select_regions_greedy_with_exclusion_windows():
    score = torch.zeros(6, 6)
    score[1, 1], score[1, 2], score[4, 4] = 9.0, 8.0, 7.0  # (1, 2) falls in the window excluded by (1, 1)
    picked, excluded = select_regions(score, count=2, region_radius=0, mask_radius=1)
    assert torch.nonzero(picked).tolist() == [[1, 1], [4, 4]]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[0:3, 0:3] = True
    expected[3:6, 3:6] = True
    assert torch.equal(excluded, expected)
    # a 3x3 region is clipped at the border; an image whose every pixel is excluded stops early
    picked, excluded = select_regions(torch.arange(9.0).view(3, 3).flip(0, 1), count=5, region_radius=1, mask_radius=2)
    assert torch.nonzero(picked).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]] and excluded.all()
    # 3D: one 3x3x3 region around the best voxel
    vol = torch.zeros(4, 4, 4)
    vol[2, 2, 2] = 1.0
    picked, _ = select_regions(vol, count=1, region_radius=1, mask_radius=1)
    assert int(picked.sum()) == 27 and picked[1:4, 1:4, 1:4].all()
    blocked = torch.full((2, 2), -math.inf)
    picked, _ = select_regions(blocked, count=3)
    assert not picked.any()


def test_regions_per_round():
    assert regions_per_round(32 * 32, 0.05, 5, 1, 2) == 2  # ceil(10.24 / 9)
    assert regions_per_round(16**3, 0.05, 5, 1, 3) == 2  # ceil(40.96 / 27)
    assert regions_per_round(512 * 1024, 0.05, 5, 1, 2) == 583  # ceil(5242.88 / 9)


def test_registered_with_the_official_defaults(toy_config):
    assert "halo" in METHODS.list()
    (plugin,) = create_method("halo", toy_config).plugins
    assert plugin.loss_terms == ("halo_hyp", "halo_al")
    assert (plugin.budget, plugin.rounds, plugin.region_radius, plugin.mask_radius) == (0.05, 5, 1, 5)
    assert (plugin.channels, plugin.curvature, plugin.hfr) == (64, 1.0, True)
    assert plugin.oracle  # active learning as published: the acquired pixels are annotated


def test_acquire_pseudo_labels_the_best_region_with_the_model_argmax():
    from types import SimpleNamespace

    import numpy as np

    from jascl.methods.baselines.semi._hyperbolic import HyperbolicHead
    from jascl.methods.baselines.semi.halo import HALOPlugin
    from jascl.networks.base import SegmenterOutput

    class Fixed(torch.nn.Module):  # logits: class 2 wins everywhere; features: the image itself
        def forward_features(self, x):
            logits = torch.stack([x[:, 0], 0 * x[:, 0], 2 + 0 * x[:, 0]], dim=1)
            return SegmenterOutput(logits, x.repeat(1, 3, 1, 1))

    class Split:
        def __init__(self, images, labels):
            self.images, self.labels = images, labels

        def __len__(self):
            return len(self.images)

    g = torch.Generator().manual_seed(0)
    images = [torch.rand(1, 8, 8, generator=g).numpy() for _ in range(2)]
    pool = Split(images, [np.zeros((8, 8), dtype=np.int64)] * 2)
    # self-training (no oracle); ceil(64 * 0.3 / 9) = 3 regions
    plugin = HALOPlugin(budget=0.6, rounds=2, region_radius=1, mask_radius=2, oracle=False)
    torch.manual_seed(0)
    plugin.head = HyperbolicHead(3, 3, channels=4)
    plugin.pseudo = torch.full((2, 8, 8), 255, dtype=torch.long)
    plugin.excluded = torch.zeros(2, 8, 8, dtype=torch.bool)
    plugin._loader = SimpleNamespace(batch_size=2)
    state = SimpleNamespace(model=Fixed(), data=SimpleNamespace(unlabelled=pool), device=torch.device("cpu"))
    added = plugin.acquire(state)
    # the expected picks: the same score, computed here, and the greedy windows
    x = torch.from_numpy(np.stack(images)).float()
    out = Fixed().forward_features(x)
    with torch.no_grad():
        plugin.head.eval()
        radii = dist0(plugin.head.embed(out.features))
    scores = halo_scores(torch.softmax(out.logits, 1), radii, 1)
    for i in range(2):
        picked, excluded = select_regions(scores[i], 3, 1, 2)
        assert torch.equal(plugin.pseudo[i] != 255, picked)
        assert torch.equal(plugin.excluded[i], excluded)
    assert set(plugin.pseudo[plugin.pseudo != 255].tolist()) == {2}
    assert added == int((plugin.pseudo != 255).sum()) and plugin.rounds_done == 1
    # a second round never picks inside an excluded window, and keeps the first round's labels
    first = plugin.pseudo.clone()
    plugin.acquire(state)
    assert torch.equal(plugin.pseudo[first != 255], first[first != 255]) and plugin.rounds_done == 2


def test_oracle_rows_map_the_truth_to_rows_and_keep_missing_truth_ignored():
    import numpy as np

    from jascl.methods.baselines.semi.halo import oracle_rows

    seen = [0, 2, 5, 7]  # classifier rows 0..3
    lut = {c: r for r, c in enumerate(seen)} | {255: 255}

    def class_index(ids):
        return torch.tensor([lut[int(i)] for i in ids.flatten()]).view_as(ids)

    truth = np.array([[0, 5, 7], [9, 255, 2]], dtype=np.uint8)  # 9: a class the session does not teach
    rows = oracle_rows(truth, [5, 7], "background", class_index)
    assert rows.tolist() == [[0, 2, 3], [0, 255, 0]]  # 2 is not taught either: background, as labelled data
    rows = oracle_rows(truth, [5, 7], "ignore", class_index)
    assert rows.tolist() == [[0, 2, 3], [255, 255, 255]]


def _acquiring_plugin(oracle, pool, budget=0.6):
    from types import SimpleNamespace

    from jascl.methods.baselines.semi._hyperbolic import HyperbolicHead
    from jascl.methods.baselines.semi.halo import HALOPlugin

    plugin = HALOPlugin(budget=budget, rounds=2, region_radius=1, mask_radius=2, oracle=oracle)
    torch.manual_seed(0)
    plugin.head = HyperbolicHead(3, 3, channels=4)
    plugin.pseudo = torch.full((len(pool), 8, 8), 255, dtype=torch.long)
    plugin.excluded = torch.zeros(len(pool), 8, 8, dtype=torch.bool)
    plugin._loader = SimpleNamespace(batch_size=2)
    return plugin


def test_oracle_reveals_the_pool_truth_of_the_acquired_pixels_and_skips_pixels_without_truth():
    """HALO's defining part: acquired pixels take the ground truth (here class 5 = row 1 on a diagonal band), not
    the model's argmax (row 2 everywhere); pixels the pool has no truth for (255) are never acquired."""
    from types import SimpleNamespace

    import numpy as np

    from jascl.networks.base import SegmenterOutput

    class Fixed(torch.nn.Module):  # logits: row 2 wins everywhere; features: the image itself
        def forward_features(self, x):
            logits = torch.stack([x[:, 0], 0 * x[:, 0], 2 + 0 * x[:, 0]], dim=1)
            return SegmenterOutput(logits, x.repeat(1, 3, 1, 1))

    class Split:
        def __init__(self, images, labels):
            self.images, self.labels = images, labels

        def __len__(self):
            return len(self.images)

    g = torch.Generator().manual_seed(0)
    images = [torch.rand(1, 8, 8, generator=g).numpy() for _ in range(2)]
    truth = np.zeros((8, 8), dtype=np.uint8)
    truth[np.abs(np.subtract.outer(np.arange(8), np.arange(8))) <= 1] = 5
    missing = np.full((8, 8), 255, dtype=np.uint8)  # a borrowed pool image: no label file
    missing[:, :2] = 0
    pool = Split(images, [truth, missing])
    seen = [0, 5, 7]

    def class_index(ids):
        lut = torch.full((256,), -1, dtype=torch.long)
        lut[255] = 255
        for r, c in enumerate(seen):
            lut[c] = r
        return lut[ids.long()]

    session = SimpleNamespace(classes=(5, 7), other_classes="background")
    state = SimpleNamespace(
        model=Fixed(),
        data=SimpleNamespace(unlabelled=pool),
        device=torch.device("cpu"),
        session=session,
        class_index=class_index,
    )
    plugin = _acquiring_plugin(True, pool)
    added = plugin.acquire(state)
    plugin.acquire(state)
    labelled = plugin.pseudo != 255
    assert added > 0 and plugin.revealed == int(labelled.sum())
    expected = class_index(torch.from_numpy(truth))
    assert torch.equal(plugin.pseudo[0][labelled[0]], expected[labelled[0]])  # the truth, rows 0 and 1
    assert set(plugin.pseudo[0][labelled[0]].tolist()) <= {0, 1} and 2 not in plugin.pseudo[labelled].tolist()
    assert labelled[1].any() and not labelled[1][:, 2:].any()  # image 1: only its two labelled columns
    # without the oracle the same acquisition labels with the model's argmax (row 2) and reveals nothing
    self_training = _acquiring_plugin(False, pool)
    self_training.acquire(state)
    assert set(self_training.pseudo[self_training.pseudo != 255].tolist()) == {2} and self_training.revealed == 0
    # the session's record states what the oracle revealed
    state.seen, state.report = seen, {}
    plugin.after_training(state)
    record = state.report["pseudo_labels"]
    assert record["filter"] == "oracle" and record["revealed"] == plugin.revealed and record["precision"] == 1.0
