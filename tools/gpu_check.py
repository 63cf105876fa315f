#!/usr/bin/env python
"""The prepared GPU check: everything the CUDA path needs a GPU to prove, in one command.

    python tools/gpu_check.py OUTDIR [--budget-s 540] [--quick]

Writes ``OUTDIR/gpu_check.json`` (the summary, rewritten after every section, so a run cut short
still leaves what it finished) and ``OUTDIR/gpu_check.log`` (every section's output). Sections, in
order of importance, each with its own time limit inside ``--budget-s``:

1. ``env``: torch, CUDA, the GPU, kvikio and whether GPUDirect Storage is on, what ``auto`` picks.
2. ``pinned``: a pinned host arena of a budget that is not a power of two: its backing bytes, that
   torch sees it as pinned, host<->device copy rates from it; and PyTorch's caching pinned
   allocator's reservation for the same request, for contrast.
3. ``bench_io``: ``tiered-offload bench-io`` with posix and kvikio (the disk's rate: the step's floor
   is its bytes at that rate), saved as the I/O profile the benchmarks' engines read.
4. ``tests``: pytest on the GPU: the kvikio conformance suite with device buffers (and posix),
   the device-path tests (wsum64 on the GPU equal to the CPU's), the engine parity tests on CUDA
   (GPT-2 and Llama tiny, state on disk, host and device budgets a quarter of the state, against
   PyTorch on the same GPU; each ``optimizer_device`` placement against its reference),
   ``forward_backward`` on CUDA against the loop (with dropout too: Philox offsets replayed, one
   loop per engine), the step in the backward (``step=True``, ``clip_norm`` within the limit) with
   each placement against its reference, the block call's checks and sums on CUDA (a saved input
   changed in place, a weight read twice in each of two calls), and the store's Hypothesis state
   machine with a CUDA device tier.
5. ``step_time``: ``tools/bench_gpu_step.py``: a 1.07B-parameter model, device and host budgets far
   below its 17 GB state, 10 steps (steady state 4-10) against plain PyTorch on the same GPU, with
   the optimizer step on the host, on the device, and placed by the planner with 4 micro-batches
   through ``forward_backward``, and on the host with 4 micro-batches and the step in the backward
   (``step=True``, no clipping), each against the plan's floors (the last against that order's),
   each step's mode and bytes in its report (rewritten after every step: a run the time limit cuts
   keeps the steps it measured).
6. ``tiers``: ``tools/bench_tiers.py --placements`` on CUDA: PCIe bytes per parameter per step with
   the optimizer step on the device and on the host, in one run, if time is left.
7. ``suite``: the whole test suite, verbose (pytest-xdist where installed), with what time is left
   (``--skip step_time,tiers`` to give it the time; its CPU side runs in CI).

Missing packages (zarr, kvikio) are expected on ``PYTHONPATH`` already (see the README's GPU section).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Check:
    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
        self.log = open(out / "gpu_check.log", "a", buffering=1)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.summary, indent=2, default=str))

    def section(self, name: str, fn, limit_s: float) -> None:
        limit = min(limit_s, self.left())
        if limit < 10:
            self.summary["sections"][name] = {"status": "not run: out of time"}
            self.say(f"== {name}: not run, out of time")
            self.save()
            return
        self.say(f"== {name} (up to {limit:.0f} s)")
        t = time.monotonic()
        try:
            result = fn(limit) or {}
            result.setdefault("status", "ok")
        except Exception as e:  # noqa: BLE001 - one section's failure must not stop the others
            result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            self.say(result["traceback"])
        result["seconds"] = round(time.monotonic() - t, 1)
        self.summary["sections"][name] = result
        self.say(f"-- {name}: {result['status']} in {result['seconds']} s")
        self.save()

    def run(self, cmd: list[str], limit: float, env: dict | None = None) -> tuple[int, str]:
        """Run a command with a time limit; its output goes to the log; returns (exit code, output tail)."""
        self.say("$ " + " ".join(cmd))
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=limit)
            code, text = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            code, text = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            text += f"\n[killed after {limit:.0f} s]"
        self.log.write(text + "\n")
        return code, text[-3000:]


def env_section(limit: float) -> dict:
    import torch

    from storage_backends import auto_choice
    from storage_backends.kvikio_backend import gds_status, kvikio_status
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory=p.total_memory)
    try:
        import kvikio
        out["kvikio"] = getattr(kvikio, "__version__", "?")
    except ImportError as e:
        out["kvikio"] = f"not importable: {e}"
    out["kvikio_status"] = kvikio_status() or "usable"
    out["gds"] = dict(zip(("active", "reason"), gds_status()))
    out["auto_backend"] = dict(zip(("backend", "reason"), auto_choice()))
    out["nvidia_fs"] = os.path.exists("/proc/driver/nvidia-fs")
    try:
        import zarr
        out["zarr"] = zarr.__version__
    except ImportError as e:
        out["zarr"] = f"not importable: {e}"
    return out


def pinned_section(limit: float) -> dict:
    import torch

    from tiered_offload.store.arena import Arena
    if not torch.cuda.is_available():
        return {"status": "skipped: no CUDA"}
    budget = (1 << 30) + 3 * 4096  # 1 GiB + 12 KiB: the caching allocator would reserve 2 GiB
    out = {"budget": budget}
    t = time.perf_counter()
    arena = Arena("host", budget, torch.device("cpu"), pin_memory=True)
    arena.open()
    out["register_s"] = time.perf_counter() - t
    buf = arena._buffer
    out.update(backing_bytes=arena.backing_bytes, pinned=arena.pinned, torch_is_pinned=bool(buf.is_pinned()),
               exact=arena.backing_bytes == budget)
    dev = torch.empty(budget, dtype=torch.uint8, device="cuda")
    buf.fill_(1)
    for name, (dst, src) in {"h2d_GBps": (dev, buf), "d2h_GBps": (buf, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 3 * budget / (time.perf_counter() - t) / 1e9
    pageable = torch.empty(budget, dtype=torch.uint8)
    pageable.fill_(1)
    t = time.perf_counter()
    dev.copy_(pageable)
    torch.cuda.synchronize()
    out["h2d_pageable_GBps"] = budget / (time.perf_counter() - t) / 1e9
    del pageable
    arena.close()
    # the old way, for contrast: torch's caching pinned allocator
    try:
        before = torch.cuda.host_memory_stats()
        old = torch.empty(budget + 4096, dtype=torch.uint8, pin_memory=True)
        after = torch.cuda.host_memory_stats()
        # the key names differ between torch versions: keep every counter that moved
        out["caching_allocator_stats_delta"] = {k: after[k] - before.get(k, 0) for k in after
                                                if isinstance(after[k], int) and after[k] != before.get(k, 0)}
        del old
    except Exception as e:  # noqa: BLE001 - an older torch without host_memory_stats
        out["caching_allocator_reserved_for_same_request"] = f"not measurable: {e}"
    del dev
    torch.cuda.empty_cache()
    if not out["exact"] or not out["torch_is_pinned"]:
        out["status"] = "FAILED"
    return out


def _pytest_counts(text: str) -> dict:
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|deselected)", tail)}
    counts["last_line"] = tail
    counts["failures"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)[:30]
    return counts


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def tests_section(check: Check, quick: bool):
    def run(limit: float) -> dict:
        out = {}
        groups = [
            ("kvikio_and_posix_conformance", ["tests/test_backends.py", "-k", "Kvikio or Posix or posix"], {}),
            ("device_path", ["tests/test_device_path.py"], {}),
            # GPT-2 and Llama; the update in the host tier against PyTorch's optimizer on CPU copies,
            # in the device tier against PyTorch's on the GPU
            ("engine_parity_cuda", ["tests/test_engine.py", "-k", "parity_adamw_hf or runs_where_told"], {}),
            ("forward_backward_cuda", ["tests/test_finetune.py", "-k", "forward_backward_on_cuda"], {}),
            # the step in the backward (step=True) clipped within its limit, each placement against its reference
            ("step_in_backward_cuda", ["tests/test_clip_in_backward.py", "-k", "within_the_limit"], {}),
            # a saved block input changed in place (its witness on a CUDA tensor); a weight read twice in
            # each of two calls (repeated_calls._StartFrom, the backward on autograd's device thread)
            ("block_calls_cuda", ["tests/test_conformance.py", "-k", "checks_and_sums_hold_on_cuda"], {}),
            ("store_state_machine_cuda_tier", ["tests/test_store_stateful.py"],
             {"TIERED_OFFLOAD_TEST_STORE_DEVICE": "cuda", "TIERED_OFFLOAD_TEST_EXAMPLES": "15" if quick else "40"}),
        ]
        ok = True
        for name, args, env in groups:
            if env.get("TIERED_OFFLOAD_TEST_STORE_DEVICE") == "cuda" and not _cuda():
                out[name] = {"status": "skipped: no CUDA"}
                check.say(f"   {name}: skipped: no CUDA")
                continue
            code, text = check.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                                   max(10.0, min(limit / 2, check.left() - 5)), env)
            out[name] = _pytest_counts(text) | {"exit": code}
            ok = ok and code == 0
            check.say(f"   {name}: {out[name]['last_line']}")
        out["status"] = "ok" if ok else "FAILED"
        return out
    return run


def bench_io_section(check: Check, quick: bool):
    def run(limit: float) -> dict:
        path = ROOT / ".gpu-check-bench-io"
        js = check.out / "bench_io.json"
        code, text = check.run([sys.executable, "-m", "tiered_offload", "bench-io", "--path", str(path), "--size",
                                "512MiB" if quick else "1GiB", "--request-sizes", "8MiB", "--threads", "4,16",
                                "--backends", "posix-direct,posix-buffered,kvikio", "--no-progress", "--json", str(js),
                                "--save-profile", str(check.out / "io-profile.json")], limit)
        shutil.rmtree(path, ignore_errors=True)
        out = {"exit": code, "tail": text[-1500:]}
        if js.exists():
            rep = json.loads(js.read_text())
            out.update(results=rep["results"], recommended=rep["recommended"], auto=rep.get("auto"), notes=rep["notes"])
        out["status"] = "ok" if code == 0 else "FAILED"
        return out
    return run


def _benchmark(check: Check, script: str, name: str, args: list[str], limit: float) -> dict:
    """Run a benchmark of ``tools/`` that writes a JSON report; its exit, output tail and report. The
    engines it builds read the disk's rates from the profile ``bench_io`` saved (``optimizer_device
    ="auto"`` weighs the disk with them; the plan's prediction uses them)."""
    js = check.out / f"{name}.json"
    profile = check.out / "io-profile.json"
    code, text = check.run([sys.executable, f"tools/{script}", "--json", str(js), *args], limit,
                           {"TIERED_OFFLOAD_PROFILE": str(profile)} if profile.exists() else None)
    for left in ROOT.glob(".bench-gpu-*"):  # a run killed at its limit leaves its state (17 GB for the 1B model)
        shutil.rmtree(left, ignore_errors=True)
    out = {"exit": code, "tail": text[-2000:]}
    if js.exists():
        out["report"] = json.loads(js.read_text())
    out["status"] = "ok" if code == 0 else "FAILED"
    return out


