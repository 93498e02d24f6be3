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


#: A rate with its unit: a number, an SI prefix (k, M, G, T, P; any case), bits (``b``, ``bit``, ``bits``,
#: the word in any case: ``Gbit``, ``GBIT``) or bytes (``B``, ``byte``, ``bytes``), then ``/s`` or ``ps``.
_RATE = re.compile(
    r"^\s*([-+]?(?:[0-9]*\.?[0-9]+(?:e[+-]?\d+)?|inf|nan))\s*([kmgtp]?)(bits?|bytes?|b)(?:/s|ps)\s*$", re.I
)
#: Rates a link can have: from 1 MB/s (a slow NIC) to 1 PB/s (far beyond any NVLink).
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e6, 1e15
_RATE_HINT = ("write it with its unit: 400Gb/s, 400 Gbit/s or 400Gbps (bits), 50GB/s or 50 GBps (bytes); "
              "a lowercase b or the word bit is bits, an uppercase B or byte is bytes")  # fmt: skip


def parse_bandwidth(value: int | float | str) -> float:
    """Returns bytes per second from a rate with its unit: "450GB/s", "50 GBps" (bytes), "400Gb/s",
    "400 Gbit/s", "400GBIT/s", "400Gbps" (bits: 50 GB/s). A bare number, or one without "/s" or "ps",
    is ambiguous (bits or bytes?) and a ValueError, as is a rate outside 1 MB/s to 1 PB/s; each says
    what to write."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a rate such as 400Gb/s, got {value!r}; {_RATE_HINT}")
    if isinstance(value, int | float):
        raise ValueError(f"{value!r} has no unit (bits or bytes per second?); {_RATE_HINT}")
    match = _RATE.match(value)
    if not match:
        try:
            float(value)
        except ValueError:
            raise ValueError(f"cannot read {value!r} as a rate; {_RATE_HINT}") from None
        raise ValueError(f"{value!r} has no unit (bits or bytes per second?); {_RATE_HINT}")
    number, prefix, unit = match.groups()
    bits = unit == "b" or unit.lower().startswith("bit")
    rate = float(number) * 10 ** (3 * " kmgtp".index(prefix.lower() or " ")) / (8 if bits else 1)
    if not math.isfinite(rate) or not MIN_BANDWIDTH <= rate <= MAX_BANDWIDTH:
        shown = f"{rate:.3g} bytes/s" if math.isfinite(rate) else "not a finite rate"
        raise ValueError(f"{value!r} is {shown}, outside the 1 MB/s to 1 PB/s a link can have; {_RATE_HINT}")
    return rate


def format_seconds(seconds: float) -> str:
    """Formats a duration for people: 0.0123 -> "12.3 ms"."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def clip(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its words that fit in ``limit`` and " ..."."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."
