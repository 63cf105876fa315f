"""Pretrained weights in PyTorch's own format (``pytorch_model.bin``, its shards and
``pytorch_model.bin.index.json``), as many Hugging Face models still ship them: read as
``from_pretrained`` reads them, without the whole file in memory.

The file is ``torch.save``'s zip archive. It is opened with ``torch.load(mmap=True,
weights_only=True)``: PyTorch's restricted unpickler (no code from the file runs: a pickle that
names anything but tensors and containers is refused) over a memory map of the file, so a tensor's
bytes are read when it is copied into the engine's buffer, one tensor at a time (clean pages of the
kernel's page cache, as any file read, let go of once copied: the mapping holds at most a
tensor's pages). The archive is checked first: the zip directory must be
whole, and every member stored uncompressed inside the file, so no read lands past its end.
"""

from __future__ import annotations

import ctypes
import pickle
import re
import sys
import zipfile
from pathlib import Path

import torch

from offload_core.errors import CheckpointError

__all__ = ["BIN_INDEX_NAME", "BIN_SINGLE_NAME", "copy_out", "is_torch_archive", "read_torch_entries"]

BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_SINGLE_NAME = "pytorch_model.bin"
_HOW = "download it again, or load the model with from_pretrained and write it with save_pretrained (safetensors)"


def is_torch_archive(path: Path) -> bool:
    """Whether ``path`` starts as a zip archive (``torch.save``'s format since PyTorch 1.6)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _check_archive(path: Path) -> bool:
    """The zip directory whole, every member stored uncompressed within the file; whether its
    bytes are in this machine's order (else ``torch.load`` swaps them in the mapped pages, which
    must then be kept: :func:`copy_out`)."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
            for m in members:
                if m.compress_type != zipfile.ZIP_STORED or m.header_offset + m.compress_size > size:
                    raise CheckpointError(f"{path}: its member {m.filename!r} is compressed or lies past the file's "
                                          f"end ({size} bytes): not a file torch.save wrote, or a damaged one; {_HOW}")
            order = [z.read(m).decode(errors="replace") for m in members
                     if m.filename.endswith("/byteorder") and m.file_size <= 8]
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint ({type(e).__name__}: {e}); "
                              f"{_HOW}") from None
    return not order or order[0] == sys.byteorder


def read_torch_entries(path: Path) -> dict[str, tuple[Path, dict, None]]:
    """``{name: (path, info, None)}`` of the tensors of a ``torch.save`` file of a state dict:
    ``info`` holds ``shape``, ``dtype`` (safetensors' code), ``torch_dtype`` (None for a dtype not
    read, as FP8: refused where the model needs it), ``tensor`` (its values, memory-mapped) and
    ``native``. A file that is not such a dict of dense tensors is a :class:`CheckpointError`
    naming it."""
    from tiered_offload.checkpoint.safetensors_io import CODES
    if not is_torch_archive(path):
        raise CheckpointError(f"{path} is not a PyTorch checkpoint of the zip format (a file torch.save wrote before "
                              f"PyTorch 1.6, or another format) and cannot be memory-mapped; {_HOW}")
    native = _check_archive(path)
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, KeyError, EOFError, OSError,
            AttributeError, IndexError) as e:
        # (not PyTorch's message whole: it says to turn the restricted unpickler off, which runs the file's code)
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = (f"it names {named[1]}, which only code could rebuild" if named else
               f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}")
        raise CheckpointError(f"{path} cannot be read as a state dict of tensors ({why}); only tensors and plain "
                              f"containers are read from it, no code from the file runs; {_HOW}") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a state dict (names to tensors); {_HOW}")
    entries = {}
    for name, t in loaded.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor; a state dict of the "
                                  f"model's tensors is expected (a training checkpoint holds more: save the model's "
                                  f"state_dict alone)")
        if t.layout != torch.strided or t.is_quantized:
            raise CheckpointError(f"{path}: tensor {name!r} is a {t.dtype} {str(t.layout).removeprefix('torch.')} "
                                  f"tensor; only dense tensors are read")
        known = t.dtype in CODES  # (another, FP8: refused where the model needs it, PretrainedReader.check_covers)
        entries[name] = (path, {"shape": list(t.shape), "dtype": CODES[t.dtype] if known else str(t.dtype),
                                "torch_dtype": t.dtype if known else None, "tensor": t, "native": native}, None)
    return entries


_MADV_DONTNEED, _PAGE = 4, 4096
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def copy_out(path: Path, name: str, tensor: torch.Tensor, out: torch.Tensor, native: bool = True) -> None:
    """Copy ``tensor`` (memory-mapped from ``path``) into ``out``, converting its dtype, then let
    go of the pages the copy mapped (on Linux: they are the file's, read again if needed again), so
    that reading a large file does not hold it all in the process's memory. Not where the file's
    bytes were swapped into this machine's order (``native`` False): the pages hold the swap."""
    try:
        out.copy_(tensor)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({e})") from None
    storage = tensor.untyped_storage()
    if _libc is not None and native and storage.nbytes():
        lo = storage.data_ptr() // _PAGE * _PAGE
        hi = -(-(storage.data_ptr() + storage.nbytes()) // _PAGE) * _PAGE
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)  # (advice: a failure is harmless)
