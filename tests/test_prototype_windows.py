"""A prototype pass over volumes larger than the training patch runs the model on sliding windows, as the
evaluation does, so its memory is bounded by the patch; images and volumes that fit the patch go through the model
whole (``jascl.engine.tasks.segmentation.accumulate_prototypes``). A volume whose stitched features would exceed the pass's bound is
taken in the evaluator's blocks, and its pieces' sums add up to the same prototypes (``prototype_blocks``,
``PrototypeAccumulator.add_piece``)."""

import json

import pytest
import torch
from monai.inferers import sliding_window_inference

from conftest import toy_protocol_dict
from jascl.data.synthetic import load_or_generate
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import FORMS, PrototypeRequest, per_sample_prototypes, prototypes_from_sums, sample_sums
from jascl.engine.tasks import segmentation
from jascl.methods import Method
from jascl.protocols import parse_protocol

REQUESTS = [PrototypeRequest((0, 1, 2)), PrototypeRequest((1, 2), per_sample=True, complement=True)]


def _toy(dims: int, size: int):
    """The toy protocol with samples of ``size`` per axis and 4 base samples."""
    spec = toy_protocol_dict(dims)
    spec["synthetic"]["size"] = size
    spec["sessions"][0]["train"] = 4
    return parse_protocol(spec, f"toy-{dims}d.yaml")


def _pass(protocol, patch, tmp_path):
    """The requests' pass over session 0 with ``patch``, and the spatial shapes the model was given."""
    overrides = [f"patch_size={json.dumps(patch)}", "sw_overlap=0.5", "sw_batch_size=4", "batch_size=2"]
    config = resolve_config(protocol.training, protocol.path, overrides=overrides)
    data = load_or_generate(protocol, tmp_path / "cache")
    trainer = ContinualTrainer(protocol, config, Method("m", []), data, progress=False)
    torch.manual_seed(0)
    model = trainer.initial_model(3)
    shapes = []
    forward = model.forward_features

    def recorded(x):
        shapes.append(tuple(x.shape[2:]))
        return forward(x)

    model.forward_features = recorded
    results = trainer.task.compute_prototype_requests(model, 0, REQUESTS)
    model.forward_features = forward
    return trainer, model, data, results, shapes


def _expected(model, data, features_of):
    """The requests' answers from every sample's features as ``features_of`` gives them (accumulated here)."""
    split = data[0].train
    accs = [r.accumulator() for r in REQUESTS]
    with torch.no_grad():
        for i in range(len(split)):
            image = torch.from_numpy(split.images[i][None]).float()
            labels = torch.from_numpy(split.labels[i][None]).long()
            for acc in accs:
                acc.update(features_of(image), labels)
    return [r.result(acc) for r, acc in zip(REQUESTS, accs)]


def _windowed(model):
    """Features of one whole volume through MONAI's sliding windows (the pass's settings in ``_pass``)."""
    return lambda image: sliding_window_inference(
        image, (32, 32, 32), 4, lambda w: model.forward_features(w).features, 0.5
    )


