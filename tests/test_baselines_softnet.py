"""SoftNet (Kang et al., ICLR 2023): the soft-subnetwork mask, its straight-through gradient, the minor-only gradient,
the incremental metric loss (hand-computed values), the masking on every registered backbone, and the method end to
end on the toy two-session protocol."""

import copy
import dataclasses
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from jascl.engine.config import resolve_config
from jascl.engine.prototypes import align_labels
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods import Plugin
from jascl.methods.baselines.fewshot._soft_subnetwork import (
    SoftSubnetwork,
    attach_learnable,
    detach_all,
    major_count,
    major_mask,
    masked_layers,
    minor_only_gradient,
    prototype_metric_loss,
    soft_subnetwork_mask,
    straight_through,
)
from jascl.methods.registry import create_method
from jascl.networks import create_segmenter
from test_backbones import TINY

SCORES = torch.tensor([0.5, -3.0, 1.0, 0.2, -0.9, 2.0, 0.1, -0.4, 0.05, 0.7])

# ----------------------------------------------------------------------------- the mask


def test_major_mask_is_the_top_c_share_by_magnitude():
    # n = 10. c = 0.3 -> round(3) = 3 weights: |s| = 3.0 (index 1), 2.0 (index 5), 1.0 (index 2)
    assert major_mask(SCORES, 0.3).tolist() == [False, True, True, False, False, True, False, False, False, False]
    # c = 0.5 -> 5 weights: also 0.9 (index 4) and 0.7 (index 9)
    assert major_mask(SCORES, 0.5).nonzero().flatten().tolist() == [1, 2, 4, 5, 9]
    # c = 0.25 -> 2.5 rounds half up to 3; c = 0.97 -> 9.7 -> 10 (all); c = 0.04 -> 0.4 -> 0 (none)
    assert [major_count(10, c) for c in (0.25, 0.97, 0.04, 1.0)] == [3, 10, 0, 10]
    assert bool(major_mask(SCORES, 0.97).all()) and not bool(major_mask(SCORES, 0.04).any())
    # per layer, whatever the weight's rank (a 3D convolution's (out, in, kD, kH, kW) included)
    assert torch.equal(major_mask(SCORES.reshape(1, 2, 5), 0.3), major_mask(SCORES, 0.3).reshape(1, 2, 5))
    assert torch.equal(major_mask(SCORES.reshape(1, 1, 1, 2, 5), 0.5), major_mask(SCORES, 0.5).reshape(1, 1, 1, 2, 5))
    # ties at the threshold stay minor: |s| = [1, 1, 1, 0.5], c = 0.5 -> 2 wanted, the largest left out is 1
    assert major_mask(torch.tensor([1.0, -1.0, 1.0, 0.5]), 0.5).tolist() == [False, False, False, False]


def test_soft_mask_is_one_on_the_major_subnetwork_and_the_soft_values_elsewhere():
    soft = torch.arange(10) / 10.0  # 0.0, 0.1, ..., 0.9
    # major (c = 0.3): indices 1, 2, 5 -> 1; the rest keep their soft value
    expected = torch.tensor([0.0, 1.0, 1.0, 0.3, 0.4, 1.0, 0.6, 0.7, 0.8, 0.9])
    assert torch.equal(soft_subnetwork_mask(SCORES, 0.3, soft), expected)


def test_soft_values_are_a_seeded_uniform_draw():
    mask = soft_subnetwork_mask(SCORES, 0.3, generator=torch.Generator().manual_seed(5))
    draw = torch.rand(10, generator=torch.Generator().manual_seed(5))
    major = major_mask(SCORES, 0.3)
    assert torch.equal(mask[major], torch.ones(3)) and torch.equal(mask[~major], draw[~major])
    assert bool(((mask[~major] >= 0) & (mask[~major] < 1)).all())
    again = soft_subnetwork_mask(SCORES, 0.3, generator=torch.Generator().manual_seed(5))
    other = soft_subnetwork_mask(SCORES, 0.3, generator=torch.Generator().manual_seed(6))
    assert torch.equal(mask, again) and not torch.equal(mask, other)


