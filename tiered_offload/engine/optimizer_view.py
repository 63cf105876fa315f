"""``engine.optimizer``: the optimizer the engine was built from (or a stand-in), kept an instance of
its class so that learning-rate schedulers and loops that call ``optimizer.step()`` /
``zero_grad()`` work on the engine. Its groups are the engine's; its state lives in the store,
so reading or saving it here is refused, naming the ways that work.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from offload_core.errors import ConfigError, TensorStateError
from tiered_offload.engine.parameter_guard import GradInStore

if TYPE_CHECKING:
    from tiered_offload.engine.facade import Engine

__all__ = ["OptimizerView"]


class _StateInStore(Mapping):
    """``engine.optimizer.state``: the optimizer's state is in the store, so reading it here
    (``state[p]["exp_avg"]`` to log a moment) is refused, where ``torch.optim``'s ``{}`` said nothing."""

    def __getitem__(self, key):
        raise TensorStateError(OptimizerView._state_in_store("state[...]"))

    def __iter__(self):
        raise TensorStateError(OptimizerView._state_in_store("state"))

    def __len__(self) -> int:
        raise TensorStateError(OptimizerView._state_in_store("state"))


_ADOPTED: dict[type, type] = {}
"""An optimizer class -> the engine's view that is still one (:meth:`OptimizerView.adopt`)."""


class OptimizerView(torch.optim.Optimizer):
    """Enough of ``torch.optim.Optimizer`` for LR schedulers: shared ``param_groups``, ``step``,
    ``zero_grad``. What it cannot honour (a new group, its state, a ``GradScaler``) is refused."""

    def __init__(self, engine: "Engine"):
        self._engine = None
        # one stand-in tensor per group: the view must look like an optimizer, but it holds no
        # parameters (the engine's are in its store) and no state; their .grad says so when used
        # (a GradScaler's unscale_)
        dummies = [torch.zeros(1, requires_grad=True) for _ in engine.param_groups]
        super().__init__([{"params": [d]} for d in dummies], dict(engine._spec.defaults))
        for group, dummy in zip(engine.param_groups, dummies):
            group["params"] = [dummy]
            dummy.grad = torch.Tensor._make_subclass(GradInStore, torch.zeros(1))
        self.param_groups = engine.param_groups
        self.state = _StateInStore()
        self._engine = engine

    @classmethod
    def adopt(cls, optimizer: torch.optim.Optimizer, engine: "Engine") -> "OptimizerView":
        """Make ``optimizer`` (the instance the engine was built from) the engine's view, still an
        instance of its class: the learning rates set in its ``param_groups`` and an LR scheduler
        built over it (before or after the engine) reach the engine's groups, and its ``step()`` is
        ``engine.step()``. (Keeping the engine's own copy of its groups left all of those without
        effect, without a word.) Its parameters and state stay the engine's."""
        scheduled = hasattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched")
        view = cls(engine)
        optimizer.__dict__.clear()
        optimizer.__dict__.update(view.__dict__)
        kind = type(optimizer)
        if kind not in _ADOPTED:
            _ADOPTED[kind] = type(f"Engine{kind.__name__}", (cls, kind), {"__module__": cls.__module__})
        optimizer.__class__ = _ADOPTED[kind]
        if scheduled:  # a scheduler built over it first checks that its step() is the one it wrapped
            me = weakref.ref(optimizer)

            @functools.wraps(cls.step)
            def step(*args, **kwargs):
                return cls.step(me(), *args, **kwargs)
            step._wrapped_by_lr_sched = True
            optimizer.step = step
        return optimizer

    def add_param_group(self, param_group: dict) -> None:  # noqa: D102 - refused once built
        if self._engine is None:  # (the base class's __init__)
            return super().add_param_group(param_group)
        raise ConfigError("engine.optimizer.add_param_group: the engine lays its store out by the optimizer's "
                          "groups when it is built, so a group cannot be added to it. To train more parameters: "
                          "engine.export_safetensors(DIR), then build a new engine over the model with those "
                          "parameters trainable and init_from=DIR (optimizer states start fresh)")

    def state_dict(self):  # noqa: D102 - refused
        raise TensorStateError(self._state_in_store("state_dict()"))

    def load_state_dict(self, state_dict) -> None:  # noqa: D102 - refused
        raise TensorStateError(self._state_in_store("load_state_dict()"))

    def __deepcopy__(self, memo):  # noqa: D105 - refused
        raise TensorStateError(self._state_in_store("", "a copy of engine.optimizer (copy.deepcopy)"))

    def __reduce_ex__(self, protocol):  # noqa: D105 - refused
        raise TensorStateError(self._state_in_store("", "a copy of engine.optimizer (pickle, torch.save)"))

    @staticmethod
    def _state_in_store(call: str, what: str | None = None) -> str:
        return (f"{what or f'engine.optimizer.{call}'}: the optimizer's state (its moments, step counts) lives in "
                f"the engine's store, not in this stand-in. A commit saves it with the weights (durable=True; "
                f"engine.commit()) and Engine.resume(storage, model) restores it; engine.export_safetensors(DIR) "
                f"exports the weights")

    def step(self, closure=None):
        """``engine.step()``, as ``torch.optim.Optimizer.step(closure)``: the closure (which computes the
        loss and back-propagates it with ``engine.backward``) runs first, with gradients enabled;
        returns its loss (None without one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's parameters' gradients only, as ``torch.optim.Optimizer.zero_grad()``: a
        trainable parameter in no group keeps accumulating (``engine.zero_grad()`` forgets all)."""
        self._engine._gradients.forget(optimized_only=True, to_none=set_to_none)
