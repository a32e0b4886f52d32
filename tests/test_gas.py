"""GAS (paper eq. 1): the noise scale by hand, and noise only in training mode."""

import pytest
import torch

from jascl.methods.gas import attach_gas, clean_weight, detach_gas, gas_noise_scale, is_gas_attached, record_sq_grad
from jascl.networks.classifier import PixelClassifier


def test_noise_scale_hand_computed_eps_one():
    # G = [0, 1, 3], eps = 1 -> G^-1 = [1, 0.5, 0.25]; min 0.25, max 1, denominator 1 + 0.75 = 1.75
    # scale = (1 + G^-1 - 0.25) / 1.75 = [1.75, 1.25, 1.0] / 1.75
    scale = gas_noise_scale(torch.tensor([0.0, 1.0, 3.0]), eps=1.0)
    assert torch.allclose(scale, torch.tensor([1.0, 1.25 / 1.75, 1.0 / 1.75]), atol=1e-7)


def test_noise_scale_default_eps_range_and_zero_buffer():
    # eps = 1e-8: G = [0, 1e-8] -> G^-1 = [1e8, 5e7]; scale = [1, 1 / (1 + 5e7)]
    scale = gas_noise_scale(torch.tensor([[0.0], [1e-8]]), eps=1e-8)
    assert scale[0, 0].item() == pytest.approx(1.0)
    assert scale[1, 0].item() == pytest.approx(1.0 / (1.0 + 5e7), rel=1e-5)
    # a zero buffer (first step of a session) gives scale 1 everywhere
    assert torch.equal(gas_noise_scale(torch.zeros(3, 4)), torch.ones(3, 4))
    # in (0, 1]: the largest gradient gets the smallest noise
    g = torch.rand(5, 7)
    s = gas_noise_scale(g)
    assert s.max().item() == pytest.approx(1.0) and s.min().item() > 0
    assert s.flatten()[g.flatten().argmax()] == s.min()


def test_noise_only_in_train_mode_and_scaled_by_sigma():
    torch.manual_seed(0)
    layer = PixelClassifier(8, 5)
    w = layer.weight.detach().clone()
    attach_gas(layer, eps=1e-8, sigma2=4.0)
    assert is_gas_attached(layer)
    layer.eval()
    assert torch.equal(layer.weight, w)  # eval: the clean weight, deterministic
    layer.train()
    draws = torch.stack([layer.weight.detach() - w for _ in range(400)])
    assert not torch.equal(draws[0], draws[1])  # fresh noise at every read
    # buffer is zero -> scale 1 everywhere -> noise std = sqrt(sigma2) = 2
    assert draws.std().item() == pytest.approx(2.0, rel=0.05)
    assert draws.mean().item() == pytest.approx(0.0, abs=0.05)
    detach_gas(layer)
    assert not is_gas_attached(layer) and torch.equal(layer.weight, w)


def test_recorded_gradient_sets_elementwise_scale():
    torch.manual_seed(0)
    layer = PixelClassifier(3, 2, cosine=False)
    noise = attach_gas(layer, eps=1.0)
    clean_weight(layer).grad = torch.tensor([[0.0, 1.0, 3.0**0.5], [0.0, 1.0, 3.0**0.5]])
    record_sq_grad(layer)
    expected = torch.tensor([1.0, 1.25 / 1.75, 1.0 / 1.75]).repeat(2, 1)
    assert torch.allclose(noise.scale(), expected, atol=1e-6)
    # gradient w.r.t. the stored weight equals the gradient w.r.t. the perturbed one
    layer.train()
    x = torch.randn(4, 3)
    clean_weight(layer).grad = None
    layer(x).sum().backward()
    assert torch.allclose(clean_weight(layer).grad, x.sum(0).expand(2, 3))


def test_authors_float32_order_zeroes_the_first_step():
    from jascl.methods.gas import gas_noise_scale_authors

    zero = torch.zeros(2, 3)
    # eq. 1 literally: (1 + 1e8 - 1e8) / (1 + 0) = 1; the authors' float32: (1 + 1e8) rounds to 1e8, minus 1e8 = 0
    assert torch.equal(gas_noise_scale(zero), torch.ones(2, 3))
    assert torch.equal(gas_noise_scale_authors(zero), torch.zeros(2, 3))
    # elsewhere both agree to float32 rounding: G = [0, 1] -> G^-1 = [1e8, ~1] -> [1e8 / 1e8, 1 / 1e8]
    g = torch.tensor([0.0, 1.0])
    assert torch.allclose(gas_noise_scale_authors(g), gas_noise_scale(g), rtol=1e-6, atol=1e-12)
    assert gas_noise_scale_authors(g).tolist() == pytest.approx([1.0, 1e-8], rel=1e-6)


def test_authors_variant_carries_the_old_rows_buffer_into_the_next_session():
    from types import SimpleNamespace

    from jascl.methods.gas import GASNoise
    from jascl.methods.gas_plugin import GASPlugin, carried_buffer

    carried = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = carried_buffer(carried, torch.zeros(4, 3))
    assert out.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert carried_buffer(carried, torch.zeros(4, 5)).abs().sum() == 0  # another shape: nothing carried

    plugin = GASPlugin(variant="authors")
    layer = PixelClassifier(3, 2)
    state = SimpleNamespace(
        model=SimpleNamespace(resolve_layer=lambda name: layer),
        session=SimpleNamespace(index=1),
        config=SimpleNamespace(freeze_incremental="all_but_classifier"),
    )
    plugin.before_session(state)
    noise = next(p for p in layer.parametrizations["weight"] if isinstance(p, GASNoise))
    assert torch.equal(noise.scale(), torch.zeros(2, 3))  # first step of the first GAS session: no noise
    noise.set_sq_grad(carried)
    plugin.after_session(state)
    assert torch.equal(plugin.carried, carried) and torch.equal(plugin.extra_state()["carried_sq_grad"], carried)
    # session 2: two more classes; the old rows start from the carried gradient, the new ones from zero
    layer2 = PixelClassifier(3, 4)
    state.model = SimpleNamespace(resolve_layer=lambda name: layer2)
    fresh = GASPlugin(variant="authors")
    fresh.load_extra_state(plugin.extra_state())  # as when session 1 is reused from its checkpoint
    fresh.before_session(state)
    noise2 = next(p for p in layer2.parametrizations["weight"] if isinstance(p, GASNoise))
    assert torch.equal(noise2.sq_grad[:2], carried) and noise2.sq_grad[2:].abs().sum() == 0
    from jascl.methods.gas import gas_noise_scale_authors

    assert torch.equal(noise2.scale(), gas_noise_scale_authors(noise2.sq_grad))
    # the new rows' G^-1 = 1e8 is the maximum: scale 1; the old rows' (G = 1..6, G^-1 <= 1) about 1e-8
    assert torch.equal(noise2.scale()[2:], torch.ones(2, 3)) and noise2.scale()[:2].max() < 1e-7
