"""What a run is compared with, as the command line names it: `--reference AXIS=VALUE` (default the
same settings at batch size 1) and `--reference-run first|modal`. Kept apart from the statistics so
that `harness run` can refuse a bad reference before an engine loads, without importing pandas."""

from __future__ import annotations

from typing import Any, Iterable

from harness.core.errors import UsageError
from harness.experiment.schema import option_axis
from harness.experiment.settings_args import parse_settings

DEFAULT_REFERENCE: dict[str, Any] = {"batch_size": 1}
#: how the reference cell's run of a prompt is chosen: its first ok run, or its most frequent output
#: (ties broken by run order); `--reference-run`
REFERENCE_RUNS: tuple[str, ...] = ("first", "modal")


def parse_reference(items: Iterable[str], option: str = "--reference") -> dict[str, Any]:
    """'axis=value' strings -> typed overrides; empty -> the default (batch_size=1)."""
    return parse_settings(items, option) or dict(DEFAULT_REFERENCE)


def refuse_reference_run(rule: str) -> None:
    """A UsageError naming the allowed rules, for a `--reference-run` that is not one."""
    if rule not in REFERENCE_RUNS:
        raise UsageError(f"--reference-run {rule}: allowed: {', '.join(REFERENCE_RUNS)}")


def refuse_reference(reference: list[str], reference_run: str, swept_options: Iterable[str]) -> None:
    """Before a run: a `--reference` or `--reference-run` that the summary after it could not use is
    refused now, before an engine loads, not after the GPU hours. An unswept engine option as the
    reference would make every cell its own reference."""
    refuse_reference_run(reference_run)
    swept = list(swept_options)
    unswept = [a for a in parse_reference(reference) if option_axis(a) and a not in swept]
    if unswept:
        raise UsageError(f"--reference {unswept[0]}: the experiment does not sweep {unswept[0]}; swept engine "
                         f"options: {', '.join(swept) or 'none'}")
