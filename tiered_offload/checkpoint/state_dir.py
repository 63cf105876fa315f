"""Offline access to a storage directory's committed state: inspect, verify, export.

Works without the model: the manifest records every tensor's extent, checksum and layout, and
every parameter's name, unit and offset. A reader holds the directory's lock shared while it
reads the state's files (a live engine rewrites and deletes them as it trains: one is refused,
named), and reads the state it opened or none (an engine that committed since is named);
``inspect`` alone reads beside a live engine (the manifest is replaced atomically: one committed
step). Reading never unpickles anything, and reaches files only through the storage backend's
key-to-file-name mapping, so no name in a manifest can point outside the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import torch

from offload_core.errors import (
    CheckpointError,
    ConfigError,
    CorruptionError,
    ExtentNotFoundError,
    InvalidKeyError,
    ShortReadError,
    StorageDirectoryError,
    StorageLockedError,
)
from storage_backends.base import key_to_filename, validate_key
from storage_backends.posix import PosixBackend
from tiered_offload.checkpoint.durable import (
    STATE_DIR,
    StateFiles,
    _dumps,
    manifest_checksum,
    read_committed,
)
from tiered_offload.checkpoint.buffer_file import load as load_buffers
from tiered_offload.checkpoint.lock import LOCK, open_own, read_holder
from tiered_offload.checkpoint.safetensors_io import (SafetensorsWriter, byte_tensor, cast_bytes, export_dtype,
                                                      exported_config, exporting, iter_chunks, write_private)
from tiered_offload.checkpoint.stripes import check_stripes, stripe_of_a_state
from tiered_offload.progress import counter
from tiered_offload.store.checksum import describe, hasher_for

__all__ = ["StateDirectory", "ShardedStateDirectory", "open_state", "rank_directories", "export_params"]

_CHUNK = 16 << 20


class StateDirectory:
    """A storage directory opened read-only."""

    def __init__(self, path: str | os.PathLike, stripes: list | None = None, live: bool = False):
        """``stripes``: the other directories of a state striped over several (the manifest lists
        them, but a manifest never decides which directories are read: the caller names them).
        ``live``: open it beside a live engine too (to inspect it; its verify and export are refused)."""
        self.path = Path(path).expanduser().absolute()
        self.files = StateFiles(self.path / STATE_DIR)
        self._opened = None
        with contextlib.nullcontext() if live or not self.path.is_dir() else self._reading("read"):
            state = read_committed(self.files) if self.path.is_dir() else None
            self._opened = self._stamp()
        if state is None:
            raise CheckpointError((self.path.is_dir() and stripe_of_a_state(self.path))
                                  or f"{self.path} holds no training state (no {self.files.manifest_path}); give the "
                                     f"storage directory an engine trained in")
        manifest = self.manifest = state.manifest
        # a step in flight: its intent and the units already rewritten are part of the state
        self.intent, self.recorded = state.intent, state.recorded
        self.previous = state.previous
        """Sharded snapshot commits: the manifest of the commit before, kept until the ranks' next start."""
        current = state.tensors()
        self.tensors = {k: dict(v) for k, v in manifest["tensors"].items()}
        self.checksum = manifest_checksum(manifest)
        """The directory's checksum algorithm (its manifest names it)."""
        for k, ref in current.items():  # (a 0-byte tensor has no file, as an all-zero one: its extent is None)
            ref = ref if int(self.tensors[k]["nbytes"]) else None
            self.tensors[k].update(extent=ref and ref[0], crc=ref and ref[1])
        for k, ref in state.grads().items():
            unit = k.split("/", 1)[0]
            info = next(u for u in manifest["units"] if u["name"] == unit)
            n = info.get("grad_numel", info["numel"]) * 4
            ref = ref if n else None
            self.tensors[k] = {"extent": ref and ref[0], "crc": ref and ref[1], "nbytes": n, "dtype": "float32",
                               "shape": [n // 4], "offset": 0}
        storage = manifest.get("storage") or {}
        listed = storage.get("directories") or [str(self.path)]
        others = [Path(d).expanduser().absolute() for d in stripes or []]
        if len(others) != len(listed) - 1:
            raise CheckpointError(
                f"{self.files.manifest_path} says the state is striped over {len(listed)} directories ({', '.join(listed)}); "
                f"{len(others) + 1} given. Name the others (`--stripe DIR` for each, in that order) to read it")
        dirs = [self.path, *others]  # the first may have been moved since; the others are the caller's
        check_stripes(dirs, manifest)
        layout = {"stripe_bytes": storage["stripe_bytes"]} if storage.get("stripe_bytes") else {}
        self.backend = PosixBackend(dirs, direct=False, create=False, writable=False, **layout,
                                    stripe_weights=storage.get("stripe_weights"))
        self.backend.open()

    def close(self) -> None:
        self.backend.close()

    def _stamp(self) -> tuple:
        """What an engine's commit changes: the manifest (replaced) and the journal (appended)."""
        out = []
        for p in (self.files.manifest_path, self.files.journal_path):
            try:
                st = p.stat()
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except (FileNotFoundError, NotADirectoryError):  # (none: a path that is no directory holds none)
                out.append(None)
        return tuple(out)

    @contextlib.contextmanager
    def _reading(self, what: str):  # what: "read", "verified", "exported"
        """The directory's lock held shared while this reader reads the state's files, with this
        process named in it (an engine started meanwhile says who holds it). Refused while an engine
        holds it, or if one committed since this reader opened the state. A lock that cannot be
        opened (read-only media, where no engine writes either) is not taken."""
        path = self.path / STATE_DIR / LOCK
        try:
            fd = open_own(path, os.O_RDWR | os.O_CREAT, StorageDirectoryError)
        except StorageDirectoryError:
            raise
        except OSError:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_holder(fd)
                who = (f"process {holder.get('pid')} on {holder.get('host')} ({holder.get('command')})" if holder
                       else "another process")
                raise StorageLockedError(
                    f"{self.path} is in use by {who}: an engine rewrites and deletes the state's files as it trains, "
                    f"so it cannot be {what} beside it. Stop it (Ctrl-C commits its step and exits) and run this "
                    f"again, or export from the training script: engine.export_safetensors(DIR)") from None
            if self._opened is not None and self._stamp() != self._opened:
                raise CheckpointError(f"{self.path} changed since it was opened here (an engine committed in it "
                                      f"since), so it cannot be {what} as opened: open it again")
            previous = os.pread(fd, 4096, 0)
            me = _dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:200]})
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)
            try:
                yield
            finally:
                if os.pread(fd, 4096, 0) == me.encode():  # (another reader's record stays)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, previous, 0)
        finally:
            os.close(fd)  # releases the lock

    def __enter__(self) -> "StateDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading -------------------------------------------------------------------------
    def extent_of(self, key: str) -> tuple[str | None, int | None, int]:
        info = self.tensors[key]
        extent = info["extent"]
        if extent is not None:
            try:
                validate_key(extent)
            except InvalidKeyError as e:
                raise CorruptionError(f"{self.files.manifest_path}: tensor {key!r} names an invalid extent: {e}") from None
        return extent, info["crc"], int(info["nbytes"])

    def read_range(self, extent: str, offset: int, out: torch.Tensor) -> None:
        """Read ``out.nbytes`` bytes of ``extent`` at byte ``offset`` into the uint8 tensor ``out``."""
        self.backend.read_into(extent, out, offset).get()

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The model's persistent buffers the committed state holds, checked against their checksum."""
        return list(load_buffers(self.manifest["meta"], self.backend, self.checksum,
                                 str(self.files.manifest_path)).items())

    def verify(self, progress=None) -> dict:
        """Check every tensor of the committed state against its checksum. Returns a report."""
        with self._reading("verified"):
            return self._verify(progress)

    def _verify(self, progress=None) -> dict:
        bad, checked, nbytes = [], 0, 0
        metas = [m for m in [self.manifest["meta"], (self.intent or {}).get("meta")] if m and m.get("buffer_file")]
        for meta in {m["buffer_file"]["extent"]: m for m in metas}.values():  # each buffer extent once
            try:
                load_buffers(meta, self.backend, self.checksum, str(self.files.manifest_path))
            except (CorruptionError, CheckpointError) as e:
                bad.append({"tensor": "model buffers", "file": self.backend.describe(meta["buffer_file"]["extent"]),
                            "problem": str(e).splitlines()[0]})
            checked += 1
            nbytes += meta["buffer_file"]["nbytes"]
        buf = torch.empty(_CHUNK, dtype=torch.uint8)
        for key in self.tensors:
            extent, expected, size = self.extent_of(key)
            if extent is None:
                continue
            where = self.backend.describe(extent)
            try:
                actual_size = self.backend.size(extent)
                if actual_size < size:
                    raise ShortReadError(f"holds {actual_size} bytes, {size} expected")
                hasher = hasher_for(expected, self.checksum)
                for a in range(0, size, _CHUNK):
                    piece = buf[:min(_CHUNK, size - a)]
                    self.read_range(extent, a, piece)
                    hasher.update(piece)
                value = hasher.recorded(self.checksum)
                if expected is not None and value != expected:
                    raise CorruptionError(f"{describe(value, self.checksum)}, expected {describe(expected, self.checksum)}")
            except (CorruptionError, ShortReadError, ExtentNotFoundError, OSError) as e:
                bad.append({"tensor": key, "file": where, "problem": str(e).splitlines()[0]})
            checked += 1
            nbytes += size
            if progress:
                progress(size)
        return {"directory": str(self.path), "step": self.manifest["step"], "tensors_checked": checked,
                "bytes_checked": nbytes, "damaged": bad, "ok": not bad}

    def inspect(self) -> dict:
        """What the directory holds: step, tensors, sizes, files, free space, the step in flight, the owner."""
        m = self.manifest
        tensors = self.tensors
        stored = {k: v for k, v in tensors.items() if v["extent"] is not None}
        referenced = {key_to_filename(v["extent"]) for v in stored.values()}
        kept = {key_to_filename(v["extent"]) for v in (self.previous or {}).get("tensors", {}).values() if v["extent"]}
        per_dir = []
        for d in self.backend.directories:
            files = [f for f in os.listdir(d) if not f.startswith(".")]
            size = sum(os.stat(d / f).st_size for f in files)
            usage = shutil.disk_usage(d)
            per_dir.append({"directory": str(d), "files": len(files), "bytes": size,
                            "unreferenced_files": sorted(f for f in files if f not in referenced | kept)[:20],
                            "previous_commit_bytes": sum(os.stat(d / f).st_size for f in files
                                                         if f in kept and f not in referenced),
                            "free_bytes": usage.free, "total_bytes": usage.total})
        intent = self.intent
        holder = _live_holder(self.path / STATE_DIR / LOCK)
        return {
            "directory": str(self.path),
            "step": m["step"],
            "previous_commit_step": None if self.previous is None else self.previous["step"],
            "step_in_flight": None if intent is None else {
                "step": intent["step"],
                "units_recorded": len(self.recorded),
                "units": len(m["units"])},
            "parameters": len(m["params"]),
            "parameter_count": sum(u["numel"] for u in m["units"]),
            "optimizer": m["optimizer"],
            "tensors": len(tensors),
            "tensors_all_zero": len(tensors) - len(stored),
            "state_bytes": sum(v["nbytes"] for v in tensors.values()),
            "learning_rate": (m["meta"].get("param_groups") or [{}])[0].get("lr"),
            "user_state": m["meta"].get("user_state"),
            "storage": per_dir,
            "stripe_bytes": self.backend.stripe_bytes if len(per_dir) > 1 else None,
            "stripe_weights": self.backend.stripe_weights,
            "lock_holder": holder or None,
            "units": [{"name": u["name"], "numel": u["numel"],
                       "tensors": {k.split("/", 1)[1]: {"bytes": v["nbytes"], "file": v["extent"] and key_to_filename(v["extent"])}
                                   for k, v in tensors.items() if k.split("/", 1)[0] == u["name"]}}
                      for u in m["units"]],
        }

    def export(self, out: str | os.PathLike, max_shard_size="2GB", dtype=torch.float32, *,
               adapter_only: bool = False, merged: bool = False) -> list[Path]:
        """Write the committed weights as Hugging Face sharded safetensors (plus config.json if
        recorded), in ``save_pretrained``'s format and ``dtype``; a PEFT model's adapter beside them
        as the engine's export writes it (``adapter_only``: that alone; ``merged``: the base model
        with the adapter merged, as ``merge_and_unload().save_pretrained`` writes it)."""
        dtype = export_dtype(dtype)
        adapter = _adapter(self.manifest, self.path, adapter_only, merged)
        with self._reading("exported"), exporting(out):
            return self._export(out, max_shard_size, dtype, adapter)

    def _export(self, out: str | os.PathLike, max_shard_size, dtype, adapter: dict) -> list[Path]:
        sharding = self.manifest.get("sharding")
        if sharding:
            raise CheckpointError(
                f"{self.path} holds rank {sharding['rank']} of {sharding['world_size']}'s slices of a sharded run, not "
                f"a model; export the run's root ({self.path.parent}), which gathers every rank's slices")
        if self.intent is not None:
            raise CheckpointError(
                f"{self.path}: step {self.intent['step']} is in flight ({len(self.recorded)} of "
                f"{len(self.manifest['units'])} units rewritten when the engine stopped), so the weights on disk are "
                f"not one step's. Open the directory with the engine (resume=True) to finish the step, then export")
        params = self.manifest["params"]
        for key in dict.fromkeys(p["tensor"] for p in params):  # every file holds what the manifest says
            extent, _, size = self.extent_of(key)
            if extent is not None:
                try:
                    held = self.backend.size(extent)
                except (ExtentNotFoundError, OSError) as e:
                    raise CorruptionError(f"{self.files.manifest_path}: tensor {key!r} is in "
                                          f"{self.backend.describe(extent)}, which cannot be read ({e}); the export was "
                                          f"not written. Run `tiered-offload verify {self.path}`") from None
                if held < size:
                    raise CorruptionError(f"{self.backend.describe(extent)} holds {held} bytes of tensor {key!r}, "
                                          f"{size} expected; the export was not written. Run `tiered-offload verify "
                                          f"{self.path}`")
        buf = torch.empty(_CHUNK, dtype=torch.uint8)
        state = {"crc_unit": None, "crc": 0, "pos": 0}

        def read_one(p: dict, write) -> None:
            extent, expected, size = self.extent_of(p["tensor"])
            if state["crc_unit"] != p["tensor"]:
                state.update(crc_unit=p["tensor"], crc=hasher_for(expected, self.checksum), pos=0)
            start = p["offset"] * 4
            if start != state["pos"]:
                raise CheckpointError(f"{self.files.manifest_path}: parameters of {p['tensor']} are not contiguous")
            n = math.prod(p["shape"]) * 4
            if extent is None:
                zeros = bytes(min(n, _CHUNK))
                for a in range(0, n, _CHUNK):
                    write(zeros[:min(_CHUNK, n - a)])
                state["pos"] += n
                return
            for a in range(0, n, _CHUNK):
                piece = buf[:min(_CHUNK, n - a)]
                self.read_range(extent, start + a, piece)
                state["crc"].update(piece)
                write(piece.numpy().data)
            state["pos"] += n
            if state["pos"] == size and expected is not None and state["crc"].recorded(self.checksum) != expected:
                raise CorruptionError(f"{self.backend.describe(extent)} (tensor {p['tensor']!r}) does not match its "
                                      f"checksum; the export was not written. Run `tiered-offload verify {self.path}`")

        return _export_model(out, params, read_one, max_shard_size, {"step": str(self.manifest["step"])},
                             self.buffers(), self.manifest.get("model_config"), dtype, adapter)


