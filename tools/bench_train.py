#!/usr/bin/env python
"""Step time of the engine against plain in-memory PyTorch, and against the I/O lower bound.

Configurations of the same model, batch and optimizer (AdamW, clipping at 1.0), built once and
then run in interleaved rounds (each round runs every configuration for a few steps, in turn),
so the noise of a shared machine hits them alike; medians over rounds:

1. plain PyTorch, everything in memory: the reference;
2. the engine with a host budget that holds the whole training state;
3. the engine in memory with nothing recomputed: the compute of a disk run that recomputes nothing;
4. the engine with the state on disk and a host budget of a quarter of it (``--host-fraction``;
   ``advised``: the budget its plan advises), its planner choosing per block between keeping,
   offloading and recomputing activations;
5. the same with every block recomputed (``activations="recompute"``, what the engine did before
   activations went through the tiers).

Runs 2 and 4 are durable (the storage directory is a committed, resumable state: committed every
``--commit-every`` steps); with ``--volatile`` each also runs with ``durable=False``, to show what
durability costs.

A configuration's time per step is the wall time of its steady steps in the round: each round
runs one step untimed first, then ``--steps-per-round`` timed ones, so the window opens and closes
with one step's deferred work (an update run in the next forward) pending and holds the steady
state's work; what is left at the end is finished untimed, before the next configuration runs,
so nothing it does is hidden behind another configuration (``--timed-finish``: each round timed up
to the end of all its work, the measure before 2026-12-06, which charges a deferred step one
update not overlapped per round). For the disk run it prints the bytes moved per step, the disk
throughput measured here, the I/O lower bound (bytes read / read rate + bytes written / write
rate) and the ratio step / max(compute, I/O bound). The first round is a warm-up, not timed,
that runs each engine until its plan is final (made, checked, revised if it did not earn its disk
bytes, its step mode tried where the disk bounds it).

    python tools/bench_train.py --d-model 512 --layers 8 --batch 8 --context 128 --rounds 5

``--step-in-backward``: every engine runs its step in the backward (``backward(loss, step=True)``,
not clipped; plain PyTorch still clips), the durable ones with ``--commit-every`` of 2 or more.

``--sweep 0.25,0.33,0.5`` runs, instead, plain PyTorch and the engine (``durable=False``) at each
of those host budgets (fractions of the state), to show what a budget buys: its step time, whether
its step overlaps the next forward, its activation modes, its disk bytes per step, and what its
plan advises.

``--accumulate 4`` runs, instead, the disk run (``durable=False``, ``--host-fraction``) three
ways per optimizer step: one micro-batch; 4 micro-batches as the loop of ``engine.backward``;
the same 4 through ``engine.forward_backward`` (each block's weights fetched once for all of
them); and the engine in memory (one micro-batch's compute). It prints the disk bytes per
optimizer step of each and the ratios: reads of 4 fused / reads of one, and the fused step /
(4 x one micro-batch's in-memory step + one micro-batch disk step's I/O floor at the measured rates).
With ``--step-in-backward`` every engine runs its step in the last backward (``step=True``), unclipped.
With ``--dropout 0.1`` every forward draws random numbers: the first ``forward_backward`` of
an engine runs the loop and learns the draws, the later ones draw the loop's numbers block by block.
Its warm-up round, too, runs each engine until its plan is final, so the timed rounds measure the
plan the run keeps.

``--against-profile PROFILE`` runs, instead, the disk run (``durable=False``, ``--host-fraction``,
every block recomputed: the plan's choice of activations, which the profile's rates can change, left
out) twice: with the backend's default options (``io_profile="none"``) and with those the bench-io
profile ``PROFILE`` recommends (``tiered-offload bench-io --save-profile PROFILE``: measured on
the same drives), interleaved. It prints each one's options, step, disk bytes and the rate the disk
delivered while busy (bytes / the time any transfer was in flight), and the ratios. ``--path``
takes several directories there, separated by commas: the runs' storage striped over them; with
``--stripe-weights 1:6`` (bench-io's advice) a third run stripes them by those weights, profiled.

``--disk-rate MB/S`` (the default mode and ``--accumulate``) holds the storage of the runs whose
state is on disk to that rate (``tools/slow_disk.py``: a disk-bound machine, the GPU's case, on
this compute-bound one); the I/O bounds are then their bytes at that rate.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from offload_core.buffers import aligned_empty
from offload_core.sizes import format_size
from storage_backends.posix import PosixBackend
from tiered_offload import Engine, EngineConfig, Tier
from tiered_offload.engine.plan_monitor import PlanMonitor
from tiered_offload_examples.models import GPT, GPTConfig
from slow_disk import SlowDisk  # (tools/)


def _checked(plan) -> list[str]:
    """What the plan's check did with the planned activations: measured them against the modes they
    replaced again, kept them, or went back."""
    return [r for r in plan.reasons if r.startswith(("back to", "kept the planned", "the activation modes it replaced"))]


def _modes(modes) -> str:
    if modes is None:
        return "plain (state fits)"
    return ", ".join(f"{modes.count(m)} {m}" for m in ("keep", "offload", "recompute") if m in modes)


def loss_of(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def disk_rates(directory: str, nbytes: int = 512 << 20) -> tuple[float, float]:
    """Sequential write (to fsync) and O_DIRECT read rates of ``directory``, bytes/s."""
    b = PosixBackend(directory).open()
    buf = aligned_empty(nbytes)
    buf.fill_(7)
    try:
        t0 = time.perf_counter()
        b.write_from("rate-probe", buf).get()
        b.flush()
        w = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.read_into("rate-probe", buf).get()
        r = nbytes / (time.perf_counter() - t0)
        b.delete("rate-probe")
    finally:
        b.close()
    return w, r


class Config:
    """One configuration: a step function, a way to finish pending work, and its timings."""

    def __init__(self, name, step, finish=lambda: None, engine=None):
        self.name, self.step, self.finish, self.engine = name, step, finish, engine
        self.per_step: list[float] = []
        self.moved = {"read": [], "written": []}
        self.read_by_kind: list[dict[str, float]] = []
        self.finish_s: list[float] = []
        self.busy_s: list[float] = []

    def run(self, batches, lead_in=False):
        """Run ``batches``, timing them up to the end of their work (``finish``); with ``lead_in``
        the first runs untimed and the window ends when the last step returns: it opens and closes
        with one step's deferred work pending, so it holds the steady state's work of the others
        (the work left is finished untimed, in ``finish_s``)."""
        if lead_in:
            self.step(batches[0])
            batches = batches[1:]
        s0 = self.engine.stats() if self.engine else None
        t0 = time.perf_counter()
        for x in batches:
            self.step(x)
        if not lead_in:
            self.finish()
        self.per_step.append((time.perf_counter() - t0) / len(batches))
        s1 = self.engine.stats() if self.engine else None
        if lead_in:
            t1 = time.perf_counter()
            self.finish()
            self.finish_s.append(time.perf_counter() - t1)
        if self.engine:
            self.moved["read"].append((s1.bytes_read[Tier.DISK] - s0.bytes_read[Tier.DISK]) / len(batches))
            self.moved["written"].append((s1.bytes_written[Tier.DISK] - s0.bytes_written[Tier.DISK]) / len(batches))
            self.busy_s.append((s1.store.disk_busy_seconds - s0.store.disk_busy_seconds) / len(batches))
            read = s1.store.by_kind(("disk->host", "disk->device"), since=s0.store)
            self.read_by_kind.append({kind: n / len(batches) for kind, n in read.items()})


OPT_KWARGS = dict(lr=1e-4, weight_decay=0.01)


def _setup(args):
    """The model (seeded), the batches' generator and the storage directory of a run."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                    dropout=args.dropout)
    directory = args.path or tempfile.mkdtemp(prefix=".bench-train-", dir=os.getcwd())
    return cfg, GPT(cfg), torch.Generator().manual_seed(1), directory


