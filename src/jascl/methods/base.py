"""Plugins on the training loop's named events, and methods as lists of plugins.

The trainer (``jascl.training.trainer``) fires these events, in this order,
for every session::

    before_session
      before_epoch   (an epoch runs max(len(labelled loader), any plugin's epoch_iterations) steps,
                      cycling the labelled loader)
        before_iteration -> after_forward (add loss terms) -> before_backward
        -> after_backward -> before_update -> after_update
      after_epoch
    after_training -> (prototypes computed) -> before_eval -> after_eval
    -> (checkpoint saved) -> after_session

A plugin overrides the events it needs; each receives the loop state. Loss
terms are added in ``after_forward`` to ``state.losses`` under a name, so they
are logged separately and summed by the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from jascl.registry import Registry

if TYPE_CHECKING:
    from jascl.training.state import LoopState
    from jascl.training.config import RunConfig

EVENTS = (
    "before_session", "before_epoch", "before_iteration", "after_forward", "before_backward", "after_backward",
    "before_update", "after_update", "after_epoch", "after_training", "before_eval", "after_eval", "after_session",
)


class Plugin:
    """Base class: every event is a no-op. Subclasses override what they need.

    Attributes:
        name: short name, used in logs and loss-term names.
        changes_base_session: True if the plugin alters training of session 0;
            methods whose plugins all leave it alone share one base checkpoint.
    """

    name = "plugin"
    changes_base_session = False

    def epoch_iterations(self, state: "LoopState") -> int | None:
        """Iterations the plugin needs in the coming epoch (None = the labelled loader's length)."""
        return None

    def before_session(self, state: "LoopState") -> None: ...
    def before_epoch(self, state: "LoopState") -> None: ...
    def before_iteration(self, state: "LoopState") -> None: ...
    def after_forward(self, state: "LoopState") -> None: ...
    def before_backward(self, state: "LoopState") -> None: ...
    def after_backward(self, state: "LoopState") -> None: ...
    def before_update(self, state: "LoopState") -> None: ...
    def after_update(self, state: "LoopState") -> None: ...
    def after_epoch(self, state: "LoopState") -> None: ...
    def after_training(self, state: "LoopState") -> None: ...
    def before_eval(self, state: "LoopState") -> None: ...
    def after_eval(self, state: "LoopState") -> None: ...
    def after_session(self, state: "LoopState") -> None: ...


@dataclass
class Method:
    """A continual-learning method: a name and the plugins that implement it."""

    name: str
    plugins: list[Plugin] = field(default_factory=list)
    description: str = ""

    @property
    def changes_base_session(self) -> bool:
        return any(p.changes_base_session for p in self.plugins)

    def epoch_iterations(self, state: "LoopState") -> int:
        """The largest number of iterations any plugin asks for in the coming epoch (0 = none)."""
        return max([p.epoch_iterations(state) or 0 for p in self.plugins], default=0)

    def fire(self, event: str, state: "LoopState") -> None:
        for plugin in self.plugins:
            getattr(plugin, event)(state)


#: Method factories take the resolved run configuration.
METHODS: Registry[Method] = Registry("method")
MethodFactory = Callable[["RunConfig"], Method]
