#!/usr/bin/env python
"""Disk traffic and step time with a device tier and a host tier below it: how the two memory
tiers share the work, the engine's default against the caching it replaced, in one run.

The GPU's arrangement: the compute runs on the device tier, the host tier sits between it and the
disk. On a machine without a GPU, ``--device cpu`` gives the engine a device tier of CPU memory
with its own budget (the same code path; its "PCIe" copies are memcpy). Configurations, each one
engine built once, then run in interleaved rounds (every configuration a few steps per round, in
turn) so a noisy machine hits them alike, after a warm-up round that runs each until its plan is
final (made, checked, revised if it did not earn its disk bytes):

* ``exclusive, short window`` (the default): the two tiers cache different tensors (a device
  victim moves down to the host tier, the host gives up copies the device also holds first), and
  the host tier prefetches from the disk only ``host_prefetch_share`` of its budget ahead;
* ``inclusive, deep window`` (the caching before): the host keeps a copy of what the device holds,
  a device victim is written to the disk, and the host prefetches ``prefetch_depth`` tensors ahead;
* the two mixed, to attribute the difference.

Reports per configuration, medians over rounds: seconds per step, disk bytes read and written per
step (as multiples of the training state), bytes copied into and out of the device tier; and the
ratios against the inclusive, deep-window configuration measured in the same run.

    python tools/bench_tiers.py                    # CPU: 29M-parameter GPT, device 1/4, host 3/8 of the state
    python tools/bench_tiers.py --shares 0.0625,0.125,0.25,1   # the host tier's prefetch window alone
    python tools/bench_tiers.py --device cuda --d-model 2048 --layers 20 --vocab 32768 --batch 4 --context 512
    python tools/bench_tiers.py --placements       # the optimizer step on the device against on the host
    python tools/bench_tiers.py --placements --disk-rate 300   # the same with the disk the bottleneck, and 'auto'
    python tools/bench_tiers.py --placements --least 300      # and the least link bytes for the same accesses
    python tools/bench_tiers.py --placements --step-in-backward   # and each placement with the step in the backward

``--least SECONDS`` records the device tier's accesses from the first measured round on and gives
the least bytes any device tier of the budget could copy in and out for them over the rounds after
it (``tools/bench_step_modes.py``'s ``least``: an integer program, a lower bound; needs SciPy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tiered_offload import Engine, EngineConfig, Tier, empty_init, format_size
from tiered_offload.engine.plan_monitor import PlanMonitor
from tiered_offload.profile import filesystem_id, save_profile
from tiered_offload_examples.models import GPT, GPTConfig

from bench_step_modes import Accesses, least  # noqa: E402 (tools/)
from slow_disk import SlowDisk  # noqa: E402

CONFIGS = {
    # name: (tier_caching, host_prefetch_share, optimizer_device)
    "exclusive, short window": ("exclusive", None, "device"),
    "inclusive, deep window": ("inclusive", 1.0, "device"),
    "exclusive, deep window": ("exclusive", 1.0, "device"),
    "inclusive, short window": ("inclusive", None, "device"),
}
BASELINE = "inclusive, deep window"
PLACEMENTS = {
    "update on the device": ("exclusive", None, "device"),
    "update on the host": ("exclusive", None, "host"),
    "update on the host, inclusive": ("inclusive", None, "host"),
    "update on the host, recomputed": ("exclusive", None, "host", "recompute"),
}
"""``--placements``: where the optimizer step runs (``EngineConfig.optimizer_device``); the last
one recomputes every block's inputs (no saved activation crosses the link: the weights' and
gradients' traffic alone, against the plan's link floor)."""
IN_BACKWARD = {
    "update on the device, recomputed": ("exclusive", None, "device", "recompute"),
    "update on the device, recomputed, in the backward": ("exclusive", None, "device", "recompute", True),
    "update on the host, recomputed, in the backward": ("exclusive", None, "host", "recompute", True),
}
"""``--step-in-backward``: each placement, every block recomputed (the plans' choices of activations
differ from run to run, and an offloaded one crosses the link), with the step run after the
backward and in it (``backward(loss, step=True)``; then no configuration clips, so that all
train alike)."""
AUTO = {"update where 'auto' puts it, recomputed": ("exclusive", None, "auto", "recompute")}
"""``--placements --disk-rate``: ``optimizer_device="auto"`` given a bench-io profile of the held
disk (its rate, as ``bench-io`` would measure it): where it puts the update, against the two."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _link_routes(before, after, steps: int) -> dict[str, float]:
    """Per step, bytes copied into and out of the device tier from the host tier (not a tensor
    created there), and both ways per kind of tensor (``link:weight``...)."""
    per = lambda ways: {k: n / steps for k, n in after.by_kind(ways, since=before).items()}  # noqa: E731
    return {"into_device": sum(per(("host->device",)).values()), "out_of_device": sum(per(("device->host",)).values()),
            **{f"link:{k}": n for k, n in per(after.LINK).items()},
            **{f"disk_read:{k}": n for k, n in per(("disk->host",)).items()},
            **{f"disk_written:{k}": n for k, n in per(("host->disk",)).items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device-fraction", type=float, default=0.25, help="device budget, of the training state")
    ap.add_argument("--host-fraction", type=float, default=0.375, help="host budget, of the training state")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds, after a warm-up round")
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--storage", default=None, help="a directory on the disk to measure (default: under the current one)")
    ap.add_argument("--shares", default=None,
                    help="instead: exclusive caching with each of these host_prefetch_share values (comma-separated; "
                         "the last is the base)")
    ap.add_argument("--placements", action="store_true",
                    help="instead: the optimizer step on the device against on the host (the update where its state "
                         "lives), link bytes per parameter per step")
    ap.add_argument("--disk-rate", type=float, default=None, metavar="MB/S",
                    help="the disk no faster than this (reads and writes together; tools/slow_disk.py): a GPU box's "
                         "disk-bound step on this machine")
    ap.add_argument("--least", type=float, default=0, metavar="SECONDS",
                    help="the least link bytes for the device tier's accesses of the rounds after the first, each "
                         "configuration's program given this long (needs SciPy and --rounds 2 or more)")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="with --placements: each placement with the step run in the backward too (no configuration "
                         "clips then)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    configs, base_name = CONFIGS, BASELINE
    if args.placements:
        configs, base_name = PLACEMENTS, "update on the device"
        if args.step_in_backward:
            configs = {**PLACEMENTS, **IN_BACKWARD}
        if args.disk_rate:
            configs = {**configs, **{name + (", in the backward" if args.step_in_backward else ""):
                                     c + ((True,) if args.step_in_backward else ()) for name, c in AUTO.items()}}
    elif args.step_in_backward:
        ap.error("--step-in-backward goes with --placements")
    clip = not args.step_in_backward
    if args.shares:
        shares = [float(x) for x in args.shares.split(",")]
        configs = {f"exclusive, share {x:g}": ("exclusive", x, "device") for x in shares}
        base_name = f"exclusive, share {shares[-1]:g}"
    device = torch.device(args.device)
    cfg = GPTConfig(vocab_size=args.vocab, context=args.context, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads)
    state = 16 * cfg.n_params()
    dev_budget, host_budget = int(state * args.device_fraction), int(state * args.host_fraction)
    print(f"model: {cfg.n_params() / 1e6:.1f}M parameters, fp32 AdamW state {format_size(state)}; device tier "
          f"{format_size(dev_budget)} ({device}), host tier {format_size(host_budget)}; batch {args.batch} x "
          f"{args.context}", flush=True)
    root = Path(tempfile.mkdtemp(prefix=".bench-tiers-", dir=args.storage or "."))
    g = torch.Generator().manual_seed(0)
    # the warm-up round runs each engine until its plan is final: the rounds measure the plan it keeps
    warm = max(PlanMonitor.FINAL_AFTER, args.steps_per_round)
    n_batches = warm + args.rounds * args.steps_per_round
    spans = [(0, warm)] + [(warm + r * args.steps_per_round, warm + (r + 1) * args.steps_per_round)
                           for r in range(args.rounds)]
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, cfg.context + 1), generator=g) for _ in range(n_batches)]
    engines, results = {}, {name: [] for name in configs}
    in_backward = {name for name, c in configs.items() if c[4:5] == (True,)}  # (IN_BACKWARD's)
    try:
        for i, (name, (caching, share, placement, *activations)) in enumerate(configs.items()):
            torch.manual_seed(0)
            with empty_init():
                model = GPT(cfg)
            store = {"tier_caching": caching, **({"host_prefetch_share": share} if share is not None else {})}
            if device.type == "cpu":
                store["device_budget_bytes"] = dev_budget  # a device tier of CPU memory
            storage = SlowDisk(root / str(i), args.disk_rate * 1e6) if args.disk_rate else root / str(i)
            if placement == "auto":  # (--disk-rate: the held disk's profile)
                store["io_profile"] = str(save_profile({"filesystem": filesystem_id(root), "recommended": {
                    "options": {}, "read_GBps": args.disk_rate / 1e3, "write_GBps": args.disk_rate / 1e3}},
                    root / "profile.json"))
            engines[name] = Engine(model, torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.01), storage=storage,
                                   device=device, host_memory=host_budget, device_memory=dev_budget, durable=False,
                                   store_config=store, config=EngineConfig(optimizer_device=placement,
                                                                      activations=(activations or ["auto"])[0]))
        losses = {name: [] for name in configs}
        recorded = {name: Accesses(engine.store, Tier.DEVICE) for name, engine in engines.items()} if args.least else {}
        windows = {}  # name -> [first event counted, end]
        for r in range(args.rounds + 1):
            for name, engine in engines.items():
                if name in recorded and r >= 1:  # (round 1's accesses fill the cache the counted rounds start from)
                    recorded[name].on = True
                    if r == 2:
                        windows[name] = [len(recorded[name].events), None]
                s0 = engine.stats()
                _sync(device)
                t = time.perf_counter()
                for x in batches[spans[r][0]:spans[r][1]]:
                    logits = engine(x[:, :-1].to(device))
                    loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].to(device).flatten())
                    if name in in_backward:
                        engine.backward(loss, step=True)
                    else:
                        engine.backward(loss)
                        if clip:
                            engine.clip_grad_norm_(1.0)
                        engine.step()
                        engine.zero_grad()
                    losses[name].append(loss.item())
                engine._await()  # the step's background work belongs to this configuration's time
                _sync(device)
                if name in windows:
                    windows[name][1] = len(recorded[name].events)
                dt = (time.perf_counter() - t) / (spans[r][1] - spans[r][0])
                s1 = engine.stats()
                per = lambda f, tier: (getattr(s1, f)[tier] - getattr(s0, f)[tier]) / args.steps_per_round  # noqa: E731
                if r:  # round 0 warms up
                    results[name].append({"s": dt, "disk_read": per("bytes_read", Tier.DISK),
                                          "disk_written": per("bytes_written", Tier.DISK),
                                          "disk_written_unread": (sum(s1.store.unread_writes.values())
                                                                  - sum(s0.store.unread_writes.values()))
                                          / args.steps_per_round,
                                          **_link_routes(s0.store, s1.store, args.steps_per_round)})
            print(f"round {r}{' (warm-up)' if r == 0 else ''} done", flush=True)
        first = next(iter(engines))
        plan = engines[first].plan.summary()
        floors = {name: (lambda f: (f or {}).get("in_backward") if name in in_backward else f)(engine.stats().floors)
                  or {} for name, engine in engines.items()}
        link_floor = {name: f.get("link") for name, f in floors.items()}
        disk_floor = {name: sum(f.get(k) or 0 for k in ("disk_read", "disk_written")) for name, f in floors.items()}
        activations = {name: engine.plan.summary().splitlines()[0] for name, engine in engines.items()}
        placed = {name: f"'auto' put the update on the {engine._updater.tier.name.lower()}: {engine._updater.why}"
                  for name, engine in engines.items() if configs[name][2] == "auto"}
        fewest = {name: least(recorded[name].events, engine.store.capacity(Tier.DEVICE), *windows[name],
                              time_limit=args.least) for name, engine in engines.items() if name in windows}
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(root, ignore_errors=True)
    same = all(v == losses[base_name] for v in losses.values())
    report = {"model": vars(args) | {"parameters": cfg.n_params(), "state_bytes": state}, "losses_identical": same,
              "configs": {}}
    median = lambda rows: {k: statistics.median(x.get(k, 0.0) for x in rows) for k in set().union(*rows)}  # noqa: E731
    base = median(results[base_name])
    print(f"\n{'configuration':<26} {'s/step':>7} {'disk read':>10} {'written':>8} {'into dev':>9} {'out of dev':>10}"
          f" {'step vs base':>12} {'disk bytes vs base':>18}")
    for name, rows in results.items():
        med = median(rows)
        disk = (med["disk_read"] + med["disk_written"]) / (base["disk_read"] + base["disk_written"])
        report["configs"][name] = med | {"step_vs_base": med["s"] / base["s"], "disk_bytes_vs_base": disk}
        print(f"{name:<26} {med['s']:>7.3f} {med['disk_read'] / state:>9.2f}x {med['disk_written'] / state:>7.2f}x "
              f"{med['into_device'] / state:>8.2f}x {med['out_of_device'] / state:>9.2f}x {med['s'] / base['s']:>12.2f}"
              f" {disk:>18.2f}")
    print(f"(bytes per step as multiples of the state, {format_size(state)}; base: {base_name}; losses of every "
          f"configuration {'identical' if same else 'DIFFERENT'}{'' if clip else '; no clipping'})")
    for name, med in report["configs"].items():
        link = (med["into_device"] + med["out_of_device"]) / cfg.n_params()
        med["link_bytes_per_parameter"] = link
        floor = link_floor[name]
        med["link_floor_bytes"] = floor
        kinds = ", ".join(f"{k[5:]} {v / cfg.n_params():.1f}" for k, v in sorted(med.items()) if k.startswith("link:"))
        disk_kinds = "; ".join(way.replace("_", " ") + " " + (", ".join(
            f"{k.split(':')[1]} {v / cfg.n_params():.2f}" for k, v in sorted(med.items()) if k.startswith(way + ":"))
            or "nothing") for way in ("disk_read", "disk_written"))
        print(f"{name:<32} device link: {link:5.1f} bytes per parameter per step "
              f"({(med['into_device'] + med['out_of_device']) / state:.2f}x the state"
              + (f"; the plan's floor {floor / cfg.n_params():.1f}, {floor / state:.2f}x)" if floor else ")")
              + f"\n{'':<32} by kind: {kinds or 'nothing'}\n{'':<32} {activations[name]}"
              + f"\n{'':<32} disk bytes per parameter per step by kind: {disk_kinds}"
              + f"\n{'':<32} disk writes written over before any read: "
                f"{med['disk_written_unread'] / max(1.0, med['disk_written']):.0%} of them"
              + (f"; disk bytes {(med['disk_read'] + med['disk_written']) / disk_floor[name]:.2f}x the plan's floor "
                 f"({disk_floor[name] / state:.2f}x the state{', in the backward' if name in in_backward else ''})"
                 if disk_floor[name] else ""))
        got = fewest.get(name)
        if got is not None:
            steps = (args.rounds - 1) * args.steps_per_round
            total = got["at_least"] / steps
            med["link_least_bytes"], med["link_least_proven"] = total, got["proven"]
            counted = results[name][1:]  # (rounds 2 on: the program's window)
            moved = sum(row["into_device"] + row["out_of_device"] for row in counted) / len(counted)
            print(f"{'':<32} the least any device tier of its budget copies for the same accesses: "
                  f"{'' if got['proven'] else '>= '}{total / cfg.n_params():.1f} bytes per parameter "
                  f"({total / state:.2f}x the state; those rounds copied {moved / total:.2f}x it)")
    if args.least and not fewest:
        print("the least link bytes need SciPy (pip install scipy) and --rounds 2 or more")
    elif args.least and any(v is None for v in fewest.values()):
        print("the least link bytes need SciPy (pip install scipy)")
    if args.disk_rate:
        rate = args.disk_rate * 1e6
        for name, med in report["configs"].items():
            moved = med["disk_read"] + med["disk_written"]
            floor = disk_floor[name]  # (0 where the plan's order needs no disk byte: no ratio to it)
            med["step_vs_bytes_time"] = med["s"] / (moved / rate) if moved else None
            med["step_vs_floor_time"] = med["s"] * rate / floor if floor else None
            print(f"{name:<32} the disk held to {args.disk_rate:g} MB/s: step / its bytes' time "
                  + (f"{med['step_vs_bytes_time']:.2f}" if moved else "- (no disk byte)")
                  + f", step / the plan's disk floor's time ({floor / rate:.3f} s) "
                  + (f"{med['step_vs_floor_time']:.2f}" if floor else "- (the floor is 0)"))
    for name, why in placed.items():
        print(f"{name}: {why}")
        report["configs"][name]["placed"] = why
    print(f"\nthe plan of '{first}' (its disk bytes per step predicted, and measured over three steps):\n  "
          + plan.replace("\n", "\n  "))
    report["plan"] = plan
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