def test_straight_through_passes_the_mask_gradient_to_the_scores_unchanged():
    s = torch.tensor([0.5, -3.0, 1.0, 0.2], requires_grad=True)
    values = soft_subnetwork_mask(s, 0.5, torch.full((4,), 0.25))  # major: |s| = 3 and 1 -> [0.25, 1, 1, 0.25]
    out = straight_through(values, s)
    assert torch.equal(out, torch.tensor([0.25, 1.0, 1.0, 0.25]))  # forward: the mask bit for bit
    (out * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert s.grad.tolist() == [1.0, 2.0, 3.0, 4.0]  # dL/ds = dL/dm


def test_soft_subnetwork_parametrization_forward_and_gradients_by_hand():
    weight = torch.tensor([[2.0, -1.0], [0.5, 3.0]])
    sub = SoftSubnetwork(weight, 0.5, torch.Generator().manual_seed(0))
    with torch.no_grad():
        sub.scores.copy_(torch.tensor([[0.5, -3.0], [1.0, 0.2]]))  # major: -3.0 and 1.0
        sub.soft.fill_(0.25)
    w = weight.clone().requires_grad_(True)
    g = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = sub.eval()(w)  # eval: the fixed draw; m = [[0.25, 1], [1, 0.25]]
    assert torch.equal(out, torch.tensor([[0.5, -1.0], [0.5, 0.75]]))
    (out * g).sum().backward()
    assert sub.scores.grad.tolist() == [[2.0, -2.0], [1.5, 12.0]]  # dL/ds = dL/dm = g * W
    assert w.grad.tolist() == [[0.25, 2.0], [3.0, 1.0]]  # dL/dW = g * m
    # training forwards draw fresh minor values from the global stream; the major entries stay W
    torch.manual_seed(7)
    trained = sub.train()(weight)
    torch.manual_seed(7)
    u = torch.rand(2, 2)
    assert torch.equal(trained, weight * torch.tensor([[u[0, 0].item(), 1.0], [1.0, u[1, 1].item()]]))
    sub.fix()  # the mask is frozen with the fixed draw
    assert torch.equal(sub.mask, torch.tensor([[0.25, 1.0], [1.0, 0.25]])) and not sub.scores.requires_grad
    assert torch.equal(sub.train()(weight), torch.tensor([[0.5, -1.0], [0.5, 0.75]]))


def test_minor_only_gradient_zeroes_the_major_entries():
    # mask 1 marks a major weight (soft values are < 1, 0 included)
    grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.3], [1.0, 0.0]])
    assert minor_only_gradient(grad, mask).tolist() == [[0.0, 2.0], [0.0, 4.0]]


# ----------------------------------------------------------------------------- the incremental metric loss


def test_metric_loss_hand_values_with_fixed_prototypes():
    # two pixels (1, 0) of class 0 and (0, 1) of class 1, prototypes (3, 0) and (0, 5), tau 0.5:
    # logits (cos / tau) = [2, 0] and [0, 2] -> each -log(e^2 / (e^2 + 1)) = log(1 + e^-2)
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).t().reshape(1, 2, 1, 2)
    target = torch.tensor([[[0, 1]]])
    protos = torch.tensor([[3.0, 0.0], [0.0, 5.0]])
    expected = math.log(1 + math.exp(-2))
    assert prototype_metric_loss(features, target, protos, tau=0.5).item() == pytest.approx(expected, abs=1e-6)
    # an ignored pixel changes nothing; the same pixels as a 3D volume give the same value
    with_ignored = torch.cat([features, torch.tensor([7.0, 7.0]).reshape(1, 2, 1, 1)], dim=3)
    target_ignored = torch.tensor([[[0, 1, 255]]])
    assert prototype_metric_loss(with_ignored, target_ignored, protos, tau=0.5).item() == pytest.approx(expected, 1e-6)
    volume = prototype_metric_loss(features.reshape(1, 2, 1, 1, 2), target.reshape(1, 1, 1, 2), protos, tau=0.5)
    assert volume.item() == pytest.approx(expected, abs=1e-6)
    # no labelled pixel: 0, still differentiable
    empty = prototype_metric_loss(features.requires_grad_(True), torch.full((1, 1, 2), 255), protos)
    empty.backward()
    assert empty.item() == 0.0 and torch.equal(features.grad, torch.zeros_like(features))


