"""Gen-Replay's pieces as pure functions and small modules: the tiny image generator (``generator=conv``), the
statistics it is trained to reproduce (inputs of the model's normalisation layers, DeepInversion's "BN statistics")
and its fitting, the entropy regulariser, the one-hot-like relabelling and the replay cross-entropy (Liu et al.,
ECCV 2022; see :mod:`.gen_replay`).

Conventions: images ``(B, C_in, *spatial)``, logits ``(B, K, *spatial)``; ``spatial`` is 2D or 3D everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: normalisation layers whose inputs carry the statistics the generator matches
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.GroupNorm)


class TinyGenerator(nn.Module):
    """``z (B, z_dim) -> image (B, out_channels, *size)``: a DCGAN-style convolutional generator, 2D or 3D.

    A linear layer maps ``z`` to ``channels`` maps of ``ceil(size / 2**upsamplings)``, then ``upsamplings``
    blocks (nearest x2 up-sampling, 3x3 convolution, BatchNorm, LeakyReLU 0.2) and a final 3x3 convolution;
    the result is cropped to ``size``. The output is not squashed: the image statistics are matched instead.

    Args:
        z_dim: latent size. channels: feature maps of every block. out_channels: image channels.
        size: spatial size of the images (2 or 3 entries). upsamplings: x2 up-sampling blocks.
    """

    def __init__(self, z_dim: int, channels: int, out_channels: int, size: Sequence[int], upsamplings: int = 2) -> None:
        super().__init__()
        dims = len(size)
        if dims not in (2, 3):
            raise ValueError(f"size must have 2 or 3 entries, got {tuple(size)}")
        self.z_dim = z_dim
        self.size = tuple(int(s) for s in size)
        self.base = tuple(math.ceil(s / 2**upsamplings) for s in self.size)
        self.channels = channels
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        norm = nn.BatchNorm3d if dims == 3 else nn.BatchNorm2d
        self.project = nn.Linear(z_dim, channels * math.prod(self.base))
        blocks: list[nn.Module] = [norm(channels)]
        for _ in range(upsamplings):
            blocks += [
                nn.Upsample(scale_factor=2, mode="nearest"),
                conv(channels, channels, 3, padding=1),
                norm(channels),
                nn.LeakyReLU(0.2),
            ]
        blocks.append(conv(channels, out_channels, 3, padding=1))
        self.blocks = nn.Sequential(*blocks)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.project(z).view(z.shape[0], self.channels, *self.base)
        x = self.blocks(x)
        return x[(slice(None), slice(None), *(slice(0, s) for s in self.size))]

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` images from ``z ~ N(0, I)`` drawn with ``generator``."""
        device = self.project.weight.device
        return self(torch.randn(n, self.z_dim, generator=generator, device=device))


# ------------------------------------------------------------------------------------------------ statistics


def channel_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and mean of squares over batch and space: ``(B, C, *sp) -> ((C,), (C,))`` (differentiable)."""
    dims = [0, *range(2, x.dim())]
    return x.mean(dim=dims), (x * x).mean(dim=dims)


def mix_moments(parts: Sequence[tuple[torch.Tensor, torch.Tensor, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) variance of a mixture from its components' ``(mean, mean of squares, weight)``.

    ``mean = sum w_i m_i / W``, ``var = sum w_i s_i / W - mean^2`` (W = sum of the weights; components of
    weight 0 are left out).

    Raises:
        ValueError: no component has a positive weight.
    """
    kept = [(m, s, float(w)) for m, s, w in parts if w > 0]
    if not kept:
        raise ValueError("mix_moments: no component with a positive weight")
    total = sum(w for _, _, w in kept)
    mean = sum(w * m for m, _, w in kept) / total
    square = sum(w * s for _, s, w in kept) / total
    return mean, (square - mean * mean).clamp_min(0)


