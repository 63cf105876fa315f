"""A PEFT model's adapter beside its export, as ``PeftModel.save_pretrained`` writes it
(``adapter_model.safetensors`` and ``adapter_config.json``), which ``PeftModel.from_pretrained``
loads onto the base model.

Which of the model's tensors make the adapter, and under which keys, is peft's own
``get_peft_model_state_dict``: it walks the model's modules for its tuner layers, so it runs with
the real blocks in the model's tree instead of the engine's stand-ins, on the engine's values of the
trainable parameters (a PEFT model trains its adapter and its ``modules_to_save`` only). A
trainable parameter the adapter leaves out (one unfrozen by hand) would be lost without a word, as
peft's own save loses it: the export says so.

A merged export (:func:`merged_export`) is the model ``merge_and_unload()`` makes, as its
``save_pretrained`` writes it: the base model's names, each tuner layer's base weights merged by
peft's own ``merge`` on the engine's values, one unit at a time (the layer's parameters are lent
to it as copies, so the model and the store are left as they were).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from offload_core.errors import CheckpointError, ConfigError
from tiered_offload.checkpoint.safetensors_io import (PretrainedReader, SafetensorsWriter, iter_chunks, pick_weights,
                                                      write_private)

__all__ = ["ADAPTER_FILE", "adapter_config", "adapter_differences", "adapter_record", "export_adapter",
           "is_adapter_directory", "merged_export", "offline_merge", "peft_adapter_name", "saved_adapter",
           "write_adapter"]

log = logging.getLogger(__name__)

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
ADAPTER_BIN = "adapter_model.bin"


def peft_adapter_name(model) -> str | None:
    """The active adapter's name where ``model`` is a PEFT model (``peft.PeftModel``), else None."""
    config, name = getattr(model, "peft_config", None), getattr(model, "active_adapter", None)
    return name if isinstance(config, dict) and isinstance(name, str) and name in config else None


