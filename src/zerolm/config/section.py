"""What every config section shares: the pydantic base (lax, frozen, no unknown keys, no booleans for
numbers), the error a validator raises to name a key other than the one being validated (zerolm.config.load
turns it into the one-line message), the error of a config that cannot be used, and setting a dotted key."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from zerolm.core.errors import ZerolmError


class Section(BaseModel):
    # Lax mode, so `--set train.lr=1e-3` (a string to YAML) still reads as a number; but no infinities
    # or NaNs, and (below) no booleans where a number is expected: YAML turns `yes` into True, and
    # pydantic would take True as 1.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if annotation in (int, float) or {int, float} & set(typing.get_args(annotation)):
                raise ValueError(f"expected a number, got {value!r}")
        return value


PositiveInt = Field(gt=0)


class _KeyError(ValueError):
    """Raised inside validators to point at a key other than the one pydantic is validating."""

    def __init__(self, key: str, message: str, related: tuple[str, ...] = ()):
        super().__init__(f"{key}: {message}")
        self.key, self.related = key, related


def problem(error: ValidationError) -> tuple[str, str]:
    """The first problem of a section's validation: its dotted key and pydantic's message without the prefix."""
    first = error.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"].removeprefix("Value error, ")


class ConfigError(ZerolmError):
    """A config that cannot be used; the message is one line naming the file and the key."""


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = tree.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is a value, not a section")
        tree = child
    tree[leaf] = value
