"""Streaming safetensors: load pretrained weights into the engine, export trained ones.

The format is small enough to handle directly (8-byte little-endian header length, a JSON
header of ``name -> dtype, shape, data_offsets``, then the bytes), which lets both directions
stream: a tensor is read straight into its place in the engine's weight buffer (through a
bounded conversion buffer when the file holds another dtype), and an export writes one tensor
at a time. Nothing is unpickled. Hugging Face's sharded layout (``model-0000i-of-0000n.safetensors``
plus ``model.safetensors.index.json``) is read and written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import struct
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from offload_core.errors import (CheckpointError, ConfigError, CorruptionError, DiskFullError, StorageDirectoryError,
                                 StorageLockedError)
from tiered_offload.checkpoint.durable import fsync_directory
from tiered_offload.checkpoint.lock import create_fresh
from tiered_offload.checkpoint import quantized
from tiered_offload.checkpoint.schema import check_index, parse_json
from tiered_offload.checkpoint.torch_bin import (BIN_INDEX_NAME, BIN_SINGLE_NAME, copy_out, is_torch_archive,
                                                read_torch_entries)
from offload_core.sizes import parse_size

log = logging.getLogger(__name__)

__all__ = ["PretrainedReader", "SafetensorsWriter", "pick_weights", "plan_shards", "INDEX_NAME", "TOKENIZER_FILES",
           "copy_tokenizer"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 << 20
_BUFFER = 16 << 20

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}


def read_header(path: Path) -> tuple[dict, int]:
    """``(tensors, data_start)`` of a safetensors file, every entry checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    header = parse_json(raw, path, " (its safetensors header)")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    for name, info in header.items():
        try:
            code = info["dtype"]
            if not isinstance(code, str):
                raise TypeError
            dtype = DTYPES.get(code)  # (None: a dtype not read, a quantized one: refused if the model needs it)
            shape = [int(s) for s in info["shape"]]
            a, b = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        numel = int(np.prod(shape)) if shape else 1
        wrong_size = dtype is not None and (b - a) != numel * torch.empty((), dtype=dtype).element_size()
        if not 0 <= a <= b or start + b > size or wrong_size:
            raise CheckpointError(f"{path}: tensor {name!r} ({code}, shape {shape}) claims bytes {a}..{b}, "
                                  f"which do not match its size or lie outside the file ({size} bytes)")
        info["torch_dtype"] = dtype
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items())
    for (a0, b0, first), (a1, b1, second) in zip(spans, spans[1:]):
        if a1 < b0 and b1 > a1 and b0 > a0:  # both non-empty, and the second starts inside the first
            raise CheckpointError(f"{path}: tensors {first!r} (bytes {a0}..{b0}) and {second!r} (bytes {a1}..{b1}) "
                                  f"overlap; the file is damaged or was not written by a safetensors writer")
    return header, start


def _quantization(directory: Path) -> str | None:
    """The ``quant_method`` of ``directory``'s ``config.json`` where it is one this reader
    dequantizes as ``from_pretrained`` does (:mod:`~tiered_offload.checkpoint.quantized`); None where the
    weights are not quantized. Another (its weights quantized or dequantized with their scales and
    kernels as they load: not fp32 weights tensor by tensor) is refused, naming the method."""
    if not (directory / "config.json").is_file():  # (none; or a FIFO, whose read would wait for a writer)
        return None
    try:
        with open(directory / "config.json", "rb") as f:
            config = parse_json(f.read(16 << 20), directory / "config.json")
    except OSError:  # (not readable or not JSON, CorruptionError: the weights say the rest)
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is None:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    if method in quantized.READABLE:
        return method
    raise CheckpointError(f"{directory / 'config.json'} says its weights are quantized (quantization_config: "
                          f"{method}): from_pretrained would load them with their scales, not as fp32 tensors; "
                          f"start from the model's weights in bf16, fp16 or fp32 (its unquantized repository; "
                          f"where this directory's weights are such, a config.json without quantization_config)")