@contextlib.contextmanager
def _engines(args, directory):
    """A list for a run's engines: every one closed at the end, and the storage directory removed
    unless ``--path`` named it."""
    engines: list = []
    try:
        yield engines
    finally:
        for e in engines:
            e.close()
        if args.path is None:
            shutil.rmtree(directory, ignore_errors=True)


def _plain(base) -> Config:
    """Plain PyTorch on a copy of ``base``: AdamW, clipping at 1.0."""
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), **OPT_KWARGS)

    def ref_step(x):
        loss_of(ref, x).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return Config("plain", ref_step)


def _storage(args, directory: str, name: str):
    """A configuration's storage: its directory, held to ``--disk-rate`` where given (the runs whose
    state is on disk; those that hold it in memory write only their commits)."""
    path = os.path.join(directory, name)
    if not args.disk_rate or name in ("memory", "host", "compute", "host-volatile"):
        return path
    os.makedirs(path, exist_ok=True)
    return SlowDisk(path, args.disk_rate * 1e6)


def _disk_budget(args, base, g, directory) -> int:
    """The disk run's host budget: ``--host-fraction`` of the state, or (``advised``) what the plan
    of an engine at a quarter of the state (or the minimum budget, if larger) advises: the least
    budget at which its step overlaps the next forward (that quarter where it already does)."""
    state = 16 * sum(p.numel() for p in base.parameters())  # AdamW, every parameter trained
    if args.host_fraction != "advised":
        return int(state * float(args.host_fraction))
    sizing = Engine(copy.deepcopy(base), torch.optim.AdamW, OPT_KWARGS, storage=os.path.join(directory, "sizing"),
                    host_memory=state, durable=False)
    quarter = max(state // 4, sizing.minimum_budget())  # a small model's quarter can be below the working set
    sizing.close()
    shutil.rmtree(os.path.join(directory, "sizing"), ignore_errors=True)
    probe = Engine(copy.deepcopy(base), torch.optim.AdamW, OPT_KWARGS, storage=os.path.join(directory, "probe"),
                   host_memory=quarter, durable=False)
    try:
        for _ in range(8):  # the plan is made once its planning iteration is measured
            if probe.plan.predicted_step_s is not None:
                break
            probe.backward(loss_of(probe, torch.randint(0, 256, (args.batch, args.context + 1), generator=g)))
            probe.clip_grad_norm_(1.0)
            probe.step()
            probe.zero_grad()
        probe.wait_committed()
        advised = probe.plan.advised_memory or quarter
    finally:
        probe.close()
        shutil.rmtree(os.path.join(directory, "probe"), ignore_errors=True)
    print(f"the plan at {format_size(quarter)} ({quarter / state:.2f} x state) advises host_memory = {format_size(advised)} "
          f"({advised / state:.2f} x state)", flush=True)
    return advised


def _rounds(args, configs, g, rows=None) -> None:
    """A warm-up round that runs each engine until its plan is final, then ``--rounds`` interleaved
    rounds (every other one in reverse order), each with a step to lead in (see :meth:`Config.run`)."""
    warm = PlanMonitor.FINAL_AFTER
    for r in range(args.rounds + 1):
        lead = r > 0 and not args.timed_finish
        steps = max(warm, args.steps_per_round) if r == 0 else args.steps_per_round + lead
        for c in configs if r % 2 == 0 else configs[::-1]:
            c.run([torch.randint(0, 256, (rows(c) if rows else args.batch, args.context + 1), generator=g)
                   for _ in range(steps)], lead_in=lead)


def main() -> int:  # noqa: C901 - a script
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="the model's dropout (with --accumulate: forward_backward replays the loop's draws)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (after a warm-up round)")
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--path", default=None, help="storage directory (default: a temp dir under cwd)")
    ap.add_argument("--host-fraction", default="0.25",
                    help="host budget of the disk run, as a fraction of the state; 'advised': the budget the plan "
                         "advises at a quarter of it (the least at which the step overlaps the next forward)")
    ap.add_argument("--volatile", action="store_true", help="also run the host and disk configurations with durable=False")
    ap.add_argument("--commit-every", type=int, default=1, help="commit the durable runs every N steps")
    ap.add_argument("--disk-rate", type=float, default=None, metavar="MB/S",
                    help="hold the disk runs' storage to this rate (tools/slow_disk.py): a disk-bound machine")
    ap.add_argument("--timed-finish", action="store_true",
                    help="time each round up to the end of its work (its last step's deferred update and commit) "
                         "instead of its steady steps after a lead-in step (the measure before 2026-12-06)")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="the engines run each step in the backward (backward(loss, step=True)), without clipping; "
                         "durable runs need --commit-every 2 or more")
    ap.add_argument("--trace", default=None, help="write the disk run's step timeline (Chrome trace) to this file")
    ap.add_argument("--accumulate", type=int, default=0, metavar="N",
                    help="compare N micro-batches per step as a loop of backwards and through forward_backward")
    ap.add_argument("--against-profile", default=None, metavar="PROFILE",
                    help="run the disk run with the backend's defaults and with this bench-io profile, nothing else")
    ap.add_argument("--stripe-weights", default=None, metavar="W",
                    help="with --against-profile and --path A,B: a third run striped by these weights (3:1)")
    ap.add_argument("--plan-free", action="store_true",
                    help="with --against-profile: the planner chooses each block's activations (default: all "
                         "recomputed, so that only the options differ)")
    ap.add_argument("--sweep", default=None, help="comma-separated host budgets (fractions of the state): run plain "
                                                  "PyTorch and the engine (durable=False) at each, nothing else")
    args = ap.parse_args()
    if args.accumulate:
        return accumulate(args)
    if args.sweep:
        return sweep(args)
    if args.against_profile:
        return against_profile(args)
    cfg, base, g, directory = _setup(args)
    with _engines(args, directory) as engines:
        def engine_config(name, host_budget, recompute="auto", durable=True, activations="auto", trace=None):
            engine = Engine(copy.deepcopy(base), torch.optim.AdamW, OPT_KWARGS, storage=_storage(args, directory, name),
                            host_memory=host_budget, recompute=recompute, durable=durable,
                            commit_every=args.commit_every if durable else 1,
                            config=EngineConfig(activations=activations), trace=trace)
            engines.append(engine)

            def step(x):
                if args.step_in_backward:  # step() and zero_grad() in the backward (no clipping)
                    engine.backward(loss_of(engine, x), step=True)
                    return
                engine.backward(loss_of(engine, x))
                engine.clip_grad_norm_(1.0)
                engine.step()
                engine.zero_grad()
            c = Config(name, step, finish=engine.wait_committed, engine=engine)
            c.flags = lambda: (f"activations={_modes(engine.activation_modes)}, step={engine.step_mode}, "
                               f"durable={engine.durable}" + (f", commit_every={engine.commit_every}" if engine.durable else ""))
            return c

        state = 16 * cfg.n_params()
        roomy = int(state * 1.6) + (64 << 20)
        plain = _plain(base)
        host = engine_config("host", roomy)
        compute = engine_config("compute", roomy, recompute=False, durable=False)
        small = _disk_budget(args, base, g, directory)
        disk = engine_config("disk", small, trace=args.trace)
        recomputing = engine_config("disk-recompute", small, durable=False, activations="recompute")
        configs = [plain, host, compute, disk, recomputing]
        if args.volatile:
            configs += [engine_config("host-volatile", roomy, durable=False),
                        engine_config("disk-volatile", small, durable=False)]
        _rounds(args, configs, g)
        for c in configs:  # drop the warm-up round (first steps initialise optimizer states)
            c.per_step = c.per_step[1:]
            c.moved = {k: v[1:] for k, v in c.moved.items()}
        state_bytes = engines[0].state_bytes()
        flags = {c.name: c.flags() for c in configs if c.engine}
        plan = disk.engine.plan.summary()
        floors = disk.engine.stats().floors
        for e in engines:
            e.close()
        engines.clear()
        w_rate, r_rate = disk_rates(directory)  # with nothing else on the disk
        if args.disk_rate:  # one device for reads and writes: the floor is all the bytes at the rate
            w_rate = r_rate = args.disk_rate * 1e6
    med = {c.name: statistics.median(c.per_step) for c in configs}
    rd, wr = statistics.median(disk.moved["read"]), statistics.median(disk.moved["written"])
    io_bound = rd / r_rate + wr / w_rate
    print(f"model: {cfg.n_params() / 1e6:.1f}M params, training state {format_size(state_bytes)}; batch {args.batch} x "
          f"{args.context} tokens; AdamW + clipping"
          + ("; the engines' step in the backward, not clipped" if args.step_in_backward else "")
          + f"; {args.rounds} interleaved rounds of {args.steps_per_round} steps, medians")
    print(f"plain PyTorch in memory                     {med['plain']:7.3f} s/step")
    print(f"engine, state fits host tier                {med['host']:7.3f} s/step   engine/in-memory = "
          f"{med['host'] / med['plain']:.2f}   ({flags['host']})")
    print(f"engine, in memory, nothing recomputed       {med['compute']:7.3f} s/step   "
          f"({med['compute'] / med['plain']:.2f} x plain)")
    print(f"engine, state on disk (host={small / state_bytes:.2f} x state)  {med['disk']:7.3f} s/step   engine/in-memory = "
          f"{med['disk'] / med['plain']:.2f}   ({flags['disk']})")
    print(f"  the same, every block recomputed, volatile {med['disk-recompute']:7.3f} s/step   engine/in-memory = "
          f"{med['disk-recompute'] / med['plain']:.2f}")
    print(f"disk run, per step: read {format_size(rd)} from disk, wrote {format_size(wr)}")
    if disk.finish_s:
        print(f"  the work left at a round's end (its last step's deferred update, the commit), untimed: "
              f"{statistics.median(disk.finish_s):.3f} s a round")
    print(f"disk rates here: read {r_rate / 1e9:.2f} GB/s, write {w_rate / 1e9:.2f} GB/s -> I/O lower bound "
          f"{io_bound:.3f} s/step; compute {med['compute']:.3f} s/step")
    print(f"disk step / max(compute, I/O bound) = {med['disk'] / max(med['compute'], io_bound):.2f}")
    floor_s = floors["disk_read"] / r_rate + floors["disk_written"] / w_rate
    print(f"the plan's disk floor: {format_size(floors['disk_read'])} read + {format_size(floors['disk_written'])} written "
          f"per step = {floor_s:.3f} s at these rates; measured disk bytes / floor = "
          f"{(rd + wr) / max(1, floors['disk_read'] + floors['disk_written']):.2f}; disk step / max(the engine's step in "
          f"memory, the floor's time) = {med['disk'] / max(med['host'], floor_s):.2f}")
    print("the disk run's plan:\n  " + plan.replace("\n", "\n  "))
    if args.volatile:
        print(f"durability: host run durable/volatile = {med['host'] / med['host-volatile']:.2f}, "
              f"disk run durable/volatile = {med['disk'] / med['disk-volatile']:.2f} "
              f"(volatile: {med['host-volatile']:.3f} / {med['disk-volatile']:.3f} s/step)")
    return 0


