"""Continual-learning methods: pure functions, plugins on the loop, and named presets."""

from jascl.engine.plugin import EVENTS, Method, Plugin
from jascl.methods import baselines, detection, presets  # noqa: F401  (register the methods)
from jascl.methods.registry import METHODS, create_method

__all__ = ["EVENTS", "METHODS", "Method", "Plugin", "create_method"]
