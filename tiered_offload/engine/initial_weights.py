"""The weights a fresh training state starts from: read from safetensors (``init_from``),
initialised (a model built on the meta device or with ``empty_init``), or copied from the model,
one unit at a time, each written to its tier and the disk before the next is built."""

from __future__ import annotations

import logging
import re

from offload_core.errors import ConfigError
from tiered_offload.checkpoint.adapter import is_adapter_directory, saved_adapter
from tiered_offload.checkpoint.safetensors_io import PretrainedReader
from tiered_offload.engine.adapter_init import dora_layers, dora_magnitudes, refuse_inits_from_base_weights
from tiered_offload.engine.binding import ModelBinding
from tiered_offload.progress import track

__all__ = ["load_initial_weights", "transformers_names"]

log = logging.getLogger(__name__)


def load_initial_weights(store, binding: ModelBinding, placement, state_kinds, init_from=None) -> None:
    """Register every unit's buffers (this process's share of them) and fill its weights."""
    base, adapter_dir = _sources(binding, init_from)
    reader, fresh, adapter, from_adapter = None, set(), None, frozenset()
    if base is not None:
        reader = PretrainedReader(base)
        fresh = _match_file_names(binding, reader)
    if adapter_dir is not None:  # the adapter's parameters read from it, not started as PEFT makes them
        adapter, from_adapter = saved_adapter(binding, adapter_dir)
        fresh -= from_adapter
    init = binding.initialiser() if binding.on_meta and (reader is None or fresh) else None
    # DoRA's magnitudes come from base weights the model did not hold when PEFT computed them
    recomputed = bool(fresh) if reader is not None else binding.on_meta
    dora = dora_layers([binding.model, *(u.module for u in binding.blocks)]) if recomputed else []
    try:
        what = "reading init_from" if init_from is not None else "placing the initial weights"
        for unit in track(binding.units, desc=what, unit="unit"):
            placement.register(store, unit, state_kinds, lambda flat, unit=unit: _fill(
                binding, unit, flat, reader, init, fresh, dora, adapter, from_adapter))
    finally:
        for r in (reader, adapter):
            if r is not None:
                r.close()
    binding.release_parameters()  # the model no longer holds the weights: the store does


def _sources(binding: ModelBinding, init_from) -> tuple:
    """``init_from`` (a checkpoint; or a list: a checkpoint and a directory PEFT's
    ``save_pretrained`` wrote, told apart by its ``adapter_config.json``) as ``(checkpoint,
    adapter directory)``, either None."""
    if init_from is None:
        return None, None
    paths = list(init_from) if isinstance(init_from, (list, tuple)) else [init_from]
    is_adapter = [is_adapter_directory(p) for p in paths]
    adapters = [p for p, a in zip(paths, is_adapter) if a]
    bases = [p for p, a in zip(paths, is_adapter) if not a]
    if len(adapters) > 1 or len(bases) > 1 or not paths:
        raise ConfigError(f"init_from={[str(p) for p in paths]}: " + (
            "two adapters" if len(adapters) > 1 else "two checkpoints" if len(bases) > 1 else "nothing") +
            "; init_from takes a checkpoint, or [BASE, ADAPTER] (a PEFT model's base checkpoint and the directory "
            "its save_pretrained wrote)")
    if adapters and not bases and binding.on_meta:
        raise ConfigError(f"init_from names only an adapter ({adapters[0]}), and the model was built without its "
                          f"base weights (on the meta device, or under empty_init): pass the base checkpoint too, "
                          f"init_from=[BASE, {str(adapters[0])!r}]")
    return (bases or [None])[0], (adapters or [None])[0]


