"""Gen-Replay's diffusion image prior: a small denoising U-Net (``diffusers.UNet2DModel``) trained with the DDPM
objective on one session's images and sampled with DDIM (Ho et al., NeurIPS 2020; Song et al., ICLR 2021).

Conventions: images ``(B, C, H, W)`` in 2D, ``(B, C, H, W, D)`` in 3D (MONAI's order: D last); intensities as the
loop feeds them. The U-Net works on ``[-1, 1]``: every prior keeps the session's intensity window (the 0.5 and 99.5
percentiles per channel) and maps it to ``[-1, 1]`` before training, and back after sampling.

2D and 3D share one 2D U-Net: a volume is learnt **slice-wise**. Every axial slice ``[..., d]`` is a training image,
conditioned on its position: an extra input channel holding ``2 d / (D - 1) - 1`` everywhere (-1 for the first
slice, 1 for the last; a class embedding of the position, tried first, was not picked up in a few hundred steps). A
volume is sampled as ``D`` slices denoised together from *one* shared starting noise with deterministic DDIM
(``eta = 0``): the slices then differ only through their position, which keeps neighbours alike. Measured against
MONAI's 3D ``DiffusionModelUNet`` (channels 16, 32) on 32^3 volumes, 2 per step, on one CPU thread: 0.58 s of CPU
per training step slice-wise against 3.9 s in 3D, and 4.0 s against 29.7 s to draw two volumes with 20 DDIM steps
(``docs/baselines.md``, Gen-Replay).

``diffusers`` is an optional dependency (``pip install 'jascl[diffusion]'``); it is imported when a prior is built,
and its absence is a one-line :class:`~jascl.errors.ConfigError` (:func:`require_diffusers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from jascl.errors import ConfigError

#: the DDPM noise schedule's length (Ho et al.: 1000 steps, linear betas 1e-4 -> 0.02, diffusers' defaults)
TRAIN_TIMESTEPS = 1000


def require_diffusers() -> Any:
    """The ``diffusers`` module, or a one-line ConfigError naming the fix."""
    try:
        import diffusers
    except ImportError as exc:
        raise ConfigError(
            "method gen-replay: method_args.gen-replay.generator=diffusion needs the diffusers package "
            "(pip install 'jascl[diffusion]'); or set method_args.gen-replay.generator=conv"
        ) from exc
    return diffusers


# ------------------------------------------------------------------------------------------------ pure functions


def intensity_window(images: torch.Tensor, low: float = 0.005, high: float = 0.995) -> torch.Tensor:
    """Per-channel (low, high) quantiles of ``(N, C, *spatial)`` images: ``(C, 2)``; a flat channel gets a window of 1."""
    flat = images.transpose(0, 1).reshape(images.shape[1], -1).float()
    window = torch.quantile(flat, torch.tensor([low, high]), dim=1).T.contiguous()
    flat_channels = window[:, 1] <= window[:, 0]
    window[flat_channels, 1] = window[flat_channels, 0] + 1.0
    return window


def to_unit(images: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Intensities mapped linearly from ``window`` (C, 2) to ``[-1, 1]`` and clipped there."""
    shape = (1, -1) + (1,) * (images.dim() - 2)
    low, high = window[:, 0].view(shape).to(images), window[:, 1].view(shape).to(images)
    return (2 * (images - low) / (high - low) - 1).clamp(-1, 1)


