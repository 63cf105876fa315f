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

Beside each mode's measured bytes it prints what a cache that sees the future would move for the
same accesses: every ``get`` of the measured steps is recorded in the order the engine made it
(with its writes, zeroings and creations), and replayed through a host tier of the same budget
evicting the tensor used again furthest ahead (dead tensors first; Belady's rule, with sizes).
That reference ignores what the engine must also respect (pins, holes, prefetch timing), so it
is a target, not a proof of a lower bound; the distance from it is what a better eviction policy
could still save on this access order, the distance from it to the floor what only another order
(or more memory) could.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

from offload_core.sizes import format_size
from tiered_offload import Engine, EngineConfig
from tiered_offload_examples.models import GPT, GPTConfig

from slow_disk import SlowDisk  # noqa: E402 (tools/)


def loss_of(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


class Accesses:
    """The store's accesses, in order, while :attr:`on`: ``(op, key, bytes)`` with op ``get``
    (needs the bytes), ``dirty`` (the copy got), ``write`` / ``create`` (new bytes, nothing read),
    ``zero`` / ``register`` (zeros: nothing read until written) and ``gone`` (unregistered)."""

    def __init__(self, store):
        self.events, self.on, self._lock = [], False, threading.Lock()
        for name, op in (("get", "get"), ("mark_dirty", "dirty"), ("write", "write"), ("create", "create"),
                         ("zero", "zero"), ("register", "register"), ("unregister", "gone")):
            setattr(store, name, self._wrap(store, getattr(store, name), op))

    def _wrap(self, store, method, op):
        def recorded(key, *args, **kwargs):
            result = method(key, *args, **kwargs)
            if self.on:
                nbytes = store.record(key).nbytes if op != "gone" else 0
                with self._lock:
                    self.events.append((op, key, nbytes))
            return result
        return recorded


def _kind(key: str) -> str:
    return key.rsplit("/", 1)[-1].split(".")[0]  # weight, grad, state, activations


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
        later[key] = i if op in ("get", "dirty") else inf
    resident: dict[str, list] = {}  # key -> [bytes, dirty, needed next at]
    zeros: set[str] = set()
    read, written, used = {}, {}, 0
    for i, (op, key, nbytes) in enumerate(events):
        counted = count_from <= i < count_to
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


def run(base, defer: bool, args, directory: str) -> dict:
    n = sum(p.numel() for p in base.parameters())
    storage = SlowDisk(directory, args.disk_rate * 1e6) if args.disk_rate else directory
    engine = Engine(copy.deepcopy(base), torch.optim.AdamW, dict(lr=1e-4), storage=storage,
                    host_memory=int(16 * n * args.host_fraction), durable=args.durable,
                    config=EngineConfig(defer_step=defer, activations="recompute",
                                        **({"prefetch_depth": args.prefetch_depth} if args.prefetch_depth is not None else {})))
    accesses, phases = Accesses(engine.store), {}
    g = torch.Generator().manual_seed(1)
    warm = args.steps // 2
    # one step recorded before the measured ones (the reference's cache fills) and one after them
    # (its choices in the last measured step see the uses that follow)
    for step in range(args.steps + 1):
        if step == warm - 1:
            accesses.on = True
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
        engine.backward(loss)
        s2 = engine.store.stats
        engine.clip_grad_norm_(1.0)
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
    weights = torch.cat([p.detach().flatten() for _, p in engine.named_parameters()])
    engine.close()
    read = {k: v / per for k, v in after.by_kind(("disk->host",), since=before).items()}
    written = {k: v / per for k, v in after.by_kind(("host->disk",), since=before).items()}
    waited = (after.io_wait_seconds - before.io_wait_seconds) / per
    return dict(read=read, written=written, seconds=seconds, waited=waited, floors=floors, deferred=mode,
                weights=weights, reference=reference, phases=phases)


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
    args = ap.parse_args()
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=256, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=8))
    n = sum(p.numel() for p in base.parameters())
    with tempfile.TemporaryDirectory(dir=".", prefix=".bench-step-modes-") as d:
        runs = {"deferred": run(base, True, args, f"{d}/deferred"), "inline": run(base, False, args, f"{d}/inline")}
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
    print(f"deferred / inline: weights read {d['read'].get('weight', 0) / i['read']['weight']:.2f}x, disk bytes "
          f"{total['deferred'] / total['inline']:.2f}x, step {d['seconds'] / i['seconds']:.2f}x; final weights "
          f"{'bitwise the same' if torch.equal(d['weights'], i['weights']) else 'DIFFERENT'}")
    assert d["deferred"] and not i["deferred"]
    return 0 if torch.equal(d["weights"], i["weights"]) else 1


if __name__ == "__main__":
    sys.exit(main())
