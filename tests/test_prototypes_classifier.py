"""Eq. 2 prototypes on a tiny feature map, the prototype store, replay loss, classifier growth."""

import math

import pytest
import torch
import torch.nn.functional as F

from jascl.engine.prototypes import PrototypeAccumulator, PrototypeStore, class_prototypes
from jascl.methods.replay import prototype_replay_loss
from jascl.networks import create_segmenter
from jascl.networks.classifier import PixelClassifier


def _tiny_batch():
    # two samples, D = 2 features on a 2x2 map (pixels in raster order)
    f1 = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 2.0]])  # labels 1 1 0 0
    f2 = torch.tensor([[0.0, 1.0], [1.0, 1.0], [5.0, 5.0], [5.0, 5.0]])  # labels 1 1 2 2
    feats = torch.stack([f1, f2]).transpose(1, 2).reshape(2, 2, 2, 2)
    labels = torch.tensor([[1, 1, 0, 0], [1, 1, 2, 2]]).reshape(2, 2, 2)
    return feats, labels


def test_eq2_prototypes_by_hand():
    feats, labels = _tiny_batch()
    protos = class_prototypes(feats, labels, [0, 1, 2])
    # class 1: sample 1 mean (2, 0) -> (1, 0); sample 2 mean (0.5, 1) -> (1, 2)/sqrt(5); average of the two
    s = 5**0.5
    assert torch.allclose(protos[1], torch.tensor([(1 + 1 / s) / 2, (2 / s) / 2]), atol=1e-6)
    assert torch.allclose(protos[0], torch.tensor([0.0, 1.0]))  # only in sample 1: mean (0, 2) -> (0, 1)
    assert torch.allclose(protos[2], torch.tensor([1.0, 1.0]) / 2**0.5)
    # streaming over two batches of one sample gives the same result
    acc = PrototypeAccumulator([0, 1, 2])
    acc.update(feats[:1], labels[:1])
    acc.update(feats[1:], labels[1:])
    for c, p in acc.compute().items():
        assert torch.allclose(p, protos[c], atol=1e-6)


def test_prototypes_from_lower_resolution_features():
    feats = torch.zeros(1, 2, 1, 2)
    feats[0, :, 0, 0] = torch.tensor([1.0, 0.0])
    feats[0, :, 0, 1] = torch.tensor([0.0, 1.0])
    labels = torch.tensor([[[0, 0, 3, 3], [0, 0, 3, 3]]])  # 2x4 labels, resized (nearest) to 1x2
    protos = class_prototypes(feats, labels, [0, 3])
    assert torch.allclose(protos[0], torch.tensor([1.0, 0.0])) and torch.allclose(protos[3], torch.tensor([0.0, 1.0]))


def test_store_roundtrip_and_lookup_by_class(tmp_path):
    store = PrototypeStore()
    store.add(0, {0: torch.tensor([1.0, 0.0]), 2: torch.tensor([0.0, 1.0])})
    store.add(1, {0: torch.tensor([0.5, 0.5]), 7: torch.tensor([0.2, 0.8])})
    store.save(tmp_path / "p.safetensors")
    loaded = PrototypeStore.load(tmp_path / "p.safetensors")
    assert set(loaded.entries) == {(0, 0), (0, 2), (1, 0), (1, 7)}
    assert torch.equal(loaded.latest(0), torch.tensor([0.5, 0.5]))  # by class id, newest session
    assert torch.equal(loaded.latest(2), torch.tensor([0.0, 1.0]))
    vectors, ids = loaded.before(1).tensors()
    assert ids.tolist() == [0, 2] and vectors.shape == (2, 2)


def test_replay_loss_by_hand():
    clf = PixelClassifier(2, 2, cosine=True, temperature=1.0)
    with torch.no_grad():
        clf.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    protos = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    targets = torch.tensor([0, 1])
    # each prototype: logits (1, 0) for its own class -> CE = log(1 + e^-1)
    per = math.log(1 + math.exp(-1))
    assert prototype_replay_loss(clf, protos, targets, "sum").item() == pytest.approx(2 * per, rel=1e-6)
    assert prototype_replay_loss(clf, protos, targets, "mean").item() == pytest.approx(per, rel=1e-6)


@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("dims", [2, 3])
def test_growth_keeps_old_logits(cosine, dims):
    torch.manual_seed(0)
    model = create_segmenter("unet", dims, 1, 3, cosine=cosine, features=(4, 4, 8, 8, 8, 6)).eval()
    x = torch.randn(2, 1, *([32] * dims))
    before = model(x)
    old_rows = model.classifier.weight.detach().clone()
    model.classifier.grow(2, init=torch.randn(2, 6))
    after = model(x)
    assert after.shape[1] == 5
    assert torch.equal(model.classifier.weight[:3], old_rows)  # old rows kept bit-exactly
    # same logits for the old classes; only float rounding of a GEMM of another shape may differ
    assert torch.allclose(after[:, :3], before, rtol=0, atol=1e-5)


def test_imprinted_rows_are_normalised_prototypes():
    clf = PixelClassifier(3, 1)
    clf.grow(1, init=torch.tensor([[3.0, 0.0, 4.0]]))
    assert torch.allclose(clf.weight[1], torch.tensor([0.6, 0.0, 0.8]))
    # a feature equal to the prototype scores the full temperature on the new row
    logits = clf(torch.tensor([[3.0, 0.0, 4.0]]))
    assert logits[0, 1].item() == pytest.approx(10.0, rel=1e-6)
    assert F.normalize(clf.weight, dim=1).shape == (2, 3)
