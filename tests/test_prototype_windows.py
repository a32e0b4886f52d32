"""A prototype pass over volumes larger than the training patch runs the model on sliding windows, as the
evaluation does, so its memory is bounded by the patch; images and volumes that fit the patch go through the model
whole (``SegmentationTask.sample_features``)."""

import json

import pytest
import torch
from monai.inferers import sliding_window_inference

from conftest import toy_protocol_dict
from jascl.data.synthetic import load_or_generate
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeRequest
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

    def windowed(image):
        return sliding_window_inference(image, (32, 32, 32), 4, lambda w: model.forward_features(w).features, 0.5)

    _close(got, _expected(model, data, windowed))
    whole = _expected(model, data, lambda image: model.forward_features(image).features)
    assert any(not torch.allclose(got[0][c], whole[0][c], atol=1e-5) for c in got[0])  # (so the rule acts)


@pytest.mark.parametrize("dims, size, patch", [(3, 32, [32, 32, 32]), (2, 64, [32, 32])])
def test_images_and_volumes_that_fit_the_patch_go_through_whole(dims, size, patch, tmp_path):
    trainer, model, data, got, shapes = _pass(_toy(dims, size), patch, tmp_path)
    # (2D images larger than the patch too: a whole image costs little)
    assert shapes == [(size,) * dims] * 2  # one forward per batch of 2 whole samples
    model.eval()
    _close(got, _expected(model, data, lambda image: model.forward_features(image).features))
