"""The one training loop. Methods are plugins on its named events (``jascl.methods.base``)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from jascl import distributed
from jascl.data.datasets import (IGNORE_INDEX, LabelledDataset, iterate_steps, loader_position,
                                 set_loader_position)
from jascl.data.sampling import derive_seed, loader_options, seeded_loader
from jascl.data.synthetic import SessionData
from jascl.errors import CheckpointError, ConfigError, TrainingError
from jascl.evaluation.evaluator import evaluate
from jascl.evaluation.metrics import summarise
from jascl.methods.base import Method
from jascl.methods.prototypes import PrototypeAccumulator, PrototypeStore
from jascl.networks.base import Segmenter, SegmenterOutput, create_segmenter
from jascl.protocols.schema import Protocol
from jascl.training.checkpoint import (load_model, load_progress, load_tensors, save_model, save_progress,
                                       save_tensors)
from jascl.training.snapshot import load_module_state, module_state, rng_state, set_rng_state
from jascl.training.config import RunConfig
from jascl.training.losses import SegmentationLoss
from jascl.training.state import LoopState
from jascl.training.stop import REQUEST

log = logging.getLogger("jascl")


#: the in-session checkpoint of a session folder (removed once the session is complete)
PROGRESS = "progress.safetensors"


@dataclass
class _Resume:
    """Where an in-session checkpoint was taken: after ``epoch``, or (``step`` set) inside it after that many steps."""

    epoch: int
    step: int | None = None
    running: torch.Tensor | None = None  # the epoch's loss sum so far
    loader_start: dict | None = None  # the labelled loader's position at the epoch's start

    @property
    def inside(self) -> bool:
        return self.step is not None

    @property
    def where(self) -> str:
        return f"inside epoch {self.epoch}, after step {self.step}" if self.inside else f"after epoch {self.epoch}"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the run (None = fp32): "auto" is bf16 on a GPU that supports it."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=float))
    os.replace(tmp, path)


class _TrainForward(nn.Module):
    """``forward_features`` as a module returning a tuple, the form DistributedDataParallel wraps."""

    def __init__(self, model: Segmenter) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model.forward_features(x)
        return out.logits, out.features


def make_optimizer(cfg: RunConfig, params: list, lr: float) -> torch.optim.Optimizer:
    """The run configuration's optimiser (``optimizer``: sgd, adam or adamw) over ``params``."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           nesterov=cfg.nesterov and cfg.momentum > 0)


def schedule_lr(optimizer: torch.optim.Optimizer, cfg: RunConfig, epoch: int, epochs: int) -> None:
    """Set every parameter group's rate for ``epoch`` of ``epochs`` (``lr_schedule``; constant: untouched).

    poly: ``initial_lr * (1 - epoch / epochs) ** lr_power``. A pure function of the epoch and of the
    rate each group had at creation (kept in the group, hence in the optimiser's checkpoint), so a
    resumed session continues the schedule exactly.
    """
    if cfg.lr_schedule != "poly":
        return
    factor = (1.0 - epoch / max(epochs, 1)) ** cfg.lr_power
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor


