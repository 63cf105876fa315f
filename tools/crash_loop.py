"""Kill training with SIGKILL at random moments, resume, repeat; check the end result is bitwise right.

    python tools/crash_loop.py --kills 300            # the long run (about 15-25 minutes here)
    python tools/crash_loop.py --kills 20 --steps 12  # what the CI test runs

A worker process trains a small GPT through the engine (durable storage, a host budget far below
the state, an LR scheduler, batches drawn from the global RNG, a user dict) and resumes from its
storage directory whenever it starts. The driver starts it, kills it with SIGKILL after a random
delay (so kills land in start-up, recovery, forward, backward, the optimizer's write-back and the
commit itself), restarts it, and after ``--kills`` kills lets it finish. Its final weights must
equal, byte for byte, those of a run that was never interrupted. The driver also samples the disk
usage of the uninterrupted run and reports the largest excess over the training state's size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()


# ---- the worker ---------------------------------------------------------------------------
def _digest(engine) -> str:
    import hashlib
    h = hashlib.sha256()
    for name, value in engine.named_parameters():
        h.update(name.encode())
        h.update(value.numpy().tobytes())
    return h.hexdigest()[:16]


def worker(directory: str, steps: int, layers: int, out: str, digests: bool = False) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from tiered_offload import Engine
    from tiered_offload.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, context=32, d_model=64, n_layers=layers, n_heads=4))
    n = sum(p.numel() for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1), storage=directory,
                    host_memory=16 * n, resume="auto")  # a quarter of the 16 bytes/parameter of state
    sched = torch.optim.lr_scheduler.LinearLR(engine.optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps)
    engine.attach_scheduler(sched)
    if engine.step_count:
        assert engine.user_state == {"batches": engine.step_count}, (engine.user_state, engine.step_count)
    print(f"START {engine.step_count} {_digest(engine)}", flush=True)  # the weights it resumed with
    while engine.step_count < steps:
        x = torch.randint(0, 256, (4, 33))  # the global RNG: a resume must restore it exactly
        logits = engine(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.user_state = {"batches": engine.step_count + 1}
        engine.step()
        engine.zero_grad()
        print(f"STEP {engine.step_count} {loss.item():.6f}" + (f" {_digest(engine)}" if digests else ""), flush=True)
    weights = {k: v.numpy() for k, v in engine.named_parameters()}
    engine.close()
    np.savez(out, **weights)
    print("DONE", flush=True)


# ---- the driver ---------------------------------------------------------------------------
def _launch(directory: Path, steps: int, layers: int, out: Path, digests: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(HERE), "--worker", str(directory), "--steps", str(steps),
                             "--layers", str(layers), "--out", str(out)] + (["--digests"] if digests else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _du(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        if Path(root).name == ".tiered-offload":
            continue
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def reference(work: Path, steps: int, layers: int) -> tuple[Path, float, float, int, int, dict]:
    """An uninterrupted run: its weights file, its start-up time and duration, the peak disk usage
    seen, the state's size, and a digest of the weights after every step."""
    out = work / "reference.npz"
    d = work / "reference"
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _du(d))
            time.sleep(0.002)
    t0 = time.perf_counter()
    proc = _launch(d, steps, layers, out, digests=True)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    boot = None
    digests = {}
    for line in proc.stdout:
        if line.startswith("START") and boot is None:
            boot = time.perf_counter() - t0
            digests[0] = line.split()[2]
        if line.startswith("STEP"):
            digests[int(line.split()[1])] = line.split()[3]
    stderr = proc.stderr.read()
    proc.wait()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{stderr}")
    manifest = json.loads((d / ".tiered-offload" / "manifest.json").read_text().split(" ", 1)[1])
    weights_and_states = sum(t["nbytes"] for t in manifest["tensors"].values())
    state = weights_and_states // (1 + len(manifest["optimizer"]["states"])) * (2 + len(manifest["optimizer"]["states"]))
    return out, boot, time.perf_counter() - t0, peak[0], state, digests


def crash_loop(work: Path, kills: int, steps: int, layers: int, seed: int = 0, log=print) -> dict:
    """Run the kill/resume loop; returns a summary (``identical`` says whether the weights matched)."""
    import numpy as np
    rng = random.Random(seed)
    ref_out, boot, duration, peak, state, ref_digests = reference(work, steps, layers)
    log(f"uninterrupted run: {duration:.1f} s; training state {state} bytes, peak disk usage {peak} bytes "
        f"(+{100 * (peak - state) / state:.1f}%)")
    d, out = work / "crashed", work / "crashed.npz"
    done_kills, resumed_at, phases = 0, [], {}
    resumes, identical_resumes, mismatches = 0, 0, []
    while True:
        proc = _launch(d, steps, layers, out)
        if done_kills >= kills:
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"the final resume failed:\n{stderr}")
            break
        # mostly while training (forward, backward, write-back, commit), sometimes in start-up / recovery
        time.sleep(rng.uniform(0.0, boot) if rng.random() < 0.2 else rng.uniform(boot, duration))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            done_kills += 1
        stdout, stderr = proc.communicate()
        if proc.returncode not in (0, -signal.SIGKILL):
            raise SystemExit(f"a resume failed (exit {proc.returncode}) after {done_kills} kills:\n{stderr}")
        lines = stdout.splitlines()
        for x in lines:
            if x.startswith("START"):
                step, digest = int(x.split()[1]), x.split()[2]
                resumed_at.append(step)
                resumes += 1
                if digest == ref_digests.get(step):
                    identical_resumes += 1
                else:
                    mismatches.append(step)
        last = lines[-1].split()[0] if lines else "BOOT"
        phases[last] = phases.get(last, 0) + 1
        if proc.returncode == 0:  # it finished before the kill; the next launch resumes at the end and exits
            out.unlink(missing_ok=True)
    a, b = np.load(ref_out), np.load(out)
    identical = sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) and a[k].tobytes() == b[k].tobytes()
                                                           for k in a.files)
    return {"kills": done_kills, "identical": identical and not mismatches, "final_weights_identical": identical,
            "resumes": resumes, "resumes_bitwise_identical": identical_resumes, "mismatched_resumes_at": mismatches,
            "resumed_at_steps": sorted(set(resumed_at)),
            "killed_after": phases, "state_bytes": state, "peak_disk_bytes": peak,
            "disk_overhead": (peak - state) / state, "uninterrupted_s": duration}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", metavar="DIR")
    ap.add_argument("--out")
    ap.add_argument("--kills", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--digests", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.layers, args.out, args.digests)
        return
    work = Path(tempfile.mkdtemp(prefix="crash-loop-"))
    try:
        t0 = time.perf_counter()
        summary = crash_loop(work, args.kills, args.steps, args.layers, args.seed)
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(summary, indent=1))
        print(f"{summary['kills']} SIGKILLs; {summary['resumes_bitwise_identical']} of {summary['resumes']} starts resumed "
              f"with weights bitwise identical to the uninterrupted run's at that step; final weights "
              f"{'bitwise identical' if summary['final_weights_identical'] else 'DIFFERENT'}; peak extra disk "
              f"{100 * summary['disk_overhead']:.1f}% of the state")
        sys.exit(0 if summary["identical"] else 1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
