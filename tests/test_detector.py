"""The detector (jascl.networks.detector): growth keeps old rows bit-exact, torchvision's losses and post-processing
on hand-made targets, per-box features, GAS on the box classifier, weights from local files."""

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from jascl.errors import ConfigError
from jascl.methods.gas import attach_gas
from jascl.networks.detector import DETECTOR_VARIANTS, Detector, create_detector
from jascl.networks.detector_weights import PREDICTOR_PREFIX, load_detector_weights

LOSSES = {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"}


def small(num_classes: int = 3, seed: int = 0) -> Detector:
    torch.manual_seed(seed)
    return create_detector("small", 1, num_classes, image_size=64)


def images(n: int = 2, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        img = torch.rand(1, 64, 64, generator=g) * 0.2
        img[:, 10:30, 12:36] += 0.7  # a bright square, so that proposals differ in content
        out.append(img)
    return out


def target(boxes: list[list[float]], labels: list[int]) -> dict[str, torch.Tensor]:
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), "labels": torch.tensor(labels)}


def test_variants_and_interface():
    model = small(4)
    assert DETECTOR_VARIANTS == ("small", "resnet50-fpn")
    assert model.num_classes == 4 and model.feature_channels == 128
    assert model.classifier is model.roi_heads.box_predictor.classifier and model.classifier.bias is not None
    assert model.box_regressor.weight.shape == (16, 128)
    # the classifier is registered once (safetensors checkpoints refuse shared tensors)
    assert [k for k in model.state_dict() if k.endswith("classifier.weight")] == [
        "roi_heads.box_predictor.classifier.weight"
    ]
    assert model.frozen_modules(1) == [] and model.encoder_modules() == [model.backbone]
    assert model.head_modules() == [model.rpn, model.roi_heads.box_head]
    with pytest.raises(ConfigError, match="unknown detector variant"):
        create_detector("tiny", 1, 3)
    with pytest.raises(ConfigError, match="box_score_tresh"):
        create_detector("small", 1, 3, box_score_tresh=0.1)
    assert create_detector("small", 1, 3, box_score_thresh=0.3).roi_heads.score_thresh == 0.3
    assert small().roi_heads.score_thresh == 0.05


def test_growth_keeps_old_rows_bit_exact_and_new_rows_by_hand():
    model = small(3).eval()
    batch = images(2)
    targets = [target([[12, 10, 36, 30]], [1]), target([[12, 10, 36, 30]], [2])]
    with torch.no_grad():
        torch.manual_seed(5)
        before = model.forward_train(batch, targets)
        predicted = model.predict(batch)
    old_w = model.classifier.weight.detach().clone()
    old_b = model.classifier.bias.detach().clone()
    old_reg_w = model.box_regressor.weight.detach().clone()
    old_reg_b = model.box_regressor.bias.detach().clone()
    init = torch.randn(2, 128)
    model.grow(2, init)
    assert model.num_classes == 5 and model.box_regressor.weight.shape == (20, 128)
    assert torch.equal(model.classifier.weight[:3], old_w) and torch.equal(model.classifier.bias[:3], old_b)
    assert torch.equal(model.box_regressor.weight[:12], old_reg_w)
    assert torch.equal(model.box_regressor.bias[:12], old_reg_b)
    assert torch.equal(model.box_regressor.bias[12:], torch.zeros(8))
    assert 0 < model.box_regressor.weight[12:].abs().max() < 0.01  # normal, std 0.001
    with torch.no_grad():
        torch.manual_seed(5)
        after = model.forward_train(batch, targets)
    assert torch.equal(after.roi_features, before.roi_features)  # same RoIs, same representations
    # same old-class logits: old rows are bit-exact above; only a GEMM of another width rounds differently (CPU BLAS
    # kernels differ by ~1e-6 between 3 and 5 output columns, as in the segmenters' growth tests)
    assert torch.allclose(after.class_logits[:, :3], before.class_logits, rtol=0, atol=1e-5)
    # new rows by hand: PixelClassifier imprinting (unit rows scaled to the old rows' mean norm, bias the old mean)
    rows = F.normalize(init, dim=1) * old_w.norm(dim=1).mean()
    expected = before.roi_features @ rows.T + old_b.mean()
    assert torch.allclose(after.class_logits[:, 3:], expected, atol=1e-5)
    # whole predict path: with the new classes' scores at exactly 0 (bias -1e4), the old detections are unchanged
    with torch.no_grad():
        model.classifier.bias[3:] = -1e4
        regrown = model.predict(batch)
    for old, new in zip(predicted, regrown):
        assert len(old["boxes"]) > 0
        assert torch.equal(new["labels"], old["labels"]) and torch.equal(new["features"], old["features"])
        assert torch.allclose(new["boxes"], old["boxes"], rtol=0, atol=1e-4)
        assert torch.allclose(new["scores"], old["scores"], rtol=0, atol=1e-6)
        assert torch.allclose(new["logits"][:, :3], old["logits"], rtol=0, atol=1e-5)


