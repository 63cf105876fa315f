"""Checksums of tensor bytes: what is written to disk is checked when it is read back.

Two algorithms, named in the storage directory's manifest:

* ``xxh3`` (the default since storage format 2): the 64-bit XXH3 hash from the ``xxhash``
  package. About 6x zlib's CRC-32 on this project's development machine (``python
  tools/bench_checksum.py``: 25 GB/s against 4.2 GB/s on one core), and it releases the GIL while
  it runs, so the I/O threads checksum in parallel with compute.
* ``crc32``: zlib's CRC-32, what format 1 directories recorded; still read and written for them.
* ``wsum64``: a weighted sum of the bytes as 64-bit words, modulo 2**64, computed by torch on the
  tensor's own device. The store uses it for bytes that move between the GPU and the disk without
  a host copy (GPUDirect Storage), so checking them never copies them to the host. Such an
  extent's checksum is recorded with its algorithm (``"wsum64:<hex>"``); any machine, with or
  without a GPU, verifies it (torch computes the same sum on the CPU, exactly: integer sums
  modulo 2**64 do not depend on the order of the additions).

A checksum is computed in one go (:func:`checksum_function`) or over pieces
(:func:`start`/``update``/``value``, for files read a chunk at a time). A recorded value is an
``int`` of the directory's algorithm or a tagged string of another (:func:`hasher_for`,
:func:`matches`, :func:`describe`).
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch

__all__ = ["ALGORITHMS", "DEFAULT", "DEVICE_ALGORITHM", "Hasher", "checksum_function", "start", "hasher_for",
           "device_checksum", "describe", "wsum64"]

DEFAULT = "xxh3"
ALGORITHMS = ("xxh3", "crc32", "wsum64")
DEVICE_ALGORITHM = "wsum64"
"""The algorithm of checksums computed on an accelerator (recorded tagged, ``"wsum64:<hex>"``)."""

_MASK = (1 << 64) - 1
_K = 0x9E3779B97F4A7C15  # odd: every word's weight (2i+1)*K is odd, so any one changed word changes the sum
_K_LEN = 0xC2B2AE3D27D4EB4F
_WORDS = 1 << 20  # words per device pass: 8 MiB of input, about 24 MiB of temporaries
_weights: dict = {}


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >> 63 else v


def _weight_table(device: torch.device) -> torch.Tensor:
    """(2i+1)*K mod 2**64 for i < _WORDS, as int64, on ``device`` (built once per device)."""
    table = _weights.get(device)
    if table is None:
        table = (torch.arange(_WORDS, dtype=torch.int64) * 2 + 1).mul_(_signed(_K)).to(device)
        _weights[device] = table
    return table


def _mix(w: int) -> int:
    return (w ^ (w >> 32)) & _MASK


class _WeightedSum:
    """wsum64 over successive pieces: sum of mix(word_i) * (2i+1)*K, mod 2**64, then the length mixed in.

    Words are the bytes taken 8 at a time, little-endian, the last one zero-padded; ``mix`` folds a
    word's high half into its low half so every bit reaches the top of the product. The aligned
    middle of each piece is summed by torch on the piece's device (one host sync, in ``value``).
    """

    def __init__(self):
        self._acc = 0  # python int, or an int64 tensor on the device once a piece was summed there
        self._words = 0  # words summed so far
        self._tail = b""  # < 8 bytes waiting for the rest of their word
        self._nbytes = 0

    def _add_word(self, raw: bytes) -> None:
        w = int.from_bytes(raw.ljust(8, b"\0"), "little")
        self._acc = self._acc + _signed(_mix(w) * ((2 * self._words + 1) * _K))
        self._words += 1

    def update(self, raw: torch.Tensor) -> None:
        n = raw.numel()
        self._nbytes += n
        start = 0
        if self._tail:
            start = min(n, 8 - len(self._tail))
            self._tail += bytes(raw[:start].cpu().numpy())
            if len(self._tail) < 8:
                return
            self._add_word(self._tail)
            self._tail = b""
        body = (n - start) // 8 * 8
        if body:
            middle = raw[start:start + body]
            if middle.storage_offset() % 8:
                middle = middle.clone()
            words = middle.view(torch.int64)
            table = _weight_table(raw.device)
            for a in range(0, words.numel(), _WORDS):
                w = words[a:a + _WORDS]
                m = w ^ ((w >> 32) & 0xFFFFFFFF)
                shift = _signed(2 * (self._words + a) * _K)  # weight of word i here: table[i - a] + shift
                part = (m * table[:m.numel()]).sum() + m.sum() * shift
                self._acc = part + self._acc if isinstance(self._acc, int) else self._acc.add_(part)
            self._words += words.numel()
        if start + body < n:
            self._tail = bytes(raw[start + body:].cpu().numpy())

    def value(self) -> int:
        if self._tail:
            self._add_word(self._tail)
            self._tail = b""
        acc = self._acc if isinstance(self._acc, int) else int(self._acc.item())
        return (acc & _MASK) ^ ((self._nbytes * _K_LEN) & _MASK)


def wsum64(raw: torch.Tensor) -> int:
    """The wsum64 checksum of a flat uint8 tensor's bytes, computed on the tensor's device."""
    h = _WeightedSum()
    h.update(raw)
    return h.value()


class Hasher:
    """A checksum computed over successive pieces: ``update(raw)`` then ``value()``."""

    def __init__(self, name: str):
        if name not in ALGORITHMS:
            from offload_core.errors import ConfigError
            raise ConfigError(f"unknown checksum {name!r}; known: {list(ALGORITHMS)}")
        self.name = name
        self._crc = 0
        self._xxh = None
        self._wsum = _WeightedSum() if name == "wsum64" else None
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
        if self._wsum is not None:
            self._wsum.update(raw)
        elif raw.device.type != "cpu":
            for a in range(0, raw.numel(), _HOST_PIECE):
                self._update(raw[a:a + _HOST_PIECE].cpu().numpy())
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
        if self._wsum is not None:
            return self._wsum.value()
        return self._xxh.intdigest() if self._xxh is not None else self._crc

    def recorded(self, default: str) -> int | str:
        """The value as it is recorded where ``default`` is the directory's algorithm."""
        value = self.value()
        return value if self.name == default else f"{self.name}:{value:016x}"


_HOST_PIECE = 64 << 20


def hasher_for(expected: int | str | None, default: str) -> Hasher:
    """A hasher of the algorithm a recorded value was made with (``default`` for a plain int)."""
    if isinstance(expected, str):
        name, _, _ = expected.partition(":")
        return Hasher(name)
    return Hasher(default)


def device_checksum(raw: torch.Tensor, default: str) -> int | str:
    """The checksum to record for ``raw``'s bytes: ``default``'s on the CPU, wsum64 (tagged,
    computed on the device) for a tensor on an accelerator."""
    name = default if raw.device.type == "cpu" else DEVICE_ALGORITHM
    return Hasher(name).update(raw).recorded(default)


def matches(raw: torch.Tensor, expected: int | str, default: str) -> tuple[bool, int | str]:
    """Whether ``raw``'s bytes have the recorded checksum ``expected``; and the value they have."""
    actual = hasher_for(expected, default).update(raw).recorded(default)
    return actual == expected, actual


def describe(value: int | str | None, default: str) -> str:
    """A recorded checksum for messages: ``xxh3 1234abcd`` or ``wsum64 00ff...``."""
    if isinstance(value, str):
        name, _, hexval = value.partition(":")
        return f"{name} {hexval}"
    return f"{default} {value:08x}" if value is not None else f"{default} (none)"


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
