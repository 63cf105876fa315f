"""Writing a live engine's weights as a Hugging Face model (sharded safetensors, ``config.json``),
streamed one tensor at a time from the store; sharded over ranks, each unit gathered from the
ranks' slices and written by rank 0. The tensors are named and laid out as ``save_pretrained``
writes them (:func:`saved_format`: transformers 5 keeps some models' tensors otherwise in memory
than in their checkpoints, and reverts that when it saves)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Callable

import torch

from offload_core.errors import DistributedError
from tiered_offload.checkpoint.adapter import peft_adapter_name
from tiered_offload.checkpoint.safetensors_io import config_json, exported_config, iter_chunks, write_private
from tiered_offload.checkpoint.state_dir import export_params

__all__ = ["export_weights", "meta_model", "model_config", "saved_format"]

log = logging.getLogger(__name__)


def model_config(model) -> dict | None:
    """The model's Hugging Face configuration as JSON (for config.json next to an export), if it
    has one. A PEFT model has none: its export has PEFT's parameter names, in which
    ``from_pretrained`` would find none of the base model's (a randomly initialised model)."""
    if peft_adapter_name(model) is not None:  # (its export writes the adapter instead: checkpoint/adapter.py)
        return None
    return config_json(model)


def export_weights(out: str | os.PathLike, *, params: list[dict], units, store, placement, buffers: list,
                   model_config: dict | None, step: int, max_shard_size, merge=None, model=None,
                   dtype: torch.dtype = torch.float32) -> list:
    """Write ``params`` (the layout's parameter entries) and the persistent ``buffers`` to ``out``;
    ``merge(unit, flat) -> {name: value}``: values that replace those of the unit's parameters
    (a merged adapter's, :func:`~tiered_offload.checkpoint.adapter.merged_export`); ``model``:
    the Hugging Face model whose ``save_pretrained`` format they are written in (:func:`saved_format`);
    ``dtype``: the weights' (and floating buffers') in the files, cast as ``model.to(dtype)`` casts.

    Every process calls it; the one that :meth:`~Placement.writes_exports` writes and returns the
    files, the others take part in each unit's gather, in the order the export reads them (each
    unit once, in the order of its first parameter), and get ``[]``.
    """
    by_key = {u.weight_key: u for u in units}
    unit_params = {}
    for p in params:
        unit_params.setdefault(p["tensor"], []).append(p)
    params, convert = saved_format(model, params) if model is not None else (params, None)
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
                if convert is not None:  # the unit's tensors, as save_pretrained converts them
                    current["merged"] = convert({q["name"]: current["merged"].get(q["name"], _view(current["flat"], q))
                                                 for q in unit_params[key]})
            value = current["merged"][p["name"]] if convert is not None else current["merged"].get(p["name"])
            for chunk in iter_chunks((_view(current["flat"], p) if value is None else value).to(dtype)):
                write(chunk)
        files = export_params(out, params, fill, max_shard_size, {"step": str(step), "source": "tiered-offload"},
                              buffers, dtype)
    if model_config is not None:
        path = Path(out) / "config.json"
        write_private(path, json.dumps(exported_config(model_config, dtype), indent=2, sort_keys=True))
        files.append(path)
    return files


def _view(flat: torch.Tensor, p: dict) -> torch.Tensor:
    return flat[p["offset"]:p["offset"] + math.prod(p["shape"])].view(p["shape"])


def meta_model(config: dict) -> torch.nn.Module:
    """The Hugging Face model a ``config.json``'s JSON describes (its first ``architectures``), built
    on the meta device (no memory, no weights). Raises what transformers raises for one it does
    not know, and ``ValueError`` where the name is not one of its model classes."""
    import transformers
    names = config.get("architectures")
    cls = getattr(transformers, names[0], None) if isinstance(names, list) and names and isinstance(names[0], str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"architectures {names!r} names no transformers model class")
    with torch.device("meta"):
        return cls(transformers.AutoConfig.for_model(**config))


def saved_format(model, params: list[dict]) -> tuple[list[dict], Callable[[dict], dict] | None]:
    """``params`` (the layout's entries, named as ``model``'s parameters) as ``model.save_pretrained``
    names and lays them out, and ``convert({name: tensor}) -> {saved name: tensor}`` for one unit's
    tensors; ``(params, None)`` where it converts nothing (most models, another transformers).
    Those it does not save (``_keys_to_ignore_on_save``: Marian's sinusoidal positions) are left out.

    transformers 5 keeps some models' tensors otherwise in memory than in their checkpoints (an
    MoE's experts stacked in one tensor a layer, ``gate_up_proj``; GPT-NeoX's head as
    ``embed_out``) and reverts that when it saves (``revert_weight_conversion``); each unit's
    tensors are reverted apart, as ``save_pretrained`` reverts an offloaded model's shard by shard
    (a conversion spans one layer's tensors). Where the units apart do not give what the whole model
    gives, the export keeps the model's own names (a warning says so)."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    params = [p for p in params if p["name"] not in ignored]
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return params, None

    def revert(tensors: dict) -> dict:
        return revert_weight_conversion(model, tensors)

    by_unit = {}
    for p in params:
        by_unit.setdefault(p["tensor"], []).append(p)
    meta = {p["name"]: torch.empty(p["shape"], device="meta") for p in params}
    try:
        whole = revert(meta)
        if {k: tuple(v.shape) for k, v in whole.items()} == {k: tuple(v.shape) for k, v in meta.items()}:
            return params, None  # nothing converts
        saved = []
        for key, unit in by_unit.items():
            reverted = revert({p["name"]: meta[p["name"]] for p in unit})
            saved += [{"name": n, "tensor": key, "offset": i, "shape": list(t.shape)} for i, (n, t) in enumerate(reverted.items())]
    except Exception as e:  # noqa: BLE001 - not a transformers model (its mapping cannot be read): its own names
        log.debug("no save_pretrained conversions for %s: %s", type(model).__name__, e)
        return params, None
    if {p["name"]: tuple(p["shape"]) for p in saved} != {k: tuple(v.shape) for k, v in whole.items()}:
        log.warning("the export of a %s keeps the model's own tensor names: save_pretrained converts tensors of "
                    "different units together, which a streamed export cannot", type(model).__name__)
        return params, None
    return saved, revert