def export_adapter(out: str | os.PathLike, binding, store, placement, required: bool = False,
                   dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write the adapter of ``binding.model`` into ``out`` if it is a PEFT model (else nothing; or,
    ``required``, a :class:`ConfigError`): its trainable parameters read from ``store``, keyed and
    filtered by peft, in ``dtype``. Sharded, every rank reads; the one that writes exports returns the files."""
    model = binding.model
    name = peft_adapter_name(model)
    if name is None:
        if required:
            raise ConfigError(f"an adapter-only export of a {type(model).__name__}, which is not a PEFT model: it has "
                              f"no adapter; export_safetensors(DIR) writes its weights")
        return []
    trained = [(unit, slot) for unit, slot in binding.param_order if slot.requires_grad]
    weights = dict(placement.parameters(store, binding.units, trained))
    adapter = _peft_state(binding, name, weights)
    kept = {id(t) for t in adapter.values()}
    prompt = model.peft_config[name].is_prompt_learning  # (saves what its encoder makes of its weights)
    left = [n for n, t in weights.items() if id(t) not in kept and not (prompt and n.startswith("prompt_encoder."))]
    if left:
        log.warning("the export's %s holds adapter %r as peft saves it, without %d trainable parameter(s) that are "
                    "not part of it (e.g. %s): they are in its model.safetensors; to save them with the adapter, put "
                    "their modules in the config's modules_to_save", ADAPTER_FILE, name, len(left), left[:3])
    if not placement.writes_exports():
        return []
    return write_adapter(out, list(adapter.items()), adapter_config(model, name), dtype)


def _peft_state(binding, name: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's ``get_peft_model_state_dict`` of adapter ``name`` on ``weights`` (the trainable
    parameters' values, by name) and the model's buffers (VeRA's shared projections, which peft
    saves with the adapter), with the real blocks in the model's tree: ``{key: value}``. Prompt
    learning saves what its prompt encoder computes: the encoder is lent ``weights`` for it; on
    the meta device (keys only), peft keys the embedding's weight itself, which its load fills."""
    from peft.utils import get_peft_model_state_dict
    config = binding.model.peft_config[name]
    encoder = getattr(binding.model, "prompt_encoder", None)
    lent = [(mod, attr, p, ".".join(filter(None, ("prompt_encoder", m, attr)))) for m, mod in encoder.named_modules()
            for attr, p in mod._parameters.items() if p is not None] if isinstance(encoder, nn.Module) else []
    inference = config.inference_mode
    try:
        for mod, attr, p, full in lent:
            if full in weights:
                mod._parameters[attr] = weights[full]
        config.inference_mode = inference or (config.is_prompt_learning and any(t.is_meta for t in weights.values()))
        with binding.real_blocks():
            buffers = {".".join(filter(None, (m, attr))): b  # (under every name, as state_dict() has them)
                       for m, mod in binding.model.named_modules(remove_duplicate=False)
                       for attr, b in mod._buffers.items() if b is not None and attr not in mod._non_persistent_buffers_set}
            return get_peft_model_state_dict(binding.model, state_dict={**buffers, **weights}, adapter_name=name)
    finally:
        config.inference_mode = inference
        for mod, attr, p, _ in lent:
            mod._parameters[attr] = p


def adapter_config(model, name: str) -> dict:
    """``adapter_config.json`` of adapter ``name``, as ``PeftModel.save_pretrained`` writes it."""
    config = copy.deepcopy(model.peft_config[name])
    config.inference_mode = True
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return json.loads((Path(tmp) / ADAPTER_CONFIG).read_text())


def adapter_record(binding) -> dict | None:
    """What a directory records of a PEFT model's adapter, for ``tiered-offload export`` to write it
    without the model (:func:`write_adapter`): its ``adapter_config.json`` and which parameters make
    it, under which keys of its file; and the base model's ``config.json`` (where it has one), from
    which a merged export rebuilds the model (:func:`offline_merge`). None for another model (or one
    peft cannot key on shapes alone)."""
    name = peft_adapter_name(binding.model)
    if name is None:
        return None
    weights = {slot.name: torch.empty(slot.shape, device="meta") for _, slot in binding.param_order if slot.requires_grad}
    names = {id(t): n for n, t in weights.items()}
    try:
        adapter = _peft_state(binding, name, weights)
        made = [key for key, t in adapter.items() if id(t) not in names]
        config = binding.model.peft_config[name]
        if config.is_prompt_learning and config.peft_type != "PROMPT_TUNING":
            made = ["prompt_embeddings"]  # (what its encoder computes; prompt tuning's is the embedding's weight)
        if made:
            raise ValueError(f"peft makes {made[:3]} of its own")
        keys = [[names[id(t)], key] for key, t in adapter.items()]  # in the file's order (a list: JSON keeps it)
        base = binding.base_config  # (for a merged export: the model rebuilt on meta, offline_merge)
        return {"adapter": name, "config": adapter_config(binding.model, name), "keys": keys,
                **({"base_config": base} if base is not None else {})}
    except Exception as e:  # noqa: BLE001 - the directory's export then holds the weights alone (it says so)
        log.warning("the storage directory does not record adapter %r (%s): `tiered-offload export` of it writes the "
                    "weights under peft's names, not the adapter", name, e)
        return None


def is_adapter_directory(path) -> bool:
    """Whether ``path`` is a directory ``PeftModel.save_pretrained`` wrote: it holds
    ``adapter_config.json`` and no model (an engine's export of a PEFT model holds both: the whole
    model, which ``init_from`` reads as a checkpoint)."""
    path = Path(path)
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file() and pick_weights(path) is None


_CONFIG_LIMIT = 16 << 20
_CONFIG_IGNORED = frozenset({"auto_mapping", "base_model_name_or_path", "inference_mode", "peft_version", "revision",
                             "task_type", "lora_dropout"})  # (where it was saved from, what for; how it trains)


def saved_adapter(binding, path) -> tuple[PretrainedReader, set[str]]:
    """The adapter ``PeftModel.save_pretrained`` wrote in ``path``, read into ``binding.model``'s
    (``init_from=[BASE, ADAPTER]``): a reader that gives each of the adapter's parameters under its
    name in the model (the file's keys are peft's ``get_peft_model_state_dict``'s, as
    :func:`adapter_record` finds them), and those names. Its config must be the model's adapter's
    (but for where it was saved from, what for, and its dropout: :func:`adapter_differences`): a
    LoRA alpha or a target that differs would train another adapter on the same tensors."""
    name, path = peft_adapter_name(binding.model), Path(path)
    if name is None:
        raise ConfigError(f"init_from names the PEFT adapter {path}, and the model is a "
                          f"{type(binding.model).__name__}, not a PEFT model: wrap it first, {_wrap_as_saved(path)}")
    differ = adapter_differences(binding.model, path)
    if differ:
        raise ConfigError(f"{path / ADAPTER_CONFIG} is not the model's adapter {name!r} (" + "; ".join(
            f"{k}: {saved!r} in the file, {own!r} in the model" for k, saved, own in differ[:4]) + "): its tensors "
            f"would train as another adapter. Build the model's adapter from the saved one: {_wrap_as_saved(path)}")
    weights_file = next((path / f for f in (ADAPTER_FILE, ADAPTER_BIN) if (path / f).is_file()), None)
    if weights_file is None:
        raise CheckpointError(f"{path} holds {ADAPTER_CONFIG} but neither {ADAPTER_FILE} nor {ADAPTER_BIN}: not "
                              f"a whole adapter; save it again with PeftModel.save_pretrained")
    weights = {slot.name: torch.empty(slot.shape, device="meta") for _, slot in binding.param_order}
    names = {id(t): n for n, t in weights.items()}
    keys = {names[id(t)]: key for key, t in _peft_state(binding, name, weights).items() if id(t) in names}
    reader = PretrainedReader(weights_file)  # (PyTorch's format as older PEFT wrote it: checkpoint/torch_bin.py)
    reader.alias(keys)
    reader.check_covers([(n, weights[n].shape) for n in keys])
    return reader, set(keys)


def _wrap_as_saved(path: Path) -> str:
    """How to give a model the adapter saved in ``path``, trainable (peft saves it for inference)."""
    return (f"config = peft.PeftConfig.from_pretrained({str(path)!r}); config.inference_mode = False; "
            f"model = peft.get_peft_model(model, config)")


def adapter_differences(model, path) -> list[tuple[str, object, object]]:
    """How the adapter config ``PeftModel.save_pretrained`` wrote in ``path`` differs from the PEFT
    ``model``'s active adapter's, in what changes what its tensors mean: ``(key, saved, model's)``."""
    from tiered_offload.checkpoint.schema import parse_json
    path = Path(path)
    redo = "save the adapter again with PeftModel.save_pretrained"
    try:
        with open(path / ADAPTER_CONFIG, "rb") as f:
            data = f.read(_CONFIG_LIMIT + 1)
        if len(data) > _CONFIG_LIMIT:
            raise CheckpointError(f"{path / ADAPTER_CONFIG} is larger than {_CONFIG_LIMIT >> 20} MiB; PEFT writes a "
                                  f"few KB; {redo}")
    except OSError as e:
        raise CheckpointError(f"{path / ADAPTER_CONFIG} cannot be read: {e}") from None
    saved = parse_json(data, path / ADAPTER_CONFIG, redo=redo)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path / ADAPTER_CONFIG} is not a JSON object, as PEFT writes it; {redo}")
    own = adapter_config(model, peft_adapter_name(model))
    return [(k, _plain(saved.get(k)), _plain(own.get(k))) for k in sorted(set(saved) | set(own))
            if k not in _CONFIG_IGNORED and _plain(saved.get(k)) != _plain(own.get(k))]


