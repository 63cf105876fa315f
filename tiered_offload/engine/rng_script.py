"""The loop's random numbers for ``forward_backward``'s micro-batches (dropout, LayerDrop, sampling).

In the loop ``for b in micro_batches: engine.backward(loss_fn(engine(b), b))`` micro-batch ``k``'s
forward draws from where micro-batch ``k - 1``'s forward left the generators. ``forward_backward``
runs block 0 of every micro-batch before block 1 of any, so micro-batch 1 reaches block 0 before
micro-batch 0 has drawn what its later blocks draw. It can still draw the loop's numbers if it knows
how far micro-batch ``k - 1``'s forward and loss move each generator: shapes decide how many numbers
dropout draws, not values. Everything a micro-batch runs between two of its turns starts from where
its own last turn ended (the pass sets the generators at each turn), so micro-batch ``k``'s forward
draws the loop's numbers if it starts where micro-batch ``k - 1``'s loss leaves the generators in the
loop. Its backward draws nothing (a recompute replays its forward's draws and puts the generators back).

:class:`Recorder` watches a loop (``forward_backward`` runs one whenever the pass could not run): the
generators' states where each micro-batch starts, after its loss and after its backward.
:meth:`Recorder.script` turns that into an :class:`RngScript`: per micro-batch, how many numbers its
forward and loss advanced each generator. The next pass starts micro-batch ``k`` where the script
says (:meth:`Expected.start`), and checks, after micro-batch ``k - 1``'s loss, that the generators
are there. That check is what makes it exact: micro-batch 0 starts where the loop does, and each one
that ends where the next one started leaves the next one the loop's numbers. A forward that ends
elsewhere (a shape changed, a draw depends on the data) undoes the pass before any backward, and the
loop runs (and is recorded) instead. Without a script no forward may draw: every turn checks that
the generators are where the pass started, so a draw is found at the first turn. The scripts are
kept per :func:`signature` of the micro-batches (:class:`RngScripts`): other shapes draw other
counts.

How far a generator moved:

* the CPU's (mt19937): counted in 32-bit draws. Its state records the position in the current block of
  624 words, so the count is found by stepping a copy to that position and then 624 draws at a time until
  the states are equal; a normal sample cached in the state (``randn``) cannot be reached this way and
  gives no script. Advancing is drawing that many numbers from a copy.
* CUDA's (Philox): its state is a seed and an offset; a kernel that draws adds to the offset, so the
  advance is the difference of the offsets.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Hashable, Sequence

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Recorder", "RngScript", "RngScripts", "Streams", "signature"]

_MT_N = 624
_MT_SEED = slice(0, 8)
"""The CPU state's initial seed (``manual_seed`` changes it)."""
_MT_NEXT = slice(16, 24)
"""The CPU state's position in its block of 624 words (``THGeneratorState.next``, a uint64)."""
_MT_NORMAL = slice(5016, 5056)
"""The CPU state's cached normal samples (a draw of uniform numbers never changes them)."""
_CPU_STATE_BYTES = 5056
_CHUNK = 1 << 20
COUNT_SECONDS = 2.0
"""The longest one count of draws may take (about 250 million numbers here); a generator reseeded
in a forward would otherwise be stepped through its whole period. Past it: no script, the loop."""


def _cpu_advance(state: torch.Tensor, n: int) -> torch.Tensor:
    """The CPU generator's state after ``n`` 32-bit draws from ``state``."""
    g = torch.Generator()
    g.set_state(state)
    _draw(g, n)
    return g.get_state()


def _draw(g: torch.Generator, n: int) -> None:
    buffer = torch.empty(min(n, _CHUNK), dtype=torch.uint8)
    while n > 0:  # random_ draws one 32-bit number per element of 32 bits or fewer (uint8: the fastest)
        buffer[:min(n, _CHUNK)].random_(generator=g)
        n -= min(n, _CHUNK)


