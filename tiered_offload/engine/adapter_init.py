"""A PEFT LoRA adapter's initial values, where its model was built under ``empty_init()`` (LoRA on
a model too large to build in memory) or its base weights are read by ``init_from``: as PEFT's
``init_lora_weights`` makes them.

The engine initialises an ``empty_init()`` model module by module with the model's own
initialiser (a Hugging Face model's ``_init_weights``). An adapter's ``lora_A`` and ``lora_B`` are
``nn.Linear``s, which that initialiser fills at random, so ``lora_B`` was not zero and training
started from a model other than the base, silently. PEFT's ``reset_lora_parameters`` ran when
``get_peft_model`` built them, on the meta device, where it did nothing; here is what it does:
``lora_A`` Kaiming-uniform (``True``) or Gaussian of std ``1/r`` (``"gaussian"``), ``lora_B`` zero;
``False`` leaves both at ``nn.Linear``'s own initialisation. DoRA's magnitude vector, which PEFT
computes from the base weights (their row norms with the adapter's product added), is computed
once the unit's base weights are read or initialised (:func:`dora_magnitudes`): with ``init_from``
the model's own base weights, and the magnitude PEFT computed from them, are not the checkpoint's.
A method that computes the adapter and a residual of the base weights from them (PiSSA, OLoRA,
CorDA, LoftQ) is refused where the base weights are read or initialised after the model was built
(``get_peft_model`` itself stops at them on the meta device), naming the way round.

Before the blocks are replaced by their stand-ins (:func:`prepare_peft_model`): prefix tuning is
refused, and PEFT's LoRA on a parameter (``ParamWrapper``: an MoE's router and experts) is made to
keep the engine's tensors as it found them (:func:`steady_param_wrappers`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Iterable

import torch
from torch import nn

from offload_core.errors import ConfigError

__all__ = ["adapter_initialisers", "dora_layers", "dora_magnitudes", "refuse_inits_from_base_weights",
           "prepare_peft_model", "steady_param_wrappers"]


def adapter_initialisers(roots: Iterable[nn.Module], peft_config) -> dict[int, Callable[[nn.Module], None]]:
    """``{id(module): initialiser}`` for the ``lora_A`` / ``lora_B`` modules of every LoRA layer under
    ``roots`` (the model and its blocks), by the adapter's ``init_lora_weights``; empty where the
    model is not a PEFT model (``peft_config``: the model's, a dict of adapter configs)."""
    if not isinstance(peft_config, dict):
        return {}
    out: dict[int, Callable[[nn.Module], None]] = {}
    for root in roots:
        for layer in root.modules():
            if not (hasattr(layer, "reset_lora_parameters") and isinstance(getattr(layer, "lora_A", None), nn.ModuleDict)):
                continue
            for name, a in layer.lora_A.items():
                config = peft_config.get(name)
                init = getattr(config, "init_lora_weights", True)
                refuse_inits_from_base_weights({name: config}, "are not in memory under empty_init()")
                out[id(a)] = _linear_default if init is False else _gaussian(layer.r[name]) if init == "gaussian" \
                    else _kaiming
                out[id(layer.lora_B[name])] = _linear_default if init is False else _zeros
            for dora in (getattr(layer, "lora_magnitude_vector", None) or {}).values():
                out[id(dora)] = _zeros  # for now: dora_magnitudes computes it from the unit's base weights
    return out


def refuse_inits_from_base_weights(peft_config, why: str) -> None:
    """Refuse an adapter of ``peft_config`` (a PEFT model's, by adapter name) whose
    ``init_lora_weights`` computes it and a residual of the base weights from them (PiSSA, OLoRA...):
    the base weights the engine trains from ``why`` (are not in memory; are read after the model
    was built)."""
    for name, config in (peft_config.items() if isinstance(peft_config, dict) else ()):
        init = getattr(config, "init_lora_weights", True)
        if init is not True and init is not False and init != "gaussian":
            raise ConfigError(
                f"adapter {name!r}: init_lora_weights={init!r} computes the adapter (and a residual of the base "
                f"weights) from the base weights, which {why}. Use init_lora_weights=True or 'gaussian', or build the "
                f"PEFT model on the pretrained model (from_pretrained, then get_peft_model) without init_from")


def dora_layers(roots: Iterable[nn.Module]) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """``(name, LoRA layer, adapter, DoRA layer)`` for each DoRA magnitude under ``roots``, once each."""
    found, seen = [], set()
    for root in roots:
        for qual, layer in root.named_modules():
            for adapter, dora in (getattr(layer, "lora_magnitude_vector", None) or {}).items():
                if id(dora) not in seen:
                    seen.add(id(dora))
                    found.append((qual, layer, adapter, dora))
    return found


def dora_magnitudes(layers, unit, flat: torch.Tensor, names: set[str] | None = None) -> None:
    """DoRA's magnitude vector of each of ``layers`` (:func:`dora_layers`) whose magnitude is among
    the unit's parameters (``names``: those of them; None: all), as PEFT computes it when it builds
    the layer (its ``update_layer``: the row norms of the base weight plus the scaled adapter
    product), from the values in the unit's weight buffer ``flat``, written there. PEFT's own code
    runs on copies of those values lent to the layer, which keeps its own parameters."""
    slots = {id(s.param): s for s in unit.params}

    def value(p: torch.Tensor) -> torch.Tensor:
        s = slots[id(p)]
        return flat[s.offset:s.offset + s.numel].view(s.shape)
    for qual, layer, adapter, dora in layers:
        magnitude = dora._parameters.get("weight")
        s = slots.get(id(magnitude))
        if s is None or (names is not None and s.name not in names):
            continue
        base = layer.get_base_layer()
        parts = [base.weight, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight] \
            if adapter in getattr(layer, "lora_A", {}) else []
        if not parts or any(id(p) not in slots for p in parts):
            raise ConfigError(f"{qual}: DoRA's magnitude of adapter {adapter!r} is computed from the base weights and "
                              f"the adapter, which are not all in its unit; build the PEFT model on the pretrained "
                              f"model (from_pretrained, then get_peft_model) without init_from")
        held = base._parameters["weight"]
        base._parameters["weight"] = nn.Parameter(value(held).clone(), requires_grad=False)
        try:
            with torch.no_grad():
                dora.update_layer(base_layer=base, lora_A=value(parts[1]).clone(), lora_B=value(parts[2]).clone(),
                                  scaling=layer.scaling[adapter])
                value(magnitude).copy_(dora.weight)
        finally:
            base._parameters["weight"] = held
            dora._parameters["weight"] = magnitude


def _linear_default(module: nn.Module) -> None:
    module.reset_parameters()


def _kaiming(module: nn.Module) -> None:
    nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))


