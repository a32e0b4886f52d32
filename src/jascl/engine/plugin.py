"""Plugins on the training loop's named events, and methods as lists of plugins.

The trainer (``jascl.engine.loop``) fires these events, in this order,
for every session::

    setup_model      (the classifier grows to the session's classes)
    before_session   (after the freezing policy is applied)
      before_epoch   (an epoch runs max(len(labelled loader), any plugin's epoch_iterations) steps,
                      cycling the labelled loader; resume_epoch instead for an epoch resumed inside)
        before_iteration -> after_forward (add loss terms) -> before_backward
        -> after_backward -> before_update -> after_update
      after_epoch
    after_training
    before_eval      (the session's prototypes are stored first; every plugin's declared
                      prototype calls, Plugin.prototype_requests, were computed in one pass)
    evaluate         (before_eval_split once per test split, ``state.eval_session`` = its session)
    after_eval -> after_session
    save_session     (the session's checkpoint and metrics are written)

What the loop does for every method is itself done by *default plugins*
(:mod:`jascl.engine.defaults`), fired before the method's own on each event: the
supervised loss ("supervised-loss"), classifier growth with prototype imprinting
("classifier-growth"), model selection on validation samples ("model-selection"),
the prototype store ("prototypes"), evaluation ("evaluation") and the session
checkpoint ("checkpoint"). A method that needs
another policy lists the default's name in :attr:`Plugin.replaces` and does the
work itself, instead of undoing what the default did.

A session that is *reused* instead of trained (the shared base model, or a
finished session of an interrupted run) fires ``session_restored`` instead,
after the model and any saved plugin state are loaded; plugins that gather
statistics at the end of a session (EWC's Fisher information) gather them
there too.

Besides events, a plugin may override the freezing policy of incremental
sessions (``freeze_incremental``), supply the optimiser (:meth:`Plugin.make_optimizer`),
re-evaluate the loss of the current batch (``state.closure``, for sharpness-aware
updates), add entries to the session's record (``state.report``, e.g. pseudo-label
statistics), and keep tensors across sessions that are saved with each session's
checkpoint (:meth:`Plugin.extra_state` / :meth:`Plugin.load_extra_state`).

Within a session, the trainer checkpoints every plugin's mutable state at epoch
ends, and with ``checkpoint_steps`` also inside epochs (:meth:`Plugin.state_dict`),
so that a killed run resumes exactly where it stopped. The default captures every
data-like attribute (tensors, modules, counters, random generators, loaders' and
batch streams' positions; :mod:`jascl.engine.snapshot`); a plugin whose state
lives elsewhere overrides the pair. A session resumed *inside* an epoch fires
``resume_epoch`` instead of that epoch's ``before_epoch``: what ``before_epoch``
set up (prototypes, a batch stream's position) comes back from the checkpoint.
A plugin that overrides ``before_epoch`` states whether that holds for it
(:attr:`Plugin.mid_epoch_resume`); if not, its methods are checkpointed at epoch
ends only.

A plugin overrides the events it needs; each receives the loop state. Loss
terms are added in ``after_forward`` to ``state.losses`` under a name, so they
are logged separately and summed by the loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from jascl.engine.prototypes import PrototypeRequest
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")

EVENTS = (
    "setup_model",
    "before_session",
    "before_epoch",
    "resume_epoch",
    "before_iteration",
    "after_forward",
    "before_backward",
    "after_backward",
    "before_update",
    "after_update",
    "after_epoch",
    "after_training",
    "before_eval",
    "evaluate",
    "before_eval_split",
    "after_eval",
    "after_session",
    "save_session",
    "session_restored",
)


class Plugin:
    """Base class: every event is a no-op. Subclasses override what they need.

    Attributes:
        name: short name, used in logs and loss-term names.
        changes_base_session: True if the plugin alters training of session 0;
            methods whose plugins all leave it alone share one base checkpoint.
        base_key: for a plugin that changes session 0 in a way other methods may share (e.g.
            JASCL's stochastic classifier): a name; methods whose base-changing plugins all have
            keys share the base trained by those plugins alone (``<run>/base-<key>``).
        freeze_incremental: freezing policy of incremental sessions this plugin
            needs ("all_but_classifier" or "none"); None = the run configuration's.
        loss_terms: the ``state.losses`` keys the plugin adds (checked non-zero by
            the registry test in the incremental session).
        base_loss_terms: the keys a plugin that changes session 0 adds there (checked
            non-zero in session 0 by the registry test; e.g. FACT's virtual-class terms).
        unused_parameters: some trainable model parameters get no gradient in some steps (e.g. the
            pixel classifier while C-FSCIL meta-learns); with several processes the trainer then
            asks DistributedDataParallel to look for them (``find_unused_parameters``).
        replaces: names of the loop's default plugins (:mod:`jascl.engine.defaults`) this
            plugin does the work of, e.g. ``("supervised-loss",)`` for a method with its own
            segmentation loss; those defaults are then not fired.
    """

    name = "plugin"
    replaces: tuple[str, ...] = ()
    changes_base_session = False
    base_key: str | None = None
    freeze_incremental: str | None = None
    #: keys this plugin adds to ``state.losses`` (non-zero in incremental sessions)
    loss_terms: tuple[str, ...] = ()
    #: keys this plugin adds to ``state.losses`` in session 0 (non-zero there; methods that change the base)
    base_loss_terms: tuple[str, ...] = ()
    #: some trainable model parameters get no gradient in some steps (DDP must look for them)
    unused_parameters = False
    #: attributes the default :meth:`state_dict` leaves out (e.g. views of tensors restored elsewhere)
    snapshot_exclude: tuple[str, ...] = ()
    #: whether a session can be checkpointed inside an epoch and resumed there: everything
    #: :meth:`before_epoch` sets up is in :meth:`state_dict` (or redone by :meth:`resume_epoch`).
    #: None: True exactly when the plugin does not override ``before_epoch``.
    mid_epoch_resume: bool | None = None

    def resumes_mid_epoch(self) -> bool:
        """:attr:`mid_epoch_resume`, with its default resolved."""
        if self.mid_epoch_resume is not None:
            return self.mid_epoch_resume
        return type(self).before_epoch is Plugin.before_epoch

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        """The optimiser of the coming session (None = the loop's SGD from the run configuration)."""
        return None

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Tensors to save with the session checkpoint (restored by :meth:`load_extra_state`)."""
        return {}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`extra_state` returned, when a saved session is reused."""

    def state_dict(self) -> dict:
        """In-session state for a resumable checkpoint (default: every data-like attribute)."""
        from jascl.engine.snapshot import capture_object

        return capture_object(self, exclude=self.snapshot_exclude)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a plugin whose session was set up again (``before_session`` ran)."""
        from jascl.engine.snapshot import restore_object

        restore_object(self, state)

    def prototype_requests(self, state: LoopState) -> Sequence[PrototypeRequest]:
        """The ``state.compute_prototypes`` calls this plugin's ``before_eval`` will make (default: none declared).

        The loop serves every plugin's declared calls with one pass over the session's data, just before
        ``before_eval`` fires (a pass over whole samples is what a call costs; a 3D base set's is large). They
        are computed from the model as training left it; a declared call is answered once, and any other call
        is computed as usual."""
        return ()

    def restore_requests(self, state: LoopState) -> Sequence[PrototypeRequest]:
        """The ``state.compute_prototype_requests`` calls this plugin's ``session_restored`` will make when session
        ``state.session`` is reused from a folder it did not train (a shared base; default: none declared).

        The trainer of such a session (:func:`jascl.experiments.bases.ensure_base`) answers them in its own pass
        before ``before_eval`` (:meth:`prototype_requests`), from the model as training left it, and keeps the
        answers in the session's prototype cache (:mod:`jascl.engine.prototype_cache`), keyed by that model: the
        restore then reads them instead of making a pass over the session's whole samples. Called on the plugin
        before its method's run has fired anything on it."""
        return ()

    def epoch_iterations(self, state: LoopState) -> int | None:
        """Iterations the plugin needs in the coming epoch (None = the labelled loader's length)."""
        return None

    def setup_model(self, state: LoopState) -> None: ...
    def before_session(self, state: LoopState) -> None: ...
    def before_epoch(self, state: LoopState) -> None: ...

    def resume_epoch(self, state: LoopState) -> None:
        """Fired instead of ``before_epoch`` for the epoch a session resumes inside, after :meth:`load_state_dict`."""

    def before_iteration(self, state: LoopState) -> None: ...
    def after_forward(self, state: LoopState) -> None: ...
    def before_backward(self, state: LoopState) -> None: ...
    def after_backward(self, state: LoopState) -> None: ...
    def before_update(self, state: LoopState) -> None: ...
    def after_update(self, state: LoopState) -> None: ...
    def after_epoch(self, state: LoopState) -> None: ...
    def after_training(self, state: LoopState) -> None: ...
    def before_eval(self, state: LoopState) -> None: ...
    def before_eval_split(self, state: LoopState) -> None: ...
    def evaluate(self, state: LoopState) -> None: ...
    def after_eval(self, state: LoopState) -> None: ...
    def after_session(self, state: LoopState) -> None: ...
    def save_session(self, state: LoopState) -> None: ...
    def session_restored(self, state: LoopState) -> None: ...


@dataclass
class Method:
    """A continual-learning method: a name and the plugins that implement it."""

    name: str
    plugins: list[Plugin] = field(default_factory=list)
    description: str = ""

    @property
    def changes_base_session(self) -> bool:
        return any(p.changes_base_session for p in self.plugins)

    @property
    def base_key(self) -> str | None:
        """The name of a session-0 model other methods share (``"+"``-joined keys of the plugins that change
        session 0), or None: the vanilla base when nothing changes session 0, else the method's own."""
        changing = [p for p in self.plugins if p.changes_base_session]
        if not changing or any(p.base_key is None for p in changing):
            return None
        return "+".join(sorted({str(p.base_key) for p in changing}))

    def base_method(self) -> Method:
        """The method that trains the shared keyed base: the plugins that change session 0, alone."""
        key = self.base_key
        if key is None:
            raise ValueError(f"method {self.name} has no shared keyed base")
        return Method(f"base-{key}", [p for p in self.plugins if p.changes_base_session])

    @property
    def unused_parameters(self) -> bool:
        """Whether a plugin leaves some trainable parameters without a gradient in some steps."""
        return any(p.unused_parameters for p in self.plugins)

    def epoch_iterations(self, state: LoopState) -> int:
        """The largest number of iterations any plugin asks for in the coming epoch (0 = none)."""
        return max([p.epoch_iterations(state) or 0 for p in self.plugins], default=0)

    def mid_epoch_blockers(self) -> list[str]:
        """Names of the plugins that cannot resume inside an epoch (:attr:`Plugin.mid_epoch_resume`)."""
        return [p.name for p in self.plugins if not p.resumes_mid_epoch()]

    def freeze_policy(self, default: str) -> str:
        """The incremental-session freezing policy: the plugins' (they must agree) or ``default``."""
        wanted = {p.freeze_incremental for p in self.plugins if p.freeze_incremental is not None}
        if len(wanted) > 1:
            raise ValueError(f"method {self.name!r}: plugins need different freezing policies {sorted(wanted)}")
        return wanted.pop() if wanted else default

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        made = [o for o in (p.make_optimizer(state, params, lr) for p in self.plugins) if o is not None]
        if len(made) > 1:
            raise ValueError(f"method {self.name!r}: more than one plugin supplies the optimiser")
        from jascl.engine.optim import own_optimizer_note  # (torch: imported where used)

        if made and (note := own_optimizer_note(made[0], state.config)) is not None:
            log.info(
                "%s session %d trains with its own optimiser: %s (docs/baselines.md)",
                self.name,
                state.session.index,
                note,
            )
        return made[0] if made else None

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Every plugin's extra state, keys prefixed ``<index>.<plugin name>.``."""
        out = {}
        for i, plugin in enumerate(self.plugins):
            for key, value in plugin.extra_state().items():
                out[f"{i}.{plugin.name}.{key}"] = value
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for i, plugin in enumerate(self.plugins):
            prefix = f"{i}.{plugin.name}."
            own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if own:
                plugin.load_extra_state(own)

    def state_dict(self) -> dict:
        """Every plugin's in-session state, keyed ``<index>.<plugin name>``."""
        return {f"{i}.{p.name}": p.state_dict() for i, p in enumerate(self.plugins)}

    def load_state_dict(self, state: dict) -> None:
        for i, plugin in enumerate(self.plugins):
            key = f"{i}.{plugin.name}"
            if key in state:
                plugin.load_state_dict(state[key])

    def with_plugins(self, extra: list[Plugin]) -> Method:
        """A copy of this method with ``extra`` plugins after its own (this one is left as it is)."""
        return Method(self.name, [*self.plugins, *extra], self.description)

    def compose(self, defaults: list[Plugin]) -> list[Plugin]:
        """The plugins a trainer fires, in order: the defaults no plugin replaces, then this method's.

        Raises:
            ValueError: a plugin replaces a default that does not exist, or two plugins replace the same one.
        """
        known = {d.name for d in defaults}
        replaced: dict[str, str] = {}
        for plugin in self.plugins:
            for name in plugin.replaces:
                if name not in known:
                    raise ValueError(
                        f"method {self.name!r}: plugin {plugin.name!r} replaces {name!r}, which is not "
                        f"a default plugin (defaults: {', '.join(sorted(known))})"
                    )
                if name in replaced:
                    raise ValueError(
                        f"method {self.name!r}: plugins {replaced[name]!r} and {plugin.name!r} both replace {name!r}"
                    )
                replaced[name] = plugin.name
        return [d for d in defaults if d.name not in replaced] + list(self.plugins)

    def fire(self, event: str, state: LoopState) -> None:
        for plugin in self.plugins:
            getattr(plugin, event)(state)
