"""The one training loop. Methods are plugins on its named events (``jascl.engine.plugin``); what the loop does
for every method (supervised loss, classifier growth, model selection, prototypes, evaluation, checkpoints) are
default plugins (``jascl.engine.defaults``) a method can replace."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import operator
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from jascl import distributed
from jascl.data.datasets import iterate_steps, loader_position, set_loader_position
from jascl.data.sampling import derive_seed, loader_options, seeded_loader
from jascl.data.types import SessionData
from jascl.engine import prototype_cache
from jascl.engine.checkpoint import load_model, load_tensors, session_aliases, session_meta
from jascl.engine.config import RunConfig
from jascl.engine.defaults import PROGRESS
from jascl.engine.optim import apply_cudnn_benchmark, make_optimizer, resolve_device, resolve_precision, schedule_lr
from jascl.engine.plugin import EVENTS, Method, Plugin
from jascl.engine.progress import SessionProgress
from jascl.engine.prototypes import PrototypeRequest, PrototypeStore
from jascl.engine.state import LoopState
from jascl.engine.stop import REQUEST, StopVote
from jascl.engine.tasks import TaskContext, create_task
from jascl.errors import ConfigError, TrainingError
from jascl.networks.base import Segmenter
from jascl.protocols.schema import Protocol

log = logging.getLogger("jascl")


class ContinualTrainer:
    """Runs a protocol's sessions in order for one method.

    Each session is a sequence of events (:mod:`jascl.engine.plugin`) fired on the
    loop's default plugins (:mod:`jascl.engine.defaults`: classifier growth, the
    supervised loss, model selection, prototypes, evaluation, checkpoint) and then on the method's;
    between them the loop applies the freezing policy, builds the optimiser, runs
    the epochs and keeps the in-session checkpoint (:mod:`jascl.engine.progress`).

    Args:
        protocol: the validated protocol.
        config: resolved run configuration.
        method: the method (its plugins receive the loop events).
        data: one :class:`SessionData` per protocol session.
        progress: show tqdm progress bars.
        extra_plugins: plugins added after the method's own (logging, probes); they are
            checkpointed with the method. The caller's ``method`` is left unchanged.
        anticipate: plugins of the methods that will reuse the sessions this trainer trains (a shared base's);
            the prototype calls their restores will make (:meth:`Plugin.restore_requests`) are answered in each
            session's pass before ``before_eval`` and kept in its folder's prototype cache.
    """

    def __init__(
        self,
        protocol: Protocol,
        config: RunConfig,
        method: Method,
        data: list[SessionData],
        progress: bool = True,
        extra_plugins: Sequence[Plugin] = (),
        anticipate: Sequence[Plugin] = (),
    ) -> None:
        self.protocol = protocol
        self.anticipate = list(anticipate)
        self.config = config
        self.method = method.with_plugins(list(extra_plugins)) if extra_plugins else method
        self.data = data
        self.progress = progress
        self.device = resolve_device(config.device)
        self.seed = config.seed if config.seed is not None else protocol.seed
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.amp_dtype = resolve_precision(config.precision, self.device)
        apply_cudnn_benchmark(config.cudnn_benchmark, self.device)
        self.loader_options = loader_options(self.device, config.num_workers, config.pin_memory)
        self.memory_format = None
        if config.channels_last:
            self.memory_format = torch.channels_last if protocol.spatial_dims == 2 else torch.channels_last_3d
        if distributed.world_size() > config.batch_size:
            raise ConfigError(
                f"batch_size={config.batch_size}: smaller than the {distributed.world_size()} "
                "processes; every rank needs at least one sample per step (batch_size is global)"
            )
        #: what the sessions learn (:mod:`jascl.engine.tasks`): the model, batches, default plugins and prototypes
        self.task = create_task(
            protocol.task,
            TaskContext(
                protocol=protocol,
                config=config,
                data=data,
                device=self.device,
                seed=self.seed,
                method=self.method,
                autocast=self.autocast,
                checkpoint_meta=self.checkpoint_meta,
                memory_format=self.memory_format,
                progress=progress,
            ),
        )
        defaults = self.task.default_plugins()
        #: what the loop fires: the defaults the method does not replace, then the method's plugins
        self.plugins = self.method.compose(defaults)
        #: the defaults in use (their in-session state is checkpointed beside the method's plugins')
        self.defaults = [d for d in defaults if any(d is p for p in self.plugins)]
        #: the plugins that declare their ``before_eval`` prototype calls, and those calls' prefetched results
        self._requesters = [p for p in self.plugins if type(p).prototype_requests is not Plugin.prototype_requests]
        self._prefetched: dict[PrototypeRequest, dict[int, torch.Tensor]] = {}
        self._prefetched_for: nn.Module | None = None
        #: while ``session_restored`` fires: the restored model and its folder, whose prototype cache serves it
        self._restored: tuple[nn.Module, Path] | None = None
        # per event, only the plugins that handle it: a step fires 8 events, most plugins handle few of them
        self._handlers = {
            event: [getattr(p, event) for p in self.plugins if getattr(type(p), event) is not getattr(Plugin, event)]
            for event in EVENTS
        }

    def fire(self, event: str, state: LoopState) -> None:
        """Fire ``event`` on every plugin of the session that handles it, defaults first."""
        for handler in self._handlers[event]:
            handler(state)

    def autocast(self) -> AbstractContextManager:
        """Forwards in the run's precision (bf16 autocast, or nothing for fp32)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def checkpoint_meta(self, t: int) -> dict:
        """What a session-``t`` checkpoint of this run must match to be loaded."""
        return session_meta(self.protocol, self.config, t)

    # ------------------------------------------------------------------ model

    def new_model(self, num_classes: int) -> Segmenter:
        """A fresh model of the run's architecture with ``num_classes`` classifier rows (the task's).

        Typed as a segmenter, the model most plugins know; a detection task's detector offers the parts plugins
        use alike (``classifier``, ``resolve_layer``, ``num_classes``; :mod:`jascl.networks.detector`)."""
        return cast(Segmenter, self.task.new_model(num_classes))

    def initial_model(self, num_classes: int) -> Segmenter:
        """The session-0 model: a fresh model plus the user's pretrained backbone weights, if any."""
        model = self.new_model(num_classes)
        if self.config.weights:
            self.task.load_weights(model, self.config.weights)
        return model

    def load_session(self, folder: Path, session: int) -> tuple[Segmenter, PrototypeStore, dict]:
        """Model, prototype store and metrics saved by :meth:`run_session` for ``session``."""
        model = self.new_model(len(self.protocol.seen_classes(session)))
        aliases = session_aliases(self.protocol, session)  # a variant's session 0 may be its source protocol's base
        load_model(model, folder / "model.safetensors", self.checkpoint_meta(session), aliases)
        store = PrototypeStore.load(folder / "prototypes.safetensors")
        record = json.loads((folder / "metrics.json").read_text())
        return model, store, record

    # ------------------------------------------------------------------ helpers

    def _labelled_dataset(self, t: int, augment: bool, crop: bool) -> Dataset:
        """Session ``t``'s labelled samples; ``crop``: to ``patch_size`` (training), else whole samples."""
        return self.task.labelled_dataset(t, augment, crop)

    @torch.no_grad()
    def compute_prototypes(
        self,
        model: nn.Module,
        t: int,
        classes: list[int],
        normalize_pixels: bool = False,
        per_sample: bool = False,
        complement: bool = False,
        form: str = "eq2",
    ) -> dict[int, torch.Tensor]:
        """Eq. 2 prototypes of ``classes`` from session ``t``'s labelled data (eval mode, no GAS noise).

        With several processes each rank takes a share of the samples and the
        sums (and per-sample prototypes) are gathered, so every rank gets those of the whole set.
        ``normalize_pixels``: see :func:`jascl.engine.prototypes.per_sample_prototypes`.
        ``per_sample``: return every sample's prototype, (N_c, D) per class, instead of their mean (D,).
        ``complement``: prototypes of each class's complement (the authors' per-class background).
        ``form``: "eq2", or "authors" (their ``get_prototype``: :mod:`jascl.engine.prototypes`).
        The train/eval mode of every module is restored afterwards. The task computes them
        (:meth:`jascl.engine.tasks.Task.compute_prototypes`: pixel features, or RoI features of boxes).
        """
        request = PrototypeRequest(tuple(classes), normalize_pixels, per_sample, complement, form)
        return self.compute_prototype_requests(model, t, [request])[0]

    @torch.no_grad()
    def compute_prototype_requests(
        self, model: nn.Module, t: int, requests: Sequence[PrototypeRequest]
    ) -> list[dict[int, torch.Tensor]]:
        """Several :meth:`compute_prototypes` calls, their results in the order given: those declared for
        ``before_eval`` (:meth:`_before_eval`) come from its pass, once each; the others take one pass together
        (:meth:`jascl.engine.tasks.Task.compute_prototype_requests`); a restored session's from its folder's
        cache where it has them (:mod:`jascl.engine.prototype_cache`)."""
        unique = list(dict.fromkeys(requests))
        served = model is self._prefetched_for
        ready = {r: self._prefetched.pop(r) for r in unique if served and r in self._prefetched}
        missing = [r for r in unique if r not in ready]
        if missing and self._restored is not None and model is self._restored[0]:
            compute = functools.partial(self.task.compute_prototype_requests, model, t)
            cached = prototype_cache.serve(self._restored[1], missing, self._pass_setting(t), model, compute)
            ready.update(zip(missing, cached))
        elif missing:
            ready.update(zip(missing, self.task.compute_prototype_requests(model, t, missing)))
        return [ready[r] for r in requests]

    def _pass_setting(self, t: int) -> dict:
        """What besides the request and the model decides a prototype pass over session ``t``'s samples here."""
        data, session = self.data[t].train.ids, self.protocol.sessions[t]
        return prototype_cache.pass_setting(t, data, session, self.device, self.amp_dtype, self.config)

    def _before_eval(self, state: LoopState) -> None:
        """Fire ``before_eval``, the plugins' declared prototype calls computed first in one pass, with those the
        restores of this session will make (``anticipate``), whose answers go to the session folder's cache."""
        requests = list(dict.fromkeys(r for p in self._requesters for r in p.prototype_requests(state)))
        ahead = [r for p in self.anticipate for r in p.restore_requests(state) if r not in requests]
        ahead = list(dict.fromkeys(ahead))
        if requests or ahead:
            t = state.session.index
            results = self.task.compute_prototype_requests(state.model, t, requests + ahead)
            self._prefetched, self._prefetched_for = dict(zip(requests, results)), state.model
            if ahead and state.out_dir is not None:
                setting = self._pass_setting(t)
                prototype_cache.keep(state.out_dir, ahead, results[len(requests) :], setting, state.model)
        try:
            self.fire("before_eval", state)
        finally:
            self._prefetched, self._prefetched_for = {}, None

    def setup_model(self, model: Segmenter, t: int) -> None:
        """Fire ``setup_model`` of session ``t`` on ``model`` alone (the classifier grows to its classes)."""
        self.fire("setup_model", self.loop_state(t, model, PrototypeStore()))

    def _freeze(self, state: LoopState) -> None:
        """Apply the session's freezing policy (``state.freeze_incremental`` after session 0); sets ``state.frozen``."""
        model, t = state.model, state.session.index
        for p in model.parameters():
            p.requires_grad_(True)
        frozen = self.task.frozen_modules(model, t, state.freeze_incremental)
        for module in frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        state.frozen = frozen

    # ------------------------------------------------------------------ session

    def run_session(
        self,
        t: int,
        model: Segmenter,
        prototypes: PrototypeStore,
        out_dir: Path,
        on_epoch: Callable[[int, float], None] | None = None,
    ) -> dict:
        """Train, evaluate and checkpoint session ``t``; returns its metrics record.

        Every ``checkpoint_every`` epochs (and after the last), and every
        ``checkpoint_steps`` training steps inside epochs, the session's whole
        training state is written atomically to ``out_dir/progress.safetensors``;
        if that file exists when the session starts, the session is set up as
        usual and then continues from it, with bit-identical results on the same
        machine and thread count. Only rank 0 writes files.
        """
        session = self.protocol.sessions[t]
        started = time.time()
        if self._stop_requested():
            raise REQUEST.stopped(
                f"before {self.method.name} session {t} ({session.name}); the sessions before it are saved"
            )
        torch.manual_seed(self.seed * 1000 + t)
        state = self.loop_state(t, model, prototypes, out_dir)
        self.fire("setup_model", state)
        self._freeze(state)
        self.fire("before_session", state)
        self._train(state, out_dir, on_epoch)
        self.fire("after_training", state)
        self._before_eval(state)
        self.fire("evaluate", state)
        self.fire("after_eval", state)
        self.fire("after_session", state)
        state.record.update(state.report)
        state.record["seconds"] = round(time.time() - started, 1)
        self.fire("save_session", state)
        return state.record

    def _train(self, state: LoopState, out_dir: Path, on_epoch: Callable[[int, float], None] | None) -> None:
        """The session's epochs: optimiser, labelled loader, the per-step events and the in-session checkpoints."""
        cfg, t, model = self.config, state.session.index, state.model
        params = [p for p in model.parameters() if p.requires_grad]
        lr = cfg.lr_base if t == 0 else cfg.lr_incremental
        state.optimizer = self.method.make_optimizer(state, params, lr)
        if state.optimizer is None:
            state.optimizer = make_optimizer(cfg, params, lr)
        for group in state.optimizer.param_groups:  # the schedule scales each group's rate at creation
            group.setdefault("initial_lr", group["lr"])
        if params and distributed.active():
            find_unused = cfg.find_unused_parameters or self.method.unused_parameters
            state.forward = self.task.ddp_forward(model, find_unused)
        options = dict(self.loader_options)
        if self.task.collate is not None:
            options["collate_fn"] = self.task.collate
        loader = seeded_loader(
            self._labelled_dataset(t, augment=cfg.augment, crop=True),
            cfg.batch_size,
            derive_seed(self.seed, "labelled", t),
            **options,
        )
        epochs = cfg.epochs_base if t == 0 else cfg.epochs_incremental
        blockers = self.method.mid_epoch_blockers()
        step_checkpoints = self._step_checkpoints(t, blockers)
        vote = StopVote()  # after every step: whether every rank stops after it (one process: at once)
        progress = SessionProgress(
            out_dir / PROGRESS,
            self.method,
            {**self.checkpoint_meta(t), "session": t, "method": self.method.name},
            self.defaults,
        )
        resume = progress.restore(state, loader)
        if resume is not None:
            log.info("%s session %d: resuming %s from %s", self.method.name, t, resume.where, progress.path)
        first_epoch = 0 if resume is None else resume.epoch + (0 if resume.inside else 1)
        bar = tqdm(
            range(first_epoch, epochs),
            desc=f"{self.method.name} s{t} {state.session.name}",
            unit="ep",
            leave=False,
            position=1,
            disable=not (self.progress and distributed.is_main()),
        )
        for epoch in bar:
            state.epoch = epoch
            schedule_lr(state.optimizer, cfg, epoch, epochs)
            model.train()
            if cfg.frozen_mode == "eval":  # "train": as the authors' code, frozen BatchNorm follows the new data
                for module in state.frozen:
                    module.eval()
            running = torch.zeros((), device=self.device)
            recent: list[tuple[torch.Tensor, object]] = []  # (loss, sample ids) of the steps since the last sync
            steps, due = 0, False
            if resume is not None and resume.step is not None and epoch == resume.epoch:
                # the epoch's set-up (plugins' before_epoch, the loader's position) comes from the checkpoint
                assert resume.loader_start is not None and resume.running is not None
                self.fire("resume_epoch", state)
                set_loader_position(loader, resume.loader_start)
                running += resume.running.to(self.device)
                steps = resume.step
            else:
                self.fire("before_epoch", state)
            epoch_start = loader_position(loader)
            n_steps = max(len(loader), self.method.epoch_iterations(state))
            for batch in iterate_steps(loader, n_steps, start=steps):
                state.batch = self.task.training_batch(batch)
                self.fire("before_iteration", state)
                total = state.closure()
                self.fire("before_backward", state)
                state.optimizer.zero_grad(set_to_none=True)
                total.backward()
                self.fire("after_backward", state)
                self.fire("before_update", state)
                state.optimizer.step()
                self.fire("after_update", state)
                state.iteration += 1
                running += total.detach().float()
                recent.append((total.detach(), batch.get("id") if isinstance(batch, dict) else None))
                steps += 1
                due = step_checkpoints and state.iteration % cfg.checkpoint_steps == 0
                stop_now = not blockers and vote.after_step()
                if (due or stop_now) and steps < n_steps:  # (at the epoch's last step: the epoch-end checkpoint)
                    _, stop = progress.sync(state, running, steps, lr, recent)
                    recent.clear()
                    progress.save(
                        state, loader, epoch, inside={"step": steps, "running": running, "loader_start": epoch_start}
                    )
                    if stop:
                        raise progress.stopped(state)
            self.fire("after_epoch", state)
            mean_loss, stop = progress.sync(state, running, steps, lr, recent)
            recent.clear()
            bar.set_postfix(loss=f"{mean_loss:.3f}")
            log.info(
                "%s session %d epoch %d: loss %.4f (%s)",
                self.method.name,
                t,
                epoch,
                mean_loss,
                ", ".join(f"{k} {float(v.detach()):.4f}" for k, v in state.losses.items()),
            )
            if on_epoch:
                on_epoch(epoch, mean_loss)
            last = epoch == epochs - 1
            if last or due or stop or (cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0):
                progress.save(state, loader, epoch)
            if stop:
                raise progress.stopped(state)
        bar.close()

    def _step_checkpoints(self, t: int, blockers: list[str]) -> bool:
        """Whether session ``t`` is also checkpointed inside epochs (``checkpoint_steps``; ``blockers``: the
        method's plugins that cannot resume there)."""
        if not self.config.checkpoint_steps:
            return False
        if blockers:
            log.warning(
                "%s session %d: checkpoint_steps=%d ignored, checkpoints at epoch ends only: plugin(s) %s "
                "cannot resume inside an epoch",
                self.method.name,
                t,
                self.config.checkpoint_steps,
                ", ".join(blockers),
            )
            return False
        return True

    def _stop_requested(self) -> bool:
        """Whether any rank was asked to stop (a collective with several processes)."""
        if not distributed.active():
            return REQUEST.requested
        flag = torch.full((1,), float(REQUEST.requested), device=self.device)
        return bool(distributed.all_reduce_sum(flag).item() > 0)

    def loop_state(
        self, t: int, model: Segmenter, prototypes: PrototypeStore, out_dir: Path | None = None
    ) -> LoopState:
        """The state plugins see in session ``t`` (the batch and loss fields are filled by the loop)."""
        protocol = self.protocol
        state = LoopState(
            protocol,
            self.config,
            self.method.name,
            protocol.sessions[t],
            self.data[t],
            model,
            self.device,
            prototypes,
            protocol.seen_classes(t),
            seed=self.seed,
            freeze_incremental=self.method.freeze_policy(self.config.freeze_incremental),
            new_model=self.new_model,
            compute_prototypes=lambda classes, **kw: self.compute_prototypes(model, t, classes, **kw),
            compute_prototype_requests=lambda requests: self.compute_prototype_requests(model, t, requests),
            previous_seen=protocol.seen_classes(t - 1) if t > 0 else [],
            forward=self.task.training_forward(model),
            autocast=self.autocast,
            loader_options=self.loader_options,
            out_dir=out_dir,
        )
        state.fire = lambda event: self.fire(event, state)

        def closure() -> torch.Tensor:
            inputs = self.task.model_inputs(state)
            with self.autocast():
                state.output = state.forward(*inputs)
                state.losses = {}
                self.fire("after_forward", state)
            if not state.losses:
                raise TrainingError(
                    f"{self.method.name} session {t}: no loss term this step; a plugin that "
                    "replaces the supervised loss must add one"
                )
            return functools.reduce(operator.add, state.losses.values())  # in insertion order, as sum() without 0

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
        state = self.loop_state(t, model, prototypes, folder)
        self._restored = (model, folder)
        try:
            self.fire("session_restored", state)
        finally:
            self._restored = None
