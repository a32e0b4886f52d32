"""User-facing errors.

Every error a user can fix (a bad protocol key, a missing file, an impossible
K-shot request) is raised as a :class:`JasclError` whose message is one line
naming the offending file or key and the fix. The CLI prints it without a
traceback and exits with code 2.
"""

from __future__ import annotations


class JasclError(Exception):
    """An error caused by user input; printed as one line, exit code 2.

    A message that quotes user input holding line breaks (a YAML key ``"\\n"``, a file name with a
    newline) keeps them escaped, so the line stays one line whatever the input.
    """

    exit_code = 2

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (one_line(args[0]),)
        super().__init__(*args)


def one_line(text: str) -> str:
    """``text`` with CR, LF and the other line separators Python splits on written as escapes."""
    return text.translate(_BREAKS)


#: what str.splitlines() breaks on, mapped to a visible escape
_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


class ConfigError(JasclError):
    """A protocol or run configuration is malformed or inconsistent."""


class DataError(JasclError):
    """Input data is missing, corrupt or does not match the protocol."""


class CheckpointError(JasclError):
    """A checkpoint or weights file cannot be loaded safely or does not fit."""


class TrainingError(JasclError):
    """Training cannot go on (e.g. the loss became NaN); the last good checkpoint is kept. Exit code 3."""

    exit_code = 3
