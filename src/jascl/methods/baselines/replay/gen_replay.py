"""Gen-Replay: replay of images synthesised by a generator instead of stored images of earlier sessions.

Source (the JASCL paper's ``10.1007/978-3-031-20053-3_9``): H. Liu, L. Gu, Z. Chi, Y. Wang, Y. Yu, J. Chen,
J. Tang, "Few-Shot Class-Incremental Learning via Entropy-Regularized Data-Free Replay", ECCV 2022
(arXiv 2207.11213; no official code found). The JASCL paper adds that its Gen-Replay "is implemented with a
diffusion model adapted from" IEEE document 10493074 (not identified further: the seed carries no bibliography).

What Liu et al. do (classification; only the abstract could be read here, the generator objective below is
reconstructed from it and from the data-free inversion methods it builds on): after each session a generator is
trained from the model alone, without real data -- its images must reproduce the statistics the model's
BatchNorm layers hold (DeepInversion's feature-statistics term) and, the paper's addition, carry a *high*
prediction entropy (entropy regularisation: uncertain, near-boundary samples transfer more knowledge). In the next
session the synthesised images are *relabelled* with one-hot-like labels from the old model, so the new model
learns from real new-class data and synthetic old data with one cross-entropy, without a separate distillation
term to balance.

Here (dense segmentation, :class:`GenReplayPlugin`):

* At the end of every session (``after_training``; ``session_restored`` for the shared base) a
  :class:`~._generator.TinyGenerator` is fitted to the final model (frozen, eval mode) by minimising
  ``moment_matching_loss + prior_weight * class_prior_loss - entropy_weight * pixel_entropy`` on its images,
  ``steps`` Adam steps of ``batch`` images.
* The statistics matched are the per-channel mean and variance of the image and of the input of every
  normalisation layer of the model. They are gathered at the end of the session on the session's own labelled
  images *and* on as many images of the previous generator, weighted by the number of images each stands for
  (the session's, and those of all earlier sessions), all under the current model: the new generator covers every
  session so far, and no image of an earlier session is ever kept.
* Incremental sessions: each iteration draws ``replay_batch`` images from the kept generator, labels them with
  ``softmax(old model logits / temperature)`` (rows of the old classes, background included) and adds
  ``replay_weight`` x the soft cross-entropy of the model on them (``gen_replay_replay``; new-class rows get
  target 0) to the loop's segmentation loss on the real batch.
* The generator's weights, shape and the number of images it stands for are kept across sessions
  (:meth:`GenReplayPlugin.extra_state`, saved with the session checkpoint in safetensors).

Deviations:

* Statistics: the default U-Net uses instance norm, which keeps no running statistics, so the "BN statistics"
  cannot be read from the model; they are measured on the session's own images at the end of the session (what a
  BatchNorm layer's running statistics summarise) and on the previous generator's images. The generator is
  therefore trained from the model plus the session's data while that data is still at hand -- not data-free as
  in the paper -- and nothing but its weights leaves the session.
* The class term of data-free generator objectives (a cross-entropy to a sampled class, one class per image) is
  replaced by :func:`~._generator.class_prior_loss`: the generated images' mean predicted class distribution is pulled towards
  the one measured on the reference images (a segmentation image shows several classes, background first).
* One generator for all sessions, warm-started from the previous one and trained on its samples (deep
  generative replay's scheme) instead of a generator per session; relabelling temperature (0.1) and loss weights
  are our choices.
* Generator: a tiny DCGAN-style convolutional generator (``channels`` maps, ``upsamplings`` x2 stages, latent
  ``z_dim``) so the toy protocol trains in seconds. The JASCL paper's variant uses a diffusion model trained on
  images; ours plays the same role (a learned image prior sampled in later sessions) with one forward pass per
  sample instead of a denoising chain, and is trained through the segmentation model instead of by denoising.
  Either way, for 3D volumes a generator this small renders coarse, low-detail images -- the paper reports that
  Gen-Replay "struggles to generate 3D medical volumes even with a diffusion model".
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method
from jascl.methods.baselines.distillation._shared import TeacherPlugin
from jascl.methods.baselines.replay._generator import (
    NormInputTaps,
    TinyGenerator,
    channel_moments,
    class_prior_loss,
    mix_moments,
    moment_matching_loss,
    one_hot_like_targets,
    pixel_entropy,
    soft_cross_entropy,
)
from jascl.methods.common import labelled_loader
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter

log = logging.getLogger("jascl")


@dataclass
class GenReplayOptions:
    """Options of ``gen-replay`` (the paper gives none for segmentation; defaults are ours, sized so the toy
    protocol trains in seconds -- on real data raise ``steps``, e.g. to a few thousand, and ``channels``).

    Attributes:
        replay_weight: weight of the replay cross-entropy on the synthesised images.
        replay_batch: synthesised images per iteration.
        temperature: relabelling temperature (``softmax(old logits / T)``; small = one-hot-like).
        z_dim: latent size of the generator.
        channels: feature maps of every generator stage.
        upsamplings: x2 up-sampling stages (the latent grid is the image size / 2**upsamplings).
        steps: generator optimisation steps at the end of each session.
        batch: generated images per generator step.
        lr: Adam learning rate of the generator.
        entropy_weight: weight of the entropy regulariser (Liu et al.: favour uncertain samples).
        prior_weight: weight of the class-frequency term.
        freeze: incremental-session freezing.
    """

    replay_weight: float = option(1.0, ge=0)
    replay_batch: int = option(4, ge=1)
    temperature: float = option(0.1, gt=0)
    z_dim: int = option(32, ge=1)
    channels: int = option(16, ge=1)
    upsamplings: int = option(2, ge=0, le=6)
    steps: int = option(30, ge=0)
    batch: int = option(4, ge=1)
    lr: float = option(3e-3, gt=0)
    entropy_weight: float = option(0.1, ge=0)
    prior_weight: float = option(1.0, ge=0)
    freeze: str = freeze_option()


class _Moments:
    """Streaming per-channel moments of the image and of every tapped layer input, and the predicted class
    frequencies, over a set of images (each image weighs its pixel count within a layer)."""

    def __init__(self) -> None:
        self.sums: list[list[torch.Tensor]] = []  # per layer: [sum x, sum x^2, count]
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


def _observe(model: Segmenter, taps: NormInputTaps, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The image and the tapped layer inputs for ``x``, and the logits."""
    taps.clear()
    logits = model.forward_features(x).logits
    return [x, *taps.inputs], logits