def _match_file_names(binding: ModelBinding, reader: PretrainedReader) -> set[str]:
    """Let ``reader`` give each of the model's parameters under the name the file has for it (as
    ``from_pretrained`` converts the file: :func:`transformers_names`), and check that it holds them
    all. A PEFT model may read its base's checkpoint: ``base_model.model.`` and ``.base_layer`` (a wrapped
    layer), ``modules_to_save.NAME`` / ``original_module`` (a copy to train) are not in the file's
    names, and the adapter's parameters not in it start as PEFT makes them. So do the parameters
    ``save_pretrained`` does not save (``_keys_to_ignore_on_save``: Marian's sinusoidal positions)
    where the file lacks them: as the model holds them, or initialised. Returns those (none where
    the file has them: a PEFT model's own export read back)."""
    names, params = reader.names(), [s for _, s in binding.param_order]
    configs = getattr(binding.model, "peft_config", None)
    prompt = isinstance(configs, dict) and any(getattr(c, "is_prompt_learning", False) for c in configs.values())
    # a tuner (LoRA...) holds the transformers model as base_model.model; prompt learning as base_model
    outer = "base_model." if prompt else "base_model.model."
    tuner = getattr(binding.model, "base_model", None) if prompt else \
        getattr(getattr(binding.model, "base_model", None), "model", None)
    prefix = getattr(getattr(binding.model, "base_model", None), "prefix", None)
    peft = isinstance(configs, dict) and tuner is not None and (prefix or prompt)
    aliases, merged, converted = transformers_names(tuner if peft else binding.model, names)
    fresh = set()
    if peft:
        in_file = set(names)
        if prefix and any(s.name not in in_file and any(p.startswith(prefix) for p in s.name.split(".")) for s in params):
            refuse_inits_from_base_weights(binding.model.peft_config, "init_from reads after the model was built")
        tied = _tied_names(tuner)
        for slot in params:
            parts = slot.name.split(".")
            if prompt and parts[0] == "prompt_encoder" and slot.name not in in_file:
                fresh.add(slot.name)  # the prompt's, as PEFT makes it
            if slot.name in in_file or not slot.name.startswith(outer):
                continue
            if prefix and any(part.startswith(prefix) for part in parts):
                fresh.add(slot.name)  # the adapter's
                continue
            inner = slot.name[len(outer):]
            base = re.sub(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)", "", inner)
            if base not in in_file and base not in aliases:  # a copy of a tied weight: the file has it once
                base = tied.get(re.sub(r"\.modules_to_save\.[^.]+(?=\.)", ".original_module", inner), base)
            if base in merged:
                merged[slot.name] = merged[base]
            else:
                aliases[slot.name] = aliases.get(base, base)
    unsaved, in_file = set(getattr(tuner if peft else binding.model, "_keys_to_ignore_on_save", None) or ()), set(names)
    fresh |= {s.name for s in params if s.name.removeprefix(outer if peft else "") in unsaved
              and s.name not in aliases and s.name not in merged and s.name not in in_file}
    reader.alias(aliases)
    reader.merge(merged)
    fresh |= _new_head(tuner if peft else binding.model, outer if peft else "", [s.name for s in params],
                       [s.name for s in params if s.name not in fresh and not reader.holds(s.name)], reader)
    reader.check_covers([(s.name, s.shape) for s in params if s.name not in fresh], converted)
    return fresh


def _new_head(model, outer: str, names: list[str], absent: list[str], reader: PretrainedReader) -> set[str]:
    """The parameters the file lacks (``absent``, of the model's ``names``) that start as the model
    holds them, as ``from_pretrained`` starts them: where every one lies outside the model's trunk
    (its ``base_model_prefix``: a task head, as a classifier's ``score``, on a language model's
    checkpoint) and the file holds the rest, the trunk among them. Where one of the trunk's is
    absent, or no name is the trunk's (a wrapper this does not know), none: refused, naming them all."""
    trunk = getattr(model, "base_model_prefix", "")
    within = lambda n: n.removeprefix(outer).startswith(trunk + ".")  # noqa: E731
    if not trunk or not absent or any(within(n) for n in absent) or not any(within(n) for n in names):
        return set()
    log.warning("init_from: %s does not hold %d parameter(s) outside the model's trunk (%s%s): they start as the "
                "model holds them (its own initialisation), as from_pretrained starts a new task head",
                reader.source, len(absent), ", ".join(absent[:5]), "..." if len(absent) > 5 else "")
    return set(absent)


