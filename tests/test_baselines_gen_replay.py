"""Gen-Replay (replay family): hand-computed values of the pure functions, the conv generator's shapes, its kept
state and its fit to closed-form statistics; the diffusion prior (the paper's row): its pieces by hand, a prior that
learns a 2D pattern and, slice-wise, a depth gradient, its kept state, the bank, and the refusal without diffusers.
(The method end to end runs in the registry-wide tests.)"""

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from jascl.engine.config import RunConfig
from jascl.methods.baselines.replay._gen_sources import ConvSource, DiffusionSource
from jascl.methods.baselines.replay._generator import (
    NormInputTaps,
    TinyGenerator,
    channel_moments,
    class_frequency,
    class_prior_loss,
    fit_to_statistics,
    mix_moments,
    moment_matching_loss,
    one_hot_like_targets,
    pixel_entropy,
    soft_cross_entropy,
)
from jascl.methods.baselines.replay.gen_replay import GenReplayOptions, GenReplayPlugin
from jascl.methods.registry import METHODS, create_method

# ----------------------------------------------------------------------------- statistics


def test_channel_moments_hand_values():
    # (B=2, C=2, 2 pixels): channel 0 holds 1, 3, 5, 7; channel 1 holds 0, 0, 2, 2
    x = torch.tensor([[[1.0, 3.0], [0.0, 0.0]], [[5.0, 7.0], [2.0, 2.0]]])
    mean, square = channel_moments(x)
    assert torch.allclose(mean, torch.tensor([4.0, 1.0]))
    assert torch.allclose(square, torch.tensor([(1 + 9 + 25 + 49) / 4, 2.0]))


def test_mix_moments_pools_components_by_weight():
    # component A: mean 1, E[x^2] 2, weight 1; component B: mean 3, E[x^2] 10, weight 3
    # mean (1 + 9) / 4 = 2.5; E[x^2] (2 + 30) / 4 = 8; variance 8 - 6.25 = 1.75
    a = (torch.tensor([1.0]), torch.tensor([2.0]), 1.0)
    b = (torch.tensor([3.0]), torch.tensor([10.0]), 3.0)
    mean, var = mix_moments([a, b])
    assert mean.item() == pytest.approx(2.5)
    assert var.item() == pytest.approx(1.75)
    # a weight-0 component is left out: A alone, variance 2 - 1 = 1
    mean, var = mix_moments([a, (torch.tensor([100.0]), torch.tensor([1e4]), 0.0)])
    assert (mean.item(), var.item()) == pytest.approx((1.0, 1.0))
    with pytest.raises(ValueError, match="positive weight"):
        mix_moments([(torch.zeros(1), torch.zeros(1), 0.0)])


def test_moment_matching_loss_sums_l2_distances_over_layers():
    gen = [(torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])), (torch.tensor([1.0]), torch.tensor([2.0]))]
    ref = [(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0])), (torch.tensor([1.0]), torch.tensor([0.5]))]
    # layer 1: ||(-3, -4)|| + 0 = 5; layer 2: 0 + 1.5
    assert moment_matching_loss(gen, ref).item() == pytest.approx(6.5)
    with pytest.raises(ValueError, match="layers"):
        moment_matching_loss(gen, ref[:1])


def test_norm_input_taps_record_the_inputs_of_normalisation_layers_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.InstanceNorm2d(2), nn.ReLU(), nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
    x = torch.randn(2, 1, 4, 4)
    with NormInputTaps(model) as taps:
        model(x)
        assert len(taps.inputs) == 2
        assert torch.equal(taps.inputs[0], model[0](x))
        assert torch.equal(taps.inputs[1], model[3](model[2](model[1](model[0](x)))))
    taps.clear()
    model(x)  # hooks removed on exit
    assert taps.inputs == []


# ----------------------------------------------------------------------------- the generator's objective and relabelling


def test_pixel_entropy_hand_values():
    uniform = torch.zeros(1, 4, 2, 2)
    assert pixel_entropy(uniform).item() == pytest.approx(math.log(4))
    # p = (3/4, 1/4) on every pixel
    logits = torch.tensor([math.log(3.0), 0.0]).view(1, 2, 1, 1).expand(2, 2, 3, 3)
    assert pixel_entropy(logits).item() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_class_prior_loss_is_kl_from_the_prior_to_the_mean_prediction():
    # two pixels: one sure of class 0 (p = (1, 0) up to e^-30), one uniform -> mean prediction (3/4, 1/4)
    logits = torch.tensor([[[30.0, 0.0]], [[0.0, 0.0]]]).view(1, 2, 1, 2)
    assert torch.allclose(class_frequency(logits), torch.tensor([0.75, 0.25]), atol=1e-6)
    prior = torch.tensor([0.5, 0.5])
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert class_prior_loss(logits, prior).item() == pytest.approx(expected, abs=1e-6)
    # a class absent from the prior contributes nothing: KL((1, 0) || (3/4, 1/4)) = log(4/3)
    assert class_prior_loss(logits, torch.tensor([1.0, 0.0])).item() == pytest.approx(math.log(4 / 3), abs=1e-6)