def _close(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and x
        for c in x:
            assert torch.allclose(x[c], y[c], atol=1e-5), c


def test_volumes_larger_than_the_patch_go_through_sliding_windows(tmp_path):
    trainer, model, data, got, shapes = _pass(_toy(3, 48), [32, 32, 32], tmp_path)
    # the model never sees more than the patch: 48^3 volumes in windows of 32^3
    assert shapes and all(s == (32, 32, 32) for s in shapes)
    # at overlap 0.5, 2 window starts per axis (0, 16): 8 windows per volume, forwards of 4
    assert len(shapes) == 4 * 8 // 4
    model.eval()
    _close(got, _expected(model, data, _windowed(model)))
    whole = _expected(model, data, lambda image: model.forward_features(image).features)
    assert any(not torch.allclose(got[0][c], whole[0][c], atol=1e-5) for c in got[0])  # (so the rule acts)


@pytest.mark.parametrize("dims, size, patch", [(3, 32, [32, 32, 32]), (2, 64, [32, 32])])
def test_images_and_volumes_that_fit_the_patch_go_through_whole(dims, size, patch, tmp_path):
    trainer, model, data, got, shapes = _pass(_toy(dims, size), patch, tmp_path)
    # (2D images larger than the patch too: a whole image costs little)
    assert shapes == [(size,) * dims] * 2  # one forward per batch of 2 whole samples
    model.eval()
    _close(got, _expected(model, data, lambda image: model.forward_features(image).features))


def test_a_volume_too_large_to_hold_is_taken_in_blocks_with_the_same_prototypes(tmp_path, monkeypatch):
    monkeypatch.setattr(segmentation, "PROTOTYPE_BLOCK_ELEMENTS", 1)  # nothing fits: the evaluator's finest blocks
    sources = []
    stitched = segmentation.whole_sample_features

    def recorded(model, x, *args):
        sources.append(tuple(x.shape))
        return stitched(model, x, *args)

    monkeypatch.setattr(segmentation, "whole_sample_features", recorded)
    trainer, model, data, got, shapes = _pass(_toy(3, 48), [32, 32, 32], tmp_path)
    assert shapes and all(s == (32, 32, 32) for s in shapes)
    # window starts 0 and 16 per axis: two chunks per axis, targets [0, 16) and [16, 48) with sources [0, 32) and
    # [0, 48); 8 blocks per volume, one volume at a time (4 volumes)
    assert len(sources) == 4 * 8 and all(s[0] == 1 for s in sources)
    assert sorted(set(sources))[0] == (1, 1, 32, 32, 32) and (1, 1, 48, 48, 48) in sources
    model.eval()
    _close(got, _expected(model, data, _windowed(model)))


def test_prototype_blocks_only_when_the_stitched_features_exceed_the_bound(monkeypatch):
    volume = torch.zeros(2, 1, 48, 40, 32)
    assert segmentation.prototype_blocks(volume, [32, 32, 32], 0.5, 8) is None  # 2 x 8 x 61440 < 2^29
    assert segmentation.prototype_blocks(volume, [48, 40, 32], 0.5, 8) is None  # fits the patch: no windows
    assert segmentation.prototype_blocks(torch.zeros(2, 1, 48, 40), [32, 32], 0.5, 8) is None  # images
    monkeypatch.setattr(segmentation, "PROTOTYPE_BLOCK_ELEMENTS", 8 * 48 * 40 * 32)  # one sample's, not two
    blocks = segmentation.prototype_blocks(volume, [32, 32, 32], 0.5, 8)
    assert blocks is not None and len(blocks) == 1  # one sample at a time fits whole
    monkeypatch.setattr(segmentation, "PROTOTYPE_BLOCK_ELEMENTS", 8 * 48 * 40 * 32 - 1)
    blocks = segmentation.prototype_blocks(volume, [32, 32, 32], 0.5, 8)
    assert blocks is not None and len(blocks) > 1
    covered = torch.zeros(48, 40, 32)
    for block in blocks:
        covered[block.target] += 1
    assert torch.equal(covered, torch.ones(48, 40, 32))  # the targets tile the volume once


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("complement", [False, True])
@pytest.mark.parametrize("normalize_pixels", [False, True])
def test_pieces_sums_add_up_to_the_whole_samples_prototypes(form, complement, normalize_pixels):
    torch.manual_seed(0)
    features = torch.randn(1, 4, 6, 5, 4)
    labels = torch.randint(0, 3, (1, 6, 5, 4))
    labels[0, :2] = 255  # ignore pixels
    labels[0, 5, 0, 0] = 4  # a class in one piece only, one pixel
    classes = [0, 1, 2, 4, 7]  # 7: absent
    whole = per_sample_prototypes(features, labels, classes, normalize_pixels, complement, form)
    totals: dict = {}
    for piece in (slice(0, 2), slice(2, 5), slice(5, 6)):
        for c, (s, n, m, o) in sample_sums(
            features[:, :, piece], labels[:, piece], classes, normalize_pixels, complement, form
        ).items():
            t = totals.get(c, (0, 0, 0, 0))
            totals[c] = (t[0] + s, t[1] + n, t[2] + m, t[3] + o)
    pieces = prototypes_from_sums(totals, complement, form)
    assert pieces.keys() == {c for c, v in whole.items() if v}
    for c, vector in pieces.items():
        assert torch.allclose(vector, whole[c][0], atol=1e-6)


def test_the_features_alone_are_the_features_stitched_with_the_logits():
    from jascl.networks.base import create_segmenter, whole_sample_features, whole_sample_forward

    torch.manual_seed(0)
    model = create_segmenter("unet", 3, 1, 5, features=[4, 4, 8, 8, 8, 6]).eval()
    x = torch.randn(1, 1, 50, 40, 36)
    with torch.no_grad():
        both = whole_sample_forward(model, x, [32, 32, 32], 2, 0.5)
        alone = whole_sample_features(model, x, [32, 32, 32], 2, 0.5)
    assert alone.shape == (1, 6, 50, 40, 36) and torch.equal(alone, both.features)