def accumulate(args) -> int:
    """One micro-batch, N as a loop, N fused, and the in-memory engine; interleaved rounds."""
    n = args.accumulate
    cfg, base, g, directory = _setup(args)
    state = 16 * cfg.n_params()

    def make(name, host, micro, fused, activations="auto"):
        engine = Engine(copy.deepcopy(base), torch.optim.AdamW, OPT_KWARGS, storage=_storage(args, directory, name),
                        host_memory=host, durable=False, config=EngineConfig(activations=activations))
        engines.append(engine)

        inside = args.step_in_backward  # (the step in the last backward, unclipped)

        def step(x):
            parts = list(x.chunk(micro))
            if fused:  # forward_backward takes the inputs; the loss finds each one's targets
                inputs = [p[:, :-1] for p in parts]
                targets = {id(i): p[:, 1:].flatten() for i, p in zip(inputs, parts)}
                loss = lambda out, b: F.cross_entropy(out.flatten(0, 1), targets[id(b)]) / micro  # noqa: E731
                engine.forward_backward(inputs, loss, step=inside)
            else:
                for k, b in enumerate(parts):
                    engine.backward(loss_of(engine, b) / micro, step=inside and k == micro - 1)
            if not inside:
                engine.clip_grad_norm_(1.0)
                engine.step()
                engine.zero_grad()
        return Config(name, step, finish=engine.wait_committed, engine=engine)
    with _engines(args, directory) as engines:
        write_rate, read_rate = disk_rates(directory)
        if args.disk_rate:  # one device for reads and writes: the floor is all the bytes at the rate
            write_rate = read_rate = args.disk_rate * 1e6
        host = _disk_budget(args, base, g, directory)
        configs = [make("memory", 2 * state, 1, False), make("one", host, 1, False),
                   make("loop", host, n, False), make("fused", host, n, True),
                   make("fused-recompute", host, n, True, "recompute")]
        _rounds(args, configs, g, rows=lambda c: args.batch if c.name in ("memory", "one") else args.batch * n)
        modes = {c.name: _modes(c.engine.activation_modes) for c in configs}
    med = {c.name: statistics.median(c.per_step[1:]) for c in configs}
    rd = {c.name: statistics.median(c.moved["read"][1:]) for c in configs}
    wr = {c.name: statistics.median(c.moved["written"][1:]) for c in configs}
    floor_one = rd["one"] / read_rate + wr["one"] / write_rate
    print(f"model: {cfg.n_params() / 1e6:.1f}M params, state {format_size(state)}, host budget {host / state:.2f} x "
          f"state;{' the step in the last backward, unclipped;' if args.step_in_backward else ''} micro-batch "
          f"{args.batch} x {args.context} tokens, {n} per optimizer step; {args.rounds} interleaved "
          f"rounds of {args.steps_per_round} steps, medians; disk {format_size(read_rate)}/s read, "
          f"{format_size(write_rate)}/s written")
    print("| run | s / optimizer step | disk read / step | disk written / step |")
    print("| --- | ---: | ---: | ---: |")
    for name, label in [("memory", "in memory, 1 micro-batch"), ("one", "disk, 1 micro-batch"),
                        ("loop", f"disk, {n} micro-batches, loop"), ("fused", f"disk, {n} micro-batches, forward_backward"),
                        ("fused-recompute", f"disk, {n} micro-batches, forward_backward, every block recomputed")]:
        print(f"| {label} | {med[name]:.3f} | {format_size(rd[name])} | {format_size(wr[name])} |")
    print(f"planned activations: one micro-batch's run {modes['one']}; forward_backward's {modes['fused']}")
    for c in configs:
        for why in _checked(c.engine.plan) if c.engine.plan.modes else []:
            print(f"{c.name}: {why}")
    kinds = sorted({k for c in configs for row in c.read_by_kind for k in row})
    print("disk reads per optimizer step by kind of tensor (medians): " + "; ".join(
        f"{c.name} " + ", ".join(f"{k} {format_size(statistics.median(r.get(k, 0.0) for r in c.read_by_kind[1:]))}"
                                  for k in kinds) for c in configs if c.name != "memory"))
    print(f"reads per optimizer step / one micro-batch's: loop {rd['loop'] / rd['one']:.2f}, forward_backward "
          f"{rd['fused'] / rd['one']:.2f}, recomputed {rd['fused-recompute'] / rd['one']:.2f} (target <= 1.15)")
    bound = n * med["memory"] + floor_one
    print(f"step / ({n} x in-memory step {med['memory']:.3f} s + one micro-batch step's I/O floor {floor_one:.3f} s): "
          f"loop {med['loop'] / bound:.2f}, forward_backward {med['fused'] / bound:.2f}, recomputed "
          f"{med['fused-recompute'] / bound:.2f} (target <= 1.1)")
    return 0


