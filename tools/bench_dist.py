#!/usr/bin/env python
"""Sharded training over torch.distributed on this machine: 1 rank, then 2 (gloo, localhost),
the same global batch, each rank's state on its own directory and a host budget a quarter of its
share of the state.

    python tools/bench_dist.py                     # 1 and 2 ranks
    python tools/bench_dist.py --ranks 1,2,3 --json dist.json

Reports per configuration: seconds per step (median after a warm-up), per rank the disk bytes
read and written per step, the stored state, and the collective bytes per step (all-gather,
reduce-scatter, all-reduce buffers; a ring moves (W-1)/W of each in and out of a rank). Then what
those volumes predict for N ranks on N drives: each rank's disk traffic shrinks as 1/N, its
collective traffic stays about 2 x (W-1)/W of the weights + 1 x of the gradients per step.

On a machine with few cores the ranks share them, so the step time does not shrink with more
ranks here; the per-rank volumes are what carries over to N GPUs with N drives.

    python tools/bench_dist.py --ranks 2 --accumulate 4

runs, instead, each world size twice with ``--accumulate`` micro-batches per optimizer step: as the
loop of ``engine.backward`` and through ``engine.forward_backward`` (each block gathered once per
pass for all of them), and prints both runs' volumes per optimizer step, their ratios, and whether
the two ended with the same weights bit for bit.

    python tools/bench_dist.py --ranks 2 --commit-every 4 --rounds 2
    python tools/bench_dist.py --ranks 1,2 --step-in-backward --rounds 2 --accumulate 2

trains durably instead (each rank's directory the checkpoint), every step committed against every
4th (snapshot commits), the two interleaved over the rounds; prints each one's step time and disk
bytes written per step (the commits' included), their ratios, the commit mode each rank ran, and
whether the two ended with the same weights bit for bit.

``--step-in-backward`` runs each world size with the step after the backward (``step()``) against
the step in it (``step=True``: each rank updates its slice of a block once the ranks reduced its
gradient), neither clipping, interleaved over the rounds (with ``--accumulate N``: N micro-batches
through ``forward_backward``); prints each one's step time, disk bytes per rank, how many updates ran
inside the backward, their ratios, and whether the two ended with the same weights bit for bit.
``--disk-rate MB/S`` holds each rank's disk to that rate (each rank its own drive, as on N GPUs
with N drives: ``tools/slow_disk.py``'s ``slow_file_backends``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def _model(args):
    from tiered_offload_examples.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, context=args.context, d_model=args.d_model, n_layers=args.layers,
                         n_heads=args.heads))


def rank_main(args) -> int:
    """One rank (RANK / WORLD_SIZE in the environment when more than one)."""
    import torch.distributed as dist
    if args.disk_rate:  # (this rank's own drive)
        from slow_disk import slow_file_backends
        slow_file_backends(args.disk_rate * 1e6)

    from tiered_offload import Engine, Tier
    from tiered_offload.engine.step_in_backward import StepInBackward
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    model = _model(args)
    n = sum(p.numel() for p in model.parameters())
    share = 16 * n / world
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-4), storage=Path(args.out) / "state",
                    durable=args.durable, commit_every=args.every,
                    host_memory=max(int(share * args.budget_fraction), args.min_host), device="cpu")
    inside = []  # per update: whether it ran inside the backward
    update_unit = engine._update_unit
    engine._update_unit = lambda unit, *a: (inside.append(StepInBackward.updating(engine)),
                                            update_unit(unit, *a))[1]
    g = torch.Generator().manual_seed(rank)
    per_rank, micro = args.batch // world, max(1, args.accumulate)
    times, disk_r, disk_w, coll = [], [], [], []
    for step in range(args.steps):
        x = torch.randint(0, 256, (per_rank, args.context + 1), generator=g)
        s0, c0 = engine.stats(), engine.collective_bytes()
        t = time.perf_counter()
        parts = list(x.chunk(micro))
        if args.fused:  # forward_backward takes the inputs; the loss finds each one's targets
            inputs = [b[:, :-1] for b in parts]
            targets = {id(i): b[:, 1:].flatten() for i, b in zip(inputs, parts)}
            engine.forward_backward(inputs, lambda out, b: F.cross_entropy(out.flatten(0, 1), targets[id(b)]) / micro,
                                    step=args.in_backward)
        for i, b in enumerate([] if args.fused else parts):
            engine.backward(F.cross_entropy(engine(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()) / micro,
                            step=args.in_backward and i == len(parts) - 1)
        if not args.in_backward:
            if not args.step_in_backward:  # (the comparison with the step in the backward clips in neither)
                engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
        if world > 1:
            dist.barrier()
        dt = time.perf_counter() - t
        s1, c1 = engine.stats(), engine.collective_bytes()
        if step >= 1:
            times.append(dt)
            disk_r.append(s1.bytes_read[Tier.DISK] - s0.bytes_read[Tier.DISK])
            disk_w.append(s1.bytes_written[Tier.DISK] - s0.bytes_written[Tier.DISK])
            coll.append({k: c1[k] - c0[k] for k in c1})
    engine._await()
    commits = type(engine._commits).__name__
    weights = torch.cat([w.detach().flatten() for _, w in engine.named_parameters()])  # gathered on every rank
    result = {"weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
              "rank": rank, "world": world, "step_s": statistics.median(times),
              "disk_read_per_step": statistics.median(disk_r), "disk_written_per_step": statistics.median(disk_w),
              "collective_per_step": {k: statistics.median(c[k] for c in coll) for k in coll[0]},
              "state_bytes": engine.state_bytes(), "local_state_bytes": engine.local_state_bytes(),
              "host_budget": engine.store.capacity("host"), "parameters": n,
              "gathered_ahead": engine._streamer.gathered_ahead, "commits": commits,
              "updates": len(inside), "updates_in_backward": sum(inside)}
    engine.close()
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()
    return 0


def run(world: int, args) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=".bench-dist-", dir=os.getcwd()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--rank-main", "--out", str(out)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k in ("layers", "d_model", "heads", "context", "batch", "steps", "budget_fraction", "min_host",
                 "accumulate", "every", "disk_rate")] + [
        f"--{flag.replace('_', '-')}" for flag in ("fused", "durable", "in_backward", "step_in_backward")
        if getattr(args, flag)]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
        procs.append(subprocess.Popen(cmd, env=env))
    import shutil
    try:
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"a rank of the {world}-rank run failed (exit {p.returncode})")
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(world)]
    finally:
        for p in procs:
            p.wait()
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
    ap.add_argument("--steps", type=int, default=5, help="steps per run, the first a warm-up")
    ap.add_argument("--budget-fraction", type=float, default=0.25, help="host budget / each rank's share of the state")
    ap.add_argument("--min-host", type=int, default=0, help="raise the host budget to at least this (bytes)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--accumulate", type=int, default=0, metavar="N",
                    help="N micro-batches per optimizer step: the loop against forward_backward")
    ap.add_argument("--commit-every", type=int, default=0, metavar="N",
                    help="durable: every step committed against every Nth")
    ap.add_argument("--rounds", type=int, default=2, help="with --commit-every: rounds of the two, interleaved")
    ap.add_argument("--disk-rate", type=float, default=0, metavar="MB/S",
                    help="each rank's disk held to this rate (its own drive)")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="the step after the backward against in it (step=True), neither clipping")
    ap.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-backward", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--durable", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--every", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    if args.step_in_backward:
        return in_backward(args)
    if args.accumulate:
        return accumulate(args)
    if args.commit_every:
        return commits(args)
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("rank_main", "out", "json")},
              "cpus": os.cpu_count(), "runs": {}}
    mib = lambda b: f"{b / 2**20:8.1f} MiB"  # noqa: E731
    print(f"{'ranks':>5} {'s/step':>8} {'disk read/rank':>15} {'written/rank':>13} {'state/rank':>12} "
          f"{'all-gather':>12} {'reduce-scat.':>12}")
    for world in [int(w) for w in args.ranks.split(",")]:
        res = run(world, args)
        report["runs"][world] = res
        r0 = res[0]
        step = max(r["step_s"] for r in res)
        c = r0["collective_per_step"]
        print(f"{world:>5} {step:8.3f} {mib(r0['disk_read_per_step']):>15} {mib(r0['disk_written_per_step']):>13} "
              f"{mib(r0['local_state_bytes']):>12} {mib(c['all_gather']):>12} {mib(c['reduce_scatter']):>12}", flush=True)
    runs = report["runs"]
    if 1 in runs and len(runs) > 1:
        base = runs[1][0]
        print(f"\nstate {mib(base['state_bytes']).strip()}, {base['parameters'] / 1e6:.1f}M parameters, {report['cpus']} cores")
        for world, res in runs.items():
            if world == 1:
                continue
            r0 = res[0]
            disk = (r0["disk_read_per_step"] + r0["disk_written_per_step"]) / (base["disk_read_per_step"] + base["disk_written_per_step"])
            print(f"{world} ranks: step {max(r['step_s'] for r in res) / base['step_s']:.2f}x one rank's; disk bytes per rank "
                  f"{disk:.2f}x; state per rank {r0['local_state_bytes'] / base['state_bytes']:.3f}x")
            weights = 4 * base["parameters"]
            coll = r0["collective_per_step"]
            print(f"  collective buffers per step: all-gather {coll['all_gather'] / weights:.2f}x the weights, "
                  f"reduce-scatter {coll['reduce_scatter'] / weights:.2f}x")
        print("prediction for N ranks on N drives (each rank's own drive, same global batch): disk bytes per rank "
              "= one rank's / N; collective bytes through each rank per step = (N-1)/N x (the all-gather and "
              "reduce-scatter buffers above), about constant in N")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def accumulate(args) -> int:
    """Each world size as the loop and through forward_backward; volumes per optimizer step."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    n = sum(p.numel() for p in _model(args).parameters())
    rows = args.batch // max(int(w) for w in args.ranks.split(",")) // args.accumulate
    print(f"{n / 1e6:.1f}M parameters, state {mib(16 * n)}, host budget {args.budget_fraction:g} x each rank's share; "
          f"{args.accumulate} micro-batches of {rows} x {args.context} tokens per rank per optimizer step; medians of "
          f"{args.steps - 1} steps after a warm-up")
    print("| ranks | run | s / step | disk read / rank | all-gather / rank | reduce-scatter / rank |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for world in [int(w) for w in args.ranks.split(",")]:
        runs = {}
        for fused in (False, True):
            args.fused = fused
            res = runs[fused] = run(world, args)
            r0, c = res[0], res[0]["collective_per_step"]
            print(f"| {world} | {'forward_backward' if fused else 'loop'} | {max(r['step_s'] for r in res):.3f} | "
                  f"{mib(r0['disk_read_per_step'])} | {mib(c['all_gather'])} | {mib(c['reduce_scatter'])} |",
                  flush=True)
        loop, fused = runs[False][0], runs[True][0]
        ratio = lambda f: f(fused) / max(f(loop), 1)  # noqa: E731
        gathers = ratio(lambda r: r["collective_per_step"]["all_gather"])
        reductions = ratio(lambda r: r["collective_per_step"]["reduce_scatter"])
        step = max(r["step_s"] for r in runs[True]) / max(r["step_s"] for r in runs[False])
        same = all(a["weights_sha256"] == b["weights_sha256"] for a, b in zip(runs[False], runs[True]))
        print(f"{world} ranks, forward_backward / loop: all-gather {gathers:.2f}x, disk reads "
              f"{ratio(lambda r: r['disk_read_per_step']):.2f}x, reduce-scatter {reductions:.2f}x, step {step:.2f}x; "
              f"final weights {'bitwise the same' if same else 'DIFFERENT'}")
    args.fused = False
    return 0


def in_backward(args) -> int:
    """Each world size with the step after the backward and in it, interleaved over the rounds."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    n = sum(p.numel() for p in _model(args).parameters())
    args.fused = args.accumulate > 1
    print(f"{n / 1e6:.1f}M parameters, state {mib(16 * n)}, host budget {args.budget_fraction:g} x each rank's share; "
          f"{max(1, args.accumulate)} micro-batch(es) per step{' (forward_backward)' if args.fused else ''}, no "
          f"clipping{f'; each rank its own disk held to {args.disk_rate:g} MB/s' if args.disk_rate else ''}; medians of {args.steps - 1} steps after a warm-up, then over {args.rounds} rounds")
    print("| ranks | step | s / step | disk read / rank / step | written | updates in the backward |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for world in [int(w) for w in args.ranks.split(",")]:
        got: dict[bool, list] = {False: [], True: []}
        for _ in range(args.rounds):
            for inside in got:
                args.in_backward = inside
                got[inside].append(run(world, args))
        summary = {}
        for inside, runs in got.items():
            step = statistics.median(max(r["step_s"] for r in res) for res in runs)
            read = statistics.median(res[0]["disk_read_per_step"] for res in runs)
            written = statistics.median(res[0]["disk_written_per_step"] for res in runs)
            summary[inside] = (step, read + written)
            r0 = runs[-1][0]
            print(f"| {world} | {'in the backward' if inside else 'after it'} | {step:.3f} | {mib(read)} | "
                  f"{mib(written)} | {r0['updates_in_backward']} of {r0['updates']} |")
        (s0, d0), (s1, d1) = summary[False], summary[True]
        same = len({r["weights_sha256"] for runs in got.values() for res in runs for r in res}) == 1
        print(f"{world} rank(s), in the backward / after it: step {s1 / s0:.2f}x, disk bytes per rank "
              f"{d1 / max(d0, 1):.2f}x; final weights {'bitwise the same' if same else 'DIFFERENT'}", flush=True)
    args.fused = args.in_backward = False
    return 0


def commits(args) -> int:
    """Durable runs, every step committed against every ``--commit-every``-th, interleaved."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    n = sum(p.numel() for p in _model(args).parameters())
    print(f"{n / 1e6:.1f}M parameters, state {mib(16 * n)}, host budget {args.budget_fraction:g} x each rank's share; "
          f"medians of {args.steps - 1} steps after a warm-up, then over {args.rounds} rounds")
    args.durable = True
    for world in [int(w) for w in args.ranks.split(",")]:
        got: dict[int, list] = {1: [], args.commit_every: []}
        for _ in range(args.rounds):
            for every in got:
                args.every = every
                got[every].append(run(world, args))
        print("| ranks | commits | mode | s / step | disk written / rank / step | read |")
        print("| ---: | --- | --- | ---: | ---: | ---: |")
        summary = {}
        for every, runs in got.items():
            step = statistics.median(max(r["step_s"] for r in res) for res in runs)
            written = statistics.median(res[0]["disk_written_per_step"] for res in runs)
            read = statistics.median(res[0]["disk_read_per_step"] for res in runs)
            summary[every] = (step, written)
            modes = sorted({r["commits"] for res in runs for r in res})
            print(f"| {world} | every {every} | {', '.join(modes)} | {step:.3f} | {mib(written)} | {mib(read)} |")
        (s1, w1), (sn, wn) = summary[1], summary[args.commit_every]
        same = len({r["weights_sha256"] for runs in got.values() for res in runs for r in res}) == 1
        print(f"{world} ranks, every {args.commit_every} / every step: step {sn / s1:.2f}x, disk written "
              f"{wn / max(w1, 1):.2f}x; final weights {'bitwise the same' if same else 'DIFFERENT'}", flush=True)
    args.durable, args.every = False, 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
