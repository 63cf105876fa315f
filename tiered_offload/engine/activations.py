"""What a block's forward saves for its backward, moved into the store.

Autograd saves tensors for backward: a linear layer's input, a softmax's output, a layer norm's
statistics. :class:`SavedActivations` intercepts each one with
:func:`torch.autograd.graph.saved_tensors_hooks` while a block runs, and after the block's forward
copies them all into one scratch tensor of the store (``block.3/activations``). From then on the
store owns the bytes: they stay in the compute tier, or go to host or disk when it is short (the
lookahead policy knows backward's order, so it writes out the ones needed last and prefetches
them back in time). The block's backward pins them again and autograd reads views of them.

What is not copied:

* views of the block's own weights (a linear layer saves its weight): they are saved as a
  position in the weight buffer and resolved against the buffer fetched for the backward;
* tensors whose layout has gaps or overlaps (q, k and v sliced from one projection's output, an
  expanded tensor) are copied with the span of their storage they cover, the views of one storage
  sharing one copy, so that they keep their strides and offsets relative to each other;
* a tensor without storage (a subclass), sparse or quantized, or empty: kept by reference, as
  autograd would (rare; their bytes are counted in :attr:`kept_bytes`).

What is never seen: a tensor a custom ``torch.autograd.Function`` keeps on its ``ctx`` as an
attribute (``ctx.x = x``) instead of through ``ctx.save_for_backward`` (saved-tensor hooks do not
see those; PyTorch's own note). Where that tensor is one the engine empties after the forward or
lies in the store's memory, a kept graph would read other bytes in backward:
:func:`kept_on_ctx` finds them, and such a block recomputes (or, configured to keep its graph,
is refused).

The copy keeps each tensor's strides, and the same tensor saved twice is stored once, so the
backward computes with exactly the tensors the forward saved: the result is PyTorch's, bitwise.

The context a recompute replays besides its saved inputs is here too: the autocast regions the
forward ran in (:func:`autocast_state`, :func:`replay_autocast`), and :func:`recomputing`, which
tells the user's forward hooks that they run in a recompute.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch

from offload_core.errors import TensorStateError

__all__ = ["SavedActivations", "ALIGN", "SavedAliases", "autocast_state", "foreign_leaves", "graph_findings",
           "graph_nodes", "kept_on_ctx", "kept_on_ctx_message", "read_outside_message", "replay_autocast",
           "recomputing", "recompute_context"]

ALIGN = 64
"""Byte alignment of each tensor inside the scratch buffer."""


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill exactly ``numel`` consecutive slots (any dimension order)."""
    if t.is_contiguous():
        return True
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


@dataclass
class _Handle:
    """Where a saved tensor went."""

    kind: str
    """``"weight"`` (a view of the weight buffer), ``"copy"`` (in the scratch buffer), ``"span"`` (one
    with gaps, until :meth:`SavedActivations.seal` makes it a copy), ``"ref"`` (kept)."""
    index: int = 0
    """copy: the stored tensor's number; span: its number among the spans; ref: the kept tensor's
    number; weight: element offset."""
    shape: tuple = ()
    stride: tuple = ()
    dtype: torch.dtype | None = None
    span: int = 0
    """copy of a tensor with gaps: the elements from its first to its last (0: its numel)."""


def _span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last in its storage."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


@dataclass(eq=False)
class _Life:
    """What the finalizer of a :class:`SavedActivations` needs (not the object itself)."""

    key: str | None = None
    released: bool = False
    orphans: list = field(default_factory=list)
    call: int | None = None
    """The block call whose node holds these activations (``RepeatedCalls.called``'s number)."""
    shared: list = field(default_factory=list)
    """The shared-input entries the block's backward will settle (``shared_inputs.awaited``); emptied
    when it does."""


