"""Kill ``tiered-offload train`` with SIGKILL at random moments, run the same command again, repeat;
check that what the command leaves is what an uninterrupted run of it leaves.

    python tools/crash_loop_train.py --kills 20            # about 3 minutes here
    python tools/crash_loop_train.py --kills 20 data.packing=documents train.grad_accum=1
    python tools/crash_loop_train.py --kills 30 --world 2   # torchrun's 2 ranks, a random one killed
    python tools/crash_loop_train.py --kills 40 --draw      # each run's settings drawn (SETTINGS below)

A small Llama, its tokenizer and its data are built here (``tools/bench_finetune.py``'s ``build``).
A worker runs the command (``tiered_offload.cli.main(["train", "--config", ...])``) in a fork of a
zygote (``tools/zygote.py``), and says READY once its imports are done; the driver kills it after a
random delay within the command's own time (so kills land in the tokenising, placing the weights, the
steps and their commits, the step exports, the evaluation and the final export), starts it again
until it exits 0 (at most ``--per-run`` kills a run), and checks the directories against those of an
uninterrupted run of the same command:

- ``final/``: every file bitwise the same (the weights, ``config.json``, the tokenizer's files);
- each ``step-N/`` kept: there, complete and bitwise the same; no ``.step-N.partial`` left;
- ``metrics.jsonl``: one record a step, 1..N, in order, with the same loss, learning rate, gradient
  norm, tokens and evaluation loss, and the final evaluation's record.

Then it starts over in fresh directories, until ``--kills`` kills have landed. Exit status 1 if a
run differs. ``--draw``: each run draws its own settings from :data:`SETTINGS` and its host budget from
:data:`HOST_FRACTIONS` (with the command line's over them), and has its own uninterrupted run to be
compared with.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

WORKER_ENV = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
"""The environment every worker runs in (its zygote's)."""

COMPARED = ("step", "loss", "lr", "grad_norm", "tokens", "eval_loss")
"""What of a ``metrics.jsonl`` record must match the uninterrupted run's (not its times nor disk bytes)."""

SETTINGS = {
    "data.packing": ["true", "false", "documents"],
    "data.eval_fraction": ["0", "0.05"],
    "train.micro_batch": ["2", "4"],
    "train.grad_accum": ["1", "2", "3"],
    "train.schedule": ["cosine", "linear", "constant"],
    "train.clip": ["1.0", "1.8", "null"],
    "train.clip_in_backward": ["true", "0.8", "100"],  # (true: each step tried, the engine's prediction deciding;
    # 100: each tried, the prediction too)
    "train.eval_every": ["0", "3", "4"],
    "train.weight_decay": ["0", "0.01"],
    "train.precision": ["fp32", "fp32", "bf16-autocast"],
    "offload.commit_every": ["1", "2", "3"],
    "output.export_every": ["0", "2", "3"],
    "output.keep": ["1", "2"],
    "output.dtype": ["fp32", "bf16"],
    "lora.r": ["0", "0", "4"],
    "lora.merged": ["false", "true"],
    "lora.dropout": ["0", "0.1"],
}
"""What ``--draw`` draws each run's settings from (a value each, uniformly; ``lora.merged`` and
``lora.dropout`` apply with ``lora.r`` above 0)."""


HOST_FRACTIONS = [0.35, 0.6, 0.6, 1.2]
"""The host budgets ``--draw`` draws from, of the training state (above 1: it all fits in memory)."""


def draw(rng: random.Random, state_bytes: int) -> list[str]:
    """One run's settings drawn from :data:`SETTINGS`, and its host budget from :data:`HOST_FRACTIONS`."""
    picked = {key: rng.choice(values) for key, values in SETTINGS.items()}
    if picked["lora.r"] == "0":
        del picked["lora.merged"], picked["lora.dropout"]
    picked["offload.host_memory"] = str(int(rng.choice(HOST_FRACTIONS) * state_bytes))
    return [f"{key}={value}" for key, value in picked.items()]


def worker(config: Path, overrides: list[str]) -> int:
    """Run the command on ``config``, saying READY once what it imports is imported."""
    import transformers  # noqa: F401 (the command's own imports, before READY: kills land in its work)

    from tiered_offload.cli import main
    print("READY", flush=True)
    return main(["train", "--config", str(config), "--no-progress", *overrides])


def write_config(directory: Path, model: Path, data: Path, steps: int, host_bytes: int, commit_every: int = 1,
                 lora: int = 0) -> Path:
    import yaml
    cfg = {"model": {"path": str(model)},
           "data": {"path": str(data), "format": "completion", "field": "text", "max_seq_len": 48, "packing": True,
                    "eval_fraction": 0.05},
           "train": {"micro_batch": 4, "grad_accum": 2, "max_steps": steps, "lr": 3e-3, "schedule": "cosine",
                     "warmup_steps": 2, "clip": 1.0, "seed": 0, "eval_every": 4},
           "offload": {"storage": str(directory / "state"), "host_memory": host_bytes,
                       "commit_every": commit_every},
           "output": {"dir": str(directory / "out"), "export_every": 3, "keep": 2},
           "lora": {"r": lora}}
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(zygote, config: Path, overrides: list[str], world: int):
    """Fork the command's ranks (one: no torchrun environment); returns each with an event set when it
    has said READY, and its output's lines."""
    port, started = _free_port(), []
    for rank in range(world):
        env = {} if world == 1 else dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                         LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                         MASTER_PORT=str(port))
        proc = zygote.launch(HERE, ["--worker", str(config), *overrides], env, stderr_to_stdout=True)
        ready, lines = threading.Event(), []

        def pump(proc=proc, ready=ready, lines=lines):
            for line in proc.stdout:
                lines.append(line)
                if line.strip() == "READY":
                    ready.set()
        threading.Thread(target=pump, daemon=True).start()
        started.append((proc, ready, lines))
    return started


