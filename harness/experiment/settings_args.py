"""Settings named on the command line (`--reference`, `--where`, `--engine/--dtype`): AXIS=VALUE or
ENGINE.OPTION=VALUE, typed and checked by the same rules as the experiment file's matrix."""

from __future__ import annotations

from typing import Any, Iterable

from pydantic import ValidationError

from harness.core.errors import UsageError
from harness.experiment.axes import AXES
from harness.experiment.schema import Matrix, option_axis, option_value


def parse_settings(items: Iterable[str], option: str) -> dict[str, Any]:
    """'axis=value' strings -> {axis: typed value}; a bad one is a UsageError naming `option`."""
    out: dict[str, Any] = {}
    for item in items:
        axis, sep, value = item.partition("=")
        axis = axis.strip()
        if sep and option_axis(axis) is not None:
            try:
                out[axis] = option_value(axis, value.strip())[1]
            except ValueError as exc:
                raise UsageError(f"{option} '{item}': {exc}") from None
            continue
        if not sep or axis not in AXES:
            raise UsageError(f"{option} '{item}': expected AXIS=VALUE with AXIS one of {', '.join(AXES)} "
                             "or ENGINE.OPTION for a swept engine option")
        probe = {"model": ["x"], axis: [value.strip()]}
        try:
            out[axis] = getattr(Matrix.model_validate(probe), axis)[0]
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise UsageError(f"{option} '{item}': {msg}") from None
    return out
