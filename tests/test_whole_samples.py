"""Whole samples in methods' statistics passes: batched only when they share a shape, volumes larger than the patch
through sliding windows, kept samples cut to the patch (jascl.methods.common, jascl.networks.base)."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jascl.data.types import Split  # noqa: E402
from jascl.experiments.runner import run_benchmark  # noqa: E402
from jascl.methods.common import labelled_loader, patch_around, whole_forward  # noqa: E402
from jascl.networks.base import Backbone, Segmenter, create_segmenter, whole_sample_forward  # noqa: E402
from jascl.protocols import parse_protocol  # noqa: E402
from test_real_protocols import fake_protocol, tiny_config, write_several_sizes  # noqa: E402


class Pointwise(Backbone):
    """A 1 x 1 (x 1) convolution: every output pixel depends on its own input pixel only, so windows stitched
    together give exactly the whole sample's outputs. Records the spatial size of every input it sees."""

    in_channels = 1
    feature_channels = 3

    def __init__(self, spatial_dims: int) -> None:
        super().__init__()
        self.spatial_dims = spatial_dims
        self.conv = (nn.Conv2d if spatial_dims == 2 else nn.Conv3d)(1, 3, 1)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape[2:]))
        return self.conv(x)


def pointwise_model(spatial_dims: int) -> Segmenter:
    torch.manual_seed(0)
    return Segmenter(Pointwise(spatial_dims), num_classes=2).eval()


def test_a_volume_larger_than_the_patch_goes_through_windows_with_the_whole_outputs():
    model = pointwise_model(3)
    x = torch.randn(1, 1, 10, 12, 9)
    with torch.no_grad():
        whole = model.forward_features(x)
        model.backbone.seen.clear()
        out = whole_sample_forward(model, x, [8, 8, 8], sw_batch_size=1, overlap=0.25)
    # MONAI's grid: 2 windows along each axis (10, 12 and 9 > 8), one at a time
    assert model.backbone.seen == [(8, 8, 8)] * 8
    assert out.logits.shape == (1, 2, 10, 12, 9) and out.features.shape == (1, 3, 10, 12, 9)
    torch.testing.assert_close(out.features, whole.features, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logits, whole.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "spatial_dims, shape, roi",
    [
        (3, (8, 8, 6), [8, 8, 8]),  # fits the patch
        (3, (10, 12, 9), None),  # no patch: whole samples
        (2, (40, 50), [16, 16]),  # images always go whole
    ],
)
def test_everything_else_is_one_forward_as_before(spatial_dims, shape, roi):
    model = pointwise_model(spatial_dims)
    x = torch.randn(2, 1, *shape)
    with torch.no_grad():
        expected = model.forward_features(x)
        model.backbone.seen.clear()
        out = whole_sample_forward(model, x, roi)
    assert model.backbone.seen == [shape]
    assert torch.equal(out.features, expected.features) and torch.equal(out.logits, expected.logits)


class Ragged(list):
    """Lazy samples of a real dataset: indexable, varying sizes, ``uniform`` False."""

    uniform = False
    ndim = 4


def state_of(images, labels, batch_size=3, patch=None):
    split = Split(images, labels, [f"s{i}" for i in range(len(images))])
    config = SimpleNamespace(batch_size=batch_size, patch_size=patch, sw_batch_size=1, sw_overlap=0.25)
    session = SimpleNamespace(classes=[1, 2], other_classes="background")
    return SimpleNamespace(data=SimpleNamespace(train=split), session=session, config=config)


def test_the_labelled_loader_batches_only_samples_of_one_shape():
    images = np.zeros((5, 1, 8, 8), np.float32)
    labels = np.zeros((5, 8, 8), np.uint8)
    batches = list(labelled_loader(state_of(images, labels)))
    assert [len(b["id"]) for b in batches] == [3, 2]
    assert [len(b["id"]) for b in labelled_loader(state_of(images, labels), batch_size=4)] == [4, 1]
    sizes = [(8, 8), (8, 12), (6, 8)]
    ragged = Ragged([np.zeros((1, *s), np.float32) for s in sizes])
    truth = Ragged([np.full(s, 2, np.uint8) for s in sizes])
    batches = list(labelled_loader(state_of(ragged, truth)))  # batch_size 3 asked: would not stack
    assert [tuple(b["image"].shape) for b in batches] == [(1, 1, 8, 8), (1, 1, 8, 12), (1, 1, 6, 8)]
    assert [int(b["label"].unique()) for b in batches] == [2, 2, 2]