def test_one_hot_like_targets_sharpen_with_the_temperature():
    logits = torch.tensor([math.log(2.0), 0.0]).view(1, 2, 1, 1)
    assert torch.allclose(one_hot_like_targets(logits, 1.0).flatten(), torch.tensor([2 / 3, 1 / 3]))
    # T = 1/2 squares the odds: 4 : 1
    assert torch.allclose(one_hot_like_targets(logits, 0.5).flatten(), torch.tensor([0.8, 0.2]))
    with pytest.raises(ValueError, match="temperature"):
        one_hot_like_targets(logits, 0.0)


def test_soft_cross_entropy_gives_new_class_rows_target_zero():
    # student p = (1/5, 2/5, 2/5) everywhere (row 2 a new class); old-model target (1, 0): -log(1/5)
    logits = torch.tensor([0.0, math.log(2.0), math.log(2.0)]).view(1, 3, 1, 1).expand(2, 3, 2, 2)
    targets = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1).expand(2, 2, 2, 2)
    assert soft_cross_entropy(logits, targets).item() == pytest.approx(math.log(5))
    # target (1/4, 3/4): 1/4 log 5 + 3/4 log(5/2)
    targets = torch.tensor([0.25, 0.75]).view(1, 2, 1, 1).expand(2, 2, 2, 2)
    expected = 0.25 * math.log(5) + 0.75 * math.log(2.5)
    assert soft_cross_entropy(logits, targets).item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="classes"):
        soft_cross_entropy(logits[:, :1], targets)


# ----------------------------------------------------------------------------- generator shapes, fitting, kept state


@pytest.mark.parametrize(("size", "upsamplings"), [((10, 12), 2), ((8, 8, 8), 1)])
def test_tiny_generator_shapes_and_reproducible_samples(size, upsamplings):
    g = TinyGenerator(z_dim=5, channels=3, out_channels=2, size=size, upsamplings=upsamplings).eval()
    # latent grid: ceil(size / 2**upsamplings), cropped back to size after the up-sampling
    assert g.base == tuple(math.ceil(s / 2**upsamplings) for s in size)
    a = g.sample(3, torch.Generator().manual_seed(1))
    b = g.sample(3, torch.Generator().manual_seed(1))
    assert a.shape == (3, 2, *size)
    assert torch.equal(a, b)


class _Stub(nn.Module):
    """A "segmenter": one BatchNorm (eval mode) on the image, then a 1x1 convolution to 2 class logits."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm2d(1).eval()
        self.head = nn.Conv2d(1, 2, 1)

    def forward_features(self, x):
        return type("Out", (), {"logits": self.head(self.norm(x))})()


def test_fitted_generator_reproduces_the_reference_image_statistics():
    torch.manual_seed(0)
    model = _Stub().requires_grad_(False)
    # both taps (the image, and the BatchNorm input, which is the image again) target mean 0.5, variance 0.04
    reference = [(torch.tensor([0.5]), torch.tensor([0.04]))] * 2
    g = TinyGenerator(z_dim=4, channels=4, out_channels=1, size=(4, 4), upsamplings=1)
    first, last = fit_to_statistics(
        model,
        g,
        reference,
        torch.tensor([0.5, 0.5]),
        steps=60,
        batch=4,
        lr=3e-2,
        entropy_weight=0.0,
        prior_weight=0.0,
        rng=torch.Generator().manual_seed(0),
    )
    assert last < 0.1 * first
    assert not any(p.requires_grad for p in g.parameters()) and not g.training
    assert all(p.grad is None for p in model.parameters())  # the model gets no gradient
    x = g.sample(256, torch.Generator().manual_seed(1))
    assert x.mean().item() == pytest.approx(0.5, abs=0.05)
    assert x.var().item() == pytest.approx(0.04, abs=0.02)


def test_extra_state_round_trips_the_conv_generator_through_safetensors(tmp_path):
    plugin = GenReplayPlugin(GenReplayOptions(generator="conv", z_dim=4, channels=3, upsamplings=1))
    assert isinstance(plugin.source, ConvSource)
    assert plugin.extra_state() == {}
    torch.manual_seed(0)
    plugin.source.generator = TinyGenerator(4, 3, 1, (6, 10), upsamplings=1).eval()
    plugin.source.images, plugin.trained_through = 12.0, 1
    save_file(plugin.extra_state(), tmp_path / "extra.safetensors")
    other = GenReplayPlugin(GenReplayOptions(generator="conv"))
    other.load_extra_state(load_file(tmp_path / "extra.safetensors"))
    assert (other.source.images, other.trained_through) == (12.0, 1)
    g = other.source.generator
    assert g is not None and g.size == (6, 10) and g.base == (3, 5)
    z = torch.randn(2, 4)
    assert torch.equal(g(z), plugin.source.generator(z))


def test_registered_with_its_options_and_loss_term():
    plugin = create_method("gen-replay", RunConfig()).plugins[0]
    assert "gen-replay" in METHODS.list()
    assert isinstance(plugin, GenReplayPlugin)
    assert isinstance(plugin.source, DiffusionSource)  # the paper's row: a diffusion model
    assert plugin.loss_terms == ("gen_replay_replay",)
    assert not plugin.changes_base_session  # the shared vanilla base; its generator is fitted when it is restored
    assert plugin.o == GenReplayOptions()
    conv = create_method("gen-replay", RunConfig(method_args={"gen-replay": {"generator": "conv"}})).plugins[0]
    assert isinstance(conv.source, ConvSource)