def test_forward_train_losses_and_roi_targets_on_hand_made_targets():
    model = small(4).train()
    batch = images(3)
    targets = [target([[12, 10, 36, 30], [40, 40, 60, 62]], [1, 3]), target([], []), target([[5, 5, 25, 20]], [2])]
    torch.manual_seed(0)
    out = model.forward_train(batch, targets)
    assert set(out.losses) == LOSSES and all(torch.isfinite(v) for v in out.losses.values())
    R = len(out.roi_targets)
    assert out.class_logits.shape == (R, 4) and out.roi_features.shape == (R, 128)
    assert out.roi_targets.dtype == torch.int64 and out.roi_batch.dtype == torch.int64
    # roi_batch is sorted by image, at most box_batch_size_per_image (128) RoIs each
    assert torch.equal(out.roi_batch, out.roi_batch.sort().values)
    assert out.roi_batch.bincount(minlength=3).le(128).all()
    # each image's RoIs are background or its own ground-truth rows (the ground truth joins the proposals)
    assert set(out.roi_targets[out.roi_batch == 0].tolist()) == {0, 1, 3}
    assert set(out.roi_targets[out.roi_batch == 1].tolist()) == {0}  # the image without boxes
    assert set(out.roi_targets[out.roi_batch == 2].tolist()) == {0, 2}
    # torchvision's classification loss is the cross-entropy of exactly these logits and targets
    assert torch.allclose(out.losses["loss_classifier"], F.cross_entropy(out.class_logits, out.roi_targets))
    sum(out.losses.values()).backward()
    assert model.classifier.weight.grad is not None and model.backbone[0].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="classifier rows 1..3"):
        model.forward_train(batch[:1], [target([[1, 1, 9, 9]], [4])])


def test_predict_matches_torchvision_postprocessing():
    model = small(3).eval()
    torch.manual_seed(0)
    proposals = [torch.tensor([[2.0, 2, 30, 30], [10, 10, 40, 50], [0, 0, 63, 63]]), torch.tensor([[5.0, 5, 20, 20]])]
    logits, deltas = torch.randn(4, 3), torch.randn(4, 12) * 0.1
    sizes = [(64, 64), (64, 64)]
    ours = model.postprocess(logits, deltas, proposals, sizes)
    boxes, scores, labels = model.roi_heads.postprocess_detections(logits, deltas, proposals, sizes)
    for i in range(2):
        assert torch.equal(ours[i]["boxes"], boxes[i]) and torch.equal(ours[i]["scores"], scores[i])
        assert torch.equal(ours[i]["labels"], labels[i])
        # each detection comes from its RoI: its score is that RoI's softmax at its label
        first = 3 * i
        probs = logits[first + ours[i]["rois"]].softmax(-1)
        assert torch.equal(probs.gather(1, ours[i]["labels"][:, None])[:, 0], ours[i]["scores"])
    with torch.no_grad():
        result = model.predict(images(1))[0]
    assert set(result) == {"boxes", "scores", "labels", "features", "logits"}
    n = len(result["boxes"])
    assert 0 < n <= 50 and result["features"].shape == (n, 128) and result["logits"].shape == (n, 3)
    assert result["labels"].min() >= 1 and result["scores"].min() > 0.05
    assert torch.allclose(result["logits"].softmax(-1).gather(1, result["labels"][:, None])[:, 0], result["scores"])
    assert torch.allclose(model.classifier(result["features"]), result["logits"], atol=1e-5)


