"""The base of every config section, and the error a bad setting raises.

Below :mod:`tether.config` and :mod:`tether.engines` (whose entries own config sections of their own), so both
build their sections on one base: frozen, unknown keys refused, numbers that are finite numbers.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, model_validator


class ConfigError(ValueError):
    """A config key, value or file is invalid. The message names the offending key."""

    __module__ = "tether.config"  # its public home (re-exported there): what messages and tracebacks name


def _number_kind(annotation) -> type | None:
    """int or float when a field holds a number (also inside ``X | None``), else None."""
    if annotation in (int, float):
        return annotation
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    return args[0] if len(args) == 1 and args[0] in (int, float) else None


class Section(BaseModel):
    """One frozen config section: unknown keys are errors, numbers must be finite numbers (not booleans)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _plain_numbers(cls, data):
        """Numbers must be finite numbers: YAML's yes/true is not 1, and inf/nan are never a setting."""
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            kind = _number_kind(field.annotation)
            value = data.get(name)
            if kind is None or value is None:
                continue
            if isinstance(value, bool):
                raise ValueError(f"{name} expects a number, got the boolean {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        return data
