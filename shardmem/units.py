"""Byte quantities: parsing "1GiB"-style strings and formatting sizes for people."""

from __future__ import annotations

import math
import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}  # fmt: skip
MAX_BYTES = 2**63 - 1  # XLA and the memory statistics count bytes in int64.
_HINT = "write e.g. 1GiB, 512MiB, 2GB or 1073741824"
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Returns a byte count from an int or a string such as "1GiB", "512 MiB" or "2e9".

    Raises ValueError with the accepted units when the value cannot be read or is not finite, and
    says so when it is larger than :data:`MAX_BYTES` (8 EiB).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}; {_HINT}")
    if isinstance(value, int):
        return _at_most_max(value, value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else ""
    try:
        if match and (not unit or unit in _UNITS):
            number = float(match.group(1)) * _UNITS[unit or "b"]
        else:
            number = float(value)  # "2e9", "inf", ...
    except ValueError:
        raise ValueError(f"cannot read {value!r} as a byte size; {_HINT}") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite byte size; {_HINT}")
    return _at_most_max(int(number), value)


def _at_most_max(number: int, value: int | float | str) -> int:
    if number > MAX_BYTES:
        raise ValueError(
            f"{value!r} is too large: {number:.3g} bytes, over the 8 EiB a byte count can hold; {_HINT}"
        )
    return number


def format_bytes(n: float) -> str:
    """Formats a byte count with binary units: 1536 -> "1.50 KiB"."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """Formats a FLOP count with decimal prefixes: 1.2e15 -> "1.20 PFLOP"."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.3g} FLOP"


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmgt]?)(b|bit|B)?(?:/s|ps)?\s*$", re.I)


def parse_bandwidth(value: int | float | str) -> float:
    """Returns bytes per second from a number or a string such as "450GB/s", "400Gb/s" (bits: 50 GB/s)
    or "2.5e10". Raises ValueError with the accepted forms when the value cannot be read."""
    hint = "write e.g. 450GB/s, 400Gb/s (bits) or 5e10 (bytes per second)"
    if isinstance(value, bool):
        raise ValueError(f"expected a bandwidth, got {value!r}; {hint}")
    if isinstance(value, int | float):
        number = float(value)
    else:
        match = _RATE.match(str(value))
        if not match or (match.group(2) and not match.group(3)):
            raise ValueError(f"cannot read {value!r} as a bandwidth; {hint}")
        scale = 10 ** (3 * " kmgt".index(match.group(2).lower() or " "))
        bits = match.group(3) in ("b", "bit", "Bit")
        number = float(match.group(1)) * scale / (8 if bits else 1)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{value!r} is not a positive, finite bandwidth; {hint}")
    return number


def format_seconds(seconds: float) -> str:
    """Formats a duration for people: 0.0123 -> "12.3 ms"."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")