def _clipped_steps(name: str, engine) -> Config:
    """A configuration of ``engine``'s loop: backward, clipping at 1.0, step, zero_grad."""
    def step(x):
        engine.backward(loss_of(engine, x))
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
    return Config(name, step, finish=engine.wait_committed, engine=engine)


def against_profile(args) -> int:
    """The disk run with the backend's default options and with the bench-io profile's, interleaved."""
    directories = args.path.split(",") if args.path else None
    args.path = directories[0] if directories else None
    cfg, base, g, directory = _setup(args)
    with _engines(args, directory) as engines:
        state = 16 * cfg.n_params()
        configs = []
        runs = [("defaults", "none", None), ("profiled", args.against_profile, None)]
        if args.stripe_weights:
            runs.append(("weighted", args.against_profile, args.stripe_weights))
        for name, profile, weights in runs:
            storage = [os.path.join(d, name) for d in directories] if directories else os.path.join(directory, name)
            if weights:
                storage = f"posix:{','.join(storage)}?stripe_weights={weights}"
            # every block recomputed in both (unless --plan-free): a profile's rates could change the plan's
            # choice, and so the bytes
            engine = Engine(copy.deepcopy(base), torch.optim.AdamW, OPT_KWARGS, storage=storage, durable=False,
                            host_memory=int(state * float(args.host_fraction)), store_config={"io_profile": profile},
                            config=EngineConfig(activations="auto" if args.plan_free else "recompute"))
            engines.append(engine)
            configs.append(_clipped_steps(name, engine))
        _rounds(args, configs, g)
        options = {c.name: (c.engine.store.backend, c.engine.plan.rates.source if c.engine.plan.rates else "-",
                            _modes(c.engine.activation_modes), _checked(c.engine.plan)) for c in configs}
    print(f"model: {cfg.n_params() / 1e6:.1f}M params, training state {format_size(state)}; batch {args.batch} x "
          f"{args.context} tokens; AdamW + clipping; host budget {args.host_fraction} x the state, durable=False; "
          f"{args.rounds} interleaved rounds of {args.steps_per_round} steps after a warm-up round, medians")
    print("| backend options | s/step | disk read + written / step | delivered while busy |")
    print("| --- | ---: | ---: | ---: |")
    row = {}
    for c in configs:
        b = options[c.name][0]
        moved = statistics.median(c.moved["read"][1:]) + statistics.median(c.moved["written"][1:])
        busy = statistics.median(c.busy_s[1:])
        row[c.name] = (statistics.median(c.per_step[1:]), moved / busy if busy else float("nan"))
        print(f"| {c.name}: threads {b.threads}, requests {format_size(b.chunk_bytes)}, "
              f"{'O_DIRECT' if b.supports_direct_io else 'buffered'}"
              f"{', stripe weights ' + ':'.join(map(str, b.stripe_weights)) if b.stripe_weights else ''} | "
              f"{row[c.name][0]:.3f} | {format_size(moved)} | "
              f"{row[c.name][1] / 1e9:.2f} GB/s |")
    for name in row:
        if name != "defaults":
            print(f"{name} / defaults: step {row[name][0] / row['defaults'][0]:.2f}, delivered rate "
                  f"{row[name][1] / row['defaults'][1]:.2f}; its plan's disk rates: {options[name][1]}")
    if args.plan_free:
        print("activations as planned: " + "; ".join(f"{name} {options[name][2]}" for name in row))
        for name in row:
            for why in options[name][3]:
                print(f"{name}: {why}")
    return 0