def moment_matching_loss(
    generated: Sequence[tuple[torch.Tensor, torch.Tensor]], reference: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """DeepInversion's feature-statistics term: ``sum_l ||mu_l - mu*_l||_2 + ||var_l - var*_l||_2``.

    Args:
        generated, reference: per tapped layer, (mean (C,), variance (C,)).
    """
    if len(generated) != len(reference):
        raise ValueError(f"{len(generated)} generated layers against {len(reference)} reference layers")
    terms = [(m - mr).norm() + (v - vr).norm() for (m, v), (mr, vr) in zip(generated, reference, strict=True)]
    return torch.stack(terms).sum()


def pixel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean over pixels of the prediction entropy ``-sum_k p_k log p_k`` (nats). ``(B, K, *sp) -> ()``."""
    log_p = F.log_softmax(logits, dim=1)
    return -(log_p.exp() * log_p).sum(dim=1).mean()


def class_frequency(logits: torch.Tensor) -> torch.Tensor:
    """Mean predicted class distribution over batch and space: ``(B, K, *sp) -> (K,)``."""
    return F.softmax(logits, dim=1).mean(dim=[0, *range(2, logits.dim())])


def class_prior_loss(logits: torch.Tensor, prior: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``KL(prior || q)``, q = :func:`class_frequency` of ``logits``: the generated images show the classes in the
    proportions the model predicts on the images the generator imitates. ``prior`` (K,) sums to 1."""
    q = class_frequency(logits).clamp_min(eps)
    p = prior.to(q)
    return (p * (p.clamp_min(eps).log() - q.log())).sum()


def one_hot_like_targets(teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Liu et al.'s relabelling: ``softmax(teacher_logits / temperature)`` per pixel (one-hot-like for small
    temperatures). ``(B, K_old, *sp)`` -> probabilities of the same shape."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    return F.softmax(teacher_logits / temperature, dim=1)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``mean over pixels of -sum_k q_k log softmax(logits)_k``.

    Args:
        logits: (B, K, *sp) of the model being trained.
        targets: (B, K_old, *sp) probabilities with K_old <= K; rows >= K_old (new classes) get target 0.
    """
    k_old = targets.shape[1]
    if k_old > logits.shape[1]:
        raise ValueError(f"targets have {k_old} classes, logits only {logits.shape[1]}")
    log_p = F.log_softmax(logits, dim=1)[:, :k_old]
    return -(targets * log_p).sum(dim=1).mean()


class NormInputTaps:
    """Forward pre-hooks on a model's normalisation layers (:data:`NORM_TYPES`) recording their inputs.

    Use as a context manager; after a forward, :attr:`inputs` holds one tensor per tapped layer, in module
    order (the graph is kept, so moments of generated inputs are differentiable).
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, NORM_TYPES)]
        self.inputs: list[torch.Tensor] = []
        self._handles: list = []

    def __enter__(self) -> NormInputTaps:
        for layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._record))
        return self

    def _record(self, module: nn.Module, args: tuple) -> None:
        self.inputs.append(args[0])

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        self.inputs = []


# ------------------------------------------------------------------------------------------------ fitting the conv generator


class Moments:
    """Streaming per-channel moments of the image and of every tapped layer input, and the predicted class
    frequencies, over a set of images (each image weighs its pixel count within a layer)."""

    def __init__(self) -> None:
        self.sums: list[list] = []  # per layer: [sum x, sum x^2, count]
        self.freq: torch.Tensor | None = None
        self.freq_count = 0.0

    def update(self, layers: list[torch.Tensor], logits: torch.Tensor) -> None:
        if not self.sums:
            self.sums = [[torch.zeros(t.shape[1], dtype=torch.float64) for _ in range(2)] + [0.0] for t in layers]
        for acc, t in zip(self.sums, layers, strict=True):
            n = t.numel() / t.shape[1]
            mean, square = channel_moments(t.detach().double())
            acc[0] += (mean * n).cpu()
            acc[1] += (square * n).cpu()
            acc[2] += n
        pixels = logits.numel() / logits.shape[1]
        freq = F.softmax(logits.detach().double(), dim=1).mean(dim=[0, *range(2, logits.dim())]).cpu() * pixels
        self.freq = freq if self.freq is None else self.freq + freq
        self.freq_count += pixels

    def components(self, weight: float) -> tuple[list[tuple[torch.Tensor, torch.Tensor, float]], tuple]:
        """Per layer ``(mean, mean of squares, weight)``, and ``(class frequency, weight)``."""
        layers = [(s1 / n, s2 / n, weight) for s1, s2, n in self.sums]
        assert self.freq is not None
        return layers, (self.freq / self.freq_count, weight)


def observe(model: nn.Module, taps: NormInputTaps, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The image and the tapped layer inputs for ``x``, and the logits (``model.forward_features(x).logits``)."""
    taps.clear()
    logits = model.forward_features(x).logits  # type: ignore[operator]
    return [x, *taps.inputs], logits


def _mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, square = channel_moments(x)
    return mean, (square - mean * mean).clamp_min(0)


def fit_to_statistics(
    model: nn.Module,
    generator: TinyGenerator,
    reference: list[tuple[torch.Tensor, torch.Tensor]],
    prior: torch.Tensor,
    *,
    steps: int,
    batch: int,
    lr: float,
    entropy_weight: float,
    prior_weight: float,
    rng: torch.Generator | None = None,
) -> tuple[float | None, float | None]:
    """Train ``generator`` in place: ``steps`` Adam steps on
    ``moment_matching_loss + prior_weight * class_prior_loss - entropy_weight * pixel_entropy`` of ``batch`` images.

    The model (in the mode the caller set) gets no gradient; ``reference`` holds (mean, variance) of the image and
    of every normalisation layer's input (:class:`NormInputTaps` order); ``prior`` (K,) the class
    frequencies. Leaves the generator in eval mode without gradients.

    Returns:
        the loss of the first and of the last step (None without steps).
    """
    generator.train().requires_grad_(True)
    params = list(generator.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    first = last = None
    with NormInputTaps(model) as taps:
        for _ in range(steps):
            layers, logits = observe(model, taps, generator.sample(batch, rng))
            loss = moment_matching_loss([_mean_var(t) for t in layers], reference)
            if prior_weight:
                loss = loss + prior_weight * class_prior_loss(logits, prior)
            if entropy_weight:
                loss = loss - entropy_weight * pixel_entropy(logits)
            grads = torch.autograd.grad(loss, params)
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            opt.step()
            value = float(loss.detach())
            first = value if first is None else first
            last = value
        taps.clear()
    generator.eval().requires_grad_(False)
    return first, last