def test_whole_forward_takes_the_runs_patch_and_window_options():
    model = pointwise_model(3)
    state = state_of(np.zeros((1, 1, 4, 4, 4), np.float32), np.zeros((1, 4, 4, 4), np.uint8), patch=[8, 8, 8])
    state.config.sw_batch_size = 4
    with torch.no_grad():
        whole_forward(state, model, torch.randn(1, 1, 12, 8, 8))
    assert model.backbone.seen == [(8, 8, 8)]  # two windows along the first axis, in one call (sw_batch_size 4)
    state.config.patch_size = None
    model.backbone.seen.clear()
    with torch.no_grad():
        whole_forward(state, model, torch.randn(1, 1, 12, 8, 8))
    assert model.backbone.seen == [(12, 8, 8)]


def test_patch_around_centres_a_pixel_of_the_class_clamped_to_the_sample():
    image = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6)
    label = torch.zeros(4, 6, dtype=torch.long)
    label[1, 5] = 2
    rng = np.random.default_rng(0)
    cut, lab = patch_around(image, label, [3, 3], rng, cls=2)
    # centre (1, 5): rows max(1 - 1, 0) = 0 .. 2, columns min(5 - 1, 6 - 3) = 3 .. 5
    assert torch.equal(cut, image[:, 0:3, 3:6]) and torch.equal(lab, label[0:3, 3:6])
    assert int(lab[1, 2]) == 2


