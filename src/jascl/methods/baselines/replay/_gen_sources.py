"""Where Gen-Replay's images come from (:mod:`.gen_replay`): one object per generator kind, each fitted at the end of
a session, drawn from in the next ones, and kept across sessions as named tensors.

* :class:`DiffusionSource` (``generator=diffusion``, the default): one :class:`~._diffusion.DiffusionPrior` per
  session, trained with the DDPM objective on that session's labelled images; at the start of an incremental
  session a bank of ``bank`` images is drawn from the kept priors (an equal share each, :func:`~._diffusion.bank_shares`)
  with DDIM, and every iteration draws its replay images from the bank.
* :class:`ConvSource` (``generator=conv``): Liu et al.'s data-free-style generator -- one
  :class:`~._generator.TinyGenerator` refitted after every session to the statistics the model sees on the session's
  images and on the previous generator's images, sampled afresh every iteration.

Conventions: images ``(B, C, *spatial)``, 2D or 3D; random draws come from generators seeded by the run's seed and
the session index, so a run, and a resumed run, draws the same images.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from jascl.data.datasets import LabelledDataset
from jascl.methods.baselines.replay._diffusion import DiffusionPrior, PriorShape, bank_shares, intensity_window
from jascl.methods.baselines.replay._generator import (
    Moments,
    NormInputTaps,
    TinyGenerator,
    fit_to_statistics,
    mix_moments,
    observe,
)
from jascl.methods.common import labelled_crops
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")


def _seeded(state: LoopState, salt: int) -> torch.Generator:
    return torch.Generator(device=state.device).manual_seed(state.seed * 7919 + salt)


def _resized(x: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    if not size or tuple(x.shape[2:]) == tuple(size):
        return x
    return F.interpolate(x, size=size, mode="trilinear" if len(size) == 3 else "bilinear")


def session_crops(state: LoopState) -> LabelledDataset:
    """The session's labelled samples as training crops (:func:`jascl.methods.common.labelled_crops`): a generator
    imitates what the model trains on, not whole volumes (whose forward a GPU cannot hold)."""
    return labelled_crops(state, "gen-replay")


def session_images(state: LoopState) -> torch.Tensor:
    """:func:`session_crops`' images, ``(N, C, *spatial)`` on the run's device."""
    dataset = session_crops(state)
    return torch.stack([dataset[i]["image"] for i in range(len(dataset))]).to(state.device)


class DiffusionSource:
    """Per-session diffusion priors and the replay bank drawn from them (see the module docstring).

    Args:
        options: the method's :class:`~.gen_replay.GenReplayOptions`.
    """

    kind = "diffusion"

    def __init__(self, options: Any) -> None:
        self.o = options
        self.priors: list[DiffusionPrior] = []
        self.bank: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        return bool(self.priors)

    def fit(self, state: LoopState) -> None:
        """Train a new prior on the session's labelled images and keep it (after the earlier ones)."""
        o = self.o
        images = session_images(state)
        shape = PriorShape(images.shape[1], tuple(images.shape[2:]), tuple(o.unet_channels))
        devices = [state.device.index or 0] if state.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the U-Net's initial weights, seeded; the loop's stream untouched
            torch.manual_seed(state.seed * 7919 + 104729 + state.session.index)
            prior = DiffusionPrior(shape, intensity_window(images), len(images))
        rng = _seeded(state, 1009 * (state.session.index + 1))
        first, last = prior.fit(images, o.diffusion_steps, o.diffusion_batch, o.diffusion_lr, rng)
        prior.unet.cpu()
        self.priors.append(prior)
        log.info(
            "gen_replay session %d: diffusion prior trained on %d images, %d DDPM steps, loss %s -> %s",
            state.session.index,
            len(images),
            o.diffusion_steps,
            None if first is None else round(first, 4),
            None if last is None else round(last, 4),
        )

    @torch.no_grad()
    def prepare(self, state: LoopState, size: tuple[int, ...]) -> None:
        """Draw the session's replay bank: ``bank`` images, an equal share from every kept prior, resized to ``size``."""
        parts = []
        for i, (prior, n) in enumerate(zip(self.priors, bank_shares(len(self.priors), self.o.bank))):
            if n:
                rng = _seeded(state, 7 * state.session.index + 131 * (i + 1))
                parts.append(_resized(prior.sample(n, self.o.sample_steps, rng, state.device), size))
            prior.unet.cpu()
        self.bank = torch.cat(parts) if parts else None

    def draw(self, n: int, rng: torch.Generator) -> torch.Tensor:
        """``n`` bank images drawn uniformly with replacement."""
        assert self.bank is not None
        return self.bank[torch.randint(0, len(self.bank), (n,), generator=rng, device=rng.device)]

    def release(self) -> None:
        self.bank = None

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {"diffusion.count": torch.tensor([len(self.priors)])}
        for i, prior in enumerate(self.priors):
            out.update(prior.to_tensors(f"diffusion.{i}."))
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        count = int(tensors["diffusion.count"][0]) if "diffusion.count" in tensors else 0
        self.priors = [DiffusionPrior.from_tensors(tensors, f"diffusion.{i}.") for i in range(count)]