def _adapter(manifest: dict, path: Path, adapter_only: bool, merged: bool) -> dict:
    """What an export of a directory does with its PEFT adapter: ``peft``, its record (None: no
    PEFT model); ``only``, the adapter alone; ``merged``, the model with it merged (both refused
    without one); ``where``, the directory."""
    peft = manifest.get("peft")
    if adapter_only and merged:
        raise ConfigError("--merged writes the model with the adapter merged, --adapter-only the adapter alone; pick one")
    for asked, flag in ((adapter_only, "--adapter-only"), (merged, "--merged")):
        if asked and peft is None:
            raise ConfigError(f"{path} holds no adapter (its model is not a PEFT model, or an older version trained "
                              f"it): `tiered-offload export {path} OUT` without {flag} writes its weights")
    return {"peft": peft, "only": adapter_only, "merged": merged, "where": str(path)}


def _saved_format(config: dict | None, params: list[dict]):
    """:func:`~tiered_offload.checkpoint.export.saved_format` for the model ``config`` (the
    directory's record of its ``config.json``) describes, built on the meta device."""
    if not config or not config.get("architectures"):
        return params, None
    from tiered_offload.checkpoint.export import meta_model, saved_format
    try:
        model = meta_model(config)
    except Exception:  # noqa: BLE001 - no transformers, or a model it does not know: the names as recorded
        return params, None
    return saved_format(model, params)


