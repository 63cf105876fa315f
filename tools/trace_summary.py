#!/usr/bin/env python
"""Where a step's time went, from an engine trace (``Engine(..., trace="run.json")``).

Per training step (from one forward to the next), averaged over the steps after ``--skip``:

* the calling thread: each phase's wall time (forward; "loss", from the forward's end to the
  backward's start: the loss, and in durable mode the wait for the last step's commit; backward;
  and the step, from the end of backward to the end of the engine's last work before the next
  forward, the optimizer inline included), and inside each the block compute, the waits for
  bytes by kind of tensor, the saving of activations, the waits for the commit window, and what
  no span covers (Python, the loss, the model's modules that are not streamed); then the time
  outside the engine (the training loop's own work, or in an interleaved benchmark the other
  configurations). A phase's rows can overlap: the waits of an inline update are inside its
  update span; "not in any span" is the time none of them covers;
* the other threads: the background step's updates and waits, the journal's intent and commits,
  and the disk transfers (seconds any transfer of each direction was in flight, and bytes);
* the disk in each phase: the seconds any disk transfer was in flight (and, with a device tier,
  any transfer between the memory tiers: the link), and the bytes each way (a transfer counted in
  the phase its midpoint falls in). A phase whose disk is busy throughout bounds the step by its
  bytes; one whose disk idles is bound by its compute, and a schedule reaches max(compute, bytes /
  rate) only where the bytes can move into it. :func:`by_phase` gives the same for one traced
  step (``tools/bench_gpu_step.py``).

    python tools/bench_train.py --volatile --trace run.json
    python tools/trace_summary.py run.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def _kind(name: str) -> str:
    """``wait block.3/state.exp_avg.1`` -> ``state``; ``wait block.3/activations.1`` -> ``activations``."""
    if name == "wait commit window":
        return "commit window"
    tensor = name.split(" ", 1)[1] if " " in name else name
    kind = tensor.split("/", 1)[1] if "/" in tensor else tensor
    return kind.split(".", 1)[0]


def _busy(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _transfers(events: list[dict]) -> list[tuple[float, float, str, int]]:
    """Every transfer of a trace: ``(start, end, direction, bytes)``, direction as ``disk->host``."""
    return [(e["ts"], e["ts"] + e["dur"], e["name"].split(" ", 1)[0], e.get("args", {}).get("bytes", 0))
            for e in events if e.get("ph") == "X" and e.get("cat") == "io"]


def _in_phases(windows: dict[str, list], transfers: list) -> tuple[dict[str, float], dict[str, float]]:
    """For each phase's stretches of time (``windows``): ``"PHASE: disk busy"`` (seconds any disk
    transfer was in flight), ``"PHASE: link busy"`` (any transfer between the memory tiers; only
    where there was one), and the bytes of each direction whose transfers have their midpoint in
    the phase (``"PHASE: disk->host"``)."""
    rows: dict[str, float] = {}
    moved: dict[str, float] = collections.defaultdict(float)
    for phase, stretches in windows.items():
        for what, on in (("disk", lambda d: "disk" in d), ("link", lambda d: "disk" not in d)):
            spans = [(max(a, p), min(b, q)) for p, q in stretches for a, b, d, _ in transfers
                     if on(d) and a < q and b > p]
            if what == "disk" or spans:
                rows[f"{phase}: {what} busy"] = _busy(spans) / 1e6
        for a, b, direction, n in transfers:
            if any(p <= (a + b) / 2 < q for p, q in stretches):
                moved[f"{phase}: {direction}"] += n
    return rows, moved


def by_phase(events: list[dict]) -> dict[str, dict[str, float]]:
    """A trace of one step (or a few): per phase (``forward``, ``backward``, and ``step``: from the
    last backward's end to the trace's last span), the seconds the disk (and the link) was busy and
    the bytes of each direction: ``{"forward": {"disk busy": s, "disk->host": bytes, ...}, ...}``."""
    spans = [e for e in events if e.get("ph") == "X"]
    windows: dict[str, list] = collections.defaultdict(list)
    for e in spans:
        if e.get("cat") == "phase" and e["name"] in ("forward", "backward"):
            windows[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    if windows["backward"] and spans:
        windows["step"].append((max(b for _, b in windows["backward"]), max(e["ts"] + e["dur"] for e in spans)))
    rows, moved = _in_phases(windows, _transfers(events))
    out: dict[str, dict[str, float]] = {}
    for key, value in [*rows.items(), *moved.items()]:
        phase, what = key.split(": ", 1)
        out.setdefault(phase, {})[what] = value
    return out


def summarize(events: list[dict], skip: int = 2) -> tuple[int, dict[str, float], dict[str, float]]:
    """``(steps, seconds per step by row, bytes per step by direction)`` of a trace's events."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    main_tid = next((t for t, n in names.items() if n == "MainThread"), None)
    starts = [e["ts"] for e in spans if e["tid"] == main_tid and e["cat"] == "phase" and e["name"] == "forward"]
    if len(starts) < skip + 2:
        raise SystemExit(f"the trace holds {len(starts)} forwards; at least {skip + 2} are needed (--skip {skip})")
    lo, hi = starts[skip], starts[-1]
    steps = len(starts) - 1 - skip
    rows: dict[str, float] = collections.defaultdict(float)
    moved: dict[str, float] = collections.defaultdict(float)
    io: dict[str, list] = collections.defaultdict(list)
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans
              if e["tid"] == main_tid and e["cat"] == "phase" and lo <= e["ts"] < hi]

    def phase_of(ts: float) -> str:
        before = None
        for a, b, name in phases:
            if a <= ts < b:
                return name
            if b <= ts:
                before = name
        return "loss" if before == "forward" else "step"
    covered: dict[str, list] = collections.defaultdict(list)
    for e in spans:
        if not lo <= e["ts"] < hi:
            continue
        sec = e["dur"] / 1e6
        thread = names.get(e["tid"], str(e["tid"]))
        if e["tid"] == main_tid:
            if e["cat"] == "phase":
                rows[f"{e['name']}: wall"] += sec
                continue
            phase = phase_of(e["ts"])
            what = {"compute": "compute", "optimizer": "optimizer updates", "activations": "saving activations"}.get(
                e["cat"], f"wait for {_kind(e['name'])}" if e["cat"] == "wait" else e["cat"])
            if e["cat"] == "compute":
                what = f"{e['name'].split(' ')[0]} compute"
            rows[f"{phase}: {what}"] += sec
            if e["cat"] != "wait" or not any(a <= e["ts"] < b for a, b in covered[phase]):
                covered[phase].append((e["ts"], e["ts"] + e["dur"]))
        elif e["cat"] == "io":
            direction = e["name"].split(" ", 1)[0]
            io[direction].append((e["ts"], e["ts"] + e["dur"]))
            moved[direction] += e.get("args", {}).get("bytes", 0)
        elif thread.startswith("tiered-offload-step"):
            rows[f"background step: {'updates' if e['cat'] == 'optimizer' else 'waits' if e['cat'] == 'wait' else e['cat']}"] += sec
        elif e["cat"] == "commit":
            rows[f"journal: {e['name'].split(' ')[0]}"] += sec
    step_wall = (hi - lo) / 1e6
    # the step phase: from each backward's end to the end of the last thing the calling thread did
    # in the engine before the next forward; after that it was elsewhere (the training loop's own
    # work, or another configuration of an interleaved benchmark)
    bounds = starts[skip:]
    windows: dict[str, list] = collections.defaultdict(list)  # each phase's stretches of time
    for a, b, name in phases:
        windows[name].append((a, b))
    for a, b in zip(bounds, bounds[1:]):
        fwd_end = max((q for p_, q, n in phases if a <= p_ < b and n == "forward"), default=a)
        bwd = [(p_, q) for p_, q, n in phases if a <= p_ < b and n == "backward"]
        bwd_end = max((q for _, q in bwd), default=fwd_end)
        rows["loss: wall"] += (min((p_ for p_, _ in bwd), default=fwd_end) - fwd_end) / 1e6
        last = max([bwd_end] + [e["ts"] + e["dur"] for e in spans
                                if e["tid"] == main_tid and e["cat"] != "phase" and bwd_end <= e["ts"] < b])
        rows["step: wall"] += (min(last, b) - bwd_end) / 1e6
        windows["step"].append((bwd_end, min(last, b)))
        rows["outside the engine: wall"] += (b - min(last, b)) / 1e6
    for phase in ("forward", "loss", "backward", "step"):
        inside = _busy(covered[phase]) / 1e6
        rows[f"{phase}: not in any span"] = max(0.0, rows.get(f"{phase}: wall", 0.0) - inside)
    for direction, intervals in io.items():
        rows[f"disk {direction}: in flight"] = _busy(intervals) / 1e6
    in_rows, in_moved = _in_phases({p: windows[p] for p in ("forward", "backward", "step")},
                                   [t for t in _transfers(events) if lo <= t[0] < hi])
    rows.update(in_rows)
    for key, n in in_moved.items():
        moved[key] += n
    rows["iteration: wall"] = step_wall
    return steps, {k: v / steps for k, v in rows.items()}, {k: v / steps for k, v in moved.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trace the engine wrote")
    ap.add_argument("--skip", type=int, default=2, help="steps to leave out at the start (warm-up, planning)")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    steps, rows, moved = summarize(events, args.skip)
    print(f"{steps} steps after the first {args.skip}; seconds per step")
    order = ["forward", "loss", "backward", "step", "outside the engine", "background step", "journal", "disk", "iteration"]
    for group in order:
        for k in sorted(k for k in rows if k.startswith(group + ":") or (group == "disk" and k.startswith("disk "))):
            if rows[k] >= 0.0005 or k.endswith("wall"):
                print(f"  {k:40s} {rows[k]:8.3f}")
    for direction, n in sorted(moved.items(), key=lambda kv: (":" in kv[0], kv[0])):  # the totals first
        print(f"  {direction + ' bytes':40s} {n / 2**20:8.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
