"""What a valid manifest and a valid journal record hold, checked as they are read.

A state directory's files may be damaged (a flipped bit, a truncated write) or written by someone
else (a hostile or careless edit that recomputes the checksum). Everything read from them passes
through here before any code uses it: the JSON is parsed with duplicate keys refused and nesting
bounded, every field the engine and the offline tools use is checked for its type and range, and
every failure is a :class:`~offload_core.errors.CorruptionError` naming the file, the field (and
the journal line) and what to do. No later code meets a ``KeyError`` or a string where a number
belongs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from offload_core.errors import CorruptionError

__all__ = ["parse_json", "check_manifest", "check_record", "check_index", "DTYPE_BYTES", "MAX_STEP"]

MAX_STEP = 2 ** 53
"""Steps (and counts) beyond this are not a training run's: a lying or damaged file."""
MAX_DEPTH = 64
"""Nesting deeper than this is refused before the parser recurses (no state file nests deeper)."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""Element sizes of the dtypes a state file may name (torch's names; safetensors' in headers)."""

_REDO = "Restore the directory from a copy, or start a new run from the last export with init_from"


class _Fail(Exception):
    """A field is wrong: ``where`` is its path (``tensors['block.0/weight'].crc``)."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")


def parse_json(data: bytes | str, path: Path | str, what: str = "", redo: str = _REDO) -> Any:
    """JSON from a state file: not UTF-8, not JSON, duplicate keys or nesting beyond
    :data:`MAX_DEPTH` are a :class:`CorruptionError` naming ``path`` (and ``what``: a line),
    saying ``redo`` (what to do; a state directory's default)."""
    where = f"{path}{what}"
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as e:
        raise CorruptionError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}); {redo}") from None
    if _depth(text) > MAX_DEPTH:
        raise CorruptionError(f"{where} nests deeper than {MAX_DEPTH} levels; no state file does. {redo}")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Fail as e:
        raise CorruptionError(f"{where}: {e}; {redo}") from None
    except (ValueError, RecursionError) as e:
        raise CorruptionError(f"{where} is not valid JSON ({e}); {redo}") from None


def _depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text (strings skipped), without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise _Fail(f"key {k!r}", "appears twice in one object")
        seen[k] = v
    return seen


