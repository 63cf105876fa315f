"""A PEFT LoRA adapter's initial values, where its model was built under ``empty_init()`` (LoRA on
a model too large to build in memory): as PEFT's ``init_lora_weights`` makes them.

The engine initialises an ``empty_init()`` model module by module with the model's own
initialiser (a Hugging Face model's ``_init_weights``). An adapter's ``lora_A`` and ``lora_B`` are
``nn.Linear``s, which that initialiser fills at random, so ``lora_B`` was not zero and training
started from a model other than the base, silently. PEFT's ``reset_lora_parameters`` ran when
``get_peft_model`` built them, on the meta device, where it did nothing; here is what it does:
``lora_A`` Kaiming-uniform (``True``) or Gaussian of std ``1/r`` (``"gaussian"``), ``lora_B`` zero;
``False`` leaves both at ``nn.Linear``'s own initialisation. A method that computes the adapter
from the base weights (DoRA's magnitude vector; PiSSA and OLoRA, at which ``get_peft_model``
itself stops on the meta device) cannot: those weights are not in memory. It is refused, naming
the way round.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from torch import nn

from offload_core.errors import ConfigError

__all__ = ["adapter_initialisers", "refuse_reparametrizing_adapters"]


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
                if getattr(config, "use_dora", False):
                    raise ConfigError(
                        f"adapter {name!r} uses DoRA (use_dora=True), whose magnitude vector PEFT computes from the "
                        f"base weights, which are not in memory under empty_init(). Build the PEFT model on the CPU, "
                        f"or use plain LoRA")
                if init is not True and init is not False and init != "gaussian":
                    raise ConfigError(
                        f"adapter {name!r}: init_lora_weights={init!r} computes the adapter from the base weights, which "
                        f"are not in memory under empty_init(). Use init_lora_weights=True or 'gaussian', or build the "
                        f"PEFT model on the CPU")
                out[id(a)] = _linear_default if init is False else _gaussian(layer.r[name]) if init == "gaussian" \
                    else _kaiming
                out[id(layer.lora_B[name])] = _linear_default if init is False else _zeros
    return out


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


def refuse_reparametrizing_adapters(model: nn.Module) -> None:
    """Refuse PEFT's ``ParamWrapper`` (LoRA on a module that is not a linear layer: an MoE's router,
    its stacked experts; what ``target_modules="all-linear"`` picks on Mixtral): it registers a
    parametrization of the module's parameter in every forward and removes it after, which the
    engine's recompute and ``forward_backward`` do not replay (a recompute stopped with PyTorch's
    "modified by an inplace operation"). Call before the blocks are replaced by their stand-ins."""
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper" and type(module).__module__.startswith("peft."):
            raise ConfigError(
                f"{name} is a PEFT ParamWrapper (LoRA on a parameter of a {type(module.get_base_layer()).__name__}, "
                f"re-parametrized in every forward), which the engine cannot recompute exactly. Put the adapter on "
                f"linear layers only: target_modules such as [q_proj, k_proj, v_proj, o_proj] (in tiered-offload "
                f"train, lora.targets)")