def test_patch_around_pads_small_samples_with_zero_and_ignore():
    image = torch.ones(1, 2, 2)
    label = torch.tensor([[0, 1], [1, 0]])
    cut, lab = patch_around(image, label, [3, 4], np.random.default_rng(0))  # any taught class: 1
    assert cut.shape == (1, 3, 4) and lab.shape == (3, 4)
    assert torch.equal(cut[0], torch.tensor([[1.0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]))
    assert torch.equal(lab, torch.tensor([[0, 1, 255, 255], [1, 0, 255, 255], [255, 255, 255, 255]]))


def test_patch_around_without_the_class_takes_the_centre_and_a_patch_sized_sample_stays():
    image = torch.arange(36, dtype=torch.float32).reshape(1, 6, 6)
    label = torch.zeros(6, 6, dtype=torch.long)
    cut, _ = patch_around(image, label, [2, 2], np.random.default_rng(0), cls=3)
    assert torch.equal(cut, image[:, 2:4, 2:4])  # centre (3, 3): start 3 - 1 = 2
    rng = np.random.default_rng(7)
    same = patch_around(image, label, [6, 6], rng, cls=3)
    assert same[0] is image and same[1] is label
    assert rng.integers(1000) == np.random.default_rng(7).integers(1000)  # nothing drawn


#: the methods with a pass over the session's whole labelled samples (or a memory of them); before such
#: samples came one at a time, all but plop, pifs and bcm stopped with torch's "stack expects each tensor to
#: be equal size" on a dataset whose samples differ in size (every real 3D dataset). gen-replay (one more,
#: which did not stop) is left out: its generator's training takes 50 s here
WHOLE_SAMPLE_METHODS = [
    "adapt-replay", "bcm", "c-fscil", "fecam", "gaps", "nc-fscil", "pifs", "plop", "saving100x", "subspace", "yooop",
]  # fmt: skip


def test_methods_with_whole_sample_passes_train_on_samples_of_different_sizes(tmp_path):
    root = write_several_sizes(tmp_path / "fake")
    protocol = parse_protocol(fake_protocol(), "fake.yaml")
    results = run_benchmark(
        protocol,
        tiny_config(protocol, [32, 32]),
        WHOLE_SAMPLE_METHODS,
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda *a: None,
        roots={"fakeroot": root},
    )
    for method in WHOLE_SAMPLE_METHODS:
        last = results["methods"][method]["sessions"][1]["per_class"]
        assert {c for c, v in last.items() if v == v} == {"0", "1", "2", "3"}, method


def test_gen_replays_conv_generator_imitates_training_crops_not_whole_samples():
    from jascl.methods.baselines.replay._gen_sources import ConvSource
    from jascl.methods.baselines.replay.gen_replay import GenReplayOptions

    sizes = [(40, 40), (40, 56), (48, 40)]
    images = Ragged([torch.rand(1, *s).numpy() for s in sizes])
    labels = Ragged([np.ones(s, np.uint8) for s in sizes])
    state = state_of(images, labels, batch_size=2, patch=[32, 32])
    state.seed, state.session.index, state.device = 0, 0, torch.device("cpu")
    state.model = create_segmenter("unet", 2, 1, 3, features=[4, 4, 8, 8, 8, 8])
    source = ConvSource(GenReplayOptions(generator="conv"))
    layers, _, count, size, channels = source.reference_statistics(state)
    # before, the whole samples went through the model and the generator took the first one's size, (40, 40)
    assert (count, size, channels) == (3, (32, 32), 1) and layers


def test_labelled_crops_are_patches_drawn_from_the_seed_and_purpose():
    from jascl.methods.common import labelled_crops

    sizes = [(40, 40), (40, 56), (48, 40)]
    images = Ragged([np.random.default_rng(i).random((1, *s), np.float32) for i, s in enumerate(sizes)])
    labels = Ragged([np.ones(s, np.uint8) for s in sizes])
    state = state_of(images, labels, patch=[32, 32])
    state.seed, state.session.index = 3, 1

    def crops(purpose):
        return [labelled_crops(state, purpose)[i]["image"] for i in range(3)]

    first, again, other = crops("retrieve"), crops("retrieve"), crops("gen-replay")
    assert [tuple(c.shape) for c in first] == [(1, 32, 32)] * 3
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    state.config.patch_size = None  # no patch: the whole samples
    assert [tuple(c.shape[1:]) for c in crops("retrieve")] == sizes


class LazyLabels(Ragged):
    """A real pool's labels: read sample by sample, never as one array (as jascl.data.real.LazySamples)."""

    def __array__(self, *args, **kwargs):
        raise TypeError("a lazy split is not held in memory as one array; index it sample by sample")


def test_the_pseudo_label_report_reads_a_lazy_pool_sample_by_sample():
    """UaD-CE, HALO and FSCIL-SS stopped at the end of every incremental session of a real dataset: the report read
    the pool's labels as one array."""
    from jascl.methods.pas import pool_pseudo_label_report

    truth = [np.array([[1, 2], [255, 0]], np.uint8), np.array([[0, 0], [2, 2]], np.uint8)]
    pseudo = torch.tensor([[[1, 1], [0, 255]], [[255, 255], [2, 0]]])
    for labels in (np.stack(truth), LazyLabels(truth)):
        report = pool_pseudo_label_report(labels, pseudo, [0, 1, 2], "uad-ce", 3)
        # kept 5 of 8 pixels; of the 4 with a known truth, 2 right (1 at (0, 0, 0), 2 at (1, 1, 0))
        assert report == {"method": "uad-ce", "rounds": 3, "coverage": 5 / 8, "precision": 0.5}


def test_ewcs_fisher_takes_its_gradients_on_training_crops_of_volumes_and_on_whole_images():
    """A whole CT volume's backward pass does not fit a GPU: the Fisher of EWC (and online EWC) is measured on
    training crops of volumes (before, the whole volumes below went through the model), on whole images in 2D
    (as Kirkpatrick et al., and as before)."""
    from jascl.methods.baselines.regularization.ewc import EWCPlugin

    for sizes, patch, seen in [
        ([(10, 12, 9), (8, 8, 8), (12, 10, 10)], [8, 8, 8], [(8, 8, 8)] * 3),
        ([(40, 40), (40, 56)], [32, 32], [(40, 40), (40, 56)]),
    ]:
        images = Ragged([np.random.default_rng(i).random((1, *s), np.float32) for i, s in enumerate(sizes)])
        images.ndim = 2 + len(patch)
        labels = Ragged([np.ones(s, np.uint8) for s in sizes])
        state = state_of(images, labels, patch=patch)
        state.seed, state.session.index, state.device = 0, 1, torch.device("cpu")
        state.freeze_incremental, state.class_index = "all_but_classifier", lambda ids: ids.long()
        state.model = pointwise_model(len(patch))
        fisher, anchors = EWCPlugin().session_fisher(state)
        assert state.model.backbone.seen == seen
        assert set(fisher) == set(anchors) == {"classifier.weight"} and bool((fisher["classifier.weight"] > 0).any())


def _class_sums(batches) -> dict[int, tuple[torch.Tensor, int]]:
    """C-FSCIL's and NC-FSCIL's statistics: every class's feature sum and pixel count over the batches."""
    out: dict[int, tuple[torch.Tensor, int]] = {}
    for features, labels in batches:
        flat = features.movedim(1, -1)
        for c in labels.unique().tolist():
            s, n = out.get(c, (0.0, 0))
            out[c] = (s + flat[labels == c].double().sum(0), n + int((labels == c).sum()))
    return out


def test_volumes_too_large_to_hold_come_in_pieces_with_the_whole_passes_class_statistics(monkeypatch):
    """``eval_features(pieces=True)``: above the bound, one sample at a time in the prototype pass's blocks; the
    class sums, counts and FeCAM's Gaussians are the whole pass's. Without ``pieces`` nothing changes."""
    from jascl.engine.tasks import segmentation
    from jascl.methods.baselines.fewshot._shared import eval_features
    from jascl.methods.baselines.fewshot.fecam import GaussianAccumulator

    gen = torch.Generator().manual_seed(0)
    images = torch.randn(2, 1, 12, 10, 9, generator=gen).numpy()
    labels = torch.randint(0, 3, (2, 12, 10, 9), generator=gen).to(torch.uint8).numpy()
    state = state_of(images, labels, batch_size=2, patch=[8, 8, 8])
    state.device = torch.device("cpu")
    model = pointwise_model(3)

    def passes(pieces: bool) -> tuple[list, dict, dict]:
        batches = list(eval_features(state, model, labelled_loader(state), pieces=pieces))
        gauss = GaussianAccumulator([0, 1, 2], beta=0.5)
        for features, lab in batches:
            gauss.update(features, lab)
        return [tuple(f.shape) for f, _ in batches], _class_sums(batches), gauss.compute()

    whole_shapes, whole_sums, whole_gauss = passes(True)  # 2 x 3 x 1080 elements: under the bound, one batch
    assert whole_shapes == [(2, 3, 12, 10, 9)]
    monkeypatch.setattr(segmentation, "PROTOTYPE_BLOCK_ELEMENTS", 1)  # nothing fits: the finest blocks
    shapes, sums, gauss = passes(True)
    assert len(shapes) == 2 * 8 and all(s[0] == 1 for s in shapes)  # 2 chunks per axis, one sample at a time
    assert sum(math.prod(s[2:]) for s in shapes) == 2 * 12 * 10 * 9  # the blocks tile each volume once
    assert sums.keys() == whole_sums.keys() == {0, 1, 2}
    for c, (s, n) in sums.items():
        assert n == whole_sums[c][1]
        torch.testing.assert_close(s, whole_sums[c][0], rtol=1e-9, atol=1e-9)
        for got, expected in zip(gauss[c], whole_gauss[c]):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expected), rtol=1e-6, atol=1e-9)
    assert passes(False)[0] == whole_shapes  # without pieces: whole samples even above the bound