def _export_model(out, params: list[dict], read, max_shard_size, metadata: dict, buffers, config: dict | None,
                  dtype: torch.dtype, adapter: dict) -> list[Path]:
    """Export a directory's model: ``read(p, write)`` gives parameter ``p``'s float32 bytes; written
    in ``save_pretrained``'s format for the model ``config`` describes (:func:`_saved_format`: where
    it converts, a unit is read whole into memory, then converted: an MoE's block, a few GB for the
    largest ones) and in ``dtype``; then ``config.json``. ``adapter`` (:func:`_adapter`): a PEFT
    model's adapter files are written beside, or alone; or the model is written with the adapter
    merged (each unit read whole, its tuner layers merged by peft: ``adapter.offline_merge``)."""
    peft, merge = adapter["peft"], None
    if peft is not None and not adapter["merged"]:  # the adapter's tensors kept as they are read
        read, captured = _capturing(read, {name for name, _ in peft["keys"]})
    if adapter["only"]:  # every unit read still (each is checked against its checksum as a whole)
        for i in _unit_order(params):
            read(params[i], lambda b: None)
        return _write_adapter(out, peft, captured, dtype)
    if adapter["merged"]:
        from tiered_offload.checkpoint.adapter import offline_merge
        from tiered_offload.checkpoint.export import saved_format
        base, renamed, base_name, merge = offline_merge(peft, params, adapter["where"])
        buffers = [(n, t) for b, t in buffers if (n := base_name(b)) is not None]
        (saved, convert), config = saved_format(base, renamed), peft["base_config"]
    else:
        saved, convert = _saved_format(config, params)
    state = {"unit": None, "converted": {}}
    by_unit: dict[str, list[dict]] = {}
    for q in params if convert is not None or merge is not None else ():
        by_unit.setdefault(q["tensor"], []).append(q)

    def fill(p: dict, write) -> None:
        if not by_unit:
            return read(p, cast_bytes(write, dtype))
        if state["unit"] != p["tensor"]:
            unit = sorted(by_unit[p["tensor"]], key=lambda q: q["offset"])
            flat = torch.empty(sum(math.prod(q["shape"]) for q in unit), dtype=torch.float32)
            raw, at = flat.view(torch.uint8), [0]

            def into(b) -> None:
                raw[at[0]:at[0] + len(b)].copy_(byte_tensor(b))
                at[0] += len(b)
            for q in unit:
                read(q, into)
            tensors = {q["name"]: flat[q["offset"]:q["offset"] + math.prod(q["shape"])].view(q["shape"]) for q in unit}
            if merge is not None:  # under the base model's names, the tuner layers' weights merged
                merged = merge(p["tensor"], tensors)
                tensors = {n: merged.get(n, t) for q, t in tensors.items() if (n := base_name(q)) is not None}
            state.update(unit=p["tensor"], converted=convert(tensors) if convert is not None else tensors)
        for chunk in iter_chunks(state["converted"][p["name"]].to(dtype)):
            write(chunk)
    files = export_params(out, saved, fill, max_shard_size, {**metadata, "source": "tiered-offload"}, buffers, dtype)
    if peft is not None and merge is None:
        files += _write_adapter(out, peft, captured, dtype)
    if config is None:
        return files
    path = Path(out) / "config.json"
    write_private(path, json.dumps(exported_config(config, dtype), indent=2, sort_keys=True))
    return [*files, path]


