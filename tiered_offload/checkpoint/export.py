"""Writing a live engine's weights as a Hugging Face model (sharded safetensors, ``config.json``),
streamed one tensor at a time from the store; sharded over ranks, each unit gathered from the
ranks' slices and written by rank 0."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

from offload_core.errors import DistributedError
from tiered_offload.checkpoint.safetensors_io import exported_config, iter_chunks, write_private
from tiered_offload.checkpoint.state_dir import export_params

__all__ = ["export_weights"]


def export_weights(out: str | os.PathLike, *, params: list[dict], units, store, placement, buffers: list,
                   model_config: dict | None, step: int, max_shard_size, merge=None) -> list:
    """Write ``params`` (the layout's parameter entries) and the persistent ``buffers`` to ``out``;
    ``merge(unit, flat) -> {name: value}``: values that replace those of the unit's parameters
    (a merged adapter's, :func:`~tiered_offload.checkpoint.adapter.merged_export`).

    Every process calls it; the one that :meth:`~Placement.writes_exports` writes and returns the
    files, the others take part in each unit's gather, in the order the export reads them (each
    unit once, in the order of its first parameter), and get ``[]``.
    """
    by_key = {u.weight_key: u for u in units}
    sequence = list(dict.fromkeys(p["tensor"] for p in params))
    if not placement.writes_exports():
        for key in sequence:
            placement.full_weights(store, by_key[key])
        return []
    current = {"key": None, "flat": None, "merged": {}}
    units_left = iter(sequence)
    with contextlib.ExitStack() as held:
        def fill(p: dict, write) -> None:
            if current["key"] != p["tensor"]:
                key = next(units_left)
                if key != p["tensor"]:  # pragma: no cover - export_params reads units in this order
                    raise DistributedError(f"export read {p['tensor']} where {key} was expected")
                held.close()  # the previous unit's weights are no longer needed
                current.update(key=key, flat=held.enter_context(placement.unit_weights(store, by_key[key])))
                current["merged"] = merge(by_key[key], current["flat"]) if merge else {}
            n = math.prod(p["shape"])
            value = current["merged"].get(p["name"])
            for chunk in iter_chunks(current["flat"][p["offset"]:p["offset"] + n] if value is None else value):
                write(chunk)
        files = export_params(out, params, fill, max_shard_size, {"step": str(step), "source": "tiered-offload"},
                              buffers)
    if model_config is not None:
        path = Path(out) / "config.json"
        write_private(path, json.dumps(exported_config(model_config), indent=2, sort_keys=True))
        files.append(path)
    return files
