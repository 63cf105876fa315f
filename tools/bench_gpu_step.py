#!/usr/bin/env python
"""Step time of a large model on one GPU: the engine with device and host budgets far below the
state, against the same model trained in plain PyTorch on that GPU (where it fits), same run.

    python tools/bench_gpu_step.py --json step.json                 # 1.07B parameters, 17 GB of state
    python tools/bench_gpu_step.py --layers 2 --d-model 256 --device cpu   # a smoke run anywhere
    python tools/bench_gpu_step.py --optimizer-device host --micro-batches 4 --step-in-backward

Reports, per side: seconds per step (median of the timed steps), model TFLOP/s (6 x parameters x
tokens per step over the step time; the engine's recomputation is not counted), and for the
engine: disk bytes read and written per step, bytes into and out of the device tier (PCIe), the
disk and PCIe rates over the step, and the share of the step the training thread waited for bytes,
per phase (forward, backward, optimizer), and the seconds the disk and the link were busy and
their bytes in each phase (``io_by_phase``: ``tools/trace_summary.py``'s ``by_phase``), from a
trace of the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tiered_offload import Engine, EngineConfig, Tier, empty_init, format_size
from tiered_offload.memstat import peak_rss_bytes
from tiered_offload_examples.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import by_phase  # noqa: E402 (tools/)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(cfg: GPTConfig, batch: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=g) for _ in range(n)]


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def _fused_loss(engine, x: torch.Tensor, n: int, step: bool = False) -> torch.Tensor:
    """The batch as ``n`` micro-batches through ``engine.forward_backward``; the mean loss (its
    gradients accumulated, as the loop of ``n`` backwards of ``loss / n`` leaves them; ``step``:
    the optimizer step run in the backward)."""
    parts = list(x.chunk(n))
    inputs = [p[:, :-1] for p in parts]
    targets = {id(i): p[:, 1:].flatten() for i, p in zip(inputs, parts)}
    losses = engine.forward_backward(inputs, lambda out, b: F.cross_entropy(out.flatten(0, 1), targets[id(b)]) / n,
                                     step=step)
    return sum(losses)


def plain(cfg: GPTConfig, batches: list[torch.Tensor], device: torch.device, warmup: int) -> dict:
    """Plain PyTorch on the device: AdamW (foreach), the whole state resident."""
    need = 16 * cfg.n_params()
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need * 1.5 > free:
            return {"skipped": f"the state ({format_size(need)}) and activations do not fit the free device memory "
                               f"({format_size(free)})"}
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    times, losses = [], []
    for i, x in enumerate(batches):
        _sync(device)
        t = time.perf_counter()
        loss = _loss(model, x.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises
        if i >= warmup:
            times.append(time.perf_counter() - t)
    out = {"step_s": statistics.median(times), "steps_timed": len(times), "losses": losses}
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _waits_by_phase(trace_path: Path) -> dict:
    """Seconds the training thread waited for bytes inside each phase of the traced step."""
    events = json.loads(trace_path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X"]
    phases = [e for e in spans if e.get("cat") == "phase"]
    waits = [e for e in spans if e.get("cat") == "wait"]
    out: dict[str, float] = {}
    for w in waits:
        phase = next((p["name"] for p in phases if p["tid"] == w["tid"] and p["ts"] <= w["ts"] <= p["ts"] + p["dur"]),
                     "optimizer and other")
        out[phase] = out.get(phase, 0.0) + w["dur"] / 1e6
    return out


def _mode_counts(modes) -> dict[str, int]:
    """How many blocks keep, offload or recompute their activations (empty: plain PyTorch)."""
    return {m: list(modes).count(m) for m in ("keep", "offload", "recompute") if modes and m in modes}


def engine_run(cfg: GPTConfig, batches: list[torch.Tensor], device: torch.device, warmup: int, storage: str,
               host_memory: str, device_memory: str, trace_dir: Path, optimizer_device: str = "auto",
               micro_batches: int = 1, progress=None, in_backward: bool = False) -> dict:
    """The engine's steps; ``progress(out)`` after each (a run cut short by a time limit keeps
    the steps it measured). The last batch is a traced step, not timed: the trace's end waits for
    its own update, which the next forward would otherwise hide (it ran about 2x a step).
    ``in_backward``: each step runs in the backward (``step=True``; no clipping), against the
    floors of that order."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with empty_init():
        model = GPT(cfg)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.01), storage=storage, device=device,
                    host_memory=host_memory, device_memory=device_memory, durable=False,
                    config=EngineConfig(optimizer_device=optimizer_device))
    init_s = time.perf_counter() - t0
    host_arena = engine.store._arenas[Tier.HOST]
    out = {"init_s": init_s, "state_bytes": engine.state_bytes(), "host_budget": engine.store.capacity("host"),
           "device_budget": engine.store.capacity("device"), "host_arena_backing_bytes": host_arena.backing_bytes,
           "host_arena_pinned": host_arena.pinned, "backend": engine.store.backend.name,
           "recompute": engine.recompute, "optimizer_device": optimizer_device,
           "update_tier": engine._updater.tier.name.lower(), "update_why": engine._updater.why,
           "micro_batches": micro_batches, "in_backward": in_backward, "steps": []}
    try:
        for i, x in enumerate(batches):
            last = i == len(batches) - 1
            s0 = engine.stats()
            trace = trace_dir / "engine_step.json"
            ctx = engine.tracing(trace) if last else _null()
            modes = _mode_counts(engine.activation_modes)  # (as this step's forward runs)
            _sync(device)
            t = time.perf_counter()
            with ctx:
                if micro_batches > 1:
                    loss = _fused_loss(engine, x.to(device), micro_batches, step=in_backward)
                else:
                    loss = _loss(engine, x.to(device))
                    engine.backward(loss, step=in_backward)
                if not in_backward:
                    engine.clip_grad_norm_(1.0)
                    engine.step()
                    engine.zero_grad()
                value = loss.item()
                _sync(device)
            dt = time.perf_counter() - t
            s1 = engine.stats()
            d = lambda f, tier: getattr(s1, f)[tier] - getattr(s0, f)[tier]  # noqa: E731
            step = {"s": dt, "loss": value, "disk_read": d("bytes_read", Tier.DISK), "disk_written": d("bytes_written", Tier.DISK),
                    "into_device": d("bytes_written", Tier.DEVICE), "out_of_device": d("bytes_read", Tier.DEVICE),
                    "io_wait_s": s1.io_wait_seconds - s0.io_wait_seconds,
                    "disk_busy_s": s1.disk_busy_seconds - s0.disk_busy_seconds,
                    "step_mode": engine.step_mode,  # (where the disk bounds it, the plan tries both)
                    # the blocks' activation modes in this step (the plan's check may measure the
                    # modes it replaced again for a few steps: they part the steady steps)
                    "activations": modes,
                    # by kind of tensor (weight, grad, state, activations): what goes beyond the floor
                    "disk_read_by_kind": s1.store.by_kind(("disk->host", "disk->device"), s0.store),
                    "disk_written_by_kind": s1.store.by_kind(("host->disk", "device->disk"), s0.store),
                    # of them, writes that were written over before any read used them (not needed)
                    "disk_written_unread": sum(s1.store.unread_writes.values()) - sum(s0.store.unread_writes.values()),
                    # forward_backward's calls that ran the loop instead of a pass, by reason
                    "loops": {k: v - s0.forward_backward_loops.get(k, 0) for k, v in s1.forward_backward_loops.items()
                              if v != s0.forward_backward_loops.get(k, 0)}}
            out["steps"].append(step)
            if progress is not None:
                progress(out)
            print(f"  engine step {i}: {dt:.2f} s, loss {value:.4f}, disk read {format_size(step['disk_read'])} "
                  f"written {format_size(step['disk_written'])}, PCIe in {format_size(step['into_device'])} "
                  f"out {format_size(step['out_of_device'])}, step {step['step_mode']}, activations "
                  f"{', '.join(f'{v} {k}' for k, v in modes.items()) or 'as plain PyTorch'}"
                  + (f", ran as the loop: {'; '.join(step['loops'])}" if step["loops"] else ""), flush=True)
        if trace.exists():
            out["waits_by_phase_s"] = _waits_by_phase(trace)
            events = json.loads(trace.read_text())
            # per phase, the disk's and the link's busy seconds and bytes each way: which phase
            # the disk bounds, and which leaves it idle
            out["io_by_phase"] = by_phase(events["traceEvents"] if isinstance(events, dict) else events)
        if len(out["steps"]) > 1:
            out["traced_step"] = out["steps"].pop()
        floors = engine.stats().floors  # what a step cannot avoid moving, beside the measured
        out["floors"] = (floors["in_backward"] or floors) if in_backward else floors  # (no room: it ran after)
        out["floors_of_step"] = floors
        out["plan"] = engine.plan.summary()  # its modes and why (the step mode tried where the disk bounds it)
    finally:
        engine.close()
    steady = against_floors(out, warmup)  # the steady steps, their median and growth
    timed = out["steps"][warmup:] or out["steps"]
    med = steady["step_s"]
    mean = lambda k: sum(s[k] for s in timed) / len(timed)  # noqa: E731
    out.update(step_s=med, steady_steps=steady["steady_steps"], growth=steady["growth"],
               disk_read_per_step=mean("disk_read"), disk_written_per_step=mean("disk_written"),
               pcie_per_step=mean("into_device") + mean("out_of_device"),
               disk_GBps_over_step=(mean("disk_read") + mean("disk_written")) / med / 1e9,
               disk_GBps_while_busy=(mean("disk_read") + mean("disk_written")) / max(mean("disk_busy_s"), 1e-9) / 1e9,
               pcie_GBps_over_step=(mean("into_device") + mean("out_of_device")) / med / 1e9,
               io_wait_share=mean("io_wait_s") / med)
    if "waits_by_phase_s" in out:  # (of the traced step)
        last = out.get("traced_step", out["steps"][-1])["s"]
        out["wait_share_by_phase"] = {k: v / last for k, v in out["waits_by_phase_s"].items()}
    return out