def _capturing(read, names):
    """``read`` that also keeps the float32 values of the parameters ``names``, and where they go."""
    captured: dict[str, torch.Tensor] = {}

    def reading(p: dict, write) -> None:
        if p["name"] not in names:
            return read(p, write)
        parts = []

        def both(b) -> None:
            parts.append(bytes(b))  # (a buffer the reader reuses)
            write(b)
        read(p, both)
        captured[p["name"]] = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.float32).view(p["shape"])
    return reading, captured


def _write_adapter(out, peft: dict, captured: dict[str, torch.Tensor], dtype: torch.dtype) -> list[Path]:
    from tiered_offload.checkpoint.adapter import write_adapter
    return write_adapter(out, [(key, captured[name]) for name, key in peft["keys"]], peft["config"], dtype)


def _unit_order(params: list[dict]) -> list[int]:
    """The parameters' indices, units in the order they first appear, each unit's by offset (the
    order an export reads them in: each unit's bytes front to back)."""
    first = {}
    for i, p in enumerate(params):
        first.setdefault(p["tensor"], i)
    return sorted(range(len(params)), key=lambda i: (first[params[i]["tensor"]], params[i]["offset"]))


def export_params(out, params: list[dict], fill, max_shard_size, metadata: dict,
                  buffers: list[tuple[str, torch.Tensor]] = (), dtype: torch.dtype = torch.float32) -> list[Path]:
    """Export parameters in unit order (each unit's bytes read front to back, once; ``fill`` writes
    them in ``dtype``), then the model's persistent buffers (floating ones in ``dtype``, as
    ``model.to(dtype)`` casts them)."""
    buffers = [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in buffers]
    order = _unit_order(params)  # units in the order they first appear in the model, parameters in buffer order
    tensors = [(params[i]["name"], dtype, tuple(params[i]["shape"])) for i in order]
    tensors += [(name, t.dtype, tuple(t.shape)) for name, t in buffers]

    def fill_one(k: int, write) -> None:
        if k < len(order):
            fill(params[order[k]], write)
        else:
            t = buffers[k - len(order)][1].contiguous()
            write(t.reshape(-1).view(torch.uint8).numpy().data)
        advance(1)
    writer = SafetensorsWriter(out, tensors, max_shard_size, metadata)
    with counter(len(tensors), desc=f"exporting to {out}", unit="tensor") as advance:
        return writer.write(fill_one)


