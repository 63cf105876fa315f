"""Byte sizes as people write them ("4GiB", "512 MB", 1048576) and back."""

from __future__ import annotations

import math
import re

from offload_core.errors import ConfigError

__all__ = ["parse_size", "format_size", "format_size_up"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, what: str = "size") -> int:
    """Return a byte count from a number or a string such as ``"4GiB"``, ``"1.5 GB"``, ``"64M"`` or ``"1e9"``.

    Decimal suffixes (kB, MB, GB) are powers of 1000 and binary ones (KiB, MiB, GiB) powers of 1024,
    as on the packaging of disks and memory. ``what`` names the setting in the error message.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{what}: a size cannot be negative ({value!r})")
        number = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{what}: cannot read {value!r} as a byte size; write e.g. 4GiB, 512MB or 1048576")
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if isinstance(number, float) and not math.isfinite(number):
        raise ConfigError(f"{what}: a size must be a finite number, got {value!r}")
    return int(number)


def format_size(nbytes: float) -> str:
    """Render a byte count with a binary suffix, e.g. ``format_size(3 << 30) == "3.00 GiB"``."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_size_up(nbytes: float) -> str:
    """Like :func:`format_size`, rounded *up* at the last digit shown: a minimum stated this way is
    enough when passed back (``parse_size(format_size_up(n)) >= n``)."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(nbytes)} B"
            return f"{math.ceil(n * 100 - 1e-6) / 100:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
