"""The base of every config section: strict keys, no non-finite numbers, no boolean where a
number belongs."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    # allow_inf_nan=False: `lr: inf` or `"nan"` is refused (a non-finite value trains NaN weights)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _a_boolean_is_not_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's `true` where a number belongs: pydantic's lax mode would read it as 1."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _takes_a_number(annotation):
            raise ValueError(f"is the boolean {str(value).lower()}, not a number")
        return value


def _takes_a_number(annotation: Any) -> bool:
    """Whether a field takes a number and no boolean (`int`, `float | None`, `'auto' | int`)."""
    kinds = set()
    pending = [annotation]
    while pending:
        t = pending.pop()
        args = get_args(t)
        if args and get_origin(t) is not Literal:
            pending.extend(args)
        else:
            kinds.add(t)
    return bool(kinds & {int, float}) and bool not in kinds