def step_time_section(check: Check, quick: bool):
    def run(limit: float) -> dict:
        if not _cuda():  # a GPU benchmark: on the CPU the 1B model would only run out of time
            return {"status": "skipped: no CUDA"}
        args = ["--steps", "10", "--warmup", "3", "--plain-steps", "4"]  # steady state: steps 4-10
        if (check.out / "bench_io.json").exists():  # the step against the disk floor at bench-io's rates
            args += ["--bench-io", str(check.out / "bench_io.json")]
        if quick:
            args = ["--layers", "4", "--d-model", "1024", "--heads", "8", "--steps", "2", "--plain-steps", "3",
                    "--host-memory", "1GiB", "--device-memory", "1GiB"]
        out = {}
        # the optimizer step where its state lives, on the GPU, as the planner places it with 4
        # micro-batches through forward_backward (the batch split: the same tokens per step)
        runs = [("host", ["--optimizer-device", "host"]), ("device", ["--optimizer-device", "device"]),
                ("auto_4_micro_batches", ["--optimizer-device", "auto", "--micro-batches", "4"]),
                # the step in the backward (no clipping): no gradient on the disk, the host keeps the weights
                ("host_4_micro_batches_in_backward", ["--optimizer-device", "host", "--micro-batches", "4",
                                                      "--step-in-backward"])]
        for i, (name, extra) in enumerate(runs):
            left = limit - sum(v.get("seconds", 0) for v in out.values())
            t = time.monotonic()
            out[name] = _benchmark(check, "bench_gpu_step.py", f"step_time_{name}", [*args, *extra], left / (len(runs) - i))
            out[name]["seconds"] = time.monotonic() - t
        out["status"] = "ok" if all(v["status"] == "ok" for v in out.values()) else "FAILED"
        return out
    return run