RANK_DIR = re.compile(r"rank-(\d+)-of-(\d+)")


def rank_directories(root: Path) -> list[tuple[int, int, Path]]:
    """``(rank, world size, directory)`` of the ``rank-R-of-W`` directories a sharded run left in ``root``."""
    if not root.is_dir():
        return []
    found = []
    for p in sorted(root.iterdir()):
        m = RANK_DIR.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), int(m.group(2)), p))
    return found


def _live_holder(lock: Path) -> dict | None:
    """The record of the process that holds ``lock`` now; None if none does (a killed engine's
    record stays in the file, but the kernel dropped its lock)."""
    try:
        fd = open_own(lock, os.O_RDONLY, StorageDirectoryError)
    except StorageDirectoryError:
        raise
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return read_holder(fd) or {"pid": None, "host": None, "since": None}
    finally:
        os.close(fd)  # (releases the probe's lock)


def open_state(path: str | os.PathLike, stripes: list | None = None, live: bool = False):
    """The right reader for ``path``: a :class:`StateDirectory`, or a :class:`ShardedStateDirectory`
    for the shared root of a sharded run (which holds ``rank-R-of-W`` directories). ``live``: to
    inspect it beside a live engine."""
    root = Path(path).expanduser().absolute()
    if not (root / STATE_DIR / "manifest.json").exists() and rank_directories(root):
        return ShardedStateDirectory(root, stripes, live)
    return StateDirectory(root, stripes, live)