def test_metric_loss_takes_new_class_prototypes_from_the_batch():
    # pixels a = (2, 0) class 0, b = (0, 3) and c = (1, 1) class 1; fixed prototypes (5, 0) and (1, 0), tau 1.
    features = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0]]).t().reshape(1, 2, 1, 3)
    target = torch.tensor([[[0, 1, 1]]])
    protos = torch.tensor([[5.0, 0.0], [1.0, 0.0]])
    # fixed prototypes only: both rows point along x, logits tie for every pixel -> log 2
    assert prototype_metric_loss(features, target, protos, tau=1.0).item() == pytest.approx(math.log(2), abs=1e-6)
    # row 1 from the batch: mean of the normalised b, c = ((0, 1) + (1, 1)/sqrt 2) / 2, at 67.5 degrees from x
    cos675, cos225, cos45 = math.cos(math.radians(67.5)), math.cos(math.radians(22.5)), math.cos(math.radians(45))
    # a: logits [1, cos 67.5], target 0; b: [0, cos 22.5], target 1; c: [cos 45, cos 22.5], target 1
    expected = (
        math.log(1 + math.exp(cos675 - 1)) + math.log(1 + math.exp(-cos225)) + math.log(1 + math.exp(cos45 - cos225))
    ) / 3
    got = prototype_metric_loss(features, target, protos, batch_rows=[1], tau=1.0)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    # a batch row without pixels in the batch keeps its fixed prototype
    only_background = torch.zeros(1, 1, 3, dtype=torch.long)
    assert prototype_metric_loss(features, only_background, protos, batch_rows=[1], tau=1.0).item() == pytest.approx(
        prototype_metric_loss(features, only_background, protos, tau=1.0).item(), abs=1e-7
    )


# ----------------------------------------------------------------------------- every registered backbone

# the largest tiny configurations are marked slow (deselect with -m "not slow"); medformer's 3D case is left out
# (its 2D case has the same modules)
SLOW = {"deeplabv3plus", "swinunetr"}
BACKBONE_CASES = [
    pytest.param(name, *cfg, id=f"{name}-{cfg[0]}d", marks=[pytest.mark.slow] if name in SLOW else [])
    for name, cfgs in sorted(TINY.items())
    for cfg in cfgs
    if not (name == "medformer" and cfg[0] == 3)
]


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", BACKBONE_CASES)
def test_masks_every_trainable_conv_and_linear_weight_of_every_backbone(name, dims, in_ch, size, kwargs):
    torch.manual_seed(0)
    model = create_segmenter(name, spatial_dims=dims, in_channels=in_ch, num_classes=3, **kwargs).eval()
    x = torch.randn(2, in_ch, *size, generator=torch.Generator().manual_seed(1))
    keys = set(model.state_dict())
    frozen = {id(p) for m in model.backbone.frozen_modules() for p in m.parameters()}
    layers = masked_layers(model)
    expected = {
        f"backbone.{path}"
        for path, m in model.backbone.named_modules()
        if isinstance(m._parameters.get("weight"), torch.nn.Parameter)
        and m.weight.dim() >= 2
        and id(m.weight) not in frozen
    }
    assert set(layers) == expected and expected
    reference = copy.deepcopy(model)
    attached = attach_learnable(layers, 0.5, torch.Generator().manual_seed(2))
    with torch.no_grad():  # the reference network: every masked weight times its eval-mode mask, by hand
        for path, (_, soft) in attached.items():
            reference.get_submodule(path).weight.mul_(soft_subnetwork_mask(soft.scores, 0.5, soft.soft))
        expected = reference(x)
    out = model(x)  # (eval mode: batch-norm statistics stay those of the reference)
    assert torch.allclose(out, expected, atol=1e-5)
    out.square().mean().backward()
    graded = [soft.scores.grad is not None and bool(soft.scores.grad.abs().sum() > 0) for _, soft in attached.values()]
    assert sum(graded) >= len(graded) // 2  # the scores learn (a few layers may not reach these logits)
    for _, soft in attached.values():
        soft.fix()
    detached = detach_all(attached)
    assert set(model.state_dict()) == keys  # the standard layout again, holding W * m
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-5)
    for mask, minor in detached.values():
        assert int((mask == 1).sum()) == major_count(mask.numel(), 0.5) and minor.numel() == int((mask != 1).sum())


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "override,match",
    [
        ("method_args.softnet.capacity=0", "method_args.softnet.capacity: must be > 0 and <= 1"),
        ("method_args.softnet.capacity=1.5", r"method_args.softnet.capacity: must be > 0 and <= 1 \(got 1.5\)"),
        ("method_args.softnet.tau=0", "method_args.softnet.tau: must be > 0"),
        ("method_args.softnet.lr_incremental=-1", "method_args.softnet.lr_incremental: must be > 0"),
    ],
)
def test_bad_options_are_one_line_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        create_method("softnet", resolve_config(overrides=[override]))