class ConvSource:
    """Liu et al.'s generator, one for the whole run, refitted after every session (see the module docstring)."""

    kind = "conv"

    def __init__(self, options: Any) -> None:
        self.o = options
        self.generator: TinyGenerator | None = None
        self.images = 0.0  # images of all sessions so far the generator stands for

    @property
    def ready(self) -> bool:
        return self.generator is not None

    @torch.no_grad()
    def reference_statistics(
        self, state: LoopState
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, int, tuple[int, ...], int]:
        """What the new generator imitates, under the current model: the session's labelled images (as training
        crops, :func:`session_crops`, ``batch_size`` at a time) mixed with as many images of the previous generator,
        weighted by the images each stands for.

        Returns:
            per layer (mean, variance), the class frequencies (K,), the session's image count, image size and
            channels.
        """
        model = state.model
        real, synthetic = Moments(), Moments()
        count, size, channels = 0, None, 1
        with eval_mode(model), NormInputTaps(model) as taps:
            for batch in DataLoader(session_crops(state), batch_size=state.config.batch_size):
                x = batch["image"].to(state.device)
                if size is None:
                    size, channels = tuple(x.shape[2:]), x.shape[1]
                real.update(*observe(model, taps, x))
                count += x.shape[0]
            assert size is not None
            if self.generator is not None and self.images > 0:
                g = self.generator.to(state.device).eval()
                rng = _seeded(state, state.session.index + 1)
                for start in range(0, count, self.o.batch):
                    x = _resized(g.sample(min(self.o.batch, count - start), rng), size)
                    synthetic.update(*observe(model, taps, x))
        parts = [real.components(float(count))]
        if synthetic.sums:
            parts.append(synthetic.components(self.images))
        layers = [mix_moments([p[0][i] for p in parts]) for i in range(len(parts[0][0]))]
        total = sum(w for _, (_, w) in parts)
        prior = sum(f * w for _, (f, w) in parts) / total
        return (
            [(m.float().to(state.device), v.float().to(state.device)) for m, v in layers],
            prior.float(),
            count,
            size,
            channels,
        )

    def fit(self, state: LoopState) -> None:
        """Refit the generator to the reference statistics (warm-started from the previous one) and keep it."""
        o = self.o
        reference, prior, count, size, channels = self.reference_statistics(state)
        previous = self.generator
        if previous is not None and previous.size == size and previous.blocks[-1].out_channels == channels:
            g = copy.deepcopy(previous)
        else:
            devices = [state.device.index or 0] if state.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(state.seed * 7919 + 104729)
                g = TinyGenerator(o.z_dim, o.channels, channels, size, o.upsamplings)
        g = g.to(state.device)
        with eval_mode(state.model):
            first, last = fit_to_statistics(
                state.model,
                g,
                reference,
                prior.to(state.device),
                steps=o.steps,
                batch=o.batch,
                lr=o.lr,
                entropy_weight=o.entropy_weight,
                prior_weight=o.prior_weight,
                rng=_seeded(state, state.session.index + 2),
            )
        self.generator = g.eval().requires_grad_(False)
        self.images += count
        log.info(
            "gen_replay session %d: generator fitted on %d images (+ %s earlier), %d steps, loss %s -> %s",
            state.session.index,
            count,
            int(self.images - count),
            o.steps,
            None if first is None else round(first, 4),
            None if last is None else round(last, 4),
        )

    def prepare(self, state: LoopState, size: tuple[int, ...]) -> None:
        assert self.generator is not None
        self.generator = self.generator.to(state.device).eval()

    def draw(self, n: int, rng: torch.Generator) -> torch.Tensor:
        assert self.generator is not None
        return self.generator.sample(n, rng)

    def release(self) -> None:
        pass

    def to_tensors(self) -> dict[str, torch.Tensor]:
        if self.generator is None:
            return {}
        g = self.generator
        upsamplings = sum(isinstance(m, torch.nn.Upsample) for m in g.blocks)
        out = {
            "images": torch.tensor([self.images], dtype=torch.float64),
            "size": torch.tensor(g.size),
            "shape": torch.tensor([g.z_dim, g.channels, g.blocks[-1].out_channels, upsamplings]),
        }
        for key, value in g.state_dict().items():
            out[f"generator.{key}"] = value.detach().cpu().clone().contiguous()
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if "shape" not in tensors:
            return
        z_dim, channels, out_channels, upsamplings = (int(v) for v in tensors["shape"].tolist())
        g = TinyGenerator(z_dim, channels, out_channels, [int(s) for s in tensors["size"].tolist()], upsamplings)
        g.load_state_dict({k[len("generator.") :]: v for k, v in tensors.items() if k.startswith("generator.")})
        self.generator = g.eval().requires_grad_(False)
        self.images = float(tensors["images"][0])
