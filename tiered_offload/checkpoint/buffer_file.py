"""The model's persistent buffers (BatchNorm statistics, counters, a registered table) on disk.

A commit's ``meta`` names one extent, ``model.buffers@<step>``, that holds every persistent
buffer's bytes one after another, its checksum, and where each buffer lies in it::

    "buffer_file": {"extent": "model.buffers@12", "crc": ..., "nbytes": 8192,
                    "tensors": {"bn.running_mean": {"dtype": "float32", "shape": [64], "offset": 0}, ...}}

so a large buffer costs no JSON (the journal's intent and the manifest stay small) and is checked
like every other tensor. The extent is written and made durable before the meta naming it is
handed to the commit protocol, and only when a buffer changed since the last one (in place or by
assignment): a model whose buffers never change writes it once. An extent is deleted once the
committed manifest names a newer one; a crash's leftovers go with the other garbage at the next
open (:func:`referenced`). States of format 2 keep their buffers as base64 JSON in
``meta["buffers"]``; those still load (:func:`load`).
"""

from __future__ import annotations

import math
import weakref

import torch

from offload_core.buffers import PAGE, aligned_empty
from offload_core.errors import CheckpointError, CorruptionError, ExtentNotFoundError, ShortReadError
from tiered_offload.store.checksum import describe, device_checksum, matches

from .durable import decode_tensor
from .layout import extent_name, parse_extent

__all__ = ["BUFFER_KEY", "BufferFile", "load", "referenced"]

BUFFER_KEY = "model.buffers"
"""The extents' key (``model.buffers@<step>``); no unit's key has this form."""
_ALIGN = 64


class BufferFile:
    """Writes the buffers of one engine's commits to its storage backend.

    Args:
        backend: the open storage backend of the state directory.
        checksum: the directory's checksum algorithm.
        committed_meta: ``fn() -> meta`` of the state the manifest holds now (its extent and the
            older ones are what may be deleted: never one a committed or pending state names).
    """

    def __init__(self, backend, checksum: str, committed_meta):
        self.backend, self.checksum, self.committed_meta = backend, checksum, committed_meta
        self._seen: list | None = None
        """``(name, weakref to the tensor, its version)`` of each buffer when the last entry was made."""
        self._entry: dict | None = None
        self._written: list[str] = []
        """Extents this engine wrote or adopted, oldest first."""

    def adopt(self, meta: dict) -> None:
        """Continue from a committed state's entry (its extent is reused while nothing changes)."""
        entry = meta.get("buffer_file")
        if entry is not None:
            self._entry = entry
            if entry["extent"] not in self._written:
                self._written.append(entry["extent"])

    def entry(self, buffers: list[tuple[str, torch.Tensor]], step: int) -> dict | None:
        """The meta entry of ``buffers`` (``(name, tensor)``) for the state after ``step``; writes a
        new extent, durably, only when one changed since the last entry."""
        if not buffers:
            return None
        seen = [(name, t, t._version) for name, t in buffers]
        if self._entry is not None and self._seen is not None and len(seen) == len(self._seen) and all(
                n == n0 and ref() is t and v == v0 for (n, t, v), (n0, ref, v0) in zip(seen, self._seen)):
            return self._entry
        tensors, offset = {}, 0
        for name, t in buffers:
            tensors[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset}
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        nbytes = max(PAGE, -(-offset // PAGE) * PAGE)
        raw = aligned_empty(nbytes)
        raw.zero_()
        for (name, t), info in zip(buffers, tensors.values()):
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            raw[info["offset"]:info["offset"] + flat.numel()].copy_(flat)
        extent = extent_name(BUFFER_KEY, step)
        self.backend.write_from(extent, raw).get()
        self.backend.sync([extent])
        self._entry = {"extent": extent, "crc": device_checksum(raw, self.checksum), "nbytes": nbytes,
                       "tensors": tensors}
        self._seen = [(n, weakref.ref(t), v) for n, t, v in seen]
        self._written.append(extent)
        self._delete_superseded()
        return self._entry

    def read(self, meta: dict, where: str) -> dict[str, torch.Tensor]:
        """The buffers ``meta`` saved (see :func:`load`)."""
        return load(meta, self.backend, self.checksum, where)

    def _delete_superseded(self) -> None:
        """Delete the extents older than the one the committed manifest names (no committed or
        pending state can name them: entries only move forward)."""
        committed = (self.committed_meta() or {}).get("buffer_file")
        if committed is None:
            return
        floor = parse_extent(committed["extent"])[1]
        keep = []
        for extent in self._written:
            if parse_extent(extent)[1] < floor:
                try:
                    self.backend.delete(extent)
                except OSError:
                    pass  # deleted at the next open with the other garbage
            else:
                keep.append(extent)
        self._written = keep


def referenced(*metas: dict | None) -> set[str]:
    """The buffer extents the given metas name (a resume keeps them; other ``model.buffers@N`` go)."""
    return {m["buffer_file"]["extent"] for m in metas if m and m.get("buffer_file")}


def load(meta: dict, backend, checksum: str, where: str) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the buffers a meta saved: read from its extent and checked against
    its checksum, or decoded from format 2's JSON (``backend`` unused then). ``where`` names the
    state for errors."""
    entry = meta.get("buffer_file")
    if entry is None:
        return {name: decode_tensor(v) for name, v in (meta.get("buffers") or {}).items()}
    extent, nbytes = entry["extent"], entry["nbytes"]
    raw = aligned_empty(nbytes)
    try:
        backend.read_into(extent, raw).get()
    except (ExtentNotFoundError, ShortReadError, OSError) as e:
        raise CorruptionError(f"{where} names the model's buffers in {backend.describe(extent)}, which cannot be read "
                              f"({e}). Restore the directory from a copy") from e
    ok, actual = matches(raw, entry["crc"], checksum)
    if not ok:
        raise CorruptionError(f"{backend.describe(extent)} (the model's buffers) does not match its checksum "
                              f"({describe(actual, checksum)}, expected {describe(entry['crc'], checksum)}). Restore "
                              f"the directory from a copy")
    out = {}
    for name, info in entry["tensors"].items():
        dtype = getattr(torch, info["dtype"])
        end = info["offset"] + math.prod(info["shape"]) * dtype.itemsize
        if end > nbytes:
            raise CheckpointError(f"{where}: buffer {name!r} lies past the end of {backend.describe(extent)}; the "
                                  f"record is damaged. Restore the directory from a copy")
        out[name] = raw[info["offset"]:end].clone().view(dtype).reshape(info["shape"])
    return out