def _cpu_distance(a: torch.Tensor, b: torch.Tensor, seconds: float = COUNT_SECONDS) -> int | None:
    """How many 32-bit draws take the CPU generator from state ``a`` to ``b`` (None: none do, or
    not found within ``seconds``)."""
    if a.numel() != _CPU_STATE_BYTES or b.numel() != _CPU_STATE_BYTES:
        return None
    if not torch.equal(a[_MT_NORMAL], b[_MT_NORMAL]) or not torch.equal(a[_MT_SEED], b[_MT_SEED]):
        return None
    if torch.equal(a, b):
        return 0
    position = [int.from_bytes(bytes(s[_MT_NEXT].tolist()), "little") for s in (a, b)]
    g = torch.Generator()
    g.set_state(a)
    n = (position[1] - position[0]) % _MT_N
    _draw(g, n)
    deadline = time.perf_counter() + seconds
    for i in range(1 << 62):
        if torch.equal(g.get_state(), b):
            return n
        if i % 256 == 255 and time.perf_counter() > deadline:
            return None
        _draw(g, _MT_N)
        n += _MT_N
    return None


def _philox(state: torch.Tensor) -> tuple[int, int] | None:
    """A CUDA generator's (seed, offset), or None when the state is not the 16 bytes that hold them."""
    if state.numel() != 16:
        return None
    raw = bytes(state.tolist())
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little", signed=True)


def _cuda_distance(a: torch.Tensor, b: torch.Tensor) -> int | None:
    pa, pb = _philox(a), _philox(b)
    if pa is None or pb is None or pa[0] != pb[0] or pb[1] < pa[1]:
        return None
    return pb[1] - pa[1]


def _cuda_advance(state: torch.Tensor, n: int) -> torch.Tensor:
    seed, offset = _philox(state)
    raw = seed.to_bytes(8, "little") + (offset + n).to_bytes(8, "little", signed=True)
    return torch.tensor(list(raw), dtype=torch.uint8)