def _tied_names(model) -> dict[str, str]:
    """``{name: first name}`` of each parameter ``model`` holds under more than one name (a head tied
    to the embeddings): the file ``save_pretrained`` wrote has it once, under the first."""
    first, tied = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _fill(binding: ModelBinding, unit, flat, reader, init, fresh=frozenset(), dora=(), adapter=None,
          from_adapter=frozenset()) -> None:
    """The unit's initial weights into ``flat``: read, initialised (a meta model) or copied; with a
    reader, the parameters in ``fresh`` as the model holds them or, on the meta device, initialised;
    those in ``from_adapter`` read by ``adapter`` (a saved PEFT adapter's); ``dora``
    (:func:`dora_layers`): then their magnitudes (those in ``fresh``, with a reader) from the
    weights in ``flat``."""
    unread = [s for s in unit.params if s.name not in from_adapter and (reader is None or s.name in fresh)]
    for slot in unit.params:
        source = adapter if slot.name in from_adapter else reader if slot.name not in fresh else None
        if source is not None:
            source.read_into(slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
    if unread and binding.on_meta:
        binding.initialise_unit(unit, flat, init, only=None if reader is None else {s.name for s in unread})
    else:
        for slot in unread:
            flat[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
    if dora:
        dora_magnitudes(dora, unit, flat, set(fresh) if reader is not None else None)


def transformers_names(model, names: list[str]) -> tuple[dict[str, str], dict[str, list[list[str]]], list[str]]:
    """For a checkpoint of a Hugging Face ``model`` whose tensors are ``names``, what
    ``from_pretrained`` makes of them (transformers 5's conversions; empty for a model without any,
    or an older transformers):

    - ``{model's name: file's name}`` where it renames (GPT-NeoX's ``embed_out`` is ``lm_head``);
    - ``{model's name: [[file's names, by expert], ...]}`` where it stacks a layer's experts, one
      tensor each in the file, along a new first dimension, and concatenates the stacks of
      several (Mixtral's ``w1`` and ``w3``, Qwen-MoE's ``gate_proj`` and ``up_proj``) along the
      second: the model's tensor is the file's, placed block by block (:meth:`PretrainedReader.merge`);
    - the file's tensors it converts otherwise, which are not read."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - not a transformers model, or another transformers: names as saved
        return {}, {}, []
    renamings = [t for t in transforms or [] if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms or [] if isinstance(t, WeightConverter)]
    aliases, groups, converted = {}, {}, []
    # (the trunk's prefix added or stripped where the model has the name so: a checkpoint of the trunk alone
    # into a model with a head, or the other way; the names only, as from_pretrained's meta state dict)
    prefix = getattr(model, "base_model_prefix", None) or None
    own = dict.fromkeys([n for n, _ in model.named_parameters(remove_duplicate=False)] +
                        [n for n, _ in model.named_buffers(remove_duplicate=False)], True)
    for name in names:
        new, pattern = rename_source_key(name, renamings, converters, prefix, own)
        if pattern is None:
            if new != name:
                aliases[new] = name
            continue
        converter = next((c for c in converters if pattern in c.source_patterns), None)
        expert = re.search(r"\.experts\.(\d+)\.", name)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", [])]
        stacks = ops[:1] == [("MergeModulelist", 0)] and ops[1:] in ([], [("Concatenate", 1)])
        if converter is None or expert is None or not stacks:
            converted.append(name)
            continue
        by_pattern = groups.setdefault(new, [{} for _ in converter.source_patterns])
        by_pattern[converter.source_patterns.index(pattern)][int(expert.group(1))] = name
    merged = {}
    for new, by_pattern in groups.items():
        if all(sorted(g) == list(range(len(by_pattern[0]))) for g in by_pattern) and by_pattern[0]:
            merged[new] = [[g[e] for e in range(len(g))] for g in by_pattern]
        else:  # an expert missing from the file: not this model's checkpoint
            converted += [n for g in by_pattern for n in g.values()]
    return aliases, merged, converted
