"""Random numbers a block draws from a generator of the model's own, not PyTorch's default ones.

``torch.rand(shape, generator=g)`` with a ``torch.Generator`` the model keeps (a noise layer with a
seed of its own, a sampler): a recomputed block draws again in backward, and where PyTorch's
default generators are put back to where the block's forward started (``fork_rng``), ``g`` was
not, so the recompute drew other numbers and the gradients were another mask's, silently.
(``torch.utils.checkpoint`` has the same gap; it says so in its documentation.)

:class:`OwnGenerators` knows, per streamed block, the generators its forward draws from:

* the ``torch.Generator`` attributes of the block's modules, and those a function attribute
  closes over, found when the engine is built;
* those its first :attr:`OwnGenerators.WATCHED` forwards are seen drawing from
  (:class:`_Watch`, a ``TorchDispatchMode``: an operation with a generator argument that is not a
  default generator; it is one where the operation moved the default generator's state). A
  generator some other object holds is found this way. Watching costs about 10 us per operation,
  so later forwards are not watched: a block that first draws from a generator of its own after
  them is not seen. A block that runs compiled (``torch.compile``) is not watched at all: under a
  dispatch mode its code would run uncompiled, with other numerics than PyTorch's compiled run.

Each forward of a block saves the states of its generators (:meth:`OwnGenerators.before`); the
recompute sets them back, and afterwards to where they were (:meth:`OwnGenerators.replay`), as
``fork_rng`` does for the default ones. ``forward_backward`` runs a block for every micro-batch
in turn, which draws a generator one block keeps in the loop's order, but one that several blocks
draw from in another: it runs the loop where one is known (:meth:`OwnGenerators.shared`), and a
pass that finds one undoes its forwards (the generators put back, :meth:`OwnGenerators.pass_start`).

A commit saves the states of the generators the model holds by name (an attribute, or a variable
a function attribute closes over: :meth:`ModelBinding.generator_slots`, restored by
:class:`~.train_state.TrainState`), so a resumed run draws from them where the uninterrupted one
would. One the watch finds that no name reaches (held by some other object) is logged when found:
a resumed run draws from it as the model's construction left it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiered_offload.engine.binding import closed_over, compiled

__all__ = ["OwnGenerators"]

log = logging.getLogger("tiered_offload")


def _attributes(modules) -> dict[int, torch.Generator]:
    """The ``torch.Generator`` attributes of ``modules``, and those a function attribute closes over."""
    return {id(g): g for m in modules for attr, v in vars(m).items()
            for _, g in [(attr, v), *closed_over(attr, v)] if isinstance(g, torch.Generator)}


def _default_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _same(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether ``a`` and ``b`` are two Python objects of one generator: equal states, and a change
    to ``a``'s shows in ``b``'s (``a`` is put back)."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    state = a.get_state()
    if not torch.equal(state, b.get_state()):
        return False
    marked = state.clone()
    marked[0] ^= 1  # the seed's lowest bit (CPU and CUDA states both begin with it)
    try:
        a.set_state(marked)
        return torch.equal(b.get_state(), marked)
    finally:
        a.set_state(state)


class _Watch(TorchDispatchMode):
    """Sees a forward's draws from generators other than the default ones: ``found`` maps each
    one's id to ``(generator, its state before its first draw here)``."""

    def __init__(self, known: set[int], defaults: dict[int, torch.Generator]):
        super().__init__()
        self.known, self.defaults = known, defaults
        self.found: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        new = [g for g in (*args, *kwargs.values()) if isinstance(g, torch.Generator)
               and id(g) not in self.known and id(g) not in self.defaults and id(g) not in self.found]
        if not new:
            return func(*args, **kwargs)
        before = [(g, g.get_state(), _default_state(g.device)) for g in new]
        out = func(*args, **kwargs)
        for g, state, default in before:
            if not torch.equal(_default_state(g.device), default):
                self.defaults[id(g)] = g  # the default generator, passed by name: fork_rng puts it back
            elif not torch.equal(g.get_state(), state):
                self.found[id(g)] = (g, state)
            # (neither moved: nothing drawn, e.g. an empty tensor; the next draw tells)
        return out