def test_per_sample_statistics_of_pifs_and_gaps_add_up_over_a_volumes_pieces(monkeypatch):
    """``sample_pieces``: every sample numbered, above the bound in blocks that come one after another; PIFS's
    prototypes (per-image sums normalised at each image's end), GAPS's memory scores and scene embeddings are
    the whole pass's, and the scores are GAPS's formula computed here by hand."""
    from jascl.engine.tasks import segmentation
    from jascl.methods.baselines.fewshot._gaps_features import memory_scores, scene_embeddings
    from jascl.methods.baselines.fewshot._shared import sample_pieces
    from jascl.methods.baselines.fewshot.pifs import pifs_prototypes

    gen = torch.Generator().manual_seed(1)
    images = torch.randn(5, 1, 12, 10, 9, generator=gen)
    labels = torch.randint(0, 3, (5, 12, 10, 9), generator=gen).to(torch.uint8)
    labels[3] = 0  # an image without class 1 or 2 gets no score
    state = state_of(images.numpy(), labels.numpy(), batch_size=2, patch=[8, 8, 8])
    state.device, state.seen = torch.device("cpu"), [0, 1]
    model = state.model = pointwise_model(3)

    def passes():
        numbers = [s for s, _, _ in sample_pieces(state, model, labelled_loader(state))]
        protos = pifs_prototypes(sample_pieces(state, model, labelled_loader(state)), [1, 2])
        return numbers, protos, memory_scores(state, [1]), scene_embeddings(state, model, list(images))

    numbers, protos, scores, embeddings = passes()
    assert numbers == [0, 1, 2, 3, 4]  # under the bound: whole samples, in order
    with torch.no_grad():
        features = model.forward_features(images).features
    w = F.normalize(model.classifier.weight.detach().float(), dim=1)[1]
    by_hand = []
    for i in (0, 1, 2, 4):
        mask = labels[i] == 1
        pooled = F.normalize(F.normalize(features[i], dim=0)[:, mask].mean(dim=1), dim=0)
        by_hand.append((float(pooled @ w) / float(mask.float().mean()), i))
    assert [i for _, i in scores[1]] == [i for _, i in by_hand]
    np.testing.assert_allclose([v for v, _ in scores[1]], [v for v, _ in by_hand], rtol=1e-5)
    torch.testing.assert_close(embeddings, F.normalize(features.flatten(2).mean(-1), dim=1))

    monkeypatch.setattr(segmentation, "PROTOTYPE_BLOCK_ELEMENTS", 1)  # nothing fits: the finest blocks
    blocked_numbers, blocked_protos, blocked_scores, blocked_embeddings = passes()
    assert blocked_numbers == [s for s in range(5) for _ in range(8)]  # 2 chunks per axis, one sample after another
    assert blocked_protos.keys() == protos.keys() == {1, 2}
    for c in protos:
        torch.testing.assert_close(blocked_protos[c], protos[c], rtol=1e-5, atol=1e-6)
    assert [i for _, i in blocked_scores[1]] == [i for _, i in scores[1]]
    np.testing.assert_allclose([v for v, _ in blocked_scores[1]], [v for v, _ in scores[1]], rtol=1e-5)
    torch.testing.assert_close(blocked_embeddings, embeddings, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "module, cls, collect",
    [("fecam", "FeCAMPlugin", "_collect"), ("cfscil", "CFSCILPlugin", "_collect_gaam"),
     ("ncfscil", "NCFSCILPlugin", "_collect_memory")],
)  # fmt: skip
def test_the_class_statistics_passes_of_fecam_and_the_fscil_methods_take_pieces(module, cls, collect, monkeypatch):
    import importlib

    mod = importlib.import_module(f"jascl.methods.baselines.fewshot.{module}")
    asked = []

    def recorded(state, model, loader, pieces=False):
        asked.append(pieces)
        return iter(())

    monkeypatch.setattr(mod, "eval_features", recorded)
    monkeypatch.setattr(mod, "labelled_loader", lambda state: [])
    state = SimpleNamespace(session=SimpleNamespace(index=1, classes=[3]), model=None)
    getattr(getattr(mod, cls)(), collect)(state)
    assert asked == [True]