# ----------------------------------------------------------------------------- end to end


class Probe(Plugin):
    """Loss terms per session; in session 1 the metric loss recomputed with the pure function and the gradients of
    the masked weights' major entries."""

    name = "probe"

    def __init__(self):
        self.terms: dict[int, dict[str, float]] = {}
        self.loss_gap = 0.0
        self.major_grad = 0.0
        self.minor_grad = 0.0

    def after_forward(self, state):
        if state.session.index != 1:
            return
        features = state.output.features
        labels = state.class_index(align_labels(state.batch["label"].to(state.device), features.shape[2:]))
        expected = prototype_metric_loss(features, labels, state.model.classifier.weight, [state.seen.index(3)])
        self.loss_gap = max(
            self.loss_gap, abs(float(state.losses["softnet_metric"].detach()) - float(expected.detach()))
        )

    def before_backward(self, state):
        terms = self.terms.setdefault(state.session.index, {})
        for key, value in state.losses.items():
            terms[key] = max(terms.get(key, 0.0), abs(float(value.detach())))

    def after_backward(self, state):
        if state.session.index != 1:
            return
        for module in state.model.modules():
            if hasattr(module, "parametrizations"):
                grad = module.parametrizations["weight"].original.grad
                mask = module.parametrizations["weight"][0].mask
                self.major_grad = max(self.major_grad, float(grad[mask == 1].abs().max()))
                self.minor_grad = max(self.minor_grad, float(grad[mask != 1].abs().max()))
        trainable = [p for p in state.model.parameters() if p.requires_grad]
        assert len(trainable) == len(masked_layers(state.model))  # only the masked weights train


def _run(protocol, config, out, cache):
    probe = Probe()
    results = run_benchmark(
        protocol, config, ["softnet"], out, cache_dir=cache, progress=False, echo=lambda *a: None, extra_plugins=[probe]
    )
    return results, probe


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import toy_protocol_dict
    from jascl.protocols import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml")
    root = tmp_path_factory.mktemp("softnet")
    results, probe = _run(protocol, config, root / "run", root / "cache")
    return protocol, config, root, results, probe


def _layers(extra):
    return sorted(k[len("0.softnet.") : -len(".mask")] for k in extra if k.endswith(".mask"))


def test_softnet_trains_its_own_base_with_the_seg_loss_then_the_metric_loss_alone(run):
    protocol, config, root, results, probe = run
    sessions = results["methods"]["softnet"]["sessions"]
    assert len(sessions) == 2 and all(0.0 <= s["all"] <= 1.0 for s in sessions)
    assert set(probe.terms[0]) == {"seg"} and set(probe.terms[1]) == {"softnet_metric"}
    assert probe.terms[1]["softnet_metric"] > 0
    assert probe.loss_gap < 1e-5  # the term is the pure function on the step's features and rows
    assert (root / "run" / "softnet" / "s0-base" / "metrics.json").exists()  # its own base, not the shared one
    assert create_method("softnet", config).changes_base_session


