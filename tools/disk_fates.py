#!/usr/bin/env python
"""Where a step's disk bytes go beyond the plan's floor: each disk write, by kind of tensor, by
what happened to that tensor next.

    python tools/disk_fates.py                          # the GPU run's proportions, update on the device
    python tools/disk_fates.py --optimizer-device host
    python tools/disk_fates.py --origins                # the writes by what started them too
    python tools/disk_fates.py --device-fraction 0 --host-fraction 0.3   # the host tier alone

A GPT at the 1B GPU run's proportions (20 blocks, the embedding a few % of the state; device and
host budgets 1/4 and 3/8 of the state, the device a stand-in of CPU memory) trains ``--steps``
steps; every copy to or from the disk is logged with its tensor's key. A write is then:

* ``read back``: the tensor's next disk transfer reads it (the write was needed);
* ``written again unread``: it is written again before any read (memory kept it after all);
* ``never again``: no disk transfer follows in the next two steps (a gradient the update read from
  memory after all, then forgotten by ``zero_grad``).

Reported per step, MiB, over ``--steps`` steps after ``--warmup``, beside the plan's floors. A write that
is not read back is traffic the floor does not count; reads above the floor are tensors that the
memory tiers could not keep (tensors large against the tiers, the working set). ``--origins`` also
splits the writes by what started them: the update's write-behind, a device victim moving down (or
room made for it), an eviction, room for a prefetch (which never waits), or anything else.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import shutil
import tempfile

import torch
import torch.nn.functional as F

from tiered_offload import Engine, EngineConfig, Tier
from tiered_offload.store.copies import CopyChains
from tiered_offload.store.record import kind_of
from tiered_offload_examples.models import GPT, GPTConfig

MIB = 1 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device-fraction", type=float, default=0.25, help="device budget, of the state (0: none)")
    ap.add_argument("--host-fraction", type=float, default=0.375, help="host budget, of the state")
    ap.add_argument("--optimizer-device", default="device", choices=("auto", "host", "device"))
    ap.add_argument("--steps", type=int, default=4, help="steps counted")
    ap.add_argument("--warmup", type=int, default=8, help="steps before the ones counted")
    ap.add_argument("--origins", action="store_true", help="split the writes by what started them")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    events: list[tuple[int, str, str, int, str]] = []
    now = [0]
    copy_between, write_back = CopyChains._copy_between, CopyChains._start_write_back
    origin: dict[str, str] = {}  # per key, what started its last write-back

    def logged(self, rec, src, dst, version):
        if Tier.DISK in (src, dst):
            events.append((now[0], rec.key, "W" if dst == Tier.DISK else "R", rec.nbytes,
                           origin.pop(rec.key, "other") if dst == Tier.DISK else ""))  # (each start once)
        return copy_between(self, rec, src, dst, version)

    def traced(self, rec, to, *, block=True):
        callers = [f.function for f in inspect.stack(0)[1:8]]
        origin[rec.key] = ("the update's write-behind" if "_update_held" in callers else
                           "a device victim moving down (or room for it)" if "_start_demote" in callers else
                           ("an eviction" if block else "room for a prefetch") if "_allocate" in callers else "other")
        return write_back(self, rec, to, block=block)
    CopyChains._copy_between = logged
    if args.origins:
        CopyChains._start_write_back = traced

    cfg = GPTConfig(vocab_size=args.vocab, context=128, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    torch.manual_seed(0)
    model = GPT(cfg)
    state = 16 * sum(p.numel() for p in model.parameters())
    storage = tempfile.mkdtemp(prefix=".disk-fates-", dir=".")
    device = {"store_config": {"device_budget_bytes": int(state * args.device_fraction)},
              "config": EngineConfig(optimizer_device=args.optimizer_device)} if args.device_fraction else {}
    g = torch.Generator().manual_seed(0)
    try:  # (a budget refused while the engine is built leaves no directory behind either)
        engine = Engine(model, torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.01), storage=storage,
                        host_memory=int(state * args.host_fraction), durable=False, **device)
        for i in range(args.warmup + args.steps + 2):  # (2 more: what follows the last counted writes)
            now[0] = i
            x = torch.randint(0, cfg.vocab_size, (4, cfg.context + 1), generator=g)
            engine.backward(F.cross_entropy(engine(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()))
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
        floors = engine.stats().floors
        engine.close()
    finally:
        CopyChains._copy_between, CopyChains._start_write_back = copy_between, write_back
        shutil.rmtree(storage, ignore_errors=True)

    counted = args.steps
    by_key = collections.defaultdict(list)
    for e in events:
        by_key[e[1]].append(e)
    reads, writes, fates, origins = (collections.Counter() for _ in range(4))
    for evs in by_key.values():
        for i, (step, key, op, n, started_by) in enumerate(evs):
            if not args.warmup <= step < args.warmup + args.steps:
                continue
            if op == "R":
                reads[kind_of(key)] += n
                continue
            writes[kind_of(key)] += n
            after = evs[i + 1][2] if i + 1 < len(evs) else None
            fate = {"R": "read back", "W": "written again unread", None: "never again"}[after]
            fates[(kind_of(key), fate)] += n
            origins[(started_by, fate)] += n
    per_step = lambda c: {k: round(v / counted / MIB, 1) for k, v in sorted(c.items())}  # noqa: E731
    floor = {k: round(floors[k] / MIB, 1) for k in ("disk_read", "disk_written")}
    report = {"state_MiB": round(state / MIB, 1), "floor_MiB": floor,
              "read_MiB_per_step": per_step(reads), "written_MiB_per_step": per_step(writes),
              "writes_by_fate_MiB_per_step": {f"{k} {f}": v for (k, f), v in per_step(fates).items()}}
    if args.origins:
        report["writes_by_origin_MiB_per_step"] = {f"{o}: {f}": v for (o, f), v in per_step(origins).items()}
    print(f"state {report['state_MiB']} MiB; the plan's floor per step: {report['floor_MiB']}")
    for what in ("read", "written"):
        got = report[f"{what}_MiB_per_step"]
        print(f"{what} per step: {got} ({sum(got.values()):.1f} MiB)")
    for what, v in report["writes_by_fate_MiB_per_step"].items():
        print(f"  {what:36s} {v:7.1f} MiB/step")
    for what, v in report.get("writes_by_origin_MiB_per_step", {}).items():
        print(f"  {what:66s} {v:7.1f} MiB/step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