def against_floors(engine: dict, warmup: int, bench_io: dict | None = None) -> dict:
    """The steady state (the steps after ``warmup``, less a traced one) against the plan's floors:
    disk and link bytes, and with ``bench_io`` (``tiered-offload bench-io --json``'s report) the
    step against the disk floor's time at bench-io's recommended read and write rates. A finished
    report from before the traced step was set apart (2026-12-04) timed its traced last step: left out."""
    steps = list(engine["steps"])
    if "traced_step" not in engine and "floors" in engine and len(steps) > warmup + 1:
        steps.pop()
    timed = steps[warmup:] or steps
    mean = lambda k: sum(x[k] for x in timed) / len(timed)  # noqa: E731
    out = {"steady_steps": f"{len(steps) - len(timed) + 1}-{len(steps)}", "step_s": statistics.median(x["s"] for x in timed),
           "growth": timed[-1]["s"] / timed[0]["s"], "disk_per_step": mean("disk_read") + mean("disk_written"),
           "link_per_step": mean("into_device") + mean("out_of_device"), "disk_busy_share": mean("disk_busy_s") / mean("s")}
    if all("disk_written_unread" in x for x in timed):  # (a report from before 2026-12-05 has none)
        out["unread_write_share"] = mean("disk_written_unread") / max(1, mean("disk_written"))
    f = engine.get("floors") or {}
    if f and f["disk_read"] + f["disk_written"] > 0:  # (a floor of 0, the state fits memory: no ratio)
        out["disk_over_floor"] = out["disk_per_step"] / (f["disk_read"] + f["disk_written"])
        if f.get("link") is not None:
            out["link_over_floor"] = out["link_per_step"] / max(1, f["link"])
        if bench_io:
            r = bench_io["recommended"]
            out["disk_floor_s"] = f["disk_read"] / (r["read_GBps"] * 1e9) + f["disk_written"] / (r["write_GBps"] * 1e9)
            out["step_over_disk_floor"] = out["step_s"] / out["disk_floor_s"]
    return out


