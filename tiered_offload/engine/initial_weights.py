"""The weights a fresh training state starts from: read from safetensors (``init_from``),
initialised (a model built on the meta device or with ``empty_init``), or copied from the model,
one unit at a time, each written to its tier and the disk before the next is built."""

from __future__ import annotations

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
        aliases, converted = transformers_names(binding.model, reader.names())
        reader.alias(aliases)
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


def transformers_names(model, names: list[str]) -> tuple[dict[str, str], list[str]]:
    """For a checkpoint of a Hugging Face ``model`` whose tensors are ``names``: the names
    transformers gives them when ``from_pretrained`` loads them, where they differ (``{model's
    name: file's name}``: GPT-NeoX's ``embed_out`` is ``lm_head``), and the tensors it converts
    (Mixtral's experts, one tensor each in the file, merged per layer in the model). Empty for a
    model transformers has no renamings for, or a transformers without them (before 5)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - not a transformers model, or another transformers: names as saved
        return {}, []
    renamings = [t for t in transforms or [] if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms or [] if isinstance(t, WeightConverter)]
    aliases, converted = {}, []
    for name in names:
        new, converter = rename_source_key(name, renamings, converters)
        if converter is not None:
            converted.append(name)
        elif new != name:
            aliases[new] = name
    return aliases, converted
