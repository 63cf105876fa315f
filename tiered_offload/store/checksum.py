"""Checksums of tensor bytes: what is written to disk is checked when it is read back.

Two algorithms, named in the storage directory's manifest:

* ``xxh3`` (the default since storage format 2): the 64-bit XXH3 hash from the ``xxhash``
  package. About 6x zlib's CRC-32 on this project's development machine (``python
  tools/bench_checksum.py``: 25 GB/s against 4.2 GB/s on one core), and it releases the GIL while
  it runs, so the I/O threads checksum in parallel with compute.
* ``crc32``: zlib's CRC-32, what format 1 directories recorded; still read and written for them.

A checksum is computed in one go (:func:`checksum_function`) or over pieces
(:func:`start`/``update``/``value``, for files read a chunk at a time). Device tensors are
checksummed from a host copy, a chunk at a time.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch

__all__ = ["ALGORITHMS", "DEFAULT", "Hasher", "checksum_function", "start"]

_CHUNK = 64 << 20

DEFAULT = "xxh3"
ALGORITHMS = ("xxh3", "crc32")


class Hasher:
    """A checksum computed over successive pieces: ``update(raw)`` then ``value()``."""

    def __init__(self, name: str):
        if name not in ALGORITHMS:
            from offload_core.errors import ConfigError
            raise ConfigError(f"unknown checksum {name!r}; known: {list(ALGORITHMS)}")
        self.name = name
        self._crc = 0
        self._xxh = None
        if name == "xxh3":
            try:
                import xxhash
            except ImportError:  # pragma: no cover - xxhash is a dependency
                from offload_core.errors import ConfigError
                raise ConfigError("checksum 'xxh3' needs the xxhash package (pip install xxhash)") from None
            self._xxh = xxhash.xxh3_64()

    def update(self, raw: torch.Tensor) -> "Hasher":
        """Add a flat uint8 tensor's bytes (any device)."""
        if raw.numel() == 0:
            return self
        if raw.device.type != "cpu":
            for a in range(0, raw.numel(), _CHUNK):
                self._update(raw[a:a + _CHUNK].cpu().numpy())
        else:
            self._update(raw.numpy())
        return self

    def _update(self, buf) -> None:
        if self._xxh is not None:
            self._xxh.update(buf)
        else:
            self._crc = zlib.crc32(buf, self._crc)

    def value(self) -> int:
        """The checksum of every byte added so far."""
        return self._xxh.intdigest() if self._xxh is not None else self._crc


def start(name: str) -> Hasher:
    """A new :class:`Hasher` for the algorithm ``name``."""
    return Hasher(name)


def checksum_function(name: str) -> Callable[[torch.Tensor], int]:
    """``fn(raw uint8 tensor) -> checksum`` for the algorithm ``name`` (its ``__name__``)."""
    Hasher(name)  # an unknown name, or a missing package, fails here

    def run(raw: torch.Tensor) -> int:
        return Hasher(name).update(raw).value()
    run.__name__ = name
    return run