# ---- field checks -------------------------------------------------------------------------------------
def _obj(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise _Fail(where, f"expected an object, found {type(v).__name__}")
    return v


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise _Fail(where, f"expected a list, found {type(v).__name__}")
    return v


def _str(v, where: str) -> str:
    if not isinstance(v, str):
        raise _Fail(where, f"expected a string, found {type(v).__name__}")
    return v


def _int(v, where: str, lo: int = 0, hi: int = MAX_STEP) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _Fail(where, f"expected an integer, found {type(v).__name__} {v!r:.40}")
    if not lo <= v <= hi:
        raise _Fail(where, f"{v} is outside [{lo}, {hi}]")
    return v


def _opt(check, v, where: str, *args):
    return None if v is None else check(v, where, *args)


def _field(obj: dict, key: str, where: str):
    if key not in obj:
        raise _Fail(f"{where}.{key}" if where else key, "missing")
    return obj[key]


def _ref(v, where: str) -> None:
    """An ``[extent, crc]`` pair (a journal's reference to a written tensor) or null."""
    if v is None:
        return
    pair = _list(v, where)
    if len(pair) != 2:
        raise _Fail(where, f"expected [extent, checksum], found {len(pair)} items")
    _str(pair[0], f"{where}[0]")
    _opt(_crc, pair[1], f"{where}[1]")


_TAGGED = re.compile(r"wsum64:[0-9a-f]{16}")


def _crc(v, where: str) -> None:
    """A recorded checksum: an integer, or a tagged one computed on an accelerator (``wsum64:<hex>``)."""
    if isinstance(v, str):
        if not _TAGGED.fullmatch(v):
            raise _Fail(where, f"{v[:40]!r} is not a checksum (an integer, or 'wsum64:' and 16 hex digits)")
        return
    _int(v, where, 0, 2 ** 64 - 1)


def _shape(v, where: str) -> int:
    """Checks a shape; returns its element count."""
    n = 1
    for i, d in enumerate(_list(v, where)):
        n *= _int(d, f"{where}[{i}]", 0, 2 ** 62)
    if n > 2 ** 62:
        raise _Fail(where, f"{v} has {n} elements")
    return n


_BUFFER_EXTENT = re.compile(r"model\.buffers@[0-9]{1,18}")
_TORCH_DTYPES = {k for k in DTYPE_BYTES if k.islower()}


def _buffer_file(b: dict, where: str) -> None:
    """The model's buffers in one extent: its name, checksum, size and each buffer's place in it."""
    extent = _str(_field(b, "extent", where), f"{where}.extent")
    if not _BUFFER_EXTENT.fullmatch(extent):
        raise _Fail(f"{where}.extent", f"{extent[:60]!r} is not a buffer extent (model.buffers@<step>)")
    _crc(_field(b, "crc", where), f"{where}.crc")
    nbytes = _int(_field(b, "nbytes", where), f"{where}.nbytes", 0, 2 ** 62)
    for k, v in _obj(_field(b, "tensors", where), f"{where}.tensors").items():
        w = f"{where}.tensors[{k!r}]"
        t = _obj(v, w)
        dtype = _str(_field(t, "dtype", w), f"{w}.dtype")
        if dtype not in _TORCH_DTYPES:
            raise _Fail(f"{w}.dtype", f"{dtype!r} is not a dtype a buffer holds")
        n = _shape(_field(t, "shape", w), f"{w}.shape")
        if _int(_field(t, "offset", w), f"{w}.offset", 0, 2 ** 62) + n * DTYPE_BYTES[dtype] > nbytes:
            raise _Fail(w, f"lies past the end of the extent ({nbytes} bytes)")


# ---- the manifest ---------------------------------------------------------------------------------
def check_manifest(manifest: Any, path: Path | str) -> dict:
    """``manifest`` if it has the shape a manifest has, else :class:`CorruptionError` naming the field."""
    try:
        _check_manifest(manifest)
    except _Fail as e:
        raise CorruptionError(f"{path}: {e}; {_REDO}") from None
    return manifest


def _check_manifest(m: Any) -> None:
    _obj(m, "the manifest")
    _str(_field(m, "format", ""), "format")
    if "checksum" in m:
        _str(m["checksum"], "checksum")
    _int(_field(m, "step", ""), "step")
    for key, t in _obj(_field(m, "tensors", ""), "tensors").items():
        w = f"tensors[{key!r}]"
        _obj(t, w)
        _opt(_str, _field(t, "extent", w), f"{w}.extent")
        _opt(_crc, _field(t, "crc", w), f"{w}.crc")
        dtype = _str(_field(t, "dtype", w), f"{w}.dtype")
        if dtype not in DTYPE_BYTES:
            raise _Fail(f"{w}.dtype", f"{dtype!r} is not a dtype a state holds")
        numel = _shape(_field(t, "shape", w), f"{w}.shape")
        nbytes = _int(_field(t, "nbytes", w), f"{w}.nbytes", 0, 2 ** 62)
        if nbytes != numel * DTYPE_BYTES[dtype]:
            raise _Fail(f"{w}.nbytes", f"{nbytes} bytes, but shape {t['shape']} of {dtype} is {numel * DTYPE_BYTES[dtype]}")
        _int(t.get("offset", 0), f"{w}.offset", 0, 2 ** 62)
    meta = _obj(_field(m, "meta", ""), "meta")
    _check_meta(meta, "meta")
    units = {}
    for i, u in enumerate(_list(_field(m, "units", ""), "units")):
        w = f"units[{i}]"
        _obj(u, w)
        name = _str(_field(u, "name", w), f"{w}.name")
        units[name] = _int(_field(u, "numel", w), f"{w}.numel", 0, 2 ** 62)
        for k in ("grad_numel", "state_numel", "piece_numel"):
            if k in u:
                _int(u[k], f"{w}.{k}", 0, 2 ** 62)
        for j, end in enumerate(_list(u.get("pieces", []), f"{w}.pieces")):
            _int(end, f"{w}.pieces[{j}]", 0, 2 ** 62)
    for i, p in enumerate(_list(_field(m, "params", ""), "params")):
        w = f"params[{i}]"
        _obj(p, w)
        _str(_field(p, "name", w), f"{w}.name")
        tensor = _str(_field(p, "tensor", w), f"{w}.tensor")
        offset = _int(_field(p, "offset", w), f"{w}.offset", 0, 2 ** 62)
        numel = _shape(_field(p, "shape", w), f"{w}.shape")
        if tensor not in m["tensors"]:
            raise _Fail(f"{w}.tensor", f"{tensor!r} is not one of the manifest's tensors")
        unit = tensor.split("/", 1)[0]
        if unit not in units:
            raise _Fail(f"{w}.tensor", f"{tensor!r} belongs to no unit of the manifest")
        # offsets are in the unit's coordinates (a rank's tensor holds its slice of them)
        held = units[unit] if m.get("sharding") else math.prod(m["tensors"][tensor]["shape"])
        if offset + numel > held:
            raise _Fail(w, f"elements [{offset}, {offset + numel}) lie outside {tensor!r}, which holds {held}")
    opt = _obj(_field(m, "optimizer", ""), "optimizer")
    _str(_field(opt, "class", "optimizer"), "optimizer.class")
    for i, s in enumerate(_list(_field(opt, "states", "optimizer"), "optimizer.states")):
        _str(s, f"optimizer.states[{i}]")
    if opt.get("groups") is not None:
        for i, g in enumerate(_list(opt["groups"], "optimizer.groups")):
            for j, n in enumerate(_list(g, f"optimizer.groups[{i}]")):
                _str(n, f"optimizer.groups[{i}][{j}]")
    storage = _obj(m.get("storage") or {}, "storage")
    for i, d in enumerate(_list(storage.get("directories") or [], "storage.directories")):
        _str(d, f"storage.directories[{i}]")
    _opt(_int, storage.get("stripe_bytes"), "storage.stripe_bytes", 1, 2 ** 40)
    if storage.get("stripe_weights") is not None:  # (a layout: one weight per directory)
        weights = _list(storage["stripe_weights"], "storage.stripe_weights")
        for i, w in enumerate(weights):
            _int(w, f"storage.stripe_weights[{i}]", 1, 64)
        if len(weights) != len(storage.get("directories") or []):
            raise _Fail("storage.stripe_weights", f"{len(weights)} weights for "
                                                  f"{len(storage.get('directories') or [])} directories")
    _opt(_obj, m.get("model_config"), "model_config")
    if m.get("peft") is not None:  # a PEFT model's adapter: its config, and which parameters make it (keys in its file)
        peft = _obj(m["peft"], "peft")
        _str(_field(peft, "adapter", "peft"), "peft.adapter")
        _obj(_field(peft, "config", "peft"), "peft.config")
        _opt(_obj, peft.get("base_config"), "peft.base_config")
        names = {p.get("name") for p in m["params"]}
        for i, pair in enumerate(_list(_field(peft, "keys", "peft"), "peft.keys")):
            if len(_list(pair, f"peft.keys[{i}]")) != 2:
                raise _Fail(f"peft.keys[{i}]", "is not [parameter name, key in the adapter's file]")
            _str(pair[1], f"peft.keys[{i}][1]")
            if _str(pair[0], f"peft.keys[{i}][0]") not in names:
                raise _Fail(f"peft.keys[{i}]", f"{pair[0]!r} names no parameter of the manifest")
    if m.get("sharding") is not None:
        sh = _obj(m["sharding"], "sharding")
        world = _int(_field(sh, "world_size", "sharding"), "sharding.world_size", 1, 2 ** 20)
        _int(_field(sh, "rank", "sharding"), "sharding.rank", 0, world - 1)


def _check_meta(meta: dict, where: str) -> None:
    _int(_field(meta, "step_count", where), f"{where}.step_count")
    rng = _obj(_field(meta, "rng", where), f"{where}.rng")
    _str(_field(rng, "cpu", f"{where}.rng"), f"{where}.rng.cpu")
    _opt(_str, rng.get("cuda"), f"{where}.rng.cuda")
    for k, v in _obj(rng.get("own", {}), f"{where}.rng.own").items():  # the model's own generators
        _str(v, f"{where}.rng.own[{k!r}]")
    _field(meta, "user_state", where)
    _opt(_obj, _field(meta, "scheduler", where), f"{where}.scheduler")
    if _opt(_str, meta.get("update_tier"), f"{where}.update_tier") not in (None, "host", "device"):
        raise _Fail(f"{where}.update_tier", f"expected 'host' or 'device', found {meta['update_tier']!r}")
    growth = meta.get("clip_growth")
    if growth is not None and (not isinstance(growth, (int, float)) or isinstance(growth, bool)
                               or not 1.0 <= growth < float("inf")):
        raise _Fail(f"{where}.clip_growth", f"expected a finite number of at least 1, found {growth!r}")
    for k, v in _obj(meta.get("param_updates", {}), f"{where}.param_updates").items():
        _int(v, f"{where}.param_updates[{k!r}]")
    for k, v in _obj(meta.get("param_scalars", {}), f"{where}.param_scalars").items():
        for name, x in _obj(v, f"{where}.param_scalars[{k!r}]").items():
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                raise _Fail(f"{where}.param_scalars[{k!r}].{name}", f"expected a number, found {type(x).__name__}")
    for k, v in _obj(meta.get("buffers", {}), f"{where}.buffers").items():
        b = _obj(v, f"{where}.buffers[{k!r}]")
        dtype = _str(_field(b, "dtype", f"{where}.buffers[{k!r}]"), f"{where}.buffers[{k!r}].dtype")
        if dtype not in DTYPE_BYTES:
            raise _Fail(f"{where}.buffers[{k!r}].dtype", f"{dtype!r} is not a dtype a state holds")
        _shape(_field(b, "shape", f"{where}.buffers[{k!r}]"), f"{where}.buffers[{k!r}].shape")
        _str(_field(b, "data", f"{where}.buffers[{k!r}]"), f"{where}.buffers[{k!r}].data")
    if meta.get("buffer_file") is not None:
        _buffer_file(_obj(meta["buffer_file"], f"{where}.buffer_file"), f"{where}.buffer_file")
    for i, g in enumerate(_list(_field(meta, "param_groups", where), f"{where}.param_groups")):
        _obj(g, f"{where}.param_groups[{i}]")
    for i, g in enumerate(_list(meta.get("tensor_hypers", []), f"{where}.tensor_hypers")):
        for k, dtype in _obj(g, f"{where}.tensor_hypers[{i}]").items():
            if dtype not in ("float32", "float64", "float16", "bfloat16"):
                raise _Fail(f"{where}.tensor_hypers[{i}][{k!r}]", f"{dtype!r} is not a floating dtype")


# ---- the journal ----------------------------------------------------------------------------------
def check_record(record: Any, where: str) -> dict:
    """A journal record (``where``: the journal and its line) with the shape the protocol writes."""
    try:
        r = _obj(record, "the record")
        kind = _str(_field(r, "type", ""), "type")
        _int(_field(r, "step", ""), "step", 1)
        if kind == "intent":
            for k, v in _obj(_field(r, "grads", ""), "grads").items():
                _ref(v, f"grads[{k!r}]")
            hyper = _field(r, "hyper", "")
            for i, h in enumerate(hyper if isinstance(hyper, list) else [_obj(hyper, "hyper")]):
                _obj(h, f"hyper[{i}]")
            scale = _field(r, "scale", "")
            if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
                raise _Fail("scale", f"expected a number or null, found {type(scale).__name__}")
            for i, n in enumerate(_list(r.get("no_grad", []), "no_grad")):
                _str(n, f"no_grad[{i}]")
            _check_meta(_obj(_field(r, "meta", ""), "meta"), "meta")
        elif kind == "unit":
            _str(_field(r, "unit", ""), "unit")
            for k, v in _obj(_field(r, "tensors", ""), "tensors").items():
                _ref(v, f"tensors[{k!r}]")
        else:
            raise _Fail("type", f"{kind!r} is not a record type of this format")
    except _Fail as e:
        raise CorruptionError(f"{where}: {e}; {_REDO}") from None
    return record


# ---- safetensors indexes ------------------------------------------------------------------------------
def check_index(index: Any, path: Path | str) -> dict:
    """A ``model.safetensors.index.json``: ``weight_map`` maps tensor names to shard file names."""
    try:
        idx = _obj(index, "the index")
        for k, v in _obj(_field(idx, "weight_map", ""), "weight_map").items():
            _str(v, f"weight_map[{k!r}]")
    except _Fail as e:
        raise CorruptionError(f"{path}: {e}; fix or re-create the index (save_pretrained writes one)") from None
    return index