class PretrainedReader:
    """Reads named tensors from a safetensors file or a directory of shards, one at a time.

    Args:
        path: a ``.safetensors`` file, or a directory holding ``model.safetensors`` or an index
            (``*.safetensors.index.json``) with its shards; without those, PyTorch's format as
            ``from_pretrained`` reads it (``pytorch_model.bin``, or its index and shards; a file
            ``torch.save`` wrote given by name too: :mod:`~tiered_offload.checkpoint.torch_bin`).
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path).expanduser()
        files, torch_format = None, False
        method = None
        if path.is_dir():
            method = _quantization(path)
            picked = pick_weights(path)
            if picked is None:
                others = sorted(p for p in path.glob("*.safetensors.index.json") if p.name != INDEX_NAME)
                others_named = f" (and {len(others)} other indexes: {', '.join(p.name for p in others[:3])})"
                raise CheckpointError(f"{path} holds none of {SINGLE_NAME}, {INDEX_NAME}, {BIN_SINGLE_NAME} or "
                                      f"{BIN_INDEX_NAME}" + (others_named if others else ""))
            index, torch_format = picked
            if index.name.endswith(".index.json"):
                try:
                    data = index.read_bytes()
                except OSError as e:
                    raise CheckpointError(f"{index} cannot be read: {e}") from None
                weight_map = check_index(parse_json(data, index), index)["weight_map"]
                files = {}
                for name, shard in weight_map.items():
                    if Path(shard).name != shard or shard.startswith("."):
                        raise CheckpointError(f"{index}: shard name {shard!r} for {name!r} is not a plain file "
                                              f"name in that directory; refusing to read outside it")
                    files[name] = path / shard
            else:
                path = index
        elif path.is_file():
            torch_format = is_torch_archive(path)
        else:
            raise CheckpointError(f"pretrained weights {path} do not exist")
        self.entries: dict[str, tuple[Path, dict, int | None]] = {}
        """Per tensor name: its file, its header entry (a PyTorch file's: its memory-mapped
        ``tensor`` too) and where the file's data starts (None for a PyTorch file)."""
        self.merged: dict[str, list[list[str]]] = {}
        """Tensors of the model made of several of the file's (:meth:`merge`)."""
        shards = sorted(set(files.values())) if files else [path]
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard} {'is not a regular file' if shard.exists() else 'does not exist'}, and "
                                      f"the index names it for {next(n for n, s in files.items() if s == shard)!r}")
        headers = {shard: read_torch_entries(shard) if torch_format else read_header(shard) for shard in shards}
        if files:
            for name, shard in files.items():
                entries = _entries(headers[shard], shard, torch_format)
                if name not in entries:
                    raise CheckpointError(f"the index maps {name!r} to {shard}, whose header does not list it")
                self.entries[name] = entries[name]
        else:
            self.entries = _entries(headers[path], path, torch_format)
        self.source = path
        if method is not None and not torch_format:  # (each quantized weight and its scales read as the weight)
            self.entries = quantized.unpacked(self.entries, path, method)

    def names(self) -> list[str]:
        return list(self.entries)

    def alias(self, aliases: dict[str, str]) -> None:
        """Let each tensor ``aliases[new]`` be read as ``new`` too (a name the model has where the
        file has an older one), unless the file has a tensor of that name itself."""
        for new, old in aliases.items():
            if new not in self.entries and old in self.entries:
                self.entries[new] = self.entries[old]

    def merge(self, merged: dict[str, list[list[str]]]) -> None:
        """Let each ``merged[new]`` be read as tensor ``new``: per group of the file's tensors (one
        per expert), those stacked along a new first dimension, and the groups' stacks concatenated
        along the second (read in place, block by block, into the model's tensor)."""
        self.merged = {new: groups for new, groups in merged.items()
                       if new not in self.entries and all(n in self.entries for g in groups for n in g)}

    def holds(self, name: str) -> bool:
        """Whether the file gives tensor ``name`` (under its own name, an alias, or stacked)."""
        return name in self.entries or name in self.merged

    def _merged_shape(self, groups: list[list[str]]) -> list[int] | None:
        shapes = [[list(self.entries[n][1]["shape"]) for n in g] for g in groups]
        if any(s != g[0] for g in shapes for s in g) or any(g[0][1:] != shapes[0][0][1:] for g in shapes):
            return None  # the experts' tensors differ in shape: not a stack
        return [len(groups[0]), sum(g[0][0] for g in shapes), *shapes[0][0][1:]]

    def check_covers(self, wanted: Iterable[tuple[str, tuple[int, ...]]], converted: Iterable[str] = ()) -> None:
        """Every ``(name, shape)`` must be present with that shape; report all that are not, and
        the file's tensors that ``converted`` names (transformers merges or splits them when it
        loads them, which this reader does not)."""
        missing, wrong, unread = [], [], []
        wanted = list(wanted)
        for name, shape in wanted:
            e = self.entries.get(name)
            if e is None and name in self.merged:
                got = self._merged_shape(self.merged[name])
                if got != list(shape):
                    wrong.append(f"{name}: the file's experts stacked {got} vs model {list(shape)}" if got else
                                 f"{name}: the file's experts for it differ in shape ({self.merged[name][0][0]}...)")
            elif e is None:
                missing.append(name)
            elif e[1]["torch_dtype"] is None or not e[1]["torch_dtype"].is_floating_point:  # (int8: bitsandbytes')
                unread.append(f"{name}: stored as {e[1]['dtype']}")
            elif list(e[1]["shape"]) != list(shape):
                wrong.append(f"{name}: file {e[1]['shape']} vs model {list(shape)}")
        for g in self.merged.values():
            unread += [f"{n}: stored as {self.entries[n][1]['dtype']}" for s in g for n in s
                       if not getattr(self.entries[n][1]["torch_dtype"], "is_floating_point", False)]
        if unread:
            raise CheckpointError(
                f"{self.source} holds {len(unread)} of the model's tensors in a dtype init_from does not read "
                f"({'; '.join(unread[:3])}{'...' if len(unread) > 3 else ''}): a quantized checkpoint (FP8 or 4-bit "
                f"weights with their scales, as its config's quantization_config says) cannot be cast to fp32 "
                f"tensor by tensor; start from the model's weights in bf16, fp16 or fp32 (its unquantized "
                f"repository)")
        if missing or wrong:
            raise CheckpointError(
                f"{self.source} does not fit this model: " + "; ".join(
                    ([f"{len(missing)} parameter(s) missing ({', '.join(missing[:5])}{'...' if len(missing) > 5 else ''})"]
                     if missing else []) + ([f"shape mismatch ({'; '.join(wrong[:5])})"] if wrong else []))
                + (_conversion_hint(sorted(converted)) if missing and converted else
                   ". Check that the checkpoint was saved from the same architecture and configuration"))
        extra = set(self.entries) - {n for n, _ in wanted} - {n for g in self.merged.values() for s in g for n in s}
        if extra:
            log.info("%s: %d tensor(s) not used by the model (e.g. %s)", self.source, len(extra), sorted(extra)[:3])

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read tensor ``name`` into ``out`` (a contiguous CPU tensor of its shape), converting the dtype."""
        if name not in self.entries and name in self.merged:
            offset = 0
            for group in self.merged[name]:
                rows = self.entries[group[0]][1]["shape"][0]
                for expert, part in enumerate(group):
                    self.read_into(part, out[expert, offset:offset + rows])
                offset += rows
            return
        self._read_entry(name, self.entries[name], out)

    def _read_entry(self, name: str, entry: tuple, out: torch.Tensor) -> None:
        path, info, start = entry
        if "mxfp4" in info or "fp8" in info:
            quantized.read_into(self._read_entry, info, out)
            return
        if info["torch_dtype"] is None or (out.is_floating_point() and not info["torch_dtype"].is_floating_point):
            # (check_covers refuses it for a model; this, for any other caller)
            raise CheckpointError(f"{path}: tensor {name!r} is stored as {info['dtype']}, a dtype init_from does not "
                                  f"read (a quantized checkpoint's); start from weights in bf16, fp16 or fp32")
        if "tensor" in info:  # a PyTorch file's: its pages read as it is copied
            copy_out(path, name, info["tensor"], out, info["native"])
            return
        a, b = info["data_offsets"]
        dtype = info["torch_dtype"]
        flat = out.reshape(-1)
        with open(path, "rb", buffering=0) as f:
            f.seek(start + a)
            if dtype == out.dtype and out.is_contiguous():
                _read_exact(f, memoryview(flat.view(torch.uint8).numpy()), path, name)
                return
            size = torch.empty((), dtype=dtype).element_size()
            per = max(1, _BUFFER // size)
            buf = torch.empty(per * size, dtype=torch.uint8)
            for lo in range(0, flat.numel(), per):
                hi = min(flat.numel(), lo + per)
                chunk = buf[:(hi - lo) * size]
                _read_exact(f, memoryview(chunk.numpy()), path, name)
                flat[lo:hi].copy_(chunk.view(dtype))

    def close(self) -> None:
        self.entries, self.merged = {}, {}  # (a PyTorch file's memory maps go with its tensors)


def pick_weights(directory: Path) -> tuple[Path, bool] | None:
    """``(file, whether PyTorch's format)`` of the weights in ``directory``: the file
    ``from_pretrained`` picks, in its order (``model.safetensors``, its index,
    ``pytorch_model.bin``, its index), else another ``*.safetensors.index.json`` where it is the
    only one; None: no weights."""
    for name, torch_format in ((SINGLE_NAME, False), (INDEX_NAME, False), (BIN_SINGLE_NAME, True),
                               (BIN_INDEX_NAME, True)):
        if (directory / name).is_file():
            return directory / name, torch_format
    others = [p for p in directory.glob("*.safetensors.index.json") if p.name != INDEX_NAME]
    return (others[0], False) if len(others) == 1 else None


def _entries(header, path: Path, torch_format: bool) -> dict:
    """A file's tensors as :attr:`PretrainedReader.entries` holds them."""
    if torch_format:
        return header
    header, start = header
    return {name: (path, info, start) for name, info in header.items()}


def _conversion_hint(converted: list[str]) -> str:
    return (f". {len(converted)} of its tensors ({', '.join(converted[:3])}{'...' if len(converted) > 3 else ''}) are "
            f"in a layout transformers converts when from_pretrained loads them (several merged into one, or one "
            f"split), which init_from does not do. Load the model with from_pretrained and write its "
            f"named_parameters() with safetensors.torch.save_file(..., 'DIR/model.safetensors'), then pass init_from=DIR")


def _read_exact(f, mv: memoryview, path: Path, name: str) -> None:
    while len(mv):
        n = f.readinto(mv)
        if not n:
            raise CheckpointError(f"{path} ends in the middle of tensor {name!r}")
        mv = mv[n:]


# ---- writing --------------------------------------------------------------------------
def plan_shards(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size) -> list[list[int]]:
    """Group tensor indices into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own)."""
    limit = parse_size(max_shard_size, what="max_shard_size")
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_n, dtype, shape) in enumerate(tensors):
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size() if shape else 4
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += nbytes
    return shards


