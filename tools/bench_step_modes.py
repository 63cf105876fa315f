"""Disk bytes per step with the optimizer step deferred to the next forward against inline.

At a host budget that cannot hold a unit's update beside the forward (a quarter of the state
here), the step either runs inline (every unit updated, then the forward reads the weights
again) or deferred (``EngineConfig.defer_step``: each unit updated by the forward as it reaches
it, so the weights the update wrote are the ones it reads). Both engines train the same model on
the same batches in the same run (``durable=False``, every block recomputed so no plan varies),
and the script prints the disk bytes per step of each, by kind of tensor, against the plan's
floor, and the ratios deferred / inline. No wait at the measured steps' boundaries: a wait for
the whole step (``commit()``, an export) runs a deferred step whole, as inline.

    python tools/bench_step_modes.py --steps 12
    python tools/bench_step_modes.py --steps 10 --prefetch-depth 2
    python tools/bench_step_modes.py --steps 10 --disk-rate 300   # a disk of 300 MB/s: disk-bound
    python tools/bench_step_modes.py --steps 8 --fused-order     # the updates moved into the backward
    python tools/bench_step_modes.py --steps 8 --step-in-backward --disk-rate 300   # the engine doing that

Beside each mode's measured bytes it prints what a cache that sees the future would move for the
same accesses: every ``get`` of the measured steps is recorded in the order the engine made it
(with its writes, zeroings and creations), and replayed through a host tier of the same budget
evicting the tensor used again furthest ahead (dead tensors first; Belady's rule, with sizes).
That reference ignores what the engine must also respect (pins, holes, prefetch timing), so it
is a target, not a proof of a lower bound; the distance from it is what a better eviction policy
could still save on this access order, the distance from it to the floor what only another order
(or more memory) could.

And the least bytes any cache of the budget could move for the same accesses, a lower bound
(:func:`least`: an integer program, solved by SciPy's HiGHS; ``--least-seconds 0`` skips it):
once with the engine's pins (a tensor got stays in memory until released), once with only the
tensor used in memory at each access. Their distance is what the pins cost.

``--fused-order`` asks what another order would save: the deferred run's accesses with each
unit's update moved into the backward, right after the unit's gradient is final (as PyTorch's
"optimizer step in the backward" does, :func:`fused_order`). Gradients then live one block long,
and the update's state traffic falls in the backward, where the disk idled. ``--step-in-backward``
runs a third engine that does it (``backward(loss, step=True)``, the same numbers); then no run
clips, so that all three end bitwise the same.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

from offload_core.sizes import format_size
from tiered_offload import Engine, EngineConfig, Tier
from tiered_offload_examples.models import GPT, GPTConfig

from slow_disk import SlowDisk  # noqa: E402 (tools/)


def loss_of(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


class Accesses:
    """The store's accesses, in order, while :attr:`on`: ``(op, key, bytes)`` with op ``get``
    (needs the bytes; pinned until its ``release``), ``dirty`` (the copy got), ``write`` /
    ``create`` (new bytes, nothing read; a created copy is pinned until released), ``zero`` /
    ``register`` (zeros: nothing read until written) and ``gone`` (unregistered).

    ``tier``: the accesses as that tier sees them (the device tier over the host's): a ``get`` in
    another tier is ``below_get``, bytes made there ``below_made`` (:func:`as_caching`)."""

    _TIER_ARG = {"get": 1, "release": 1, "dirty": 1, "write": 2, "create": 3}
    """Where each wrapped method takes its tier (positional, after the key)."""

    def __init__(self, store, tier=None):
        self.events, self.on, self._lock, self.tier = [], False, threading.Lock(), tier
        self.marks: list[tuple[int, tuple]] = []
        """``(position in events, what)``: where a unit's update began or ended, a backward, a step
        (:meth:`mark`; :func:`fused_order`)."""
        for name, op in (("get", "get"), ("release", "release"), ("mark_dirty", "dirty"), ("write", "write"),
                         ("create", "create"), ("zero", "zero"), ("register", "register"), ("unregister", "gone")):
            setattr(store, name, self._wrap(store, getattr(store, name), op))

    def mark(self, *what) -> None:
        """Note that ``what`` happens here, between two events (while :attr:`on`)."""
        if self.on:
            with self._lock:
                self.marks.append((len(self.events), what))

    def _as_seen(self, store, op: str, args: tuple, kwargs: dict) -> str | None:
        if self.tier is None or op not in self._TIER_ARG:
            return op
        at = self._TIER_ARG[op] - 1
        given = kwargs.get("tier", args[at] if len(args) > at else ("host" if op == "write" else None))
        if (store.compute_tier if given is None else Tier.parse(given)) == self.tier:
            return op
        return {"get": "below_get", "release": None}.get(op, "below_made")

    def _wrap(self, store, method, op):
        def recorded(key, *args, **kwargs):
            seen = self._as_seen(store, op, args, kwargs)
            if seen == "release" and self.on:  # (before the room is free: no get that uses it comes first)
                with self._lock:
                    self.events.append((seen, key, store.record(key).nbytes))
            result = method(key, *args, **kwargs)
            if self.on and seen not in ("release", None):
                nbytes = store.record(key).nbytes if op != "gone" else 0
                with self._lock:
                    self.events.append((seen, key, nbytes))
            return result
        return recorded


def _kind(key: str) -> str:
    return key.rsplit("/", 1)[-1].split(".")[0]  # weight, grad, state, activations


def _unit(key: str) -> str:
    return key.rsplit("/", 1)[0]  # block.3, rest


def fused_order(events: list, marks: list, first: int, last: int) -> tuple[list, int, int]:
    """The recorded accesses reordered as if each unit's update ran in the backward, right after
    that unit's last access there (its gradient final; the order PyTorch's "optimizer step in the
    backward", a post-accumulate-grad hook per parameter, makes): each update's accesses (between
    the marks ``update-start`` and ``update-end`` of its unit, and the zeroing of its gradient
    right after) moved from where the deferred step ran them (the next forward) to the backward
    before. Returns the events and the range of steps ``first`` to ``last`` (the marks ``step``)
    in them. What a cache could move for that order (``--step-in-backward`` measures the engine's)."""
    items: list[tuple] = []  # ("mark", what) and ("event", event), in recorded order
    at = 0
    for position, what in marks + [(len(events), ("end",))]:
        items += [("event", e) for e in events[at:position]]
        items.append(("mark", what))
        at = position
    kept, segments, i = [], [], 0  # the items without the updates; (item index, unit, its accesses)
    while i < len(items):
        kind, what = items[i]
        if kind == "mark" and what[0] == "update-start":
            unit, j, moved = what[1], i + 1, []
            while items[j] != ("mark", ("update-end", unit)):
                if items[j][0] == "event" and _unit(items[j][1][1]) == unit:
                    moved.append(items[j][1])
                else:
                    kept.append(items[j])  # another thread's access, or a mark: where it was
                j += 1
            if j + 1 < len(items) and items[j + 1][0] == "event" and items[j + 1][1][:2] == ("zero", f"{unit}/grad"):
                moved.append(items[j + 1][1])
                j += 1
            segments.append((len(kept), unit, moved))
            i = j + 1
        else:
            kept.append(items[i])
            i += 1
    backwards, start = [], None
    for k, (kind, what) in enumerate(kept):
        if kind == "mark" and what[0] == "backward-start":
            start = k
        elif kind == "mark" and what[0] == "backward-end" and start is not None:
            backwards.append((start, k))
    after: dict[int, list] = {}
    for where, unit, moved in segments:
        before = [b for b in backwards if b[1] <= where]
        used = ([k for k in range(*before[-1]) if kept[k][0] == "event" and _unit(kept[k][1][1]) == unit]
                if before else [])
        after.setdefault(used[-1] if used else where - 1, []).extend(moved)
    out, count_from, count_to = [], None, None
    for k in range(-1, len(kept)):
        if k >= 0:
            kind, what = kept[k]
            if kind == "event":
                out.append(what)
            elif what == ("step", first):
                count_from = len(out)
            elif what == ("step", last):
                count_to = len(out)
        out.extend(after.get(k, []))
    return out, count_from, count_to


def foresight(events: list, capacity: int, count_from: int, count_to: int) -> tuple[dict, dict]:
    """Disk bytes (read, written) of events ``count_from:count_to`` of a cache of ``capacity`` bytes that
    evicts the tensor whose bytes are needed furthest ahead (a dead one first: overwritten, zeroed
    or gone before its next read, it is dropped unwritten). Starts empty; a tensor's first ``get``
    reads it unless it holds zeros. Both by kind of tensor (``weight``, ``grad``, ``state``...)."""
    inf = len(events)
    next_at = [inf] * len(events)  # per event: where its tensor's bytes are next needed (inf: dead before)
    later: dict[str, int] = {}
    for i in range(len(events) - 1, -1, -1):
        op, key, _ = events[i]
        next_at[i] = later.get(key, inf)
        if op != "release":
            later[key] = i if op in ("get", "dirty") else inf
    resident: dict[str, list] = {}  # key -> [bytes, dirty, needed next at]
    zeros: set[str] = set()
    read, written, used = {}, {}, 0
    for i, (op, key, nbytes) in enumerate(events):
        counted = count_from <= i < count_to
        if op == "release":  # (this reference keeps no pins)
            continue
        if op in ("zero", "register", "gone"):
            if key in resident:
                used -= resident.pop(key)[0]
            if op != "gone":
                zeros.add(key)
            continue
        if key not in resident:
            if op == "get" and key not in zeros and counted:
                read[_kind(key)] = read.get(_kind(key), 0) + nbytes
            resident[key] = [nbytes, False, inf]
            used += nbytes
        entry = resident[key]
        entry[2] = next_at[i]
        if op in ("dirty", "write", "create"):
            entry[1] = True
            zeros.discard(key)
        while used > capacity:
            victim = max((k for k in resident if k != key), key=lambda k: resident[k][2], default=None)
            if victim is None:
                break
            size, dirty, needed = resident.pop(victim)
            used -= size
            if dirty and needed < inf and counted:
                written[_kind(victim)] = written.get(_kind(victim), 0) + size
    return read, written



def as_caching(events: list, pins: bool = True) -> tuple[list, list, list, list, set]:
    """The recorded timeline as a caching problem. ``stretches``: ``(from, to, bytes, version,
    key)``, each time a tensor's bytes must survive unpinned from one use (its release, or the
    write that made them) to its next ``get`` (a cache keeps them, or reads them again then).
    ``versions``: ``(at, bytes, made, key)``, each content a tensor had (``made``: in memory, not
    yet on disk, so a cache that drops it writes it once first). ``pinned[t]``: the bytes pinned
    just after event ``t`` (from a ``get`` to its ``release``: in memory whatever the cache does).
    Zeros are made again for free, so a zeroed tensor carries nothing until it is written. Without
    ``pins``, a tensor need be in memory only at its ``get`` (as :func:`foresight` assumes).

    A cache over another (the device tier over the host's) also sees the tier below use a
    tensor: ``below_get`` needs the bytes there (a version made in the cache is written down,
    ``flushed``), ``below_made`` makes new bytes there, so the cache's next ``get`` of it reads
    them (``fetched``: ``(at, bytes, key)``, whatever the cache does)."""
    stretches, versions, pinned, fetched, flushed, now = [], [], [], [], set(), 0
    tensors: dict[str, dict] = {}
    for t, (op, key, nbytes) in enumerate(events):
        s = tensors.setdefault(key, {"since": None, "version": None, "zeros": False, "pins": 0, "bytes": nbytes,
                                     "below": False})
        if op in ("zero", "register", "gone"):
            s.update(since=None, version=None, zeros=op != "gone", below=False)
        elif op == "below_get":
            if s["version"] is not None and versions[s["version"]][2] and not s["zeros"]:
                flushed.add(s["version"])
        elif op == "below_made":
            s.update(since=None, version=None, zeros=False, below=True)
        elif op == "get":
            if s["pins"] == 0:
                if s["since"] is not None and not s["zeros"]:
                    stretches.append((s["since"], t, nbytes, s["version"], key))
                elif s["version"] is None and not s["zeros"]:  # first seen (its bytes below), or made there
                    if s["below"]:
                        fetched.append((t, nbytes, key))
                    versions.append((t, nbytes, False, key))
                    s.update(version=len(versions) - 1, below=False)
                s["since"] = None if pins else t
                now += nbytes if pins else 0
            s["pins"] += pins
        elif op == "release" and pins:
            s["pins"] -= 1
            if s["pins"] == 0:
                now -= s["bytes"]
                s["since"] = t
        elif op != "release":  # dirty, write, create: new bytes, made in memory
            versions.append((t, nbytes, True, key))
            if op == "create" and pins:  # (given pinned)
                now += nbytes if s["pins"] == 0 else 0
                s["pins"] += 1
            s.update(version=len(versions) - 1, zeros=False, below=False, since=t if s["pins"] == 0 else None)
        pinned.append(now)
    return stretches, versions, pinned, fetched, flushed


def least(events: list, capacity: int, count_from: int, count_to: int, *, pins: bool = True,
          time_limit: float = 300.0) -> dict | None:
    """The least disk bytes any cache of ``capacity`` bytes could move in events
    ``count_from:count_to`` of this timeline (:func:`as_caching`): an integer program that keeps
    or drops each stretch, pays a read for each dropped stretch ending in the window and one write
    for each version made in the window and dropped at all, with what is kept and pinned after
    each event within ``capacity``. So a lower bound for this order of accesses (an engine must
    also respect holes, prefetch lead times and what the timeline does not record), where
    :func:`foresight` is one good cache. Returns ``read`` and ``written`` by kind, and ``proven``:
    False where ``time_limit`` cut the search (then ``at_least`` is the solver's bound on the
    total, and the split is its best cache found). ``pins``: the engine's pins held (False: the
    bound for any engine making these accesses in this order). None without SciPy."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_matrix
    except ImportError:
        return None
    stretches, versions, pinned, fetched, flushed = as_caching(events, pins)
    made = {v: j for j, v in enumerate(k for k, version in enumerate(versions) if version[2])}
    n, m, T = len(stretches), len(made), len(events)
    # variables: keep[i] for each stretch, wrote[j] for each version made, held[t] (kept after event t)
    cost = np.zeros(n + m + T)
    rows, cols, vals = [], [], []  # held[t] - held[t-1] = what starts at t - what ends at t
    for t in range(T):
        rows += [t] * (1 + bool(t))
        cols += [n + m + t, n + m + t - 1][:1 + bool(t)]
        vals += [1.0, -1.0][:1 + bool(t)]
    drops, constant = [], 0.0  # (wrote[j] >= 1 - keep[i])
    for i, (start, end, nbytes, version, _) in enumerate(stretches):
        rows += [start, end]
        cols += [i, i]
        vals += [-float(nbytes), float(nbytes)]
        if count_from <= end < count_to:
            cost[i] -= nbytes
            constant += nbytes
        if version in made:
            drops.append((i, made[version]))
    for version, j in made.items():
        if count_from <= versions[version][0] < count_to:
            cost[n + j] = versions[version][1]
    flow = csr_matrix((vals, (rows, cols)), shape=(T, n + m + T))
    paid = csr_matrix(([1.0, 1.0] * len(drops), ([r for r in range(len(drops)) for _ in (0, 1)],
                                                  [c for i, j in drops for c in (i, n + j)])),
                      shape=(len(drops), n + m + T))
    if max(pinned, default=0) > capacity:
        raise ValueError(f"the timeline pins {max(pinned)} bytes at once, beyond the {capacity} of the tier")
    room = capacity - np.asarray(pinned, dtype=float)
    sys.stdout.flush()
    quiet, saved = os.open(os.devnull, os.O_WRONLY), os.dup(1)
    os.dup2(quiet, 1)  # (HiGHS prints a line of its own now and then)
    try:
        res = milp(cost, integrality=np.r_[np.ones(n), np.zeros(m + T)],
                   bounds=Bounds(np.r_[np.zeros(n), [float(v in flushed) for v in made], np.zeros(T)],
                                 np.r_[np.ones(n + m), room]),
                   constraints=[LinearConstraint(flow, 0, 0), LinearConstraint(paid, 1, np.inf)],
                   options={"time_limit": time_limit})
    finally:
        os.dup2(saved, 1)
        os.close(saved), os.close(quiet)
    if res.x is None:
        raise RuntimeError(f"the least bytes' program found no cache: {res.message}")
    read, written = {}, {}
    for at, nbytes, key in fetched:
        if count_from <= at < count_to:
            read[_kind(key)] = read.get(_kind(key), 0) + nbytes
            constant += nbytes
    for i, (_, end, nbytes, _, key) in enumerate(stretches):
        if count_from <= end < count_to and res.x[i] < 0.5:
            read[_kind(key)] = read.get(_kind(key), 0) + nbytes
    for version, j in made.items():
        at, nbytes, _, key = versions[version]
        if count_from <= at < count_to and res.x[n + j] > 0.5:
            written[_kind(key)] = written.get(_kind(key), 0) + nbytes
    return {"read": read, "written": written, "proven": res.status == 0,
            "at_least": (res.mip_dual_bound if res.status != 0 else res.fun) + constant}


def run(base, defer: bool, args, directory: str, in_backward: bool = False) -> dict:
    n = sum(p.numel() for p in base.parameters())
    storage = SlowDisk(directory, args.disk_rate * 1e6) if args.disk_rate else directory
    engine = Engine(copy.deepcopy(base), torch.optim.AdamW, dict(lr=1e-4), storage=storage,
                    host_memory=int(16 * n * args.host_fraction), durable=args.durable,
                    config=EngineConfig(overlap_step=False, defer_step=defer, activations="recompute",
                                        state_piece_numel=args.state_piece_numel,
                                        **({"prefetch_depth": args.prefetch_depth} if args.prefetch_depth is not None
                                           else {})))
    accesses, phases = Accesses(engine.store), {}
    update_unit, backward = engine._update_unit, engine.backward

    def marked_update(unit, *a, **k):
        accesses.mark("update-start", unit.name)
        update_unit(unit, *a, **k)
        accesses.mark("update-end", unit.name)

    def marked_backward(loss, **kwargs):
        accesses.mark("backward-start")
        backward(loss, **kwargs)
        accesses.mark("backward-end")
    engine._update_unit, engine.backward = marked_update, marked_backward
    g = torch.Generator().manual_seed(1)
    warm = args.steps // 2
    # one step recorded before the measured ones (the reference's cache fills) and one after them
    # (its choices in the last measured step see the uses that follow)
    for step in range(args.steps + 1):
        if step == warm - 1:
            accesses.on = True
        accesses.mark("step", step)
        if step == warm:
            count_from = len(accesses.events)
            before, t0 = engine.store.stats, time.perf_counter()
        if step == args.steps:
            seconds = (time.perf_counter() - t0) / (args.steps - warm)
            after, count_to = engine.store.stats, len(accesses.events)
        x = torch.randint(0, 256, (args.batch, args.context + 1), generator=g)
        s0 = engine.store.stats
        loss = loss_of(engine, x)
        s1 = engine.store.stats
        if in_backward:  # the step, and zero_grad, in it
            engine.backward(loss, step=True)
        else:
            engine.backward(loss)
        s2 = engine.store.stats
        if not (in_backward or args.step_in_backward):  # (no clipping beside a step in the backward: bitwise)
            engine.clip_grad_norm_(1.0)
        if not in_backward:
            engine.step()
            engine.zero_grad()
        if warm <= step < args.steps:  # the disk bytes by phase (a deferred step's updates run in the forward)
            for phase, a, b in (("forward", s0, s1), ("backward", s1, s2), ("step", s2, engine.store.stats)):
                for way in ("disk->host", "host->disk"):
                    for kind, nbytes in b.by_kind((way,), since=a).items():
                        phases[(phase, way, kind)] = phases.get((phase, way, kind), 0) + nbytes / (args.steps - warm)
    floors, mode = engine.plan.floors, engine.defer_step
    accesses.on = False
    ref_read, ref_written = foresight(accesses.events, engine.store.capacity(engine.store.compute_tier),
                                      count_from, count_to)
    per = args.steps - warm
    reference = ({k: v / per for k, v in ref_read.items()}, {k: v / per for k, v in ref_written.items()})
    capacity = engine.store.capacity(engine.store.compute_tier)
    fewest = {pins: least(accesses.events, capacity, count_from, count_to, pins=pins, time_limit=args.least_seconds)
              for pins in (True, False)} if args.least_seconds else {}
    fused = None
    if args.fused_order and defer:
        events, first, last = fused_order(accesses.events, accesses.marks, warm, args.steps)
        got_read, got_written = foresight(events, capacity, first, last)
        units, kinds = engine.schedule.units, len(engine.schedule.state_kinds)
        beyond = max(0, 4 * sum(u.numel + kinds * u.state_numel for u in units) - capacity)
        fused = dict(foresight=(sum(got_read.values()) / per, sum(got_written.values()) / per), floor=2 * beyond,
                     least={pins: least(events, capacity, first, last, pins=pins, time_limit=args.least_seconds)
                            for pins in (True, False)} if args.least_seconds else {})
    weights = torch.cat([p.detach().flatten() for _, p in engine.named_parameters()])
    engine.close()
    read = {k: v / per for k, v in after.by_kind(("disk->host",), since=before).items()}
    written = {k: v / per for k, v in after.by_kind(("host->disk",), since=before).items()}
    waited = (after.io_wait_seconds - before.io_wait_seconds) / per
    return dict(read=read, written=written, seconds=seconds, waited=waited, floors=floors, deferred=mode,
                weights=weights, reference=reference, phases=phases, least=fewest, fused=fused)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="steps per engine; the second half is measured")
    ap.add_argument("--host-fraction", type=float, default=0.25)
    ap.add_argument("--durable", action="store_true",
                    help="durable engines (every step committed, as by default; the bench's default is durable=False)")
    ap.add_argument("--disk-rate", type=float, default=None, metavar="MB/S",
                    help="the disk no faster than this (reads and writes together; sleeps): the disk-bound case")
    ap.add_argument("--prefetch-depth", type=int, default=None,
                    help="EngineConfig.prefetch_depth (default: the engine's): fewer bytes ahead, fewer evicted early")
    ap.add_argument("--state-piece-numel", type=int, default=EngineConfig().state_piece_numel,
                    help="EngineConfig.state_piece_numel: the optimizer states an update holds at once, in elements")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="a third engine, each step run in its backward (backward(loss, step=True)); no run clips")
    ap.add_argument("--fused-order", action="store_true",
                    help="also the deferred run's accesses reordered with each unit's update in the backward, right "
                         "after its gradient is final: what a cache that sees the future, and the least any cache, "
                         "would move for that order (--step-in-backward: what the engine moves)")
    ap.add_argument("--least-seconds", type=float, default=300,
                    help="time for each least-bytes program (needs SciPy; 0: not computed)")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=256, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=8))
    n = sum(p.numel() for p in base.parameters())
    with tempfile.TemporaryDirectory(dir=".", prefix=".bench-step-modes-") as d:
        runs = {"deferred": run(base, True, args, f"{d}/deferred"), "inline": run(base, False, args, f"{d}/inline")}
        if args.step_in_backward:
            runs["in the backward"] = run(base, False, args, f"{d}/in-backward", in_backward=True)
    floors = runs["inline"]["floors"]
    floor = floors["disk_read"] + floors["disk_written"]
    print(f"model: {n / 1e6:.1f}M parameters, state {format_size(16 * n)}, host budget {args.host_fraction} x state; "
          + (f"the disk held to {args.disk_rate:g} MB/s; " if args.disk_rate else "") +
          f"{args.steps - args.steps // 2} measured steps each; the plan's disk floor {format_size(floor)} per step")
    print("| step | s / step | of it waiting for bytes | disk read / step (weights, gradients, states) | written / step "
          "| bytes / floor | foresight: read, written | bytes / foresight's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    total = {}
    for name, r in runs.items():
        read, written = sum(r["read"].values()), sum(r["written"].values())
        total[name] = read + written
        kinds = ", ".join(format_size(r["read"].get(k, 0)) for k in ("weight", "grad", "state"))
        ref_read, ref_written = r["reference"]
        ref = sum(ref_read.values()) + sum(ref_written.values())
        print(f"| {name} | {r['seconds']:.3f} | {r['waited']:.3f} | {format_size(read)} ({kinds}) | {format_size(written)} | "
              f"{(read + written) / floor:.2f} | {format_size(sum(ref_read.values()))}, "
              f"{format_size(sum(ref_written.values()))} | {(read + written) / max(1, ref):.2f} |")
    if args.least_seconds and runs["inline"]["least"][True] is None:
        print("the least bytes need SciPy (pip install scipy)")
    elif args.least_seconds:
        print("the least any cache of this budget moves for the same accesses (an integer program; '>=': its bound "
              "where --least-seconds cut the search), per step, and the measured bytes against it:")
        for name, r in runs.items():
            print(f"  {name}: " + "; ".join(
                f"{'with the engine pins' if pins else 'only the tensor used in memory'} "
                f"{'' if got['proven'] else '>= '}{format_size(got['at_least'] / (args.steps - args.steps // 2))} "
                f"({total[name] / (got['at_least'] / (args.steps - args.steps // 2)):.2f}x)"
                for pins, got in r["least"].items()))
    fused = runs["deferred"]["fused"]
    if fused is not None:
        ahead = sum(fused["foresight"])
        print(f"the deferred run's accesses with each update in the backward (the order of a step in it): foresight "
              f"{format_size(ahead)} per step ({ahead / floor:.2f}x the plan's floor; "
              f"{ahead / max(1, sum(sum(x.values()) for x in runs['deferred']['reference'])):.2f}x the deferred "
              f"order's foresight; {ahead / total['deferred']:.2f}x the deferred run's measured bytes); that order's "
              f"own floor (the weights and states memory cannot hold, each way) {format_size(fused['floor'])}")
        for pins, got in fused["least"].items():
            per = args.steps - args.steps // 2
            print(f"  the least, {'with the engine pins' if pins else 'only the tensor used in memory'}: "
                  f"{'' if got['proven'] else '>= '}{format_size(got['at_least'] / per)} "
                  f"({got['at_least'] / per / floor:.2f}x the plan's floor)")
    if args.disk_rate:
        rate = args.disk_rate * 1e6
        print(f"at {args.disk_rate:g} MB/s: the floor's bytes take {floor / rate:.3f} s; " + "; ".join(
            f"{name}'s {total[name] / rate:.3f} s (step / that: {r['seconds'] / (total[name] / rate):.2f})"
            for name, r in runs.items()))
    if args.durable:
        print("(durable: the journal writes every rewritten weight and state and the gradients each step, which the "
              "reference cache does not; compare its reads only)")
    print("by kind, read / written per step, measured against foresight's:")
    for name, r in runs.items():
        ref_read, ref_written = r["reference"]
        print(f"  {name}: " + "; ".join(
            f"{k} {format_size(r['read'].get(k, 0))} / {format_size(r['written'].get(k, 0))} against "
            f"{format_size(ref_read.get(k, 0))} / {format_size(ref_written.get(k, 0))}"
            for k in sorted(set(r["read"]) | set(r["written"]) | set(ref_read) | set(ref_written))))
    print("by phase, disk bytes read / written per step:")
    for name, r in runs.items():
        for phase in ("forward", "backward", "step"):
            got = {(way, kind): v for (p_, way, kind), v in r["phases"].items() if p_ == phase and v}
            kinds = sorted({kind for _, kind in got})
            print(f"  {name}, {phase}: " + ("; ".join(
                f"{kind} {format_size(got.get(('disk->host', kind), 0))} / {format_size(got.get(('host->disk', kind), 0))}"
                for kind in kinds) or "nothing"))
    d, i = runs["deferred"], runs["inline"]
    b = runs.get("in the backward")
    if b is not None:
        print(f"in the backward / deferred: disk bytes {total['in the backward'] / total['deferred']:.2f}x, step "
              f"{b['seconds'] / d['seconds']:.2f}x, gradients read + written "
              f"{format_size(b['read'].get('grad', 0) + b['written'].get('grad', 0))}; final weights "
              f"{'bitwise the same' if torch.equal(b['weights'], d['weights']) else 'DIFFERENT'}")
    ratio = lambda a, b: f"{a / b:.2f}x" if b else ("1.00x" if not a else "inf")  # noqa: E731 (none read: at 0.9)
    print(f"deferred / inline: weights read {ratio(d['read'].get('weight', 0), i['read'].get('weight', 0))}, disk bytes "
          f"{total['deferred'] / total['inline']:.2f}x, step {d['seconds'] / i['seconds']:.2f}x; final weights "
          f"{'bitwise the same' if torch.equal(d['weights'], i['weights']) else 'DIFFERENT'}")
    assert d["deferred"] and not i["deferred"]
    same = torch.equal(d["weights"], i["weights"]) and (b is None or torch.equal(b["weights"], d["weights"]))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