def test_boxes_stay_float32_under_bfloat16_autocast():
    model = small(3)
    batch = images(1)
    pooled_boxes = []  # the RoIs the detector pools, seen by a hook on RoIAlign
    model.roi_heads.box_roi_pool.register_forward_hook(lambda m, args, out: pooled_boxes.append(args[1][0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.train().forward_train(batch, [target([[12, 10, 36, 30]], [1])])
        result = model.eval().predict(batch)[0]
        proposals, _ = model.rpn(*_rpn_inputs(model, batch))
    assert all(torch.isfinite(v) for v in out.losses.values())
    assert [b.dtype for b in pooled_boxes] == [torch.float32, torch.float32]
    assert model.box_regressor(out.roi_features).dtype == torch.float32
    assert all(result[k].dtype == torch.float32 for k in ("boxes", "scores", "features", "logits"))
    # what torchvision's RPN alone does under autocast (bfloat16 proposals), which the detector avoids
    assert proposals[0].dtype == torch.bfloat16


def _rpn_inputs(model: Detector, batch: list[torch.Tensor]) -> tuple:
    image_list, _ = model.transform(batch)
    return image_list, model._features(image_list.tensors)


def test_box_features_per_box():
    model = small(3).eval()
    batch = images(2)
    a, b, c = [12.0, 10, 36, 30], [40.0, 40, 60, 62], [0.0, 0, 20, 16]
    with torch.no_grad():
        together = model.box_features(batch, [torch.tensor([a, b, c]), torch.zeros(0, 4)])
        alone = model.box_features(batch[:1], [torch.tensor([b])])
        reversed_ = model.box_features(batch[:1], [torch.tensor([c, b, a])])
    assert together[0].shape == (3, 128) and together[1].shape == (0, 128)
    assert torch.allclose(alone[0][0], together[0][1], atol=1e-6)
    assert torch.allclose(reversed_[0], together[0].flip(0), atol=1e-6)
    assert not torch.allclose(together[0][0], together[0][1])  # different boxes, different features


def test_resolve_layer_and_gas_noise_only_in_training():
    model = small(3)
    assert model.resolve_layer("classifier") is model.classifier
    assert model.resolve_layer("roi_heads.box_head.fc7") is model.roi_heads.box_head.fc7
    with pytest.raises(ConfigError, match="backbone, rpn, roi_heads") as info:
        model.resolve_layer("decoder")
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    clean = copy.deepcopy(model)
    noise = attach_gas(model.resolve_layer("classifier"))
    # scale ~1e-8 on row 1 (G = 1 there, G = 0 elsewhere: eq. 1 gives 1/(1 + 1e8 - 1) there and 1 elsewhere)
    sq_grad = torch.zeros(3, 128)
    sq_grad[1] = 1.0
    noise.set_sq_grad(sq_grad)
    batch = images(2)
    targets = [target([[12, 10, 36, 30]], [1]), target([[40, 40, 60, 62]], [2])]
    model.train(), clean.train()
    with torch.no_grad():
        torch.manual_seed(3)
        noisy = model.forward_train(batch, targets)
        torch.manual_seed(3)
        plain = clean.forward_train(batch, targets)
    assert torch.equal(noisy.roi_features, plain.roi_features) and torch.equal(noisy.roi_targets, plain.roi_targets)
    diff = (noisy.class_logits - plain.class_logits).abs()
    assert diff[:, 1].max() < 1e-4 and diff[:, [0, 2]].min() > 0  # noise where the scale says, none elsewhere
    model.eval(), clean.eval()
    with torch.no_grad():
        ours, theirs = model.predict(batch), clean.predict(batch)
    for got, want in zip(ours, theirs):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_load_weights_from_a_second_detector(tmp_path):
    model, other = small(3, seed=0), small(5, seed=1)
    predictor_before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(PREDICTOR_PREFIX)}
    source = other.state_dict()
    predictor_keys = sorted(k for k in source if k.startswith(PREDICTOR_PREFIX))
    assert len(predictor_keys) == 4
    torch.save(source, tmp_path / "other.pth")
    save_file({k: v.contiguous() for k, v in source.items()}, str(tmp_path / "other.safetensors"))
    for name in ("other.pth", "other.safetensors"):
        target_model = small(3, seed=0)
        report = load_detector_weights(target_model, tmp_path / name)
        assert report["loaded"] == len(source) - 4 and sorted(report["skipped"]) == predictor_keys
        assert report["missing"] == []
        for key, value in target_model.state_dict().items():
            want = predictor_before[key] if key.startswith(PREDICTOR_PREFIX) else source[key]
            assert torch.equal(value, want), key
    # a wrapped file ({"model": ...} with "module." names) loads the same
    torch.save({"model": {f"module.{k}": v for k, v in source.items()}}, tmp_path / "wrapped.pth")
    assert load_detector_weights(model, tmp_path / "wrapped.pth")["loaded"] == len(source) - 4


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "not found"), ({"fc.weight": torch.zeros(2, 2)}, "no tensor matches"), ([1, 2], "no tensors found")],
)
def test_load_weights_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "weights.pth"
    if content is not None:
        torch.save(content, path)
    with pytest.raises(ConfigError, match=message) as info:
        load_detector_weights(small(), path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_resnet50_fpn_constructs_refuses_grey_and_maps_legacy_names(tmp_path):
    model = create_detector("resnet50-fpn", 3, 4)
    assert model.feature_channels == 1024 and model.num_classes == 4
    assert model.transform.min_size == (800,) and model.transform.max_size == 1333
    assert model.backbone.body.bn1.eps == 0.0  # torchvision's value for its COCO weights
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ConfigError, match="in_channels=1"):
        create_detector("resnet50-fpn", 1, 4)
    # torchvision's pre-0.13 names (its COCO file) map to today's
    inner = torch.randn_like(model.backbone.fpn.inner_blocks[0][0].weight)
    conv = torch.randn_like(model.rpn.head.conv[0][0].weight)
    torch.save(
        {"backbone.fpn.inner_blocks.0.weight": inner, "rpn.head.conv.weight": conv}, tmp_path / "coco_legacy.pth"
    )
    report = load_detector_weights(model, tmp_path / "coco_legacy.pth")
    assert report["loaded"] == 2 and report["skipped"] == []
    assert torch.equal(model.backbone.fpn.inner_blocks[0][0].weight, inner)
    assert torch.equal(model.rpn.head.conv[0][0].weight, conv)