_EXPORTING: dict[Path, list] = {}
"""The export directories this process holds (:func:`exporting`): ``[fd, depth]``, under ``_HOLD``."""
_HOLD = threading.Lock()


@contextlib.contextmanager
def exporting(out: Path):
    """Hold the export directory ``out`` (made, owner-only, where missing) for an export's writes:
    an ``flock`` on the directory, so that a second export into it, from another process, is
    refused instead of renaming this one's half-written files into place (or mixing two states'
    shards under one index). Held again inside (the weights, then ``config.json``...) it nests. A
    file system without ``flock`` on directories goes without. Held, it removes the shards'
    temporaries a killed export left. A directory it made is removed again where the export
    failed before writing anything there (a refused export leaves none)."""
    out = Path(out)
    made = not os.path.lexists(out)
    try:
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
    except (FileExistsError, NotADirectoryError) as e:
        what = "it is a file" if isinstance(e, FileExistsError) else "a path above it is a file"
        raise StorageDirectoryError(e.errno, f"cannot export into {out}: {what}, not a directory; name a "
                                             f"directory (new or existing)") from None
    except OSError as e:
        raise StorageDirectoryError(e.errno, f"cannot export into {out}: {e.strerror}; name a directory "
                                             f"you can write") from None
    key = out.resolve()
    with _HOLD:
        held = _EXPORTING.get(key)
        if held is None:
            fd = None
            try:
                fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StorageLockedError(f"{out} is being written by another export (another process); wait for it "
                                         f"to finish, or export elsewhere") from None
            except OSError:  # (a directory this user cannot open to read, no flock there: it goes without)
                pass
            else:  # (no other export writes here: a shard's temporary is a killed one's, up to a shard's size)
                for stale in out.glob(".*.safetensors.partial"):
                    stale.unlink(missing_ok=True)
            held = _EXPORTING[key] = [fd, 0]
        held[1] += 1
    try:
        yield
    except BaseException:
        if made and held[1] == 1:
            with contextlib.suppress(OSError):
                out.rmdir()  # (only where empty)
        raise
    finally:
        with _HOLD:
            held[1] -= 1
            if not held[1]:
                del _EXPORTING[key]
                if held[0] is not None:
                    os.close(held[0])  # (releases the flock)