class SavedActivations:
    """The tensors one block's forward saved for its backward.

    Life cycle: :meth:`hooks` around the block's forward (with its weight buffer), :meth:`seal`
    into the store, then in backward :meth:`attach` (with the weight buffer fetched again),
    autograd unpacks, :meth:`release`. If the graph is dropped without a backward, its life (the
    scratch key and the block call) is put on ``orphans`` for the streamer to unregister the key
    and uncount the call (never from the garbage collector's thread).
    """

    def __init__(self, weights: torch.Tensor | None, orphans: list, *, count_only: bool = False,
                 call: int | None = None, shared: list | None = None):
        self.inputs_only = weights is None
        """A recompute's checkpoint (the block's inputs), not a graph's saved tensors."""
        self.count_only = count_only
        """Only measure: what a seal would store, counted while the tensors are held as a kept
        graph holds them (until this object goes), so a tensor the forward frees never lends its
        address to a later one that would then pass for it (2 MiB short of a GPT block's 28 MiB)."""
        self._weights = weights
        self._w_lo = weights.data_ptr() if weights is not None and weights.numel() else 0
        self._w_hi = self._w_lo + (weights.numel() * weights.element_size() if weights is not None else 0)
        self._w_itemsize = weights.element_size() if weights is not None else 1
        self._copies: list[torch.Tensor] = []
        self._versions: list[int] = []
        self._spans: list[tuple[torch.Tensor, _Handle | None, int]] = []
        """Saved tensors with gaps: (tensor, handle, version), copied at seal by storage spans."""
        self._layout: list[tuple[int, _Handle]] = []
        self._seen: dict[tuple, _Handle] = {}
        self._kept: list[torch.Tensor] = []
        self._views: list[torch.Tensor] | None = None
        self._w_new: torch.Tensor | None = None
        self._handles: list[_Handle] = []
        self.nbytes = 0
        """Bytes of the scratch buffer."""
        self.kept_bytes = 0
        """Bytes kept by reference (no storage, sparse, quantized, a misaligned view): outside the
        store's budget."""
        self.life = _Life(orphans=orphans, call=call, shared=list(shared or ()))
        if not count_only:
            weakref.finalize(self, _orphaned, self.life)

    @property
    def key(self) -> str | None:
        return self.life.key

    # ---- forward ------------------------------------------------------------------------
    def hooks(self):
        """The context manager that routes what autograd saves through :meth:`pack` / :meth:`unpack`.

        The graph holds both hooks (each saved tensor's), and this object holds saved tensors,
        whose ``grad_fn`` is the graph: until :meth:`seal` its copies, and the tensors kept by
        reference until the backward. That is a cycle through autograd's C++ objects that Python's
        garbage collector cannot see, which would keep a graph dropped without a backward (and its
        scratch tensor in the store) forever. So the hooks hold this object weakly (the block's
        autograd node holds it strongly)."""
        me = weakref.ref(self)
        if self.count_only:  # weakly too: the graph would hold the tensors this object holds
            return torch.autograd.graph.saved_tensors_hooks(lambda t: me()._count(t), _never_unpacked)

        def unpack(h: _Handle) -> torch.Tensor:
            owner = me()
            if owner is None:
                raise TensorStateError("a block's saved activations were released before its backward; run the "
                                       "forward again")
            return owner.unpack(h)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: me().pack(t), unpack)

    def _where(self, t: torch.Tensor) -> tuple[str, object]:
        """How :meth:`pack` files ``t``: ``("weight", element offset in the weight buffer)``,
        ``("seen", signature)`` (the same tensor saved before), ``("ref", signature or None)`` (kept
        as it is) or ``("copy", signature)``."""
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # no storage (a tensor subclass): autograd keeps it
            return "ref", None
        itemsize = t.element_size()
        if self._w_lo <= ptr < self._w_hi and t.device == self._weights.device and itemsize == self._w_itemsize:
            return "weight", (ptr - self._w_lo) // itemsize
        sig = (ptr, t.dtype, tuple(t.shape), t.stride(), t.device)
        if sig in self._seen:
            return "seen", sig
        if t.numel() == 0 or t.is_sparse or t.is_quantized:
            return "ref", sig
        return ("copy" if _dense(t) else "span"), sig

    def _count(self, t: torch.Tensor) -> None:
        """count_only: what :meth:`seal` would store of ``t``; ``t`` held, not packed (never unpacked)."""
        kind, sig = self._where(t)
        if kind == "copy":
            self._seen[sig] = None
            self._copies.append(t)
        elif kind == "span":
            self._seen[sig] = None
            self._spans.append((t, None, 0))

    def pack(self, t: torch.Tensor) -> _Handle:
        kind, where = self._where(t)
        if kind == "weight":
            return _Handle("weight", where, tuple(t.shape), t.stride(), t.dtype)
        if kind == "seen":
            return self._seen[where]
        if kind == "ref":
            handle = self._keep(t)
        elif kind == "span":
            handle = _Handle("span", len(self._spans), tuple(t.shape), t.stride(), t.dtype)
            self._spans.append((t, handle, t._version))
        else:
            handle = _Handle("copy", len(self._copies), tuple(t.shape), t.stride(), t.dtype)
            self._copies.append(t)
            self._handles.append(handle)
            self._versions.append(t._version)
        if where is not None:
            self._seen[where] = handle
        return handle

    def _keep(self, t: torch.Tensor) -> _Handle:
        self._kept.append(t)
        try:
            self.kept_bytes += t.numel() * t.element_size()
        except RuntimeError:
            pass
        return _Handle("ref", len(self._kept) - 1)

    def unpack(self, h: _Handle) -> torch.Tensor:
        if h.kind == "ref":
            return self._kept[h.index]
        if h.kind == "weight":
            if self._w_new is None:
                raise TensorStateError("a block's weights were unpacked outside its backward; this is a bug")
            w = self._w_new
            return w.as_strided(h.shape, h.stride, w.storage_offset() + h.index)
        if self._views is None:
            if self.life.released:
                raise TensorStateError("this forward's saved activations were used by a backward already; run a "
                                       "forward again before another backward (retain_graph is not supported)")
            if h.kind == "span":  # still in memory: the backward of a block that was never sealed
                return self._spans[h.index][0]
            if self._copies:
                return self._copies[h.index]
            raise TensorStateError("saved activations unpacked before attach(); this is a bug")
        return self._views[h.index]

    def keep_as_read(self) -> None:
        """Kept in memory, not in the store (no room: ``BlockStreamer.seal``): a recompute's inputs
        are copied (their strides kept), so a change the caller makes to one in place afterwards
        (PyTorch allows it where the block saved nothing of it) leaves the checkpoint as the
        forward read it; it had been held by reference and the recompute ran on the changed values.
        A graph's saved tensors stay autograd's own (:class:`SavedAliases` watches the block's)."""
        if self.inputs_only:
            self._copies = [_copy_of(t) for t in self._copies]
            self._spans = [(_copy_of(t), h, v) for t, h, v in self._spans]

    def storages(self) -> set[tuple]:
        """Where the tensors saved so far (before :meth:`seal`) keep their bytes: a block's input or
        output in one of them was saved by its graph (:class:`SavedAliases`)."""
        return {_storage(t) for t in [*self._copies, *(t for t, _, _ in self._spans), *self._kept]} - {None}

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` itself (not a copy) is what a backward will unpack."""
        return (any(x is t for x in self._copies) or any(x is t for x in self._kept)
                or any(x is t for x, _, _ in self._spans))

    def _storage_spans(self) -> list[tuple[int, int, list]]:
        """The saved tensors with gaps grouped by the storage they view: ``(lo, hi, members)``, the
        byte range of the storage they cover together and their ``(tensor, handle, version)``."""
        groups: dict[tuple, list] = {}
        for t, h, v in self._spans:
            size = t.element_size()
            lo = t.storage_offset() * size
            g = groups.setdefault((t.untyped_storage().data_ptr(), t.device), [lo, lo, []])
            g[0], g[1] = min(g[0], lo), max(g[1], lo + _span(t) * size)
            g[2].append((t, h, v))
        return [(lo, hi, members) for lo, hi, members in groups.values()]

    def _offsets(self) -> tuple[list[int], list[tuple[int, int, int, list]], int]:
        """Where each dense copy starts in the scratch buffer, each storage span ``(start, lo, hi,
        members)``, and the buffer's size."""
        starts, spans, offset = [], [], 0
        for t in self._copies:
            offset = -(-offset // ALIGN) * ALIGN
            starts.append(offset)
            offset += t.numel() * t.element_size()
        for lo, hi, members in self._storage_spans():
            offset = -(-offset // ALIGN) * ALIGN
            spans.append((offset, lo, hi, members))
            offset += hi - lo
        return starts, spans, offset

    def pending_bytes(self) -> int:
        """Bytes the scratch tensor will take (before :meth:`seal`)."""
        return self._offsets()[2]

    def seal(self, store, key: str) -> None:
        """Copy the saved tensors into a new scratch tensor ``key`` of the store, and drop them."""
        self._weights = None
        if not self._copies and not self._spans:
            return
        for t, v in [*zip(self._copies, self._versions), *((t, v) for t, _, v in self._spans)]:
            if t._version != v:
                raise TensorStateError("a tensor saved for backward was modified in place later in the same block's "
                                       "forward; PyTorch would fail in backward too. Use an out-of-place operation")
        starts, spans, nbytes = self._offsets()
        layout = list(zip(starts, self._handles))
        placed, kept = [], []
        for start, lo, _, members in spans:  # each view at its place in its storage's copy
            for t, h, _ in members:
                where = t.storage_offset() * t.element_size() - lo
                if where % t.element_size():  # (views of one storage with other dtypes, misaligned: kept)
                    kept.append((t, h))
                    continue
                placed.append((h, len(layout)))
                layout.append((start + where, _Handle("copy", len(layout), h.shape, h.stride, h.dtype, _span(t))))
        raw = store.create(key, (nbytes,), torch.uint8)  # (may fail: then the handles stay as they are)
        self.life.key, self.nbytes, self._layout = key, nbytes, layout
        for h, index in placed:
            h.kind, h.index, h.span = "copy", index, layout[index][1].span
        for t, h in kept:
            h.kind, h.index = "ref", self._keep(t).index
        try:
            for (start, h), t in zip(self._layout, self._copies):
                self._view(raw, start, h).copy_(t)
            for start, lo, hi, members in spans:
                t = members[0][0]
                src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), lo, (hi - lo,), (1,))
                raw[start:start + hi - lo].copy_(src)
        finally:
            store.release(key)
        self._copies, self._versions, self._seen, self._spans = [], [], {}, []

    @staticmethod
    def _view(raw: torch.Tensor, start: int, h: _Handle) -> torch.Tensor:
        n = h.span
        if not n:
            n = 1
            for s in h.shape:
                n *= s
        typed = raw[start:start + n * torch.empty((), dtype=h.dtype).element_size()].view(h.dtype)
        return typed.as_strided(h.shape, h.stride)

    # ---- backward -----------------------------------------------------------------------
    def attach(self, raw: torch.Tensor | None, weights: torch.Tensor | None) -> None:
        """For the backward: ``raw`` is the scratch tensor (pinned), ``weights`` the block's weight buffer."""
        self._w_new = weights
        if raw is not None:
            self._views = [self._view(raw, start, h) for start, h in self._layout]

    def release(self) -> None:
        """The backward is done: forget the views and the tensors kept (the caller unregisters the key)."""
        self._views, self._w_new, self._kept, self._copies, self._spans = None, None, [], [], []
        self.life.released = True


def _copy_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its shape and strides (the span of storage it covers copied whole: a
    layout with gaps or overlaps kept)."""
    n = _span(t)
    out = torch.empty(n, dtype=t.dtype, device=t.device)
    out.copy_(t.as_strided((n,), (1,), t.storage_offset()))
    return out.as_strided(t.shape, t.stride())


def _storage(t: torch.Tensor) -> tuple | None:
    """``(device, address)`` of ``t``'s storage (None: it has none, a subclass or sparse tensor)."""
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class SavedAliases:
    """The inputs and outputs of one block call that its graph saved for backward, watched for an
    in-place change until the block's backward.

    PyTorch's backward raises when a tensor a node saved has changed in place since ("one of the
    variables needed for gradient computation has been modified by an inplace operation"): the
    engine's copy of what the block saved (or its recompute, from a copy of its inputs) would go on
    with the old values, silently training something PyTorch refuses. Autograd checks the version
    counter a tensor shares with its views and detached aliases; this keeps, for each watched
    tensor, a witness that shares that counter and holds no bytes (so the tensor's own memory
    goes when it would, and a change through any alias, or before the tensor's Python object
    went, is seen).
    """

    def __init__(self, name: str):
        self.name = name
        self._watched: list[tuple[torch.Tensor, int, str]] = []

    def watch(self, kind: str, tensors, saved: set[tuple], given=None) -> None:
        """Watch the ``tensors`` (the block's inputs or outputs, ``kind``) whose storage is one of
        ``saved`` (:meth:`SavedActivations.storages`), or whose ``given`` stand-in's is."""
        for k, t in enumerate(tensors):
            if _storage(t) in saved or (given is not None and _storage(given[k]) in saved):
                witness = t.detach()
                try:  # (the counter is shared, its count kept: an empty set_ would bump it)
                    with torch.autograd._unsafe_preserve_version_counter(witness):
                        witness.set_()
                except (RuntimeError, NotImplementedError, AttributeError):  # (no storage, or no such call)
                    continue
                self._watched.append((witness, witness._version, f"{kind} {k} ({tuple(t.shape)}, {t.dtype})"))

    def check(self) -> None:
        """Raise as PyTorch would if a watched tensor changed in place since :meth:`watch`."""
        for witness, version, what in self._watched:
            if witness._version != version:
                raise TensorStateError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: block {self.name}'s {what}, which the block saved for its backward, is at version "
                    f"{witness._version}; expected version {version} instead (PyTorch's backward raises the same). "
                    f"Change it out of place (x = x * 2, not x.mul_(2)), or change a clone of it")


def _never_unpacked(_h) -> torch.Tensor:
    raise TensorStateError("a measuring forward's graph was back-propagated; this is a bug")


def _orphaned(life: _Life) -> None:
    """Finalizer: the graph holding these activations was dropped without a backward."""
    if ((life.key is not None or life.call is not None) and not life.released) or life.shared:
        life.orphans.append(life)  # list.append is atomic; the streamer unregisters it later


def kept_on_ctx(outputs, emptied, memory: torch.Tensor, nodes=None) -> list[str]:
    """Where a custom autograd Function in the graph behind ``outputs`` keeps a tensor on its
    ``ctx`` as an attribute (directly, or in a list, tuple or dict there) that is one of
    ``outputs`` or ``emptied`` (the block's inputs and weight leaves, emptied after the forward),
    or lies in ``memory``'s storage (a store arena, reused before the backward):
    ``["Square.x", ...]`` (the Function's name and the attribute; ``nodes``: the graph's, if walked)."""
    ids = {id(t) for t in [*outputs, *emptied]}
    base = memory.untyped_storage().data_ptr()

    def unsafe(t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        try:
            return id(t) in ids or t.untyped_storage().data_ptr() == base
        except (RuntimeError, NotImplementedError):  # a sparse or subclass tensor: no storage of the store's
            return id(t) in ids
    found = []
    for node in nodes if nodes is not None else graph_nodes(t.grad_fn for t in outputs):
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            for name, value in vars(node).items():
                values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                    else (value,)
                if any(unsafe(t) for t in values):
                    found.append(f"{type(node).__name__.removesuffix('Backward')}.{name}")
    return found


def kept_on_ctx_message(name: str, found: list[str]) -> str:
    """The error for block ``name`` whose graph keeps :func:`kept_on_ctx`'s ``found`` on a ctx."""
    return (f"block {name}: a custom autograd Function in it keeps tensors on its ctx as attributes "
            f"({', '.join(found[:3])}) instead of through ctx.save_for_backward, where the engine cannot store "
            f"them: a kept or offloaded graph of this block would give its backward other bytes. Save them with "
            f"ctx.save_for_backward(...) (read ctx.saved_tensors), or let the block recompute: "
            f"EngineConfig(activations='recompute'), or 'auto', which recomputes such a block")


def foreign_leaves(outputs, weights: torch.Tensor, inputs, nodes=None) -> list[torch.Tensor]:
    """The tensors requiring grad that the graph behind a block's ``outputs`` adds a gradient into
    and that are neither views of its ``weights`` buffer nor its ``inputs``: a parameter outside the
    blocks that the block reads through a module or function it is given (or an attribute), or a
    learnable tensor of the user's. The block's backward computes its weights' and inputs'
    gradients alone, so theirs from the block would never arrive. ``nodes``: the graph's, if walked."""
    def where(t: torch.Tensor) -> tuple:  # (by address: the store's tiers are arenas, one storage for many)
        try:
            return t.device, t.data_ptr(), t.data_ptr() + _span(t) * t.element_size()
        except RuntimeError:  # (no storage: a subclass)
            return t.device, -1, -1
    device, lo, hi = where(weights)
    own = {where(t) for t in inputs}
    found: list[torch.Tensor] = []
    for node in nodes if nodes is not None else graph_nodes(t.grad_fn for t in outputs):
        v = getattr(node, "variable", None)  # (an AccumulateGrad's leaf)
        if not isinstance(v, torch.Tensor) or not v.numel() or any(v is f for f in found):
            continue
        at = where(v)
        if at not in own and not (at[0] == device and lo <= at[1] and at[2] <= hi):
            found.append(v)
    return found


def read_outside_message(name: str, found: list[torch.Tensor], names: dict[int, str]) -> str:
    """The error for block ``name`` whose graph reaches :func:`foreign_leaves`' ``found`` (``names``:
    a parameter's name by its ``id``)."""
    what = ", ".join(names.get(id(t), f"a tensor of shape {tuple(t.shape)}") for t in found[:3])
    return (f"block {name}'s forward reads {what}, which requires grad and is neither one of the block's weights "
            f"nor one of its inputs (a parameter outside the blocks, read through a module or function the block "
            f"is given, or an attribute): its gradient from the block would never reach it. Pass the tensor to the "
            f"block as an argument (block(h, weight): it trains as in PyTorch), or make the module part of the block")


def graph_findings(name: str, outputs, emptied, weights: torch.Tensor, inputs, names) -> tuple[str | None, ...]:
    """Block ``name``'s graph behind ``outputs``, walked once for both checks: what a custom Function
    keeps on its ctx (:func:`kept_on_ctx`, ``emptied`` as there) and what requires grad besides the
    ``weights`` buffer and ``inputs`` (:func:`foreign_leaves`); each as its error message, or None.
    ``names`` is called (for :func:`read_outside_message`) only where something is found."""
    nodes = list(graph_nodes(t.grad_fn for t in outputs))
    on_ctx = kept_on_ctx(outputs, emptied, weights, nodes)
    found = foreign_leaves(outputs, weights, inputs, nodes)
    return (kept_on_ctx_message(name, on_ctx) if on_ctx else None,
            read_outside_message(name, found, names()) if found else None)


def graph_nodes(roots):
    """Every node of the autograd graph behind ``roots`` (``grad_fn`` s; None skipped), once each.
    Every node's Python object is held through the walk: one let go would give its id to another."""
    seen: dict[int, object] = {}
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


def autocast_state(device: torch.device) -> list[tuple[str, torch.dtype, bool]]:
    """``(device type, dtype, cache enabled)`` of each autocast region a block's forward runs in
    (the CPU's, and the compute device's): its recompute must run in the same ones, or it would
    compute in other dtypes than the forward did (``torch.autocast(..., torch.bfloat16)``)."""
    return [(kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in dict.fromkeys(("cpu", device.type)) if torch.is_autocast_enabled(kind)]


@contextlib.contextmanager
def replay_autocast(state: list[tuple[str, torch.dtype, bool]]):
    """Enter the autocast regions :func:`autocast_state` recorded."""
    with contextlib.ExitStack() as stack:
        for kind, dtype, cache in state:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
        yield


_RECOMPUTE = threading.local()


def recomputing() -> bool:
    """Whether this thread runs a block's recompute (its forward again, in backward). The forward
    hooks on a block and its modules run there too, as under ``torch.utils.checkpoint`` (a hook
    that changes an output changes the recomputed one alike); one with a side effect (a count, a
    list of activations) can skip it here. (One on ``model.blocks[i]``, the stand-in, runs once.)"""
    return getattr(_RECOMPUTE, "on", False)


@contextlib.contextmanager
def recompute_context():
    """A block's recompute runs in this (see :func:`recomputing`)."""
    before, _RECOMPUTE.on = recomputing(), True
    try:
        yield
    finally:
        _RECOMPUTE.on = before
