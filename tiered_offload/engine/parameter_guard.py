"""What the user's code may do to the model's parameters while the engine holds their weights, and
what it may not: the rules at the boundary between the model the user holds and the store.

Between the engine's calls each parameter holds a placeholder of its shape (one element, expanded;
its weights are in the store, its ``.grad`` a :class:`GradInStore`), and a streamed block's does
outside the block's forward too (the forward runs on leaves of the engine's own):

* **honoured**: gradient hooks (``param.register_hook``), put on the leaves that stand for a
  streamed block's parameters in each backward (:func:`hook_leaves`; on a repeated block's summed
  gradients, :func:`run_grad_hooks`); forward hooks run again in a recompute, which the engine says
  at build time (:func:`warn_of_forward_hooks`);
* **refused where it happens, naming the parameter**: reading or changing its values (an op on it,
  ``.data``, a copy, ``print``: a penalty summed over ``model.parameters()``, an EMA, ``nn.init``):
  :func:`unbind` gives it a class that says so (:class:`_Unbound`); its shape, dtype, ``requires_grad``,
  hooks and ``.grad`` read as before, and ``model.to()`` moves its placeholder;
* **followed**: ``requires_grad`` set to False and back (gradual freezing), by each block call as
  PyTorch's graph follows it;
* **refused at the next forward, naming the way**: unfreezing a parameter frozen when the engine was
  built (:func:`check_requires_grad`), a post-accumulate-grad hook on a streamed block's parameter
  (:func:`check_grad_hooks`), a parameter added after the engine was built
  (:func:`check_no_new_parameters`), a parameter changed in place, given new ``.data`` or another
  dtype or device (:func:`check_untouched`), Hugging Face's ``resize_token_embeddings``
  (:func:`refuse_resizing`), reading a ``.grad`` (:class:`GradInStore`), and the model's
  ``state_dict`` / ``load_state_dict`` (:func:`weights_in_store`, :func:`weights_into_store`).

:meth:`~tiered_offload.engine.binding.ModelBinding.check_call` runs the checks before every forward.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

import torch

from offload_core.errors import ConfigError, TensorStateError

__all__ = ["GradInStore", "bind", "check_grad_hooks", "check_no_new_parameters", "check_requires_grad", "check_untouched",
           "grad_hooks", "hook_leaves", "refuse_resizing", "run_grad_hooks", "unbind", "warn_of_forward_hooks",
           "state_dict_names_only", "weights_in_store", "weights_into_store"]


_MOVES = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type"})
"""Calls that give a tensor another dtype or device (``model.to()``, ``.half()``): on a placeholder
they give a placeholder of that dtype or device, not the whole tensor materialised."""


def _moved(func, args, kwargs):
    """``func`` (one of :data:`_MOVES`) applied to the placeholder ``args[0]``: ``args[0]`` itself
    where nothing changes (as PyTorch returns the tensor itself), else a placeholder of the new
    dtype or device and the same shape (one element, expanded)."""
    t = args[0]
    one = torch._C._disabled_torch_function_impl(func, (torch.Tensor,), (torch.zeros((), dtype=t.dtype, device=t.device),
                                                                         *args[1:]), kwargs)
    if not isinstance(one, torch.Tensor) or (one.dtype == t.dtype and one.device == t.device):
        return torch._C._disabled_torch_function_impl(func, (torch.Tensor,), args, kwargs)
    if isinstance(t, _Unbound):  # (check_untouched tells this placeholder from new data)
        t._tiered_offload_moved = one
    return one.expand(t.shape)


class GradInStore(torch.Tensor):
    """A parameter's ``.grad`` while the gradient lives in the store (see
    :meth:`~tiered_offload.engine.binding.ModelBinding.grad_in_store`): reading its values is a TensorStateError. What modules
    do to every parameter's ``.grad`` (``model.to()``, ``.float()``, a deep copy) still works."""

    _ALLOWED = {"detach", "requires_grad_", "_has_compatible_shallow_copy_type", "__deepcopy__", "__reduce_ex__",
                "__get__", "__set__", "clone", "device", "dtype", "shape", "requires_grad", "is_sparse", "grad_fn",
                "is_leaf", "size", "dim", "is_floating_point", "is_complex", "element_size", "numel", "nelement",
                "is_contiguous", "stride"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _MOVES or name == "clone":  # (a placeholder of the parameter's shape: nothing materialised)
            moved = _moved(func, args, kwargs or {}) if name != "clone" else args[0].detach()
            return moved if isinstance(moved, GradInStore) else torch.Tensor._make_subclass(GradInStore, moved)
        if name in cls._ALLOWED:
            return super().__torch_function__(func, types, args, kwargs or {})
        raise TensorStateError(
            "this parameter's gradient lives in the engine's store, not in .grad: clip with "
            "engine.clip_grad_norm_(max_norm) or engine.clip_grad_value_(v) (not torch.nn.utils' over "
            "model.parameters()), "
            "forget gradients with engine.zero_grad(), and read weights with engine.named_parameters(). A "
            "torch.amp.GradScaler cannot unscale them: autocast to torch.bfloat16, which needs no loss scaling")


class _Unbound:
    """Mixed into a parameter's class while it holds a placeholder (:func:`unbind`): its shape,
    dtype, device, ``requires_grad``, hooks and ``.grad`` are as before, and ``model.to()`` moves
    it; any read of its values (an op on it, ``.data``, a copy, ``print``) is a TensorStateError
    that names it. The values are in the store, and the placeholder (one element, expanded to the
    shape) would give zeros."""

    _METHODS = frozenset({"__set__", "size", "dim", "numel", "nelement", "element_size", "is_floating_point",
                          "is_complex", "is_contiguous", "stride", "data_ptr", "requires_grad_", "register_hook",
                          "register_post_accumulate_grad_hook", "_has_compatible_shallow_copy_type", "get_device",
                          "__hash__", "__len__"})
    _PROPERTIES = frozenset({"shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "_version",
                             "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
                             "is_mps", "is_xpu", "is_nested", "itemsize", "nbytes", "_backward_hooks",
                             "_post_accumulate_grad_hooks", "output_nr", "names", "_base", "is_mkldnn"})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            allowed = getattr(getattr(func, "__self__", None), "__name__", "") in cls._PROPERTIES
        else:  # (state_dict's detach, where its keys alone are read: state_dict_names_only)
            allowed = name in cls._METHODS or (name == "detach" and getattr(_NAMES_ONLY, "on", False))
        if allowed:
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        if name in _MOVES:
            return _moved(func, args, kwargs)
        what = getattr(getattr(func, "__self__", None), "__name__", "") if name == "__get__" else name
        given = (*args, *kwargs.values())  # (nn.init passes the tensor by keyword)
        held = next((a for a in (*given, *(x for a in given if isinstance(a, (list, tuple)) for x in a))
                     if isinstance(a, _Unbound)), None)
        raise TensorStateError(_unbound_use(getattr(held, "_tiered_offload_name", "a parameter"), what or str(func)))

    def __deepcopy__(self, memo):
        raise TensorStateError(_unbound_use(self._tiered_offload_name, "__deepcopy__"))

    def __reduce_ex__(self, protocol):
        raise TensorStateError(_unbound_use(self._tiered_offload_name, "__reduce_ex__"))


def _unbound_use(name: str, what: str) -> str:
    """The error for ``what`` (an op, ``data``) on the unbound parameter ``name``."""
    where = ("outside the engine's calls (a streamed block's weights are there only inside its forward): they live in "
             "the engine's store, and the parameter holds a placeholder of its shape")
    if what in ("__deepcopy__", "__reduce_ex__", "__reduce__"):
        return (f"{name}: a copy of it (copy.deepcopy, torch.save, pickle) {where}, so the copy would hold no weights. "
                f"Read them with engine.named_parameters(); a copy of the model: engine.export_safetensors(DIR), "
                f"then from_pretrained(DIR) (or init_from=DIR)")
    if _on_stack(f"{os.sep}torch{os.sep}_dynamo{os.sep}"):
        return (f"{name}: torch.compile traces a model the engine streams ({what} on its placeholder; the weights "
                f"live in the engine's store). Compile each block instead, before building the engine (for block in "
                f"model.<blocks>: block.compile(): bitwise as PyTorch), and call the model itself")
    if _in_peft_merge():
        return (f"{name}: PEFT's merge (merge_adapter, merge_and_unload) reads it {where}, and would write merged "
                f"weights into placeholders. The model with the adapter merged: engine.export_safetensors(DIR, "
                f"merged=True) writes what merge_and_unload().save_pretrained(DIR) writes; the adapter alone: "
                f"adapter_only=True. Training goes on unmerged")
    if _on_stack(f"{os.sep}peft{os.sep}", _ADALORA_ALLOCATION):
        return (f"{name}: AdaLoRA's rank allocation (update_and_allocate) reads the adapter's weights and gradients "
                f"between steps and masks them in place, {where}: the engine cannot run it. AdaLoRA trains through "
                f"the engine with the ranks it was built with (without update_and_allocate, as PyTorch without it); "
                f"its allocation needs the model in memory")
    if what.endswith("_") and not what.startswith("__"):
        return (f"{name}: {what} changes its values {where}, so the change would be lost. Start from other weights "
                f"with init_from=DIR (an export) or by changing the model before the engine is built; a "
                f"constraint on the weights trains as in PyTorch as a torch.nn.utils.parametrize parametrization")
    return (f"{name}: {what} reads its values {where}. Read weights with engine.named_parameters() (an EMA, a "
            f"log); a penalty on a block's weights: compute it in the block's forward (README)")


_PEFT_MERGES = frozenset({"merge", "merge_adapter", "merge_and_unload", "_unload_and_optionally_merge"})
_ADALORA_ALLOCATION = frozenset({"update_and_allocate", "update_ipt", "mask_to_budget", "mask_using_rank_pattern"})


def _in_peft_merge() -> bool:
    """Whether PEFT's merge of an adapter into its base layer is on this thread's stack."""
    return _on_stack(f"{os.sep}peft{os.sep}", _PEFT_MERGES)


def _on_stack(path: str, names: frozenset[str] | None = None) -> bool:
    """Whether a function from a file under ``path`` (one of ``names``, if given) is on this thread's stack."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if path in code.co_filename and (names is None or code.co_name in names):
            return True
        frame = frame.f_back
    return False


_UNBOUND: dict[type, type] = {}


def unbind(param: torch.nn.Parameter, name: str) -> None:
    """Make ``param`` (holding its placeholder) refuse reads of its values, naming it ``name``."""
    cls = type(param)
    if issubclass(cls, _Unbound):
        return
    if cls not in _UNBOUND:
        _UNBOUND[cls] = type(f"Unbound{cls.__name__}", (_Unbound, cls), {"_tiered_offload_class": cls})
    param._tiered_offload_name = name
    param.__class__ = _UNBOUND[cls]


def bind(param: torch.nn.Parameter) -> None:
    """Give ``param`` its own class back (it is about to hold its weights)."""
    if isinstance(param, _Unbound):
        param.__class__ = type(param)._tiered_offload_class


_NAMES_ONLY = threading.local()


@contextlib.contextmanager
def state_dict_names_only():
    """Within it, on this thread, ``state_dict()`` of a streamed model works (and a placeholder's
    ``detach``, which it calls): its values are placeholders, for code that reads its keys only
    (peft's adapter keys for an export)."""
    _NAMES_ONLY.on = True
    try:
        yield
    finally:
        _NAMES_ONLY.on = False


def weights_in_store(module, prefix, keep_vars) -> None:
    """``state_dict()`` of a model the engine streams (``torch.save(model.state_dict())``, Hugging
    Face's ``save_pretrained``): its parameters are empty placeholders and its blocks stand-ins,
    so what it would save is nothing of the training. Refused, naming the export."""
    if getattr(_NAMES_ONLY, "on", False):
        return
    if isinstance(getattr(module, "peft_config", None), dict):  # PEFT's save_pretrained: its adapter
        raise TensorStateError(
            f"state_dict() of {type(module).__name__} (PEFT's save_pretrained): the weights live in the engine's "
            f"store, the model holds empty placeholders. engine.export_safetensors(DIR, adapter_only=True) writes "
            f"what PeftModel.save_pretrained writes; engine.export_safetensors(DIR, merged=True) the model with the "
            f"adapter merged (for from_pretrained)")
    raise TensorStateError(
        f"state_dict() of {type(module).__name__}: the weights live in the engine's store, the model holds "
        f"empty placeholders. Save them with engine.export_safetensors(DIR) (safetensors shards, index and "
        f"config.json: from_pretrained(DIR) loads them), or read them with engine.named_parameters()")


def weights_into_store(module, *_args) -> None:
    """``load_state_dict()`` into a model the engine streams: the weights it would set are the
    store's. Refused, naming the ways in."""
    raise TensorStateError(
        f"load_state_dict() into {type(module).__name__}: the weights live in the engine's store. Build the "
        f"engine with init_from=DIR (safetensors) to start from other weights, or Engine.resume(DIR) to continue "
        f"a saved training state")


def check_requires_grad(binding) -> None:
    """Refuse unfreezing a parameter that was frozen when the engine was built: the units' layouts
    give it no gradient or optimizer state. Freezing mid-run (and unfreezing again) is followed
    by each block call, as PyTorch's graph follows it (:meth:`~tiered_offload.engine.binding.Unit.training`,
    :meth:`~tiered_offload.engine.binding.Unit.receiving`)."""
    for _, slot in binding.param_order:
        if slot.param.requires_grad and not slot.requires_grad:
            raise ConfigError(
                f"{slot.name}.requires_grad changed to True after the engine was built, and it was frozen then: the "
                f"engine laid out gradients and optimizer states without it. Freezing mid-run works: to unfreeze "
                f"parameters later (gradual unfreezing), build the engine with them trainable and freeze them before "
                f"the first step. Else engine.export_safetensors(DIR), then build a new engine with it trainable and "
                f"init_from=DIR (optimizer states start fresh)")


def check_untouched(binding, units) -> None:
    """Refuse a change to the units' parameters since they became placeholders (between the
    engine's calls): an in-place one (``nn.init``, a ``clamp_`` or ``copy_`` under no_grad), new
    data (``param.data = ...``) or a dtype or device (``model.to(...)``). Each would be made to
    an empty placeholder and lost, or make the next forward fail on mixed dtypes."""
    home = binding.placeholder().device  # ("cuda" names cuda:0: compare with where placeholders are made)
    for unit in units:
        for slot in unit.params:
            p = slot.param
            if p.dtype != torch.float32 or p.device != home:
                raise ConfigError(
                    f"{slot.name} is now {str(p.dtype).removeprefix('torch.')} on {p.device} (model.to(), .half() "
                    f"after the engine was built): the engine keeps the training state in float32 on "
                    f"{home}. Compute in lower precision with torch.autocast; model.float() puts it back")
            moved = getattr(p, "_tiered_offload_moved", slot.held)  # (model.to(): a placeholder too)
            if p.data_ptr() not in (slot.held.data_ptr(), moved.data_ptr()) or p._version != slot.version:
                slot.version = p._version  # (said once)
                raise TensorStateError(
                    f"{slot.name} was changed after the engine was built (in place, or new .data): its weights "
                    f"live in the engine's store, and the parameter holds an empty placeholder, so the change "
                    f"was lost. Read weights with engine.named_parameters(); start from other weights with "
                    f"init_from=DIR (an export) or by changing the model before the engine is built; a "
                    f"constraint on the weights trains as in PyTorch as a torch.nn.utils.parametrize "
                    f"parametrization")


def check_no_new_parameters(binding) -> None:
    """Refuse a parameter the model holds that the engine was not built with (a module added or
    replaced since: a new head, an adapter): the store is laid out when the engine is built, so it
    would run as a plain tensor outside the budgets and never be trained."""
    known = {id(s.param) for _, s in binding.param_order}
    # (remove_duplicate=False: no set of tensors hashed; the ids are compared first, a cheap test)
    named = [binding.model.named_parameters(remove_duplicate=False),
             *(u.module.named_parameters(prefix=u.qualname, remove_duplicate=False) for u in binding.blocks)]
    for name, p in (item for it in named for item in it):
        if id(p) not in known and isinstance(p, torch.nn.Parameter):
            raise ConfigError(
                f"{name} was added after the engine was built (a new or replaced module, an adapter, "
                f"resize_token_embeddings): the engine lays its store out when it is built, so it would never train "
                f"it. Change the model before building the engine; to keep what it trained: "
                f"engine.export_safetensors(DIR), change the model, then a new engine with init_from=DIR")


def refuse_resizing(model) -> None:
    """A Hugging Face model's ``resize_token_embeddings`` becomes a refusal naming the way: it
    replaces the embedding (a new parameter the store was not laid out for) and reads the old
    one's placeholder on the way."""
    if callable(getattr(model, "resize_token_embeddings", None)):
        def resize_token_embeddings(*_args, **_kwargs):  # a function: a deep copy shares it
            raise ConfigError(
                f"{type(model).__name__}.resize_token_embeddings after the engine was built: the engine laid its "
                f"store out for the embeddings it found. Resize (after adding tokens to the tokenizer) before "
                f"building the engine; to keep what it trained: engine.export_safetensors(DIR), load it, resize, "
                f"then a new engine with init_from=DIR")
        model.resize_token_embeddings = resize_token_embeddings


def check_grad_hooks(binding) -> None:
    """Refuse a post-accumulate-grad hook on a streamed block's parameter: the gradient adds up
    in the store's buffer, never in that parameter's ``.grad``, so the hook would never run.
    (Hooks from ``param.register_hook`` run: :func:`grad_hooks`.)"""
    for unit in binding.blocks:
        for slot in unit.params:
            if slot.param._post_accumulate_grad_hooks:
                raise ConfigError(
                    f"{slot.name} has a post-accumulate-grad hook (register_post_accumulate_grad_hook): the engine "
                    f"adds its gradient up in its store, never in this parameter's .grad, so the hook would not run. "
                    f"Remove it (handle.remove()). A hook from {slot.name.rsplit('.', 1)[-1]}.register_hook(fn) "
                    f"does run, on each backward's gradient before it is added; the optimizer runs in "
                    f"engine.step()")


def warn_of_forward_hooks(blocks) -> None:
    """Say that the forward hooks on the blocks (or every module's) run again in a recompute."""
    hooked = [u.qualname for u in blocks if any(m._forward_hooks or m._forward_pre_hooks for m in u.module.modules())]
    every = torch.nn.modules.module
    if getattr(every, "_global_forward_hooks", None) or getattr(every, "_global_forward_pre_hooks", None):
        hooked = ["every module (a global hook)"]
    if hooked:
        more = f" and {len(hooked) - 3} more" if len(hooked) > 3 else ""
        logging.getLogger("tiered_offload").warning(
            "forward hooks on %s%s run again when the engine recomputes a block in backward (its forward again, as "
            "under torch.utils.checkpoint). A hook with a side effect (a count, a list of activations) can skip it "
            "while tiered_offload.recomputing() is true, to see each forward once", ", ".join(hooked[:3]), more)


def grad_hooks(slot) -> list:
    """The hooks ``param.register_hook`` has put on ``slot``'s parameter, in their order, as they
    are now (one registered or removed after the engine was built counts)."""
    return list((slot.param._backward_hooks or {}).values())


def hook_leaves(unit, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hooks the user put on the unit's parameters (``param.register_hook``) on the leaves
    ``params`` that stand for them in a backward, in order: autograd runs them on each gradient
    before adding it into the store's buffer, as PyTorch runs them before adding it into ``.grad``.
    A leaf that requires no gradient now gets them too (set later, it has them, as a parameter would)."""
    for s_ in unit.trainable():
        hooks = grad_hooks(s_)
        if hooks:
            leaf, was = params[s_.local_name], params[s_.local_name].requires_grad
            for hook in hooks:
                leaf.requires_grad_(True).register_hook(hook)
            leaf.requires_grad_(was)
    return params


def run_grad_hooks(grad: torch.Tensor, hooks: list) -> torch.Tensor:
    """``grad`` through ``hooks`` in turn, each given what the one before returned (or its own
    input, where it returned None): what autograd does before adding a gradient to ``.grad``."""
    for hook in hooks:
        out = hook(grad)
        grad = grad if out is None else out
    return grad