class SafetensorsWriter:
    """Writes named tensors into sharded safetensors files, streaming: headers first, then each
    tensor's bytes as the caller produces them, in the order declared.

    ``tensors`` is ``[(name, dtype, shape), ...]``; ``fill(i, write)`` must call ``write(bytes-like)``
    with tensor ``i``'s bytes (possibly in several pieces).
    """

    def __init__(self, out_dir: str | os.PathLike, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_size="2GB", metadata: dict | None = None, single_name: str = SINGLE_NAME):
        self.out = Path(out_dir)
        self.tensors = tensors
        self.shards = plan_shards(tensors, max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.single_name = single_name
        """The file's name where one shard holds every tensor (a PEFT adapter's: ``adapter_model.safetensors``)."""

    def file_name(self, k: int) -> str:
        n = len(self.shards)
        return self.single_name if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"

    def nbytes(self) -> int:
        """Bytes the export writes (tensor data; the headers add a few KiB)."""
        return sum((int(np.prod(shape)) if shape else 1) * torch.empty((), dtype=dtype).element_size()
                   for _, dtype, shape in self.tensors)

    def write(self, fill: Callable[[int, Callable[[bytes], None]], None]) -> list[Path]:
        """Write every shard under a temporary name, then publish them: an export over an older
        one is complete and of one step, or recognisably incomplete (no index, so nothing loads it).

        Publishing removes the old index (and a single-file export's file) first, renames the new
        shards into place, writes the new index last (atomically, naming the step), then removes
        shards of the old export the new index does not name."""
        with exporting(self.out):
            return self._write(fill)

    def _write(self, fill: Callable[[int, Callable[[bytes], None]], None]) -> list[Path]:
        need, free = self.nbytes(), shutil.disk_usage(self.out).free
        if need > free:
            raise DiskFullError(f"the export needs {need} bytes in {self.out} and {free} are free; free space or "
                                f"export elsewhere", path=str(self.out), needed_bytes=need, free_bytes=free)
        written: list[Path] = []
        weight_map, total = {}, 0
        try:
            for k, members in enumerate(self.shards):
                header, offset = {"__metadata__": self.metadata}, 0
                for i in members:
                    name, dtype, shape = self.tensors[i]
                    nbytes = (int(np.prod(shape)) if shape else 1) * torch.empty((), dtype=dtype).element_size()
                    header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                    offset += nbytes
                    weight_map[name] = self.file_name(k)
                total += offset
                raw = json.dumps(header, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                path = self.out / self.file_name(k)
                tmp = path.with_name(f".{path.name}.partial")
                with open(create_fresh(tmp), "wb") as f:
                    written.append(tmp)
                    try:
                        f.write(struct.pack("<Q", len(raw)))
                        f.write(raw)
                        for i in members:
                            start = f.tell()
                            fill(i, f.write)
                            expect = int(header[self.tensors[i][0]]["data_offsets"][1] - header[self.tensors[i][0]]["data_offsets"][0])
                            if f.tell() - start != expect:
                                raise CorruptionError(f"export: tensor {self.tensors[i][0]!r} produced {f.tell() - start} "
                                                      f"bytes, expected {expect}")
                        f.flush()
                        os.fsync(f.fileno())
                    except OSError as e:
                        if e.errno == errno.ENOSPC:
                            free = shutil.disk_usage(self.out).free
                            raise DiskFullError(f"disk full writing {tmp}; the export was not written (an earlier "
                                                f"export there is unchanged). Free space or export elsewhere",
                                                path=str(tmp), needed_bytes=need, free_bytes=free) from e
                        raise
            return self._publish(written, weight_map, total)
        except BaseException:
            for tmp in written:
                tmp.unlink(missing_ok=True)
            raise

    def _publish(self, written: list[Path], weight_map: dict, total: int) -> list[Path]:
        if self.single_name != SINGLE_NAME:  # a file beside the model's (an adapter): only itself replaced
            final = self.out / self.single_name
            os.replace(written[0], final)
            fsync_directory(self.out)
            return [final]
        index = self.out / INDEX_NAME
        index.unlink(missing_ok=True)  # from here until the new index lands, nothing loads a mixed export
        if len(self.shards) > 1:
            (self.out / SINGLE_NAME).unlink(missing_ok=True)
        fsync_directory(self.out)
        finals = []
        for k, tmp in enumerate(written):
            final = self.out / self.file_name(k)
            os.replace(tmp, final)
            finals.append(final)
        if len(self.shards) > 1:
            meta = {"total_size": total, **{k: v for k, v in self.metadata.items() if k != "format"}}
            write_private(index, json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2), sync=True)
            finals.append(index)
        fsync_directory(self.out)
        names = {f.name for f in finals}
        for stale in self.out.glob("model-*-of-*.safetensors"):  # an older export's other shards
            if stale.name not in names:
                stale.unlink(missing_ok=True)
        return finals


EXPORT_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                 "fp32": torch.float32, "float32": torch.float32}