class Streams:
    """The generators a forward may draw from: the CPU's, and the device's on a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def get(self) -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if self.cuda:
            states.append(torch.cuda.get_rng_state(self.device))
        return states

    def set(self, states: Sequence[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        if self.cuda:
            torch.cuda.set_rng_state(states[1], self.device)

    @staticmethod
    def equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    def distance(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
        """How far each generator moved from ``a`` to ``b`` (None: not by draws this can replay)."""
        counts = [_cpu_distance(a[0], b[0]), *([_cuda_distance(a[1], b[1])] if self.cuda else [])]
        return None if None in counts else tuple(counts)

    def describe(self, expected: Sequence[torch.Tensor] | None, now: Sequence[torch.Tensor]) -> str:
        """Which generators are not where ``expected`` says, in words (for a pass's reason to stop)."""
        if expected is None:
            return "past the script"
        moved = []
        if not torch.equal(expected[0], now[0]):
            n = _cpu_distance(expected[0], now[0], seconds=0.2)
            moved.append("the CPU generator moved" + (f" {n} draws" if n else ""))
        if self.cuda and not torch.equal(expected[1], now[1]):
            a, b = _philox(expected[1]), _philox(now[1])
            moved.append(f"the CUDA generator's Philox offset moved {a[1]} -> {b[1]}" if a and b and a[0] == b[0]
                         else "the CUDA generator was reseeded")
        return " and ".join(moved)

    def advance(self, states: Sequence[torch.Tensor], counts: tuple[int, ...]) -> list[torch.Tensor]:
        out = [_cpu_advance(states[0], counts[0]) if counts[0] else states[0]]
        if self.cuda:
            out.append(_cuda_advance(states[1], counts[1]) if counts[1] else states[1])
        return out


class RngScript:
    """Per micro-batch, how far its forward and loss moved each generator in the loop that was
    recorded (see the module's docstring)."""

    def __init__(self, streams: Streams, advances: list[tuple[int, ...]]):
        self.streams, self.advances = streams, advances
        self.misses = 0
        """Passes in a row whose draws the scripts did not predict (from two on, ``forward_backward``
        runs the loop until two loops in a row draw alike)."""

    def __eq__(self, other) -> bool:
        return isinstance(other, RngScript) and self.advances == other.advances

    @property
    def draws(self) -> bool:
        return any(any(c) for c in self.advances)


def signature(micro_batches: Sequence[Any]) -> Hashable:
    """What decides how many numbers the micro-batches' forwards draw: each one's tensors' shapes
    and dtypes and its other plain values (a flag or a length can change the path; a float is taken
    for a value that changes from step to step, and only its type counts). Values of tensors are
    left out: a forward whose draws depend on them misses (see :attr:`RngScript.misses`)."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype)
        return x if isinstance(x, (bool, int, str, type(None))) else type(x).__name__
    return tuple(tuple(leaf(x) for x in tree_flatten(b)[0]) for b in micro_batches)


class RngScripts:
    """The scripts learned so far, by the micro-batches' :func:`signature` (the last step of an
    epoch, shorter, keeps its own), the most recently used ``limit`` of them; and the signatures
    whose draws a loop could not make a script of, for the next ``REFUSE_CALLS`` calls of each."""

    REFUSE_CALLS = 64
    """Calls with micro-batches of a signature whose draws could not be replayed that run the loop
    alone (not recorded: counting draws that cannot be counted takes up to ``COUNT_SECONDS`` per
    micro-batch) before a pass is tried again."""

    def __init__(self, limit: int = 16):
        self.limit = limit
        self._scripts: OrderedDict[Hashable, RngScript] = OrderedDict()
        self._refused: dict[Hashable, int] = {}

    def refused(self, key: Hashable) -> bool:
        """Whether this call with micro-batches of ``key`` runs the loop alone (counted down)."""
        left = self._refused.pop(key, 0)
        if left > 1:
            self._refused[key] = left - 1
        return left > 0

    def refuse(self, key: Hashable) -> None:
        """A loop of micro-batches of ``key`` drew what no pass can replay."""
        self._scripts.pop(key, None)
        self._refused[key] = self.REFUSE_CALLS
        while len(self._refused) > self.limit:
            del self._refused[next(iter(self._refused))]

    def get(self, key: Hashable) -> RngScript | None:
        script = self._scripts.get(key)
        if script is not None:
            self._scripts.move_to_end(key)
        return script

    def put(self, key: Hashable, script: RngScript | None) -> None:
        """Keep ``script`` for ``key`` (None: forget it)."""
        self._scripts.pop(key, None)
        if script is not None:
            self._scripts[key] = script
            while len(self._scripts) > self.limit:
                self._scripts.popitem(last=False)


class Expected:
    """Where one pass's micro-batches start drawing: micro-batch 0 where the pass starts, micro-batch
    ``k`` where the script says micro-batch ``k - 1``'s forward and loss leave the generators
    (computed once, as the pass reaches it). Without a script, every micro-batch starts where the
    pass started, and any draw is a miss."""

    def __init__(self, script: RngScript | None, start: list[torch.Tensor]):
        self.script = script
        self._starts = [start]
        self._lock = threading.Lock()
        self.missed = False
        """A micro-batch's forward drew other numbers than the script says (set by the pass's
        turns; sharded, also any draw without a script, for the ranks' agreement)."""

    def start(self, k: int) -> list[torch.Tensor] | None:
        """Where micro-batch ``k``'s forward starts drawing (None: past the script)."""
        if self.script is None:
            return self._starts[0]
        if k > len(self.script.advances) - 1:
            return None
        with self._lock:
            while len(self._starts) <= k:
                i = len(self._starts) - 1
                self._starts.append(self.script.streams.advance(self._starts[i], self.script.advances[i]))
            return self._starts[k]


class Recorder:
    """Watches the loop: the generators' states where each micro-batch starts, after its loss and
    after its backward."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self.runs: list[dict[str, list[torch.Tensor]]] = []

    def mark(self, where: str) -> None:
        """The loop is at ``where`` ("start", "loss" or "end") of a micro-batch."""
        if where == "start":
            self.runs.append({})
        self.runs[-1][where] = self.streams.get()

    def script(self) -> RngScript | None:
        """What each micro-batch's forward and loss drew, or None where a pass could not replay it:
        a backward drew, something drew between micro-batches, or a draw was not one this can count."""
        advances = []
        for i, run in enumerate(self.runs):
            if len(run) != 3 or not self.streams.equal(run["loss"], run["end"]):
                return None
            if i + 1 < len(self.runs) and not self.streams.equal(run["end"], self.runs[i + 1]["start"]):
                return None
            advances.append(self.streams.distance(run["start"], run["loss"]))
            if advances[-1] is None:
                return None
        return RngScript(self.streams, advances) if advances else None