class ContinualTrainer:
    """Runs a protocol's sessions in order for one method.

    At each session it grows the classifier to all classes seen so far (old
    rows kept exactly, new rows imprinted from the new classes' prototypes),
    applies the freezing policy, trains with DiceCE plus the method's loss
    terms, computes and stores prototypes (eq. 2), evaluates on the test splits
    of every session so far over all seen classes, and saves a checkpoint.

    Args:
        protocol: the validated protocol.
        config: resolved run configuration.
        method: the method (its plugins receive the loop events).
        data: one :class:`SessionData` per protocol session.
        progress: show tqdm progress bars.
    """

    def __init__(self, protocol: Protocol, config: RunConfig, method: Method, data: list[SessionData],
                 progress: bool = True) -> None:
        self.protocol = protocol
        self.config = config
        self.method = method
        self.data = data
        self.progress = progress
        self.device = resolve_device(config.device)
        self.seed = config.seed if config.seed is not None else protocol.seed
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.loss_fn = SegmentationLoss(config.lambda_ce, config.lambda_dice)
        self.amp_dtype = resolve_precision(config.precision, self.device)
        self.loader_options = loader_options(self.device, config.num_workers, config.pin_memory)
        self.memory_format = None
        if config.channels_last:
            self.memory_format = torch.channels_last if protocol.spatial_dims == 2 else torch.channels_last_3d
        if distributed.world_size() > config.batch_size:
            raise ConfigError(f"batch_size={config.batch_size}: smaller than the {distributed.world_size()} "
                              "processes; every rank needs at least one sample per step (batch_size is global)")

    def autocast(self) -> ContextManager:
        """Forwards in the run's precision (bf16 autocast, or nothing for fp32)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def checkpoint_meta(self, t: int) -> dict:
        """What a session-``t`` checkpoint of this run must match to be loaded."""
        cfg = self.config
        return {"protocol": self.protocol.name, "backbone": cfg.backbone, "backbone_args": cfg.backbone_args,
                "classifier": cfg.classifier, "seen": list(self.protocol.seen_classes(t))}

    # ------------------------------------------------------------------ model

    def new_model(self, num_classes: int) -> Segmenter:
        torch.manual_seed(self.seed)
        cfg = self.config
        model = create_segmenter(cfg.backbone, self.protocol.spatial_dims, self.protocol.in_channels, num_classes,
                                 cosine=cfg.classifier == "cosine", temperature=cfg.temperature, **cfg.backbone_args)
        if cfg.patch_size is not None:
            if len(cfg.patch_size) != self.protocol.spatial_dims:
                raise ConfigError(f"patch_size={cfg.patch_size}: needs {self.protocol.spatial_dims} entries for this protocol")
            model.backbone.check_input_size(tuple(cfg.patch_size), "patch_size")
        else:
            model.backbone.check_input_size(tuple(self.data[0].train.images.shape[2:]), "image size (patch_size=null)")
        model = model.to(self.device)
        if cfg.sync_batchnorm:
            distributed.sync_batchnorm(model, self.device)
        if self.memory_format is not None:
            model = model.to(memory_format=self.memory_format)
        if cfg.compile:
            # in place, so parameter names (and checkpoints) stay the same; static shapes: one graph per input
            # shape (batch remainders, evaluation sizes) is more robust than symbolic shapes
            model.backbone.compile(dynamic=False)
        return model

    def initial_model(self, num_classes: int) -> Segmenter:
        """The session-0 model: a fresh model plus the user's pretrained backbone weights, if any."""
        model = self.new_model(num_classes)
        if self.config.weights:
            from jascl.networks.weights import load_backbone_weights

            load_backbone_weights(model.backbone, self.config.weights)
        return model

    def load_session(self, folder: Path, session: int) -> tuple[Segmenter, PrototypeStore, dict]:
        """Model, prototype store and metrics saved by :meth:`run_session` for ``session``."""
        model = self.new_model(len(self.protocol.seen_classes(session)))
        load_model(model, folder / "model.safetensors", self.checkpoint_meta(session))
        store = PrototypeStore.load(folder / "prototypes.safetensors")
        record = json.loads((folder / "metrics.json").read_text())
        return model, store, record

    # ------------------------------------------------------------------ helpers

    def _labelled_dataset(self, t: int, augment: bool, crop: bool) -> LabelledDataset:
        """Session ``t``'s labelled samples; ``crop``: to ``patch_size`` (training), else whole samples."""
        session = self.protocol.sessions[t]
        patch = self.config.patch_size
        return LabelledDataset(self.data[t].train, session.classes, session.other_classes, augment=augment,
                               patch_size=patch if crop else None, seed=derive_seed(self.seed, "augment", t))

    @torch.no_grad()
    def compute_prototypes(self, model: Segmenter, t: int, classes: list[int], normalize_pixels: bool = False,
                           per_sample: bool = False) -> dict[int, torch.Tensor]:
        """Eq. 2 prototypes of ``classes`` from session ``t``'s labelled data (eval mode, no GAS noise).

        With several processes each rank takes a share of the samples and the
        sums (and per-sample prototypes) are gathered, so every rank gets those of the whole set.
        ``normalize_pixels``: see :func:`jascl.methods.prototypes.per_sample_prototypes`.
        ``per_sample``: return every sample's prototype, (N_c, D) per class, instead of their mean (D,).
        The train/eval mode of every module is restored afterwards.
        """
        modes = {m: m.training for m in model.modules()}
        model.eval()
        acc = PrototypeAccumulator(classes, normalize_pixels, keep_samples=per_sample)
        dataset = self._labelled_dataset(t, augment=False, crop=False)
        # whole samples: batch them only when they all have one size (real datasets vary)
        uniform = getattr(self.data[t].train.images, "uniform", True)
        loader = DataLoader(Subset(dataset, distributed.shard(range(len(dataset)))),
                            batch_size=self.config.batch_size if uniform else 1)
        with self.autocast():
            for batch in loader:
                out = model.forward_features(batch["image"].to(self.device))
                acc.update(out.features, batch["label"].to(self.device))
        acc.all_reduce(model.backbone.feature_channels)
        for module, mode in modes.items():
            module.train(mode)
        return acc.samples() if per_sample else acc.compute()

    def _grow(self, model: Segmenter, t: int) -> None:
        seen = self.protocol.seen_classes(t)
        new = seen[model.num_classes:]
        if not new:
            return
        protos = self.compute_prototypes(model, t, new)
        if all(c in protos for c in new):
            init = torch.stack([protos[c] for c in new])
        else:
            init = None
            log.warning("session %d: some new classes have no labelled pixels; random classifier rows", t)
        model.classifier.grow(len(new), init)

    def _freeze(self, model: Segmenter, t: int) -> list[torch.nn.Module]:
        """Apply the freezing policy; returns the frozen modules (kept in eval mode while training)."""
        for p in model.parameters():
            p.requires_grad_(True)
        frozen = list(model.backbone.frozen_modules())  # e.g. SAM's image encoder, frozen in every session
        if t > 0 and self.method.freeze_policy(self.config.freeze_incremental) == "all_but_classifier":
            frozen = [model.backbone]
        for module in frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        return frozen

    # ------------------------------------------------------------------ session

    def run_session(self, t: int, model: Segmenter, prototypes: PrototypeStore, out_dir: Path,
                    on_epoch: Callable[[int, float], None] | None = None) -> dict:
        """Train, evaluate and checkpoint session ``t``; returns its metrics record.

        Every ``checkpoint_every`` epochs (and after the last), and every
        ``checkpoint_steps`` training steps inside epochs, the session's whole
        training state is written atomically to ``out_dir/progress.safetensors``;
        if that file exists when the session starts, the session is set up as
        usual and then continues from it, with bit-identical results on the same
        machine and thread count. Only rank 0 writes files.
        """
        cfg, protocol = self.config, self.protocol
        session = protocol.sessions[t]
        started = time.time()
        if self._stop_requested():
            raise REQUEST.stopped(f"before {self.method.name} session {t} ({session.name}); the sessions before it "
                                  "are saved")
        torch.manual_seed(self.seed * 1000 + t)
        if t > 0:
            self._grow(model, t)
        frozen = self._freeze(model, t)
        seen = protocol.seen_classes(t)
        state = self.loop_state(t, model, prototypes)
        self.method.fire("before_session", state)

        params = [p for p in model.parameters() if p.requires_grad]
        lr = cfg.lr_base if t == 0 else cfg.lr_incremental
        state.optimizer = self.method.make_optimizer(state, params, lr)
        if state.optimizer is None:
            state.optimizer = make_optimizer(cfg, params, lr)
        for group in state.optimizer.param_groups:  # the schedule scales each group's rate at creation
            group.setdefault("initial_lr", group["lr"])
        if params and distributed.active():
            ddp = distributed.wrap(_TrainForward(model), self.device, cfg.find_unused_parameters)
            state.forward = lambda x: SegmenterOutput(*ddp(x))
        loader = seeded_loader(self._labelled_dataset(t, augment=cfg.augment, crop=True), cfg.batch_size,
                               derive_seed(self.seed, "labelled", t), **self.loader_options)
        epochs = cfg.epochs_base if t == 0 else cfg.epochs_incremental
        blockers = self.method.mid_epoch_blockers()
        resumable_inside = not blockers
        step_checkpoints = self._step_checkpoints(t, blockers)
        alone = not distributed.active()  # one process acts on a stop signal at once, several at sync points
        progress_path = out_dir / PROGRESS
        resume, saved = None, None
        if progress_path.exists():
            resume = self._restore_progress(progress_path, t, state, loader)
            saved = resume.where
            log.info("%s session %d: resuming %s from %s", self.method.name, t, resume.where, progress_path)
        first_epoch = 0 if resume is None else resume.epoch + (0 if resume.inside else 1)
        bar = tqdm(range(first_epoch, epochs), desc=f"{self.method.name} s{t} {session.name}", unit="ep",
                   leave=False, position=1, disable=not (self.progress and distributed.is_main()))
        for epoch in bar:
            state.epoch = epoch
            schedule_lr(state.optimizer, cfg, epoch, epochs)
            model.train()
            for module in frozen:
                module.eval()
            running = torch.zeros((), device=self.device)
            steps, due = 0, False
            if resume is not None and resume.inside and epoch == resume.epoch:
                # the epoch's set-up (plugins' before_epoch, the loader's position) comes from the checkpoint
                self.method.fire("resume_epoch", state)
                set_loader_position(loader, resume.loader_start)
                running += resume.running.to(self.device)
                steps = resume.step
            else:
                self.method.fire("before_epoch", state)
            epoch_start = loader_position(loader)
            n_steps = max(len(loader), self.method.epoch_iterations(state))
            for batch in iterate_steps(loader, n_steps, start=steps):
                state.batch = batch
                self.method.fire("before_iteration", state)
                total = state.closure()
                self.method.fire("before_backward", state)
                state.optimizer.zero_grad(set_to_none=True)
                total.backward()
                self.method.fire("after_backward", state)
                self.method.fire("before_update", state)
                state.optimizer.step()
                self.method.fire("after_update", state)
                state.iteration += 1
                running += total.detach().float()
                steps += 1
                due = step_checkpoints and state.iteration % cfg.checkpoint_steps == 0
                stop_now = alone and REQUEST.requested and resumable_inside
                if (due or stop_now) and steps < n_steps:  # (at the epoch's last step: the epoch-end checkpoint)
                    _, stop = self._sync(running, steps, t, epoch, saved, progress_path, lr)
                    self._save_progress(progress_path, t, epoch, state, loader,
                                        inside={"step": steps, "running": running, "loader_start": epoch_start})
                    saved = f"inside epoch {epoch}, after step {steps}"
                    if stop:
                        raise self._stopped(t, saved, progress_path)
            self.method.fire("after_epoch", state)
            mean_loss, stop = self._sync(running, steps, t, epoch, saved, progress_path, lr)
            bar.set_postfix(loss=f"{mean_loss:.3f}")
            log.info("%s session %d epoch %d: loss %.4f (%s)", self.method.name, t, epoch, mean_loss,
                     ", ".join(f"{k} {float(v.detach()):.4f}" for k, v in state.losses.items()))
            if on_epoch:
                on_epoch(epoch, mean_loss)
            last = epoch == epochs - 1
            if last or due or stop or (cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0):
                self._save_progress(progress_path, t, epoch, state, loader)
                saved = f"after epoch {epoch}"
            if stop:
                raise self._stopped(t, saved, progress_path)
        bar.close()
        self.method.fire("after_training", state)

        prototypes.add(t, self.compute_prototypes(model, t, [0, *session.classes]))
        self.method.fire("before_eval", state)

        def before_split(index: int) -> None:
            state.eval_session = index
            self.method.fire("before_eval_split", state)

        with self.autocast():
            result = evaluate(model, [d.test for d in self.data[: t + 1]], seen, self.device, mode=cfg.eval_mode,
                              roi=cfg.patch_size, batch_size=cfg.batch_size, sw_batch_size=cfg.sw_batch_size,
                              overlap=cfg.sw_overlap, mc_samples=cfg.eval_mc_samples, seed=self.seed + t,
                              before_split=before_split, progress=self.progress and distributed.is_main())
        state.eval_session = None
        state.metrics["eval"] = result
        self.method.fire("after_eval", state)
        self.method.fire("after_session", state)

        record = self.session_record(t, result)
        if "pseudo_labels" in state.metrics:
            record["pseudo_labels"] = state.metrics["pseudo_labels"]
        record["seconds"] = round(time.time() - started, 1)
        if distributed.is_main():
            out_dir.mkdir(parents=True, exist_ok=True)
            save_model(model, out_dir / "model.safetensors",
                       {**self.checkpoint_meta(t), "session": t, "method": self.method.name})
            prototypes.save(out_dir / "prototypes.safetensors")
            save_tensors(self.method.extra_state(), out_dir / "plugins.safetensors")
            _write_json(out_dir / "metrics.json", record)  # written last: marks the session complete
            progress_path.unlink(missing_ok=True)
        return record

    # ------------------------------------------------------------------ in-session checkpoints

    def _step_checkpoints(self, t: int, blockers: list[str]) -> bool:
        """Whether session ``t`` is also checkpointed inside epochs (``checkpoint_steps``; ``blockers``: the
        method's plugins that cannot resume there)."""
        if not self.config.checkpoint_steps:
            return False
        if blockers:
            log.warning("%s session %d: checkpoint_steps=%d ignored, checkpoints at epoch ends only: plugin(s) %s "
                        "cannot resume inside an epoch", self.method.name, t, self.config.checkpoint_steps,
                        ", ".join(blockers))
            return False
        return True

    def _sync(self, running: torch.Tensor, steps: int, t: int, epoch: int, saved: str | None,
              progress_path: Path, lr: float) -> tuple[float, bool]:
        """(mean training loss so far in ``epoch``, whether any rank was asked to stop); a non-finite loss stops
        the session (:class:`TrainingError`).

        One host synchronisation, and with several processes one collective: every rank calls it at the same
        steps, and the stop signal travels with the loss.
        """
        flag = torch.full((), float(REQUEST.requested), device=running.device)
        loss_sum, stops = distributed.all_reduce_sum(torch.stack([running.float(), flag])).tolist()
        mean_loss = loss_sum / max(steps * distributed.world_size(), 1)
        if not math.isfinite(mean_loss):
            session = self.protocol.sessions[t]
            kept = (f"its last good checkpoint ({saved}) is kept in {progress_path}"
                    if saved is not None else "no checkpoint of it had been written yet")
            raise TrainingError(f"{self.method.name} session {t} ({session.name}) epoch {epoch}: the training loss "
                                f"became {mean_loss}; the session stopped and {kept}; lower the learning rate "
                                f"({'lr_base' if t == 0 else 'lr_incremental'}={lr}) or check the data, then "
                                "rerun to resume")
        return mean_loss, stops > 0

    def _stop_requested(self) -> bool:
        """Whether any rank was asked to stop (a collective with several processes)."""
        if not distributed.active():
            return REQUEST.requested
        flag = torch.full((1,), float(REQUEST.requested), device=self.device)
        return bool(distributed.all_reduce_sum(flag).item() > 0)

    def _stopped(self, t: int, saved: str, progress_path: Path) -> Exception:
        session = self.protocol.sessions[t]
        return REQUEST.stopped(f"in {self.method.name} session {t} ({session.name}): its training state {saved} is "
                               f"saved in {progress_path}")

    def _save_progress(self, path: Path, t: int, epoch: int, state: LoopState, loader: DataLoader,
                       inside: dict | None = None) -> None:
        """Everything the rest of session ``t`` depends on (rank 0 writes; nothing is pickled).

        After ``epoch``, or with ``inside`` (``step``, ``running`` loss sum, ``loader_start``:
        the loader's position at the epoch's start) after that many steps of it.
        """
        if not distributed.is_main():
            return
        metrics = {k: v for k, v in state.metrics.items() if isinstance(v, (int, float, str, bool))}
        payload = {"epoch": epoch, "iteration": state.iteration, "model": module_state(state.model),
                   "optimizer": state.optimizer.state_dict(), "plugins": self.method.state_dict(),
                   "loader": loader.batch_sampler.state_dict(), "rng": rng_state(), "metrics": metrics}
        meta = {**self.checkpoint_meta(t), "session": t, "method": self.method.name, "epoch": epoch}
        if inside is not None:
            payload["inside"] = inside
            meta["step"] = inside["step"]
        path.parent.mkdir(parents=True, exist_ok=True)
        save_progress(path, meta, payload)

    def _restore_progress(self, path: Path, t: int, state: LoopState, loader: DataLoader) -> "_Resume":
        """Load an in-session checkpoint into a freshly set-up session; returns where it was taken."""
        _, payload = load_progress(path, {**self.checkpoint_meta(t), "session": t, "method": self.method.name})
        inside = payload.get("inside")
        if inside is not None and self.method.mid_epoch_blockers():
            raise CheckpointError(f"{path}: taken inside epoch {payload['epoch']}, but plugin(s) "
                                  f"{', '.join(self.method.mid_epoch_blockers())} of {self.method.name} cannot resume "
                                  "there; delete it to restart this session from its beginning")
        load_module_state(state.model, payload["model"])
        state.optimizer.load_state_dict(payload["optimizer"])
        self.method.load_state_dict(payload["plugins"])
        loader.batch_sampler.load_state_dict(payload["loader"])
        set_rng_state(payload["rng"])
        state.iteration = int(payload["iteration"])
        state.metrics.update(payload["metrics"])
        if inside is None:
            return _Resume(int(payload["epoch"]))
        return _Resume(int(payload["epoch"]), int(inside["step"]), inside["running"], inside["loader_start"])

    def loop_state(self, t: int, model: Segmenter, prototypes: PrototypeStore) -> LoopState:
        """The state plugins see in session ``t`` (the batch and loss fields are filled by the loop)."""
        protocol = self.protocol
        state = LoopState(protocol, self.config, self.method, protocol.sessions[t], self.data[t], model, self.device,
                          prototypes, protocol.seen_classes(t), seed=self.seed, new_model=self.new_model,
                          compute_prototypes=lambda classes, **kw: self.compute_prototypes(model, t, classes, **kw),
                          previous_seen=protocol.seen_classes(t - 1) if t > 0 else [],
                          forward=model.forward_features, autocast=self.autocast,
                          loader_options=self.loader_options)

        def closure() -> torch.Tensor:
            batch = state.batch
            x = batch["image"].to(self.device, non_blocking=True)
            if self.memory_format is not None:
                x = x.contiguous(memory_format=self.memory_format)
            labels = batch["label"]
            if "ignore" in batch:  # flagged per sample by the dataset
                has_ignore = bool(batch["ignore"].any())
            else:  # a batch a plugin made: check on the host if it is there
                has_ignore = bool((labels == IGNORE_INDEX).any()) if labels.device.type == "cpu" else None
            target = state.class_index(labels.to(self.device, non_blocking=True))
            with self.autocast():
                state.output = state.forward(x)
                state.losses = {"seg": self.loss_fn(state.output.logits, target, has_ignore)}
                self.method.fire("after_forward", state)
            return sum(state.losses.values())

        state.closure = closure
        return state

    def restore_session(self, t: int, folder: Path, model: Segmenter, prototypes: PrototypeStore) -> None:
        """Tell the method that session ``t`` was reused from ``folder`` (not trained now).

        Loads the plugins' saved extra state if the folder has any (a session this
        method trained) and fires ``session_restored``.
        """
        extra = folder / "plugins.safetensors"
        if extra.exists():
            self.method.load_extra_state(load_tensors(extra))
        state = self.loop_state(t, model, prototypes)
        self.method.fire("session_restored", state)

    def session_record(self, t: int, result) -> dict:
        protocol = self.protocol
        seen = protocol.seen_classes(t)
        session = protocol.sessions[t]
        old = [c for c in seen if c != 0 and c not in session.new_classes]
        new = list(session.new_classes)
        per_class = result.metric(protocol.metric)
        summary = summarise(per_class, old, new, include_background=result.background_in_mean)
        base = summarise(per_class, protocol.base_classes(), [], include_background=False)["old"]
        return {
            "session": t, "name": session.name, "domains": list(session.domains),
            "all": summary["all"], "old": summary["old"], "new": summary["new"], "base": base,
            "background": summary["background"],
            "per_class": {str(c): v for c, v in per_class.items()},
            "dice": {str(c): v for c, v in result.dice.items()},
            "iou": {str(c): v for c, v in result.iou.items()},
        }