def export_dtype(dtype) -> torch.dtype:
    """The dtype an export writes its weights in: ``torch.bfloat16`` / ``float16`` / ``float32`` or
    their names (``"bf16"``, ``"bfloat16"``...); anything else is a :class:`ConfigError`."""
    found = EXPORT_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if found not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"dtype {dtype}: an export's weights are bfloat16, float16 or float32 (the state trains in "
                          f"float32; torch.bfloat16 halves the files)")
    return found


def config_json(model) -> dict | None:
    """``model``'s Hugging Face config as ``save_pretrained`` writes it to ``config.json`` (its class
    in ``architectures``, which ``save_pretrained`` sets, and by which an export without the model
    rebuilds it); None for a model without one."""
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        config = json.loads(to_json())
    except (TypeError, ValueError):
        return None
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if isinstance(config, dict) and pretrained is not None and isinstance(model, pretrained):
        config["architectures"] = [type(model).__name__]
    return config


def exported_config(config: dict, dtype: torch.dtype = torch.float32) -> dict:
    """A model's Hugging Face ``config.json`` as an export writes it: its dtype is the export's
    (fp32 unless asked: a bf16 source's ``"torch_dtype": "bfloat16"`` would make
    ``from_pretrained`` load fp32 weights as bf16 without a word)."""
    out = dict(config)
    out.pop("quantization_config", None)  # (an export's weights are plain, as the model held them)
    name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in out or (key == "dtype" and dtype != torch.float32):
            out[key] = name
    return out