def run_once(zygote, config: Path, kill_after: float | None, overrides: list[str] = (), world: int = 1,
             rng: random.Random | None = None, timeout: float = 600) -> tuple[int, float, str]:
    """One start of the command (``world`` ranks, as torchrun starts them): a rank drawn by ``rng``
    killed ``kill_after`` s after every rank said READY (None: left to finish); the others then end
    on their own (a ``DistributedError``), or are killed after a minute. Returns the exit status
    (-9 where a rank was killed, else the first nonzero, else 0), its seconds after READY and the
    output of every rank."""
    started = _start(zygote, config, list(overrides), world)
    procs = [p for p, _, _ in started]

    def output() -> str:
        return "".join(f"[rank {r}] {line}" for r, (_, _, lines) in enumerate(started) for line in lines)
    if not all(ready.wait(timeout=120) for _, ready, _ in started):
        for p in procs:
            p.kill()
        raise RuntimeError("a worker never said READY:\n" + output()[-4000:])
    t0 = time.monotonic()
    killed = None
    try:
        procs[0].wait(timeout=kill_after if kill_after is not None else timeout)
    except Exception:  # (subprocess.TimeoutExpired: its time is up)
        killed = (rng or random).randrange(world)
        procs[killed].send_signal(signal.SIGKILL)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=60 if killed is not None else timeout))
        except Exception:  # (a rank that outlived its killed peer by a minute: hung)
            p.send_signal(signal.SIGKILL)
            codes.append(p.wait(timeout=60))
    code = -signal.SIGKILL if killed is not None else next((c for c in codes if c), 0)
    return code, time.monotonic() - t0, output()