def sweep(args) -> int:
    """Plain PyTorch and the engine at each host budget of ``--sweep``, interleaved."""
    fractions = [float(f) for f in args.sweep.split(",")]
    cfg, base, g, directory = _setup(args)
    with _engines(args, directory) as engines:
        configs = [_plain(base)]
        state = 16 * cfg.n_params()  # AdamW, every parameter trained: weights, gradients, m and v
        for f in fractions:
            engine = Engine(copy.deepcopy(base), torch.optim.AdamW, OPT_KWARGS, storage=os.path.join(directory, f"{f:g}"),
                            host_memory=int(state * f), durable=False)
            engines.append(engine)
            configs.append(_clipped_steps(f"{f:g}", engine))
        _rounds(args, configs, g)
        rows = []
        for c in configs[1:]:
            e = c.engine
            advice = [r for r in e.plan.reasons if r.startswith("the step does not overlap")]
            rows.append((c, e.step_mode, _modes(e.activation_modes), advice))
    med = {c.name: statistics.median(c.per_step[1:]) for c in configs}  # the first round warms up
    print(f"model: {cfg.n_params() / 1e6:.1f}M params, training state {format_size(state)}; batch {args.batch} x "
          f"{args.context} tokens; AdamW + clipping; {args.rounds} interleaved rounds of {args.steps_per_round} steps, "
          f"medians; plain PyTorch {med['plain']:.3f} s/step")
    print("| host budget | s/step | vs plain | step | activations | disk read / step | disk written / step |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: |")
    for c, how, modes, _ in rows:
        rd, wr = statistics.median(c.moved["read"][1:]), statistics.median(c.moved["written"][1:])
        print(f"| {c.name} x state ({format_size(int(state * float(c.name)))}) | {med[c.name]:.3f} | "
              f"{med[c.name] / med['plain']:.2f} | {how} | {modes} | {format_size(rd)} | "
              f"{format_size(wr)} |")
    for c, _, _, advice in rows:
        for a in advice:
            print(f"plan at {c.name} x state: {a}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
