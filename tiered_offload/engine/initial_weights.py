"""The weights a fresh training state starts from: read from safetensors (``init_from``),
initialised (a model built on the meta device or with ``empty_init``), or copied from the model,
one unit at a time, each written to its tier and the disk before the next is built."""

from __future__ import annotations

import re

from tiered_offload.checkpoint.safetensors_io import PretrainedReader
from tiered_offload.engine.binding import ModelBinding
from tiered_offload.progress import track

__all__ = ["load_initial_weights", "transformers_names"]


def load_initial_weights(store, binding: ModelBinding, placement, state_kinds, init_from=None) -> None:
    """Register every unit's buffers (this process's share of them) and fill its weights."""
    init = binding.initialiser() if binding.on_meta and init_from is None else None
    reader = None
    if init_from is not None:
        reader = PretrainedReader(init_from)
        aliases, merged, converted = transformers_names(binding.model, reader.names())
        reader.alias(aliases)
        reader.merge(merged)
        reader.check_covers([(s.name, s.shape) for _, s in binding.param_order], converted)
    try:
        what = "reading init_from" if reader is not None else "placing the initial weights"
        for unit in track(binding.units, desc=what, unit="unit"):
            placement.register(store, unit, state_kinds, lambda flat, unit=unit: _fill(binding, unit, flat, reader, init))
    finally:
        if reader is not None:
            reader.close()
    binding.release_parameters()  # the model no longer holds the weights: the store does


def _fill(binding: ModelBinding, unit, flat, reader, init) -> None:
    """The unit's initial weights into ``flat``: read, initialised (a meta model) or copied."""
    if reader is not None:
        for slot in unit.params:
            reader.read_into(slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
    elif binding.on_meta:
        binding.initialise_unit(unit, flat, init)
    else:
        for slot in unit.params:
            flat[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))


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
    for name in names:
        new, pattern = rename_source_key(name, renamings, converters)
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