class GenReplayPlugin(TeacherPlugin):
    """Liu et al. (ECCV 2022) generative replay on the jascl loop: see the module docstring."""

    name = "gen_replay"
    loss_terms = ("gen_replay_replay",)

    def __init__(self, options: GenReplayOptions | None = None, freeze: str | None = None) -> None:
        super().__init__(freeze)
        self.o = options or GenReplayOptions()
        self.generator: TinyGenerator | None = None
        self.images = 0.0  # images of all sessions so far the generator stands for
        self.trained_through = -1  # last session whose data the generator has seen
        self._rng: torch.Generator | None = None

    # ------------------------------------------------------------------ kept across sessions

    def extra_state(self) -> dict[str, torch.Tensor]:
        if self.generator is None:
            return {}
        g = self.generator
        out = {
            "images": torch.tensor([self.images], dtype=torch.float64),
            "trained_through": torch.tensor([self.trained_through]),
            "size": torch.tensor(g.size),
            "shape": torch.tensor([g.z_dim, g.channels, g.blocks[-1].out_channels, self._upsamplings(g)]),
        }
        for key, value in g.state_dict().items():
            out[f"generator.{key}"] = value.detach().cpu().clone().contiguous()
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if "shape" not in tensors:
            return
        z_dim, channels, out_channels, upsamplings = (int(v) for v in tensors["shape"].tolist())
        g = TinyGenerator(z_dim, channels, out_channels, [int(s) for s in tensors["size"].tolist()], upsamplings)
        g.load_state_dict({k[len("generator.") :]: v for k, v in tensors.items() if k.startswith("generator.")})
        self.generator = g.eval().requires_grad_(False)
        self.images = float(tensors["images"][0])
        self.trained_through = int(tensors["trained_through"][0])

    @staticmethod
    def _upsamplings(g: TinyGenerator) -> int:
        return sum(isinstance(m, torch.nn.Upsample) for m in g.blocks)

    # ------------------------------------------------------------------ the generator

    @torch.no_grad()
    def reference_statistics(
        self, state: LoopState
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, int, tuple[int, ...], int]:
        """What the new generator imitates, under the current model: the session's labelled images mixed with as
        many images of the previous generator, weighted by the images each stands for.

        Returns:
            per layer (mean, variance), the class frequencies (K,), the session's image count, image size and
            channels.
        """
        model = state.model
        real, synthetic = _Moments(), _Moments()
        count, size, channels = 0, None, 1
        with eval_mode(model), NormInputTaps(model) as taps:
            for batch in labelled_loader(state):
                x = batch["image"].to(state.device)
                if size is None:
                    size, channels = tuple(x.shape[2:]), x.shape[1]
                real.update(*_observe(model, taps, x))
                count += x.shape[0]
            if self.generator is not None and self.images > 0:
                g = self.generator.to(state.device).eval()
                rng = torch.Generator(device=state.device).manual_seed(state.seed * 7919 + state.session.index + 1)
                for start in range(0, count, self.o.batch):
                    x = g.sample(min(self.o.batch, count - start), rng)
                    if tuple(x.shape[2:]) != size:
                        x = F.interpolate(x, size=size, mode="trilinear" if len(size) == 3 else "bilinear")
                    synthetic.update(*_observe(model, taps, x))
        parts = [real.components(float(count))]
        if synthetic.sums:
            parts.append(synthetic.components(self.images))
        layers = [mix_moments([p[0][i] for p in parts]) for i in range(len(parts[0][0]))]
        total = sum(w for _, (_, w) in parts)
        prior = sum(f * w for _, (f, w) in parts) / total
        assert size is not None
        return (
            [(m.float().to(state.device), v.float().to(state.device)) for m, v in layers],
            prior.float(),
            count,
            size,
            channels,
        )

    def fit_generator(self, state: LoopState) -> None:
        """Train the generator at the end of the session (see the module docstring) and keep it."""
        o = self.o
        if len(state.data.train) == 0:
            log.warning(
                "%s session %d: no labelled images, the generator is kept as it is", self.name, state.session.index
            )
            return
        reference, prior, count, size, channels = self.reference_statistics(state)
        prior = prior.to(state.device)
        previous = self.generator
        if previous is not None and previous.size == size and previous.blocks[-1].out_channels == channels:
            g = copy.deepcopy(previous)
        else:
            devices = [state.device.index or 0] if state.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(state.seed * 7919 + 104729)
                g = TinyGenerator(o.z_dim, o.channels, channels, size, o.upsamplings)
        g = g.to(state.device)
        rng = torch.Generator(device=state.device).manual_seed(state.seed * 7919 + state.session.index + 2)
        with eval_mode(state.model):
            first, last = fit_to_statistics(
                state.model,
                g,
                reference,
                prior,
                steps=o.steps,
                batch=o.batch,
                lr=o.lr,
                entropy_weight=o.entropy_weight,
                prior_weight=o.prior_weight,
                rng=rng,
            )
        self.generator = g.eval().requires_grad_(False)
        self.images += count
        self.trained_through = state.session.index
        log.info(
            "%s session %d: generator fitted on %d images (+ %s earlier), %d steps, loss %s -> %s",
            self.name,
            state.session.index,
            count,
            int(self.images - count),
            o.steps,
            None if first is None else round(first, 4),
            None if last is None else round(last, 4),
        )

    # ------------------------------------------------------------------ events

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self._rng = None
        if self.teacher is None:
            return
        if self.generator is None:
            log.warning("%s session %d: no generator kept, nothing is replayed", self.name, state.session.index)
            return
        self.generator = self.generator.to(state.device).eval()
        self._rng = torch.Generator(device=state.device).manual_seed(state.seed * 7919 + state.session.index)

    def replay_loss(self, state: LoopState) -> torch.Tensor:
        """The soft cross-entropy of the model on ``replay_batch`` synthesised, relabelled images."""
        assert self.generator is not None and self.teacher is not None
        with torch.no_grad():
            x = self.generator.sample(self.o.replay_batch, self._rng)
            targets = one_hot_like_targets(
                self.teacher.forward_features(x).logits[:, : self.num_old], self.o.temperature
            )
        return soft_cross_entropy(state.model.forward_features(x).logits, targets)

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None or self.generator is None or not self.o.replay_weight:
            return
        state.losses["gen_replay_replay"] = self.o.replay_weight * self.replay_loss(state)

    def after_training(self, state: LoopState) -> None:
        self.fit_generator(state)

    def session_restored(self, state: LoopState) -> None:
        if self.trained_through < state.session.index:
            self.fit_generator(state)


def _mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, square = channel_moments(x)
    return mean, (square - mean * mean).clamp_min(0)


def fit_to_statistics(
    model: Segmenter,
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
    of every normalisation layer's input (:class:`~._generator.NormInputTaps` order); ``prior`` (K,) the class
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
            layers, logits = _observe(model, taps, generator.sample(batch, rng))
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


@METHODS.register(
    "gen-replay",
    options=GenReplayOptions,
    paper="Liu et al., ECCV 2022 (entropy-regularised data-free replay)",
    doc="baseline: replay of images from a generator fitted to the model after each session, relabelled by the old model",
)
def gen_replay(o: GenReplayOptions, config: RunConfig) -> Method:
    """Gen-Replay: a tiny generator per run, refitted after every session, replayed with one-hot-like labels."""
    return Method(
        "gen-replay",
        [GenReplayPlugin(o, freeze_policy(o.freeze))],
        "Gen-Replay: synthesised images of earlier sessions replayed with the old model's labels",
    )