def tiers_section(check: Check, quick: bool):
    def run(limit: float) -> dict:
        if not _cuda():  # tools/bench_tiers.py itself runs the same comparison on the CPU
            return {"status": "skipped: no CUDA"}
        size = ["--d-model", "512", "--layers", "8"] if quick else ["--d-model", "1024", "--layers", "8", "--vocab",
                                                                    "32768", "--context", "512"]
        return _benchmark(check, "bench_tiers.py", "tiers",
                          ["--device", "cuda", "--rounds", "2", "--steps-per-round", "1", "--placements", *size], limit)
    return run


def suite_section(check: Check, extra: list[str]):
    def run(limit: float) -> dict:
        try:
            import xdist  # noqa: F401
            par = ["-n", str(min(12, os.cpu_count() or 2))]
        except ImportError:
            par = []
        args = list(extra)
        try:
            import pytest_timeout  # noqa: F401
        except ImportError:  # without the plugin pytest refuses the option: the section would run nothing
            if any(a.startswith("--timeout") for a in args):
                check.say("pytest-timeout is not installed: the suite runs without a per-test timeout")
            args = [a for a in args if not a.startswith("--timeout")]
        # -v: each test's outcome is in the log as it finishes, so a run cut short still says which
        # tests failed and which were still running
        code, text = check.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *par, *args, "tests"],
                               limit)
        out = _pytest_counts(text) | {"exit": code}
        out["status"] = "ok" if code == 0 else ("cut short" if code == 124 else "FAILED")
        return out
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory for gpu_check.json and gpu_check.log")
    ap.add_argument("--budget-s", type=float, default=540,
                    help="the whole check's time limit (default 540: one 600 s call on a lent GPU, less the set-up)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run of the check itself")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    ap.add_argument("--suite-args", default="--durations=15 --timeout=150",
                    help="extra pytest arguments for the whole suite (--timeout needs pytest-timeout, which the "
                         "GPU image has)")
    args = ap.parse_args()
    out = Path(args.out).resolve()  # (its commands run in the repository root)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget_s)
    skip = set(filter(None, args.skip.split(",")))
    sections = [
        ("env", env_section, 30),
        ("pinned", pinned_section, 30),
        ("bench_io", bench_io_section(check, args.quick), 60),
        ("tests", tests_section(check, args.quick), 150),
        # 3 runs of 10 steps of the 1B model (and a traced one): about 9 s a step on the H200 of
        # 2026-12-04, plus 15 s to build and 10 s of plain PyTorch: 140 s each
        ("step_time", step_time_section(check, args.quick), 420),
        ("tiers", tiers_section(check, args.quick), 150),  # its warm-up runs each plan until final: 9 steps
        ("suite", suite_section(check, args.suite_args.split()), 240),
    ]
    for name, fn, limit in sections:
        if name not in skip:
            check.section(name, fn, limit)
    s = check.summary["sections"]
    check.summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    check.summary["ok"] = all(v.get("status") in ("ok",) or str(v.get("status", "")).startswith("skipped")
                              for v in s.values())
    check.save()
    check.say("== summary: " + ", ".join(f"{k}: {v.get('status')}" for k, v in s.items()))
    return 0 if check.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
