"""The one base of every config model: unknown keys are refused (a typo is an error, not a
silently ignored option), no number is infinite or NaN (``1e309`` reads as infinity: a delay
of it held every call it touched), and a parsed config never changes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