def _say_floors(a: dict) -> str:
    text = (f"steady state (steps {a['steady_steps']}): {a['step_s']:.2f} s/step, the last / the first {a['growth']:.2f}, "
            f"the disk busy {100 * a['disk_busy_share']:.0f}% of it")
    if "unread_write_share" in a:
        text += f"; {100 * a['unread_write_share']:.0f}% of the disk writes written over before any read"
    if "disk_over_floor" in a:
        text += f"; against the plan's floors: disk bytes {a['disk_over_floor']:.2f}x"
    if "link_over_floor" in a:
        text += f", link {a['link_over_floor']:.2f}x"
    if "step_over_disk_floor" in a:
        text += f"; the step {a['step_over_disk_floor']:.2f}x the disk floor's {a['disk_floor_s']:.2f} s at bench-io's rates"
    return text


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="engine steps timed, the first a warm-up (and one traced after them)")
    ap.add_argument("--plain-steps", type=int, default=4, help="plain PyTorch steps, the first a warm-up")
    ap.add_argument("--warmup", type=int, default=1,
                    help="engine steps before the steady state (the check: 3, so steps 4-10 of 10)")
    ap.add_argument("--host-memory", default="6GiB")
    ap.add_argument("--device-memory", default="4GiB")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--storage", default=None, help="default: a temporary directory under the current one")
    ap.add_argument("--optimizer-device", default="auto", choices=("auto", "host", "device"),
                    help="where the optimizer step runs (EngineConfig.optimizer_device)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="split each step's batch into N micro-batches through engine.forward_backward")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="each step in the backward (backward(loss, step=True) or forward_backward(..., step=True); "
                         "no clipping): against that order's floors")
    ap.add_argument("--bench-io", default=None, metavar="JSON",
                    help="bench-io's --json report: the step against the disk floor's time at its rates")
    ap.add_argument("--summarize", default=None, metavar="REPORT",
                    help="run nothing: the steady state of a saved report (this tool's --json) against its floors")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bench_io = json.loads(Path(args.bench_io).read_text()) if args.bench_io else None
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        engine = saved.get("engine") or saved["engine_partial"]
        print(_say_floors(against_floors(engine, args.warmup, bench_io)))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 training, as the product promises
    cfg = GPTConfig(vocab_size=args.vocab, context=args.context, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads)
    tokens = args.batch * args.context
    flops = 6 * cfg.n_params() * tokens
    print(f"model: {cfg.n_params() / 1e9:.3f}B parameters, fp32 AdamW state {format_size(16 * cfg.n_params())}; "
          f"{tokens} tokens per step; device {device}", flush=True)
    report = {"model": vars(args) | {"parameters": cfg.n_params(), "state_bytes": 16 * cfg.n_params()},
              "tokens_per_step": tokens, "model_flops_per_step": flops}
    storage = args.storage or tempfile.mkdtemp(prefix=".bench-gpu-", dir=os.getcwd())
    trace_dir = Path(tempfile.mkdtemp(prefix="bench-gpu-trace-"))
    try:
        p = plain(cfg, _batches(cfg, args.batch, args.plain_steps), device, warmup=1)
        if "step_s" in p:
            p["TFLOPs"] = flops / p["step_s"] / 1e12
            print(f"plain PyTorch: {p['step_s']:.3f} s/step, {p['TFLOPs']:.1f} TFLOP/s", flush=True)
        else:
            print(f"plain PyTorch: {p['skipped']}", flush=True)
        report["plain"] = p
        def partial(steps_so_far: dict) -> None:  # the report as far as it got, rewritten after each step
            if args.json:
                Path(args.json).write_text(json.dumps(report | {"engine_partial": steps_so_far}, indent=2, default=str))
        e = engine_run(cfg, _batches(cfg, args.batch, args.steps + 1), device, min(args.warmup, args.steps - 1), storage,
                       args.host_memory, args.device_memory, trace_dir, args.optimizer_device, args.micro_batches,
                       progress=partial, in_backward=args.step_in_backward)
        e["TFLOPs"] = flops / e["step_s"] / 1e12
        report["engine"] = e
        if "step_s" in p:
            report["engine_over_plain"] = e["step_s"] / p["step_s"]
        print(f"engine: {e['step_s']:.2f} s/step (median of steps {e['steady_steps']}; the last / the first of them "
              f"{e['growth']:.2f}), {e['TFLOPs']:.2f} TFLOP/s; disk {e['disk_GBps_over_step']:.2f} GB/s "
              f"over the step ({e['disk_GBps_while_busy']:.2f} while busy), PCIe {e['pcie_GBps_over_step']:.2f} GB/s; "
              f"waited {100 * e['io_wait_share']:.0f}% of the step; update in the {e['update_tier']} tier "
              f"({e['update_why']})", flush=True)
        report["against_floors"] = against_floors(e, min(args.warmup, args.steps - 1), bench_io)
        print(_say_floors(report["against_floors"]), flush=True)
        report["peak_rss_bytes"] = peak_rss_bytes()
    finally:
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(trace_dir, ignore_errors=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
