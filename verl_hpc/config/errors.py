"""One exception type for bad configuration, always printable as one line.

Why: a user who mistypes a key on a login node must see the field path and the fix,
not a 40-line pydantic or Python traceback. Every config check raises `FieldError`;
the loader turns pydantic's errors into `ConfigError` with the same format.
"""

from __future__ import annotations


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
        return f"{where}{field}{self.message}{hint}"


class FieldError(ConfigError):
    """Raised inside validators; pydantic wraps it, the loader unwraps it keeping the path."""