def _plain(value):
    """A config value compared as its meaning: peft keeps ``target_modules`` (and other lists) as
    sets, which JSON writes in no fixed order."""
    if isinstance(value, list) and all(isinstance(v, (str, int)) for v in value):
        return sorted(value, key=repr)
    return value


def write_adapter(out: str | os.PathLike, tensors: list[tuple[str, torch.Tensor]], config: dict,
                  dtype: torch.dtype = torch.float32) -> list[Path]:
    """``adapter_model.safetensors`` of ``tensors`` (key, value; floating ones in ``dtype``) and
    ``adapter_config.json`` of ``config``, in ``out``."""
    values = [t.to(dtype) if t.is_floating_point() else t for _, t in tensors]
    files = SafetensorsWriter(out, [(k, t.dtype, tuple(t.shape)) for (k, _), t in zip(tensors, values)],
                              max_shard_size=1 << 62, single_name=ADAPTER_FILE).write(
        lambda i, write: [write(c) for c in iter_chunks(values[i])])
    path = Path(out) / ADAPTER_CONFIG
    write_private(path, json.dumps(config, indent=2, sort_keys=True))
    return [*files, path]


def merged_export(binding, params: list[dict], buffers: list) -> tuple[list[dict], list, Callable, dict | None]:
    """What a merged export of the PEFT model ``binding.model`` writes (``export_safetensors(merged=True)``):
    ``params`` (the layout's entries) and ``buffers`` under the base model's names, those of the
    adapter and of ``original_module`` left out; ``merge(unit, flat)``, the merged weights of the
    tuner layers among the unit's parameters by those names; and the base model's config."""
    model = binding.model
    with binding.real_blocks():
        slots = {id(s.param): (u.name, s.name, s.shape) for u, s in binding.param_order}
        base_name, merge_values = _merge_plan(model, slots)

    def merge(unit, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return merge_values(unit.name, {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in unit.params})

    renamed = [dict(p, name=n) for p in params if (n := base_name(p["name"])) is not None]
    kept = [(n, t) for b, t in buffers if (n := base_name(b)) is not None]
    return renamed, kept, merge, binding.base_config


def offline_merge(record: dict, params: list[dict], where: str) -> tuple[nn.Module, list[dict], Callable, Callable]:
    """A merged export of a storage directory's PEFT model without the engine: from the directory's
    ``record`` of its adapter (:func:`adapter_record`), the PEFT model rebuilt on the meta device
    (the base model from its recorded ``config.json``, the adapter from its config), checked
    against the directory's ``params`` (the manifest's entries). Returns the base model (on meta),
    ``params`` under its names (as :func:`merged_export`), ``base_name`` (for the buffers) and
    ``merge(unit tensor, values by name)``. ``where`` names the directory in the errors."""
    config = record.get("base_config")
    if not config or not config.get("architectures"):
        raise ConfigError(f"{where} does not record its base model's config.json (an older version trained it, or "
                          f"the base model is not a Hugging Face model), so the model cannot be rebuilt to merge the "
                          f"adapter: export it with --adapter-only and merge it with peft (merge_and_unload)")
    try:
        import peft
        from tiered_offload.checkpoint.export import meta_model
        base = meta_model(config)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*base_model_name_or_path")  # (the base has no path: on meta)
            model = peft.get_peft_model(base, peft.PeftConfig.from_peft_type(**record["config"]),
                                        adapter_name=record["adapter"], low_cpu_mem_usage=True)
    except Exception as e:  # noqa: BLE001 - no peft or transformers, or one that does not know the model
        raise ConfigError(f"{where}: the model with its adapter could not be rebuilt from the recorded configs "
                          f"({type(e).__name__}: {e}); export it with --adapter-only and merge it with peft") from None
    by_name = {p["name"]: p for p in params}
    built = dict(model.named_parameters())
    differ = sorted(set(built) ^ set(by_name)) + [n for n, p in by_name.items()
                                                  if n in built and list(built[n].shape) != list(p["shape"])]
    if differ:
        raise ConfigError(f"{where}: the model rebuilt from the recorded configs does not hold the directory's "
                          f"parameters (it differs in {len(differ)}, e.g. {differ[:3]}); export it with --adapter-only "
                          f"and merge it with peft")
    owner = {id(p): (by_name[n]["tensor"], n, tuple(p.shape)) for n, p in built.items()}
    base_name, merge = _merge_plan(model, owner)
    return base, [dict(p, name=n) for p in params if (n := base_name(p["name"])) is not None], base_name, merge


def _merge_plan(model, owner: dict[int, tuple[str, str, tuple]]) -> tuple[Callable, Callable]:
    """How the PEFT model ``model`` (its real modules in its tree) is merged, its parameters' ``owner``
    given (``id(parameter) -> (unit, name, shape)``; a parameter without one is not stored):
    ``base_name(name)``, the name ``merge_and_unload()`` leaves a parameter or buffer under (None: it
    goes), and ``merge(unit, values)``, the merged weights of the tuner layers among the unit's
    parameters (``values``: by name) under those names. peft's refusals come here, before a file is
    written."""
    name = peft_adapter_name(model)
    if name is None:
        raise ConfigError(f"a merged export of a {type(model).__name__}, which is not a PEFT model: it has no adapter "
                          f"to merge; export_safetensors(DIR) writes its weights")
    if model.peft_config[name].is_prompt_learning:
        raise ConfigError(f"a merged export of a {model.peft_config[name].peft_type} adapter, which has no weights to "
                          f"merge (prompt learning); export_safetensors(DIR, adapter_only=True) writes it")
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    modules = dict(model.named_modules())
    tuners = {q: m for q, m in modules.items() if isinstance(m, BaseTunerLayer)}
    wrappers = {q for q, m in modules.items() if isinstance(m, AuxiliaryTrainingWrapper)}
    base_prefix = "base_model.model."

    def base_name(full: str) -> str | None:
        """The name ``merge_and_unload()`` leaves ``full`` (a PEFT model's) under; None: it goes."""
        for qual in _owners(full, tuners):
            tail = full[len(qual) + 1:]
            if not tail.startswith("base_layer."):
                return None  # the adapter's
            full = f"{qual}.{tail[len('base_layer.'):]}"
        for qual in _owners(full, wrappers):
            tail = full[len(qual) + 1:]
            if not tail.startswith(f"modules_to_save.{name}."):
                return None  # original_module, another adapter's copy
            full = f"{qual}.{tail[len(f'modules_to_save.{name}.'):]}"
        return full[len(base_prefix):] if full.startswith(base_prefix) else None

    in_unit = {}  # unit -> [(qual, layer)]
    for qual, layer in tuners.items():
        found = [owner[id(p)] for p in layer.parameters() if id(p) in owner]
        units = {u for u, _, _ in found}
        foreign = [n for _, n, _ in found if not n.startswith(f"{qual}.")]
        if foreign or len(units) > 1:
            raise ConfigError(f"a merged export of {qual}, whose parameters are shared with another module "
                              f"({', '.join(foreign or sorted(units))}): merge_and_unload would change both; export "
                              f"the adapter (adapter_only=True) and merge it with peft")
        if units:
            in_unit.setdefault(units.pop(), []).append((qual, layer))
            _merge_layer(layer, name, qual, {n: torch.empty(shape, device="meta") for _, n, shape in found})  # peft's refusals, now

    def merge(unit, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        merged = {}
        for qual, layer in in_unit.get(unit, ()):
            for local, value in _merge_layer(layer, name, qual, values).items():
                merged[base_name(f"{qual}.{local}")] = value
        return merged
    return base_name, merge


def _owners(full: str, quals) -> list[str]:
    """The modules among ``quals`` that hold the parameter ``full``, innermost first."""
    return sorted((q for q in quals if full.startswith(f"{q}.")), key=len, reverse=True)


def _merge_layer(layer, adapter: str, qual: str, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's ``layer.merge`` run on copies of its parameters' ``values`` (by full name): the base
    layer's parameters after it, by their names in ``layer``. The layer keeps its own parameters,
    merged adapters and caches."""
    lent = []
    for mod_name, mod in layer.named_modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                local = f"{mod_name}.{attr}" if mod_name else attr
                lent.append((mod, attr, p, local))
    merged_before, caches = list(layer.merged_adapters), copy.copy(getattr(layer, "_caches", None))
    try:
        for mod, attr, p, local in lent:
            mod._parameters[attr] = nn.Parameter(values[f"{qual}.{local}"].clone(), requires_grad=p.requires_grad)
        try:
            with torch.no_grad():
                layer.merge(adapter_names=[adapter])
        except (RuntimeError, ValueError, NotImplementedError) as e:
            raise ConfigError(f"a merged export of {qual}: peft cannot merge its adapter ({e}); export the adapter "
                              f"alone (adapter_only=True)") from None
        base = layer.get_base_layer()
        prefix = next(n for n, m in layer.named_modules() if m is base)
        # LoRA on a parameter (ParamWrapper) merges that one; wrappers nest, one per parameter of the same base
        merged = getattr(layer, "parameter_name", None)
        return {(f"{prefix}.{a}" if prefix else a): p.detach() for a, p in base._parameters.items()
                if p is not None and (merged is None or a == merged)}
    finally:
        for mod, attr, p, _ in lent:
            mod._parameters[attr] = p
        layer.merged_adapters[:] = merged_before
        if caches is not None:
            layer._caches = caches
