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
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from offload_core.sizes import format_size
from tiered_offload import Engine, EngineConfig
from tiered_offload_examples.models import GPT, GPTConfig


def loss_of(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def run(base, defer: bool, args, directory: str) -> dict:
    n = sum(p.numel() for p in base.parameters())
    engine = Engine(copy.deepcopy(base), torch.optim.AdamW, dict(lr=1e-4), storage=directory,
                    host_memory=int(16 * n * args.host_fraction), durable=False,
                    config=EngineConfig(defer_step=defer, activations="recompute"))
    g = torch.Generator().manual_seed(1)
    warm = args.steps // 2
    for step in range(args.steps):
        if step == warm:
            before, t0 = engine.store.stats, time.perf_counter()
        x = torch.randint(0, 256, (args.batch, args.context + 1), generator=g)
        engine.backward(loss_of(engine, x))
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
    seconds = (time.perf_counter() - t0) / (args.steps - warm)
    after, floors, mode = engine.store.stats, engine.plan.floors, engine.defer_step
    weights = torch.cat([p.detach().flatten() for _, p in engine.named_parameters()])
    engine.close()
    per = args.steps - warm
    read = {k: v / per for k, v in after.by_kind(("disk->host",), since=before).items()}
    written = {k: v / per for k, v in after.by_kind(("host->disk",), since=before).items()}
    waited = (after.io_wait_seconds - before.io_wait_seconds) / per
    return dict(read=read, written=written, seconds=seconds, waited=waited, floors=floors, deferred=mode,
                weights=weights)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="steps per engine; the second half is measured")
    ap.add_argument("--host-fraction", type=float, default=0.25)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=256, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=8))
    n = sum(p.numel() for p in base.parameters())
    with tempfile.TemporaryDirectory(dir=".", prefix=".bench-step-modes-") as d:
        runs = {"deferred": run(base, True, args, f"{d}/deferred"), "inline": run(base, False, args, f"{d}/inline")}
    floors = runs["inline"]["floors"]
    floor = floors["disk_read"] + floors["disk_written"]
    print(f"model: {n / 1e6:.1f}M parameters, state {format_size(16 * n)}, host budget {args.host_fraction} x state; "
          f"{args.steps - args.steps // 2} measured steps each; the plan's disk floor {format_size(floor)} per step")
    print("| step | s / step | of it waiting for bytes | disk read / step (weights, gradients, states) | written / step "
          "| bytes / floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    total = {}
    for name, r in runs.items():
        read, written = sum(r["read"].values()), sum(r["written"].values())
        total[name] = read + written
        kinds = ", ".join(format_size(r["read"].get(k, 0)) for k in ("weight", "grad", "state"))
        print(f"| {name} | {r['seconds']:.3f} | {r['waited']:.3f} | {format_size(read)} ({kinds}) | {format_size(written)} | "
              f"{(read + written) / floor:.2f} |")
    d, i = runs["deferred"], runs["inline"]
    print(f"deferred / inline: weights read {d['read'].get('weight', 0) / i['read']['weight']:.2f}x, disk bytes "
          f"{total['deferred'] / total['inline']:.2f}x, step {d['seconds'] / i['seconds']:.2f}x; final weights "
          f"{'bitwise the same' if torch.equal(d['weights'], i['weights']) else 'DIFFERENT'}")
    assert d["deferred"] and not i["deferred"]
    return 0 if torch.equal(d["weights"], i["weights"]) else 1


if __name__ == "__main__":
    sys.exit(main())