def cast_bytes(write: Callable, dtype: torch.dtype) -> Callable:
    """``write`` taking float32 bytes, written as ``dtype`` (each value cast as PyTorch casts it)."""
    if dtype == torch.float32:
        return write

    def cast(b) -> None:
        write(tensor_bytes(byte_tensor(b).view(torch.float32).to(dtype)))
    return cast


def byte_tensor(b) -> torch.Tensor:
    """The bytes ``b`` (a writable buffer: without a copy) as a uint8 tensor."""
    return torch.frombuffer(b if isinstance(b, memoryview) and not b.readonly else bytearray(b), dtype=torch.uint8)


def write_private(path: Path, data: str | bytes, *, sync: bool = False) -> None:
    """Write a file readable by its owner only (like everything else tiered-offload creates), whole:
    a temporary file beside it swapped in, which replaces whatever is at ``path`` (a FIFO there made
    the write wait for a reader forever; a link's target was overwritten) and never a half-written one."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(create_fresh(tmp), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
"""Copied from a model directory beside an export, so the export is a complete model directory."""


def tokenizer_files(model_dir: Path) -> list[Path]:
    """The tokenizer's files (:data:`TOKENIZER_FILES`) ``model_dir`` holds, as plain files."""
    return [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]


def copy_tokenizer(model_dir: Path, out: Path) -> list[Path]:
    """Copy ``model_dir``'s tokenizer files into ``out`` (each written whole: :func:`write_private`);
    returns the files written. An ``OSError`` names the file it failed on (``filename``)."""
    written = []
    for source in tokenizer_files(model_dir):
        data = source.read_bytes()
        try:
            write_private(out / source.name, data)
        except OSError as e:
            e.filename = str(out / source.name)
            raise
        written.append(out / source.name)
    return written


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def iter_chunks(t: torch.Tensor, chunk: int = _BUFFER) -> Iterator[memoryview]:
    mv = tensor_bytes(t)
    for a in range(0, len(mv), chunk):
        yield mv[a:a + chunk]
