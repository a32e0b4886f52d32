"""Gen-Replay's diffusion prior (``generator=diffusion``, the JASCL paper's row): the pure pieces by hand, a prior that
learns a 2D pattern (an untrained one does not), a slice-wise prior that learns a depth gradient through its
position condition, its kept state, the bank's equal shares, and the one-line refusal without ``diffusers``."""

import builtins
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from jascl.engine.config import RunConfig
from jascl.errors import ConfigError
from jascl.methods.baselines.replay._diffusion import (
    DiffusionPrior,
    PriorShape,
    bank_shares,
    ddpm_loss,
    from_unit,
    intensity_window,
    pad_to_multiple,
    slices_to_volumes,
    to_unit,
    volume_slices,
)
from jascl.methods.baselines.replay._gen_sources import DiffusionSource
from jascl.methods.baselines.replay.gen_replay import GenReplayOptions
from jascl.methods.registry import create_method

# ----------------------------------------------------------------------------- pure pieces


def test_intensity_window_and_unit_maps_by_hand():
    # channel 0 holds 0..100 (the 0.5 / 99.5 % quantiles: 0.5 and 99.5), channel 1 is flat at 7
    x = torch.stack([torch.arange(101.0), torch.full((101,), 7.0)]).view(1, 2, 101)
    window = intensity_window(x)
    assert window[0].tolist() == pytest.approx([0.5, 99.5])
    assert window[1].tolist() == [7.0, 8.0]  # a flat channel gets a window of 1
    unit = to_unit(x, window)
    assert unit[0, 0, 50].item() == pytest.approx(0.0)  # the middle of [0.5, 99.5]
    assert unit[0, 0, 0].item() == -1.0 and unit[0, 0, 100].item() == 1.0  # clipped
    assert unit[0, 1, 0].item() == -1.0  # 7 is the bottom of [7, 8]
    assert torch.allclose(from_unit(unit, window)[0, 0, 1:100], x[0, 0, 1:100], atol=1e-4)


def test_volume_slices_round_trip_and_positions():
    v = torch.arange(2 * 1 * 3 * 2 * 4.0).view(2, 1, 3, 2, 4)  # B=2, C=1, H=3, W=2, D=4
    slices, positions = volume_slices(v)
    assert slices.shape == (8, 1, 3, 2)
    assert torch.equal(slices[5], v[1, :, :, :, 1])  # volume-major: volume 1, slice 1
    assert positions.tolist() == pytest.approx([-1.0, -1 / 3, 1 / 3, 1.0] * 2)  # 2 d / (D - 1) - 1
    assert torch.equal(slices_to_volumes(slices, 4), v)


def test_pad_to_multiple_repeats_the_edges():
    x = torch.arange(6.0).view(1, 1, 2, 3)
    padded = pad_to_multiple(x, 4)
    assert padded.shape == (1, 1, 4, 4)
    assert padded[0, 0].tolist() == [[0, 1, 2, 2], [3, 4, 5, 5], [3, 4, 5, 5], [3, 4, 5, 5]]
    assert pad_to_multiple(x, 1) is x


def test_ddpm_loss_is_the_noise_prediction_error():
    class Zero(torch.nn.Module):  # predicts eps = 0: the loss is the mean square of the noise
        def forward(self, x, t):
            return SimpleNamespace(sample=torch.zeros_like(x[:, :1]))

    class NoNoise:
        def add_noise(self, clean, noise, t):
            return clean

    noise = torch.tensor([1.0, -2.0, 3.0, 0.0]).view(1, 1, 2, 2)
    loss = ddpm_loss(Zero(), NoNoise(), torch.zeros(1, 1, 2, 2), noise, torch.tensor([5]))
    assert loss.item() == pytest.approx((1 + 4 + 9) / 4)
    seen = []

    class Record(Zero):
        def forward(self, x, t):
            seen.append(x)
            return super().forward(x, t)

    ddpm_loss(Record(), NoNoise(), torch.zeros(1, 1, 2, 2), noise, torch.tensor([5]), torch.tensor([0.5]))
    assert seen[0].shape == (1, 2, 2, 2) and torch.all(seen[0][:, 1] == 0.5)  # the position as an extra channel


def test_bank_shares_are_equal_with_the_remainder_first():
    assert bank_shares(3, 17) == [6, 6, 5]
    assert bank_shares(2, 32) == [16, 16]
    assert bank_shares(4, 2) == [1, 1, 0, 0]
    assert bank_shares(0, 5) == []


def test_prior_shape_round_trips_through_a_tensor():
    shape = PriorShape(2, (12, 10, 6), (8, 16, 16))
    assert PriorShape.from_tensor(shape.as_tensor()) == shape
    assert shape.slicewise and shape.plane == (12, 10)
    assert not PriorShape(1, (8, 8), (8,)).slicewise


# ----------------------------------------------------------------------------- the prior learns its session's images