def _metrics(out: Path) -> list[tuple]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [tuple(r.get(k) for k in COMPARED) for r in records]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def differences(got: Path, want: Path) -> list[str]:
    """How the output directory ``got`` differs from the uninterrupted run's ``want``."""
    problems = []
    if _metrics(got) != _metrics(want):
        problems.append(f"metrics.jsonl differs: {_metrics(got)} against {_metrics(want)}")
    exports = sorted(p.name for p in want.iterdir() if p.is_dir() and (p.name == "final" or p.name.startswith("step-")))
    mine = sorted(p.name for p in got.iterdir() if p.is_dir() and not p.name.startswith(".cache"))
    if mine != exports:
        problems.append(f"exports {mine}, the uninterrupted run's {exports}")
    for name in exports:
        if (got / name).is_dir() and _files(got / name) != _files(want / name):
            problems.append(f"{name}/ differs from the uninterrupted run's ({sorted(_files(got / name))})")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value",
                    help="the command's own settings over the loop's (data.packing=documents, train.grad_accum=1)")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--per-run", type=int, default=4, help="kills at most in one run before it may finish")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--commit-every", type=int, default=1, help="offload.commit_every (above 1: snapshot commits)")
    ap.add_argument("--lora", type=int, default=0, help="lora.r (0: every parameter trains)")
    ap.add_argument("--world", type=int, default=1, help="ranks, as torchrun --nproc_per_node starts them (a random "
                                                         "one killed)")
    ap.add_argument("--draw", action="store_true", help="each run's settings drawn from SETTINGS (seeded by --seed)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.overrides)
    from bench_finetune import build
    from zygote import Zygote

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="crash-loop-train-"))
    try:
        model = build(work, args.layers, args.width)
        import transformers
        config = transformers.AutoConfig.from_pretrained(model)
        n = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
        host = 16 * n * 6 // 10  # six tenths of the training state: it streams through the disk
        with Zygote(env=WORKER_ENV) as zygote:
            def uninterrupted(directory: Path, overrides: list[str]) -> float | None:
                """The uninterrupted run's seconds; None: the command refused the drawn settings (exit 2)."""
                directory.mkdir()
                code, seconds, log = run_once(zygote, write_config(directory, model, work / "train.jsonl", args.steps,
                                                                   host, args.commit_every, args.lora), None,
                                              overrides, args.world)
                if code == 2 and args.draw:
                    print(f"refused: {' '.join(overrides)}: {log.strip().splitlines()[-1][:300]}", flush=True)
                    return None
                if code != 0:
                    print(log)
                    raise SystemExit(f"the uninterrupted run failed ({' '.join(overrides)})")
                torn = sum(line.startswith("[rank 0]") and "over train.clip" in line for line in log.splitlines())
                if torn:  # (train.clip_in_backward: a step tried in the backward over the limit, run again)
                    print(f"the uninterrupted run tore {torn} step(s) in the backward and ran them again", flush=True)
                return seconds
            whole_s = None if args.draw else uninterrupted(work / "whole", args.overrides)
            if whole_s is not None:
                print(f"uninterrupted: {whole_s:.1f} s after its imports; {args.steps} steps, host {host} bytes "
                      f"(0.6 of the state)", flush=True)
            kills, runs, bad, refused = 0, 0, 0, 0
            while kills < args.kills:
                runs += 1
                overrides, whole = args.overrides, work / "whole"
                if args.draw:
                    overrides, whole = [*draw(rng, 16 * n), *args.overrides], work / f"whole-{runs}"
                    whole_s = uninterrupted(whole, overrides)
                    if whole_s is None:
                        runs, refused = runs - 1, refused + 1
                        shutil.rmtree(whole, ignore_errors=True)
                        if refused == 20:  # (the command line's settings, say, refused with any drawn)
                            raise SystemExit("20 drawings in a row refused: see the settings above")
                        continue
                    refused = 0
                    print(f"run {runs}: {' '.join(overrides)} (uninterrupted: {whole_s:.1f} s)", flush=True)
                d = work / f"run-{runs}"
                d.mkdir()
                config = write_config(d, model, work / "train.jsonl", args.steps, host, args.commit_every,
                                      args.lora)
                starts, mine = 0, 0
                while True:
                    starts += 1
                    kill = rng.uniform(0, whole_s) if mine < args.per_run and kills < args.kills else None
                    code, _, log = run_once(zygote, config, kill, overrides, args.world, rng)
                    if code == -signal.SIGKILL:
                        kills, mine = kills + 1, mine + 1
                        continue
                    if code != 0:
                        print(log[-4000:])
                        bad += 1
                        print(f"run {runs}: start {starts} exited {code}", flush=True)
                        break
                    problems = differences(d / "out", whole / "out")
                    bad += bool(problems)
                    print(f"run {runs}: {mine} kills in {starts} starts: "
                          + ("same as the uninterrupted run" if not problems else "; ".join(problems)), flush=True)
                    break
                shutil.rmtree(d, ignore_errors=True)
                if args.draw:
                    shutil.rmtree(whole, ignore_errors=True)
            print(f"{kills} kills over {runs} runs: {runs - bad} of {runs} the same as the uninterrupted run")
            return 1 if bad else 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
