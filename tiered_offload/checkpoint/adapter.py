"""A PEFT model's adapter beside its export, as ``PeftModel.save_pretrained`` writes it
(``adapter_model.safetensors`` and ``adapter_config.json``), which ``PeftModel.from_pretrained``
loads onto the base model.

Which of the model's tensors make the adapter, and under which keys, is peft's own
``get_peft_model_state_dict``: it walks the model's modules for its tuner layers, so it runs with
the real blocks in the model's tree instead of the engine's stand-ins, on the engine's values of the
trainable parameters (a PEFT model trains its adapter and its ``modules_to_save`` only). A
trainable parameter the adapter leaves out (one unfrozen by hand) would be lost without a word, as
peft's own save loses it: the export says so.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

from offload_core.errors import ConfigError
from tiered_offload.checkpoint.safetensors_io import SafetensorsWriter, iter_chunks

__all__ = ["ADAPTER_FILE", "export_adapter", "peft_adapter_name"]

log = logging.getLogger(__name__)

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def peft_adapter_name(model) -> str | None:
    """The active adapter's name where ``model`` is a PEFT model (``peft.PeftModel``), else None."""
    config, name = getattr(model, "peft_config", None), getattr(model, "active_adapter", None)
    return name if isinstance(config, dict) and isinstance(name, str) and name in config else None


def export_adapter(out: str | os.PathLike, binding, store, placement, required: bool = False) -> list[Path]:
    """Write the adapter of ``binding.model`` into ``out`` if it is a PEFT model (else nothing; or,
    ``required``, a :class:`ConfigError`): its trainable parameters read from ``store``, keyed and
    filtered by peft. Sharded, every rank reads; the one that writes exports returns the files."""
    model = binding.model
    name = peft_adapter_name(model)
    if name is None:
        if required:
            raise ConfigError(f"an adapter-only export of a {type(model).__name__}, which is not a PEFT model: it has "
                              f"no adapter; export_safetensors(DIR) writes its weights")
        return []
    from peft.utils import get_peft_model_state_dict
    trained = [(unit, slot) for unit, slot in binding.param_order if slot.requires_grad]
    weights = dict(placement.parameters(store, binding.units, trained))
    with binding.real_blocks():
        adapter = get_peft_model_state_dict(model, state_dict=weights, adapter_name=name)
    kept = {id(t) for t in adapter.values()}
    left = [n for n, t in weights.items() if id(t) not in kept]
    if left:
        log.warning("the export's %s holds adapter %r as peft saves it, without %d trainable parameter(s) that are "
                    "not part of it (e.g. %s): they are in its model.safetensors; to save them with the adapter, put "
                    "their modules in the config's modules_to_save", ADAPTER_FILE, name, len(left), left[:3])
    if not placement.writes_exports():
        return []
    values = list(adapter.values())
    files = SafetensorsWriter(out, [(k, t.dtype, tuple(t.shape)) for k, t in adapter.items()], max_shard_size=1 << 62,
                              single_name=ADAPTER_FILE).write(lambda i, write: [write(c) for c in iter_chunks(values[i])])
    config = copy.deepcopy(model.peft_config[name])  # as PeftModel.save_pretrained writes it
    config.inference_mode = True
    config.save_pretrained(str(out))
    path = Path(out) / ADAPTER_CONFIG
    path.chmod(0o600)
    return [*files, path]