def _gaussian(r: int) -> Callable[[nn.Module], None]:
    def init(module: nn.Module) -> None:
        nn.init.normal_(module.weight, std=1 / r)
    return init


def _zeros(module: nn.Module) -> None:
    nn.init.zeros_(module.weight)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def prepare_peft_model(model: nn.Module) -> None:
    """What a PEFT model needs before its blocks are replaced by their stand-ins: prefix tuning
    refused (it gives every block its trained prefix as past keys and values, a cache object, not
    as a tensor input whose gradient the engine streams), ``ParamWrapper``s steadied
    (:func:`steady_param_wrappers`)."""
    config = getattr(model, "peft_config", None)
    if isinstance(config, dict) and any(getattr(c, "peft_type", None) == "PREFIX_TUNING" for c in config.values()):
        raise ConfigError("PEFT's prefix tuning gives every block its trained prefix as past keys and values (a cache "
                          "object), which the engine does not stream a gradient through. Prompt tuning "
                          "(peft.PromptTuningConfig) and P-tuning (peft.PromptEncoderConfig) train the prefix as input "
                          "embeddings, LoRA in the blocks: each trains through the engine as in PyTorch")
    steady_param_wrappers(model)


def steady_param_wrappers(model: nn.Module) -> None:
    """Let PEFT's ``ParamWrapper`` (LoRA on a parameter of a module that is not a linear layer: an
    MoE's router, its stacked experts; what ``target_modules="all-linear"`` picks on Mixtral, and
    ``target_parameters``) run on the engine's weights as it runs on the model's own. In every
    forward it registers a parametrization of its base layer's parameter (``_activate_lora``) and
    removes it after. Registering ``set_``s the tensor onto itself (no new value, a new version), and
    removing it registers the tensor again: as a parameter if it is an ``nn.Parameter``, else as a
    buffer. Inside the engine's calls the slot holds the engine's tensor (a leaf of the block's
    forward), so a recompute stopped with PyTorch's "modified by an inplace operation" and the weight
    came back as a buffer, holding the engine's placeholder. Each wrapper's ``_activate_lora`` is
    wrapped: PEFT's own code runs (its choice of how to add the adapter, and so its numbers), then
    the tensor's version is put back and, once PEFT removed its parametrization, the tensor goes
    back into the parameter slot it came from. Call before the blocks are replaced by their stand-ins."""
    for name, module in model.named_modules():
        if type(module).__name__ != "ParamWrapper" or not type(module).__module__.startswith("peft."):
            continue
        activate = getattr(module, "_activate_lora", None)
        if getattr(activate, "func", None) is _activate_keeping_slot:
            continue  # (wrapped by an engine built on this model before)
        if activate is None or not isinstance(getattr(module, "parameter_name", None), str) \
                or not callable(getattr(module, "get_base_layer", None)):
            base = type(getattr(module, "base_layer", module)).__name__
            raise ConfigError(
                f"{name} is a PEFT ParamWrapper (LoRA on a parameter of a {base}) of "
                f"a peft version the engine does not know (no _activate_lora / parameter_name). Put the adapter on "
                f"linear layers only: target_modules such as [q_proj, k_proj, v_proj, o_proj] (in tiered-offload "
                f"train, lora.targets), or use a peft version from 0.17 on")
        module._activate_lora = functools.partial(_activate_keeping_slot, module, activate)


@contextlib.contextmanager
def _activate_keeping_slot(wrapper: nn.Module, activate: Callable, active_adapters):
    """PEFT's ``activate(active_adapters)`` with the base layer's parameter kept as it was: the same
    version (its ``set_`` onto itself changed nothing) and, after, in its parameter slot."""
    base, name = wrapper.get_base_layer(), wrapper.parameter_name
    held = base._parameters.get(name)
    version = None if held is None else held._version
    try:
        with activate(active_adapters):
            if held is not None and held._version != version:
                torch._C._autograd._unsafe_set_version_counter((held,), (version,))
            yield
    finally:
        if held is not None and base._buffers.get(name) is held:
            del base._buffers[name]
            base._parameters[name] = held