def _fit(images, shape, steps, seed=0):
    torch.manual_seed(seed)
    prior = DiffusionPrior(shape, intensity_window(images), len(images))
    first, last = prior.fit(images, steps, 8, 3e-3, torch.Generator().manual_seed(seed))
    return prior, first, last


@pytest.mark.slow
def test_trained_prior_draws_its_sessions_pattern_and_an_untrained_one_does_not():
    # every training image: a bright left half (0.9) and a dark right half (0.1), with a little noise
    g = torch.Generator().manual_seed(0)
    images = torch.full((16, 1, 8, 8), 0.1)
    images[..., :4] = 0.9
    images = images + 0.02 * torch.randn(images.shape, generator=g)
    shape = PriorShape(1, (8, 8), (8, 16))
    untrained, _, _ = _fit(images, shape, 0)
    trained, first, last = _fit(images, shape, 400)
    assert last < first
    device = torch.device("cpu")

    def contrast(prior):
        x = prior.sample(8, 10, torch.Generator().manual_seed(1), device)
        assert x.shape == (8, 1, 8, 8)
        return (x[..., :4].mean() - x[..., 4:].mean()).item()

    assert contrast(trained) > 0.4  # the pattern: left brighter than right by ~0.8
    assert abs(contrast(untrained)) < 0.2


@pytest.mark.slow
def test_slicewise_prior_learns_a_depth_dependent_pattern_through_its_position_channel():
    # slices 0-1 of every volume: bright left half; slices 2-3: bright right half. Only the position channel tells
    # the slices apart (the slices of a sampled volume share their starting noise).
    depth = 4
    volumes = torch.full((6, 1, 8, 8, depth), 0.1)
    volumes[:, :, :, :4, :2] = 0.9
    volumes[:, :, :, 4:, 2:] = 0.9
    volumes = volumes + 0.02 * torch.randn(volumes.shape, generator=torch.Generator().manual_seed(0))
    prior, _, _ = _fit(volumes, PriorShape(1, (8, 8, depth), (8, 16)), 400)
    x = prior.sample(2, 10, torch.Generator().manual_seed(2), torch.device("cpu"))
    assert x.shape == (2, 1, 8, 8, depth)
    contrast = x[:, :, :, :4].mean(dim=(0, 1, 2, 3)) - x[:, :, :, 4:].mean(dim=(0, 1, 2, 3))
    assert contrast[0].item() > 0.2 and contrast[-1].item() < -0.2  # left bright first, right bright last


def test_diffusion_source_keeps_one_prior_per_session_through_safetensors(tmp_path):
    images = torch.rand(4, 1, 8, 8)
    source = DiffusionSource(GenReplayOptions(unet_channels=[8, 16], bank=5, sample_steps=3))
    for _ in range(2):
        prior, _, _ = _fit(images, PriorShape(1, (8, 8), (8, 16)), 2)
        source.priors.append(prior)
    save_file(source.to_tensors(), tmp_path / "extra.safetensors")
    other = DiffusionSource(GenReplayOptions())
    other.load_tensors(load_file(tmp_path / "extra.safetensors"))
    assert len(other.priors) == 2 and other.priors[1].shape == PriorShape(1, (8, 8), (8, 16))
    assert torch.equal(other.priors[0].window, source.priors[0].window) and other.priors[0].images == 4
    device = torch.device("cpu")
    a = source.priors[1].sample(2, 3, torch.Generator().manual_seed(3), device)
    b = other.priors[1].sample(2, 3, torch.Generator().manual_seed(3), device)
    assert torch.equal(a, b)
    # the bank: 5 images, 3 from the first prior and 2 from the second, resized to the session's size
    state = SimpleNamespace(seed=1, session=SimpleNamespace(index=2), device=device)
    other.o = GenReplayOptions(bank=5, sample_steps=3)
    other.prepare(state, (12, 12))
    assert other.bank is not None and other.bank.shape == (5, 1, 12, 12)
    drawn = other.draw(3, torch.Generator().manual_seed(0))
    assert drawn.shape == (3, 1, 12, 12)
    assert all(any(torch.equal(d, b) for b in other.bank) for d in drawn)


def test_without_diffusers_the_method_is_refused_in_one_line(monkeypatch):
    real_import = builtins.__import__

    def no_diffusers(name, *args, **kwargs):
        if name == "diffusers" or name.startswith("diffusers."):
            raise ImportError("No module named 'diffusers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_diffusers)
    with pytest.raises(ConfigError, match=r"diffusers package \(pip install 'jascl\[diffusion\]'\)") as err:
        create_method("gen-replay", RunConfig())
    assert "\n" not in str(err.value) and "generator=conv" in str(err.value)
    # the conv generator needs no diffusers
    create_method("gen-replay", RunConfig(method_args={"gen-replay": {"generator": "conv"}}))


def test_bad_unet_channels_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"method_args.gen-replay.unet_channels=\[0\]"):
        create_method("gen-replay", RunConfig(method_args={"gen-replay": {"unet_channels": [0]}}))