def test_only_minor_weights_change_in_session_1_and_checkpoints_hold_w_times_m(run):
    protocol, config, root, results, probe = run
    folder = root / "run" / "softnet"
    m0, m1 = load_file(folder / "s0-base" / "model.safetensors"), load_file(folder / "s1-inc" / "model.safetensors")
    x0, x1 = load_file(folder / "s0-base" / "plugins.safetensors"), load_file(folder / "s1-inc" / "plugins.safetensors")
    assert not any("parametrizations" in k for k in m1) and set(m0) == set(m1)  # standard layout
    layers = _layers(x0)
    assert layers == _layers(x1) and len(layers) == 22  # every conv / transposed conv of the toy U-Net
    changed = 0
    for path in layers:
        mask, key = x0[f"0.softnet.{path}.mask"], f"{path}.weight"
        assert torch.equal(mask, x1[f"0.softnet.{path}.mask"])  # fixed after session 0
        major = mask == 1
        assert int(major.sum()) == major_count(mask.numel(), 0.97)
        assert bool(((mask[~major] >= 0) & (mask[~major] < 1)).all())
        assert torch.equal(m0[key][major], m1[key][major])  # the major subnetwork is frozen bit-exactly
        for m, x in ((m0, x0), (m1, x1)):  # the checkpoint is W * m: W on the major entries, raw minor * m elsewhere
            assert torch.equal(m[key][~major], x[f"0.softnet.{path}.minor"] * mask[~major])
        changed += int(not torch.equal(x0[f"0.softnet.{path}.minor"], x1[f"0.softnet.{path}.minor"]))
    assert changed == len(layers)  # the minor weights of every layer were trained
    assert probe.major_grad == 0.0 and probe.minor_grad > 0.0
    for key in m0:  # biases, norm layers and the old classifier rows are untouched
        if key == "classifier.weight":
            assert torch.equal(m1[key][:3], m0[key])
        elif key[: -len(".weight")] not in layers:
            assert torch.equal(m0[key], m1[key]), key
    # the new class's row is its normalised prototype under the fine-tuned network (nearest-prototype prediction)
    protos = load_file(folder / "s1-inc" / "prototypes.safetensors")
    assert torch.allclose(m1["classifier.weight"][3], F.normalize(protos["s1.c3"], dim=0), atol=1e-6)


def test_a_reused_base_session_gives_back_its_masks(run, tmp_path):
    """Session 1 retrained on the saved session 0 (model + plugin state) equals the one trained straight after it."""
    protocol, config, root, results, _ = run
    out = tmp_path / "again"
    shutil.copytree(root / "run" / "softnet" / "s0-base", out / "softnet" / "s0-base")
    again, probe = _run(protocol, config, out, root / "cache")
    assert 0 not in probe.terms and 1 in probe.terms  # session 0 reused, session 1 trained
    first, second = root / "run" / "softnet" / "s1-inc", out / "softnet" / "s1-inc"
    for name in ("model.safetensors", "plugins.safetensors"):
        a, b = load_file(first / name), load_file(second / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name

    def strip(records):  # the records without their timings
        return json.dumps([{k: v for k, v in r.items() if k != "seconds"} for r in records])

    assert strip(again["methods"]["softnet"]["sessions"]) == strip(results["methods"]["softnet"]["sessions"])


def test_softnet_needs_the_cosine_classifier(run, tmp_path):
    protocol, config, root, _, _ = run
    linear = dataclasses.replace(config, classifier="linear")
    with pytest.raises(ConfigError, match="method softnet: .*set classifier: cosine"):
        run_benchmark(
            protocol, linear, ["softnet"], tmp_path / "run", cache_dir=root / "cache", progress=False, echo=lambda *a: 0
        )
