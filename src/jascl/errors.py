"""User-facing errors.

Every error a user can fix (a bad protocol key, a missing file, an impossible
K-shot request) is raised as a :class:`JasclError` whose message is one line
naming the offending file or key and the fix. The CLI prints it without a
traceback and exits with code 2.
"""

from __future__ import annotations


class JasclError(Exception):
    """An error caused by user input; printed as one line, exit code 2."""

    exit_code = 2


class ConfigError(JasclError):
    """A protocol or run configuration is malformed or inconsistent."""


class DataError(JasclError):
    """Input data is missing, corrupt or does not match the protocol."""


class CheckpointError(JasclError):
    """A checkpoint or weights file cannot be loaded safely or does not fit."""


class TrainingError(JasclError):
    """Training cannot go on (e.g. the loss became NaN); the last good checkpoint is kept. Exit code 3."""

    exit_code = 3