class ShardedStateDirectory:
    """The shared root of a sharded run, read offline: every rank's directory, their slices
    gathered into one model on export."""

    def __init__(self, root: str | os.PathLike, stripes: list | None = None, live: bool = False):
        self.path = Path(root).expanduser().absolute()
        found = rank_directories(self.path)
        worlds = {w for _, w, _ in found}
        if len(worlds) != 1:
            raise CheckpointError(f"{self.path} holds the directories of runs with {sorted(worlds)} ranks; keep one "
                                  f"run's rank-R-of-W directories per root")
        world = worlds.pop()
        ranks = {r: d for r, _, d in found}
        if sorted(ranks) != list(range(world)):
            raise CheckpointError(f"{self.path}: a run of {world} ranks, but only the directories of ranks "
                                  f"{sorted(ranks)} are there; every rank's directory is needed")
        if stripes:
            raise CheckpointError("--stripe with a sharded root: give each rank's directory its stripes instead")
        self.world = world
        self.ranks: list[StateDirectory] = []
        try:
            for r in range(world):
                sd = StateDirectory(ranks[r], live=live)
                self.ranks.append(sd)
                sharding = sd.manifest.get("sharding") or {}
                if sharding != {"rank": r, "world_size": world}:
                    raise CheckpointError(f"{sd.files.manifest_path} describes {sharding or 'an unsharded state'}, not "
                                          f"rank {r} of {world}; the directory was moved or mixed with another run's")
        except BaseException:
            self.close()
            raise
        self.manifest = self.ranks[0].manifest

    def close(self) -> None:
        for sd in self.ranks:
            sd.close()

    def __enter__(self) -> "ShardedStateDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def steps(self) -> list[int]:
        return [sd.manifest["step"] for sd in self.ranks]

    def inspect(self) -> dict:
        """The run as a whole (rank 0's description) with every rank's step, step in flight and files."""
        per_rank = [sd.inspect() for sd in self.ranks]
        info = dict(per_rank[0], directory=str(self.path))
        info["state_bytes"] = sum(r["state_bytes"] for r in per_rank)
        info["tensors"] = sum(r["tensors"] for r in per_rank)
        info["tensors_all_zero"] = sum(r["tensors_all_zero"] for r in per_rank)
        info["storage"] = [d for r in per_rank for d in r["storage"]]
        info["ranks"] = [{"rank": i, "directory": r["directory"], "step": r["step"],
                          "step_in_flight": r["step_in_flight"], "lock_holder": r["lock_holder"],
                          "previous_commit_step": r["previous_commit_step"]}
                         for i, r in enumerate(per_rank)]
        return info

    def verify(self, progress=None) -> dict:
        reports = [sd.verify(progress) for sd in self.ranks]
        return {"directory": str(self.path), "step": min(self.steps()),
                "tensors_checked": sum(r["tensors_checked"] for r in reports),
                "bytes_checked": sum(r["bytes_checked"] for r in reports),
                "damaged": [d for r in reports for d in r["damaged"]], "ok": all(r["ok"] for r in reports)}

    def export(self, out: str | os.PathLike, max_shard_size="2GB", dtype=torch.float32, *,
               adapter_only: bool = False, merged: bool = False) -> list[Path]:
        """Gather every rank's slices into one model (Hugging Face safetensors, config.json, in
        ``save_pretrained``'s format and ``dtype``; a PEFT model's adapter beside it, or
        ``adapter_only``, or ``merged`` into it), after checking every slice against its checksum."""
        dtype = export_dtype(dtype)
        adapter = _adapter(self.manifest, self.path, adapter_only, merged)
        with contextlib.ExitStack() as reading:
            for sd in self.ranks:
                reading.enter_context(sd._reading("exported"))
            reading.enter_context(exporting(out))
            return self._export(out, max_shard_size, dtype, adapter)

    def _export(self, out: str | os.PathLike, max_shard_size, dtype, adapter: dict) -> list[Path]:
        steps = self.steps()
        in_flight = [r for r, sd in enumerate(self.ranks) if sd.intent is not None]
        if len(set(steps)) != 1 or in_flight:
            raise CheckpointError(f"{self.path}: the ranks are at steps {steps}" + (
                f" with a step in flight on rank(s) {in_flight}" if in_flight else "") + "; a resume of every rank "
                "brings them to one step (run the job again with resume), then export")
        report = self.verify()
        if not report["ok"]:
            first = report["damaged"][0]
            raise CorruptionError(f"{first['file']} (tensor {first['tensor']!r}): {first['problem']}; the export was "
                                  f"not written. Run `tiered-offload verify {self.path}` for the whole list")
        units = {u["name"]: u["numel"] for u in self.manifest["units"]}
        buf = torch.empty(_CHUNK, dtype=torch.uint8)

        def fill(p: dict, write) -> None:
            numel = units[p["tensor"].split("/", 1)[0]]
            size = max(1, math.ceil(numel / self.world))  # each rank's slice (ShardLayout)
            lo, hi = p["offset"], p["offset"] + math.prod(p["shape"])
            while lo < hi:
                r = lo // size
                end = min(hi, (r + 1) * size)
                extent, _, _ = self.ranks[r].extent_of(p["tensor"])
                n = (end - lo) * 4
                if extent is None:
                    zeros = bytes(min(n, _CHUNK))
                    for a in range(0, n, _CHUNK):
                        write(zeros[:min(_CHUNK, n - a)])
                else:
                    start = (lo - r * size) * 4
                    for a in range(0, n, _CHUNK):
                        piece = buf[:min(_CHUNK, n - a)]
                        self.ranks[r].read_range(extent, start + a, piece)
                        write(piece.numpy().data)
                lo = end
        return _export_model(out, self.manifest["params"], fill, max_shard_size, {"step": str(steps[0])},
                             self.ranks[0].buffers(), self.manifest.get("model_config"), dtype, adapter)
