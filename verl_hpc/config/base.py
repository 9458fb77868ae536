"""The base of every config object: strict, so a typo is an error, never a silent default."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are rejected; assignments are validated; objects are plain data."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
