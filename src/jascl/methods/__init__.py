"""Continual-learning methods: pure functions, plugins on the loop, and named presets.

Importing this package imports no method: :data:`METHODS` lists them from the registry index
(:mod:`jascl.registry`) and imports a method's module the first time the method is built or described.
"""

from jascl.engine.plugin import EVENTS, Method, Plugin
from jascl.methods.registry import METHODS, create_method

__all__ = ["EVENTS", "METHODS", "Method", "Plugin", "create_method"]