class OwnGenerators:
    """Per streamed block, the generators of the model's own its forward draws from (see the
    module's docstring).

    Args:
        modules: the streamed blocks' modules, in order.
        model: the whole model: a generator of its own outside the blocks (the embeddings', the
            head's) is drawn in the loop's order only by the loop.
        named: the generators a commit saves; one found drawing that is not among them is logged.
    """

    WATCHED = 2
    """Forwards of each block watched for draws from generators not found as attributes."""

    def __init__(self, modules: list[torch.nn.Module], model: torch.nn.Module, named: list[torch.Generator] = ()):
        self.of_block = [_attributes(m.modules()) for m in modules]
        inside = {id(sub) for m in modules for sub in m.modules()}
        self.outside = _attributes(m for m in model.modules() if id(m) not in inside)
        self._watched = [0] * len(modules)
        self._unwatched = [compiled(m.modules()) for m in modules]
        """Blocks that run compiled: not watched (a dispatch mode would run them uncompiled, with
        other numerics)."""
        if any(self._unwatched):
            log.info("%d of %d blocks run compiled: their forwards are not watched for generators of the model's own "
                     "(a dispatch mode would run them uncompiled); a generator a module holds as an attribute, or "
                     "that a function attribute closes over, is replayed all the same", sum(self._unwatched), len(modules))
        self._defaults: dict[int, torch.Generator] = {}
        """Wrappers of the default generators seen passed by name (held, so their ids stay theirs)."""
        self._pass: dict[int, tuple[torch.Generator, torch.Tensor]] | None = None
        self._named = list(named)

    def _canonical(self, g: torch.Generator) -> torch.Generator:
        """The generator already known (named, or a block's) that ``g`` is, else ``g``: a dispatch
        mode sees a new Python object for a generator at each operation."""
        known = (*self._named, *(h for gens in self.of_block for h in gens.values()), *self.outside.values())
        return next((h for h in known if _same(g, h)), g)

    def shared(self) -> bool:
        """Whether a generator is drawn from by more than one block, or is the model's outside
        them (``forward_backward``'s vertical order would draw it in another order than the loop)."""
        if self.outside:
            return True
        seen: set[int] = set()
        for gens in self.of_block:
            if seen & gens.keys():
                return True
            seen |= gens.keys()
        return False

    def before(self, index: int) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
        """The states of block ``index``'s generators now, before its forward (what its recompute
        starts from)."""
        return {k: (g, g.get_state()) for k, g in self.of_block[index].items()}

    @contextlib.contextmanager
    def forward(self, index: int, saved: dict) -> Iterator[None]:
        """Around block ``index``'s forward, ``saved`` from :meth:`before`: one of its first
        forwards is watched, and the generators found drawing join the block's (and ``saved``)."""
        if self._unwatched[index] or self._watched[index] >= self.WATCHED:
            yield
            return
        self._watched[index] += 1
        watch = _Watch(set(self.of_block[index]), self._defaults)
        with watch:
            yield
        for g, state in watch.found.values():
            g = self._canonical(g)
            k = id(g)
            if k in self.of_block[index]:
                continue  # one the block is known to draw from, seen through another wrapper
            if not any(g is h for h in self._named):
                log.warning("block %d draws from a torch.Generator the model holds under no name (not a module's "
                            "attribute): its recompute replays it, but a commit does not save its state, so a "
                            "resumed run draws from it as the model's construction left it. Make it an attribute "
                            "of a module to have it saved", index)
            self.of_block[index][k] = g
            saved.setdefault(k, (g, state))
            if self._pass is not None:
                self._pass.setdefault(k, (g, state))

    @staticmethod
    @contextlib.contextmanager
    def replay(saved: dict) -> Iterator[None]:
        """A recompute: the generators in ``saved`` start where the forward's did, and are put
        back where they are now afterwards."""
        now = [(g, g.get_state()) for g, _ in saved.values()]
        try:
            for g, state in saved.values():
                g.set_state(state)
            yield
        finally:
            for g, state in now:
                g.set_state(state)

    # ---- forward_backward's pass ------------------------------------------------------------
    def pass_start(self) -> None:
        """A vertical pass begins: note every known generator's state (and, as they are found, the
        others' before their first draw), so that an undone pass can put them back."""
        self._pass = {k: (g, g.get_state()) for gens in self.of_block for k, g in gens.items()}

    def pass_end(self, undone: bool) -> None:
        """The pass is over; ``undone``: its forwards are dropped, the generators go back."""
        if undone and self._pass is not None:
            for g, state in self._pass.values():
                g.set_state(state)
        self._pass = None
