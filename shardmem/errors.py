"""The exceptions shardmem raises for mistakes a user can fix.

Every message names the config key or argument, the value it got, and what to do instead. The CLI
prints these without a traceback and exits with code 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ShardmemError(Exception):
    """Base class of the errors a user can cause and fix."""


class ConfigError(ShardmemError):
    """A config value, command-line override or argument is invalid."""


class PlanError(ShardmemError):
    """A configuration could not be planned (lowered or compiled) for the requested target."""


class DoesNotFit(PlanError):
    """The compiler itself refused the step as too big for the device: XLA's TPU compiler fails on a
    program over the chip's HBM, so there is no report, only its figures: ``required_bytes`` (what it
    needed for the step's temporaries, a lower bound of the peak) and ``available_bytes`` (the HBM it
    had), None where its message gives none; and ``per_device``, what each device holds that is known
    without the compile, from the shapes and shardings (``params``, ``optimizer``, ``batch``, ...). The
    CLI exits 3, as for a plan that does not fit."""

    exit_code = 3

    def __init__(self, message: str, required_bytes: int | None = None, available_bytes: int | None = None,
                 per_device: dict[str, int] | None = None):  # fmt: skip
        super().__init__(message)
        self.required_bytes, self.available_bytes = required_bytes, available_bytes
        self.per_device = dict(per_device or {})


def at_least(option: str, value: int | None, least: int, fix: str) -> None:
    """Raises ConfigError "``option value``: ``fix``" when ``value`` (None: not given) is below ``least``:
    the one check of every numeric command-line option, so that all of them say the same."""
    if value is not None and value < least:
        raise ConfigError(f"{option} {value}: {fix}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Returns " (did you mean 'x'?)" for the closest choice, or "" when none is close (case aside: NF4
    -> nf4)."""
    spelled = {str(c).lower(): str(c) for c in choices}
    close = difflib.get_close_matches(str(word).lower(), list(spelled), n=1, cutoff=0.6)
    return f" (did you mean '{spelled[close[0]]}'?)" if close else ""


def one_of(choices: Iterable[object]) -> str:
    """Formats valid choices as "a, b or c"."""
    items = [str(c) for c in choices]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]
