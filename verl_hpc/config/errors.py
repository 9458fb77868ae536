"""One exception type for bad configuration, always printable as one line.

Why: a user who mistypes a key on a login node must see the field path and the fix,
not a 40-line pydantic or Python traceback. Every config check raises `FieldError`;
the loader turns pydantic's errors into `ConfigError` with the same format.
"""

from __future__ import annotations

# Every character str.splitlines() breaks on, shown escaped (`\n`) so a user's value that
# holds one (a path with a newline, a key with a form feed) still prints as one line.
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


class ConfigError(ValueError):
    """Invalid configuration: `path` is the dotted field, `hint` says how to fix it."""

    def __init__(self, path: str, message: str, hint: str | None = None, source: str | None = None):
        self.path = path
        self.message = message
        self.hint = hint
        self.source = source
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = f"{self.source}: " if self.source else ""
        field = f"{self.path}: " if self.path else ""
        hint = f" (hint: {self.hint})" if self.hint else ""
        return f"{where}{field}{self.message}{hint}".translate(_LINE_BREAKS)


class FieldError(ConfigError):
    """Raised inside validators; pydantic wraps it, the loader unwraps it keeping the path."""
