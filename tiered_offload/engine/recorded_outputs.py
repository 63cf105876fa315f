"""Outputs a Hugging Face model records inside its blocks, handed out with their gradients.

transformers (5.x) records ``output_router_logits`` (a mixture of experts' load-balancing loss),
``output_attentions`` and the like with forward hooks on the modules of a class
(``_can_record_outputs``), which append what those modules return to a collector the model's
forward reads at its end. The hooks are put on the modules found by walking the model's children,
so the modules inside a streamed block (whose stand-in has none) would get none, and what they
gave in the engine's own forward of a block would be outside the engine's backward: a loss on it
would train nothing.

A tensor a block's forward keeps as an attribute (a loss term a mixture-of-experts layer keeps
for the training loop to add) is such an output too, found by comparing the block's attributes
before and after its forward (:meth:`ModelBinding.set_tensors`), handed out by setting the
attribute to the node's output.

So the engine hooks those modules itself (:class:`RecordedOutputs`). While a block runs, a
recorder on the thread (:meth:`RecordedOutputs.record`) collects what they give, for the keys the
model's collector asks for; a block's autograd node returns them as extra outputs, which go into
the collector in the order PyTorch's hooks would have appended them (block by block, module by
module), and the gradients that come back for them join the block's backward: the recompute
records them again, a kept graph has them. Without transformers' collector (another version) such
an output is refused by name (:func:`inside_message`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from torch import nn

from offload_core.errors import ConfigError

__all__ = ["RecordedOutputs", "inside_message"]


def _collector():
    """transformers' collector of recorded outputs (a private name: None in versions without it)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers version
        return None
    return _active_collector


def inside_message(flag: str, where: str, asked: str) -> str:
    how = f"set config.{flag} = False before building the engine" if asked == "config" else f"call without {flag}"
    return (f"{flag} records the outputs of {where} modules inside the blocks, which this transformers version "
            f"records where the engine cannot hand them out with their gradients. {how}; the blocks' outputs "
            f"(output_hidden_states) are recorded")


class RecordedOutputs:
    """The modules inside the blocks whose outputs the model can record, hooked (see the module's
    docstring).

    Args:
        model: the model (its ``PreTrainedModel`` parts say what they record).
        blocks: the streamed blocks' modules.
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module]):
        self._thread = threading.local()
        self._collector = None
        inside = [m for b in blocks for m in b.modules() if m is not b]
        self.flags: dict[str, str] = {}
        """``{flag: class}`` of each output recorded inside the blocks (``output_router_logits``...)."""
        targets: dict[tuple, None] = {}  # (key, class, index): a model and its base model list the same
        for sub in model.modules():
            for key, specs in (getattr(sub, "_can_record_outputs", None) or {}).items():
                for spec in specs if isinstance(specs, list) else [specs]:
                    target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
                    index = getattr(spec, "index", 0 if "hidden_states" in key else 1)
                    if isinstance(target, type) and any(isinstance(m, target) for m in inside):
                        flag = "output_attentions" if key in ("cross_attentions", "mask_decoder_attentions") \
                            else f"output_{key}"
                        self.flags.setdefault(flag, target.__name__)
                        targets[(key, target, index)] = None
        if self.flags:  # (a transformers model: transformers is imported already)
            self._collector = _collector()
        self.handed_out = self._collector is not None
        """Whether they are handed out (else asking for one is refused)."""
        if not self.handed_out:
            for flag, where in self.flags.items():
                if any(getattr(getattr(sub, "config", None), flag, False) is True for sub in model.modules()):
                    raise ConfigError(inside_message(flag, where, "config"))
            return
        for m in inside:
            for key, target, index in targets:
                if isinstance(m, target):
                    m.register_forward_hook(self._hook(key, index))

    def check(self, kwargs: dict) -> None:
        """Refuse a call that asks for an output this version's transformers records out of reach."""
        if not self.handed_out:
            for flag, where in self.flags.items():
                if kwargs.get(flag):
                    raise ConfigError(inside_message(flag, where, "pass"))

    def _hook(self, key: str, index: int):
        def hook(_module, _args, output):
            recorder = getattr(self._thread, "recorder", None)
            if recorder is None or key not in recorder[0]:
                return
            value = output[index] if isinstance(output, tuple) else output
            if value is not None:
                recorder[1].append((key, value))
        return hook

    def wanted(self) -> frozenset[str]:
        """The keys the model's forward running on this thread collects (none outside one)."""
        if self._collector is None:
            return frozenset()
        collected = self._collector.get()
        return frozenset(k for k in collected or () if isinstance(collected[k], list))

    @contextlib.contextmanager
    def record(self, keys: frozenset[str] | list[str], hand_out: bool = False) -> Iterator[list]:
        """Collect what the hooked modules give for ``keys`` while a block runs on this thread:
        yields the list of ``(key, tensor)``; ``hand_out``: append them to the model's collector
        at the end (a block whose graph is PyTorch's own: kept, or no gradient)."""
        if not keys:
            yield []
            return
        before = getattr(self._thread, "recorder", None)
        self._thread.recorder = (frozenset(keys), [])
        try:
            yield self._thread.recorder[1]
        finally:
            got = self._thread.recorder[1]
            self._thread.recorder = before
        if hand_out:
            self.hand_out(got)

    def hand_out(self, pairs) -> None:
        """Append ``(key, tensor)`` pairs to the model's collector, in order; a key ``(module,
        name)`` is a tensor the block keeps as an attribute (:meth:`ModelBinding.set_tensors`):
        the node's output takes its place."""
        collected = self._collector.get() if self._collector is not None else None
        for key, value in pairs:
            if isinstance(key, tuple):
                key[0].__dict__[key[1]] = value
            elif collected is not None and key in collected:
                collected[key].append(value)