def from_unit(images: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_unit` (without the clipping)."""
    shape = (1, -1) + (1,) * (images.dim() - 2)
    low, high = window[:, 0].view(shape).to(images), window[:, 1].view(shape).to(images)
    return (images + 1) / 2 * (high - low) + low


def slice_positions(depth: int, volumes: int = 1) -> torch.Tensor:
    """The position of every slice of ``volumes`` volumes of ``depth`` slices, volume-major: ``2 d / (D - 1) - 1``
    (0 for a single slice)."""
    if depth == 1:
        return torch.zeros(volumes)
    return (torch.arange(depth, dtype=torch.float32) * (2 / (depth - 1)) - 1).repeat(volumes)


def with_position(slices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(N, C, H, W)`` slices with their position ``(N,)`` appended as a constant channel: ``(N, C + 1, H, W)``."""
    n, _, h, w = slices.shape
    return torch.cat([slices, positions.to(slices).view(n, 1, 1, 1).expand(n, 1, h, w)], dim=1)


def volume_slices(volumes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, C, H, W, D)`` volumes -> ``(B * D, C, H, W)`` slices (volume-major) and their positions ``(B * D,)``
    (:func:`slice_positions`)."""
    b, c, h, w, d = volumes.shape
    slices = volumes.permute(0, 4, 1, 2, 3).reshape(b * d, c, h, w)
    return slices, slice_positions(d, b)


def slices_to_volumes(slices: torch.Tensor, depth: int) -> torch.Tensor:
    """The inverse of :func:`volume_slices`: ``(B * D, C, H, W)`` -> ``(B, C, H, W, D)``."""
    n, c, h, w = slices.shape
    return slices.reshape(n // depth, depth, c, h, w).permute(0, 2, 3, 4, 1).contiguous()


def pad_to_multiple(images: torch.Tensor, multiple: int) -> torch.Tensor:
    """``(B, C, H, W)`` padded at the bottom and right (edge values repeated) to sides divisible by ``multiple``."""
    h, w = images.shape[-2:]
    pad_h, pad_w = -h % multiple, -w % multiple
    if not (pad_h or pad_w):
        return images
    return F.pad(images, (0, pad_w, 0, pad_h), mode="replicate")


def ddpm_loss(
    unet: torch.nn.Module,
    scheduler: Any,
    clean: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The DDPM objective (Ho et al., eq. 14): ``|| eps - eps_theta(sqrt(a_t) x0 + sqrt(1 - a_t) eps, t) ||^2``, mean
    over every element.

    Args:
        unet: the noise predictor ``(x_t, t) -> eps`` (``.sample``).
        scheduler: a ``diffusers.DDPMScheduler`` (its ``add_noise`` gives x_t).
        clean: x0, ``(B, C, H, W)`` in [-1, 1]. noise: eps, same shape. timesteps: ``(B,)`` long.
        positions: ``(B,)`` slice positions (slice-wise 3D; given to the U-Net as an extra channel), or None.
    """
    noisy = scheduler.add_noise(clean, noise, timesteps)
    if positions is not None:
        noisy = with_position(noisy, positions)
    return F.mse_loss(unet(noisy, timesteps).sample, noise)


# ------------------------------------------------------------------------------------------------ the prior


@dataclass(frozen=True)
class PriorShape:
    """What builds a prior's U-Net: image channels, spatial size (2 or 3 entries), U-Net channels per level."""

    channels: int
    size: tuple[int, ...]
    unet_channels: tuple[int, ...]

    @property
    def slicewise(self) -> bool:
        return len(self.size) == 3

    @property
    def plane(self) -> tuple[int, int]:
        """(H, W) of the images the 2D U-Net sees, before padding."""
        return (self.size[0], self.size[1])

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.channels, len(self.size), *self.size, *self.unet_channels], dtype=torch.long)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> PriorShape:
        values = [int(v) for v in t.tolist()]
        dims = values[1]
        return cls(values[0], tuple(values[2 : 2 + dims]), tuple(values[2 + dims :]))


def build_unet(shape: PriorShape) -> torch.nn.Module:
    """The denoiser: ``diffusers.UNet2DModel`` with plain ResNet blocks (no attention), one block per level, group
    norm in groups of ``gcd(8, channels)``; slice-wise priors take the slice position as an extra input channel."""
    diffusers = require_diffusers()
    levels = len(shape.unet_channels)
    return diffusers.UNet2DModel(
        sample_size=list(shape.plane),
        in_channels=shape.channels + int(shape.slicewise),
        out_channels=shape.channels,
        block_out_channels=tuple(shape.unet_channels),
        down_block_types=("DownBlock2D",) * levels,
        up_block_types=("UpBlock2D",) * levels,
        layers_per_block=1,
        norm_num_groups=math.gcd(8, *shape.unet_channels),
    )


class DiffusionPrior:
    """One session's image prior: a DDPM-trained 2D U-Net (slice-wise for volumes) and the session's intensity window.

    Args:
        shape: channels, image size and U-Net channels.
        window: ``(C, 2)`` intensity window (:func:`intensity_window`).
        images: how many images it was trained on (the weight of its share of the replay bank).
    """

    def __init__(self, shape: PriorShape, window: torch.Tensor, images: int = 0) -> None:
        self.shape = shape
        self.window = window.float().cpu()
        self.images = images
        self.unet = build_unet(shape)
        self.scheduler = require_diffusers().DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS)

    @property
    def multiple(self) -> int:
        """Image sides must divide by this (the U-Net halves them ``levels - 1`` times)."""
        return 2 ** (len(self.shape.unet_channels) - 1)

    def _training_images(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = to_unit(images.float(), self.window)
        positions = None
        if self.shape.slicewise:
            x, positions = volume_slices(x)
        return pad_to_multiple(x, self.multiple), positions

    def fit(
        self, images: torch.Tensor, steps: int, batch: int, lr: float, generator: torch.Generator
    ) -> tuple[float | None, float | None]:
        """``steps`` Adam steps of :func:`ddpm_loss` on minibatches of ``batch`` images (slices, for volumes) drawn
        with replacement from ``images`` ``(N, C, *size)``; timesteps uniform, noise standard normal, all drawn
        from ``generator`` (on the images' device).

        Returns:
            the loss of the first and of the last step (None without steps).
        """
        device = images.device
        x, positions = self._training_images(images)
        unet = self.unet.to(device).train().requires_grad_(True)
        opt = torch.optim.Adam(unet.parameters(), lr=lr)
        first = last = None
        for _ in range(steps):
            pick = torch.randint(0, x.shape[0], (batch,), generator=generator, device=device)
            clean = x[pick]
            noise = torch.randn(clean.shape, generator=generator, device=device)
            t = torch.randint(0, TRAIN_TIMESTEPS, (batch,), generator=generator, device=device)
            where = None if positions is None else positions.to(device)[pick]
            loss = ddpm_loss(unet, self.scheduler, clean, noise, t, where)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = float(loss.detach())
            first = last if first is None else first
        unet.eval().requires_grad_(False)
        return first, last

    @torch.no_grad()
    def sample(self, n: int, steps: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """``n`` images ``(n, C, *size)`` in the session's intensities: deterministic DDIM (eta 0) over ``steps``
        of the 1000 training steps, from noise drawn with ``generator``; a volume's slices share one starting noise."""
        diffusers = require_diffusers()
        ddim = diffusers.DDIMScheduler(num_train_timesteps=TRAIN_TIMESTEPS, clip_sample=True)
        ddim.set_timesteps(steps)
        unet = self.unet.to(device).eval()
        h, w = self.shape.plane
        ph, pw = h + (-h % self.multiple), w + (-w % self.multiple)
        noise = torch.randn((n, self.shape.channels, ph, pw), generator=generator, device=device)
        positions = None
        if self.shape.slicewise:
            depth = self.shape.size[2]
            noise = noise.repeat_interleave(depth, dim=0)
            positions = slice_positions(depth, n).to(device)
        x = noise
        for t in ddim.timesteps:
            inputs = x if positions is None else with_position(x, positions)
            eps = unet(inputs, t.to(device).expand(x.shape[0])).sample
            x = ddim.step(eps, t, x).prev_sample
        x = x[..., :h, :w]
        if self.shape.slicewise:
            x = slices_to_volumes(x, self.shape.size[2])
        return from_unit(x, self.window.to(device))

    # ------------------------------------------------------------------ kept across sessions

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The prior as named tensors (safetensors): shape, window, image count and the U-Net's weights."""
        out = {
            f"{prefix}shape": self.shape.as_tensor(),
            f"{prefix}window": self.window.contiguous(),
            f"{prefix}images": torch.tensor([self.images]),
        }
        for key, value in self.unet.state_dict().items():
            out[f"{prefix}unet.{key}"] = value.detach().cpu().clone().contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> DiffusionPrior:
        prior = cls(
            PriorShape.from_tensor(tensors[f"{prefix}shape"]),
            tensors[f"{prefix}window"],
            int(tensors[f"{prefix}images"][0]),
        )
        start = f"{prefix}unet."
        prior.unet.load_state_dict({k[len(start) :]: v for k, v in tensors.items() if k.startswith(start)})
        prior.unet.eval().requires_grad_(False)
        return prior


def bank_shares(priors: int, total: int) -> list[int]:
    """How many of ``total`` replay images each of ``priors`` session priors draws: an equal share, the remainder to
    the earlier sessions (``3, 17 -> [6, 6, 5]``). Equal, not proportional to each session's images, so that a 5-shot
    session is replayed as much as a base session of hundreds of images."""
    if priors <= 0:
        return []
    return [total // priors + int(i < total % priors) for i in range(priors)]
