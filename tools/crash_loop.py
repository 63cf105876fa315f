"""Kill training with SIGKILL at random moments, resume, repeat; check the end result is bitwise right.

    python tools/crash_loop.py --kills 300             # the long run (about 3 minutes here)
    python tools/crash_loop.py --kills 8 --steps 8     # about what the CI test runs

A worker process trains a small GPT through the engine (durable storage, a host budget far below
the state, an LR scheduler, batches drawn from the global RNG, a user dict) and resumes from its
storage directory whenever it starts. The driver starts it, kills it with SIGKILL after a random
delay (so kills land in start-up, recovery, forward, backward, the optimizer's write-back and the
commit itself) and restarts it until it finishes; then it starts over in a fresh directory, until
``--kills`` kills have landed. Every start prints a digest of the weights it resumed with, which
must equal the uninterrupted run's at that step, and every finished run's weights must equal that
run's final weights byte for byte. The driver also samples the disk usage of the uninterrupted run
and reports the largest excess of the state's files over the training state's size, and the most
offloaded activations on the disk apart (they spill only as far as the free space holds them).

Workers are forked from a *zygote*, a process that has imported torch and the library once (a
fresh interpreter spends about 6 s on those imports, an optimizer's first construction included;
a fork starts training in 0.1 s), so kills land in the engine's own start-up and recovery rather
than in the imports, and a loop runs several times more kills in the same time.
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
sys.path.insert(0, str(HERE.parent))
from zygote import Forked, Zygote  # noqa: E402 (tools/)


# ---- the worker ---------------------------------------------------------------------------
def _digest(engine) -> str:
    import hashlib
    h = hashlib.sha256()
    for name, value in engine.named_parameters():
        h.update(name.encode())
        h.update(value.numpy().tobytes())
    return h.hexdigest()[:16]


OPTIMIZERS = {"adamw": ("AdamW", dict(lr=3e-3, weight_decay=0.1)),
              "adafactor": ("Adafactor", dict(lr=1e-2, weight_decay=0.1))}
"""The optimizers a worker can train with: ``torch.optim`` class name and keyword arguments."""


def worker(directory: str, steps: int, layers: int, out: str, digests: bool = False, commit_every: int = 1,
           host_fraction: float = 1.0, device_fraction: float = 0.0, optimizer: str = "adamw",
           buffers: bool = False, accumulate: int = 1, dropout: float = 0.0, own_noise: float = 0.0,
           in_backward: bool = False, clip: float = 0.0, optimizer_device: str = "auto", stripes: int = 1,
           stripe_weights: str = "") -> None:
    import numpy as np
    import torch

    from offload_core.errors import ClipTornError
    from tiered_offload import Engine, EngineConfig
    from tiered_offload_examples.models import GPT, GPTConfig

    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, context=32, d_model=64, n_layers=layers, n_heads=4, dropout=dropout))
        if buffers:  # every block counts its calls in a persistent buffer its output depends on
            model.blocks = torch.nn.ModuleList(_counted(b) for b in model.blocks)
        if own_noise:  # every block draws from a generator of its own: a commit must save where it is
            model.blocks = torch.nn.ModuleList(_noisy(b, i, own_noise) for i, b in enumerate(model.blocks))
        n = sum(p.numel() for p in model.parameters())
        # host_fraction 1.0: the 16 bytes per parameter of state, less what page alignment takes: the
        # state does not quite fit, units stream through the disk and commits use the journal
        opt_cls, opt_kwargs = OPTIMIZERS[optimizer]
        # striped: 16 KiB stripes, so that the tensors of this small model spread over the directories
        storage = (f"posix:{','.join(map(str, _stripes(Path(directory), stripes)))}?stripe_bytes=16KiB"
                   + (f"&stripe_weights={stripe_weights}" if stripe_weights else "") if stripes > 1 else directory)
        engine = Engine(model, getattr(torch.optim, opt_cls), opt_kwargs, storage=storage,
                        host_memory=int(16 * n * host_fraction), resume="auto", commit_every=commit_every,
                        # a device tier of CPU memory: the GPU's three tiers on the CPU
                        store_config={"device_budget_bytes": int(16 * n * device_fraction)} if device_fraction
                        else None, config=EngineConfig(optimizer_device=optimizer_device))
        sched = torch.optim.lr_scheduler.LinearLR(engine.optimizer, start_factor=1.0, end_factor=0.1,
                                                  total_iters=steps)
        engine.attach_scheduler(sched)
        if engine.step_count:
            assert engine.user_state == {"batches": engine.step_count}, (engine.user_state, engine.step_count)
        print(f"START {engine.step_count} {_digest(engine)}", flush=True)  # the weights it resumed with
        return engine

    # clip: each step clipped at it in the backward (clip_norm); one torn there runs again, after a resume in
    # this process (as tiered-offload train does), clipped after the backward
    torn: set[int] = set()
    while True:
        engine = build()
        try:
            modes = _train(engine, steps, accumulate, in_backward, clip, torn, digests)
            break
        except ClipTornError:
            torn.add(engine.step_count + 1)
            print(f"TORN {engine.step_count + 1}", flush=True)
            engine.close()
    print("MODES " + " ".join(sorted(modes)), flush=True)
    weights = {k: v.numpy() for k, v in engine.named_parameters()}
    engine.close()
    np.savez(out, **weights)
    print("DONE", flush=True)


def _train(engine, steps: int, accumulate: int, in_backward: bool, clip: float, torn: set, digests: bool) -> set:
    """The worker's steps (see :func:`worker`) to ``steps``; returns the step modes seen."""
    import torch
    import torch.nn.functional as F
    modes = set()
    while engine.step_count < steps:
        fused = in_backward and engine.step_count + 1 not in torn
        clipped = {"clip_norm": clip} if fused and clip else {}
        x = torch.randint(0, 256, (4, 33))  # the global RNG: a resume must restore it exactly
        engine.user_state = {"batches": engine.step_count + 1}  # (committed with the step)
        if accumulate > 1:  # the micro-batches through each block together
            parts = list(x.repeat(accumulate, 1).chunk(accumulate))
            inputs = [p[:, :-1] for p in parts]
            targets = {id(i): p[:, 1:].flatten() for i, p in zip(inputs, parts)}
            losses = engine.forward_backward(inputs, lambda out, b: F.cross_entropy(out.flatten(0, 1), targets[id(b)]),
                                             step=fused, **clipped)
            loss = sum(losses) / accumulate
        else:
            logits = engine(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            engine.backward(loss, step=fused, **clipped)
        if not fused:  # (in the backward: the step and zero_grad() ran there; clipped by clip_norm, or not at all)
            if not in_backward or clip:
                engine.clip_grad_norm_(clip or 1.0)
            engine.step()
            engine.zero_grad()
        print(f"STEP {engine.step_count} {loss.item():.6f}" + (f" {_digest(engine)}" if digests else ""), flush=True)
        modes.add(engine.step_mode)
    return modes


def _counted(block):
    """``block`` counting its calls in a persistent buffer its output depends on."""
    import torch

    class Counted(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x, *args, **kwargs):
            out = self.inner(x * (1.0 + 0.01 * self.calls), *args, **kwargs)
            if self.training:
                self.calls += 1
            return out
    return Counted(block)


def _noisy(block, seed: int, p: float):
    """``block`` with its input masked (a share ``p`` zeroed) by numbers drawn from a
    ``torch.Generator`` of its own, seeded ``seed``."""
    import torch

    class Noisy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.gen = torch.Generator().manual_seed(seed)

        def forward(self, x, *args, **kwargs):
            if self.training:
                x = x * (torch.rand(x.shape, generator=self.gen) >= p) / (1 - p)
            return self.inner(x, *args, **kwargs)
    return Noisy(block)


# ---- the driver ---------------------------------------------------------------------------
REFERENCE_TIMEOUT_S = 600.0
"""Longest an uninterrupted run may take before it is taken for hung and killed."""

WORKER_ENV = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
"""The environment every worker runs in (the zygote's: both are read when a process starts)."""


def _worker_argv(directory: Path, steps: int, layers: int, out: Path, digests: bool = False, commit_every: int = 1,
                 host_fraction: float = 1.0, device_fraction: float = 0.0, optimizer: str = "adamw",
                 buffers: bool = False, accumulate: int = 1, dropout: float = 0.0, own_noise: float = 0.0,
                 in_backward: bool = False, clip: float = 0.0, optimizer_device: str = "auto",
                 stripes: int = 1, stripe_weights: str = "") -> list[str]:
    """A worker's command-line arguments (``main`` parses them in the fork as in a fresh process)."""
    return (["--worker", str(directory), "--steps", str(steps), "--layers", str(layers), "--out", str(out),
             "--commit-every", str(commit_every), "--host-fraction", str(host_fraction),
             "--device-fraction", str(device_fraction), "--optimizer", optimizer]
            + (["--digests"] if digests else []) + (["--buffers"] if buffers else [])
            + ["--accumulate", str(accumulate), "--dropout", str(dropout), "--own-noise", str(own_noise)]
            + (["--step-in-backward"] if in_backward else []) + (["--clip-in-backward", str(clip)] if clip else [])
            + ["--optimizer-device", optimizer_device, "--stripes", str(stripes)]
            + (["--stripe-weights", stripe_weights] if stripe_weights else []))


def _zygote() -> Zygote:
    """A zygote for this loop's workers (tools/zygote.py), in the environment they run in."""
    return Zygote(env=WORKER_ENV)


def _runs_workers(zygote: Zygote) -> Zygote:
    """``zygote``, if it was started in the environment the workers run in (else ValueError)."""
    if not WORKER_ENV.items() <= zygote.env.items():
        raise ValueError(f"the crash loop's workers run in {WORKER_ENV} (their zygote's environment); this "
                         f"zygote sets {zygote.env}")
    return zygote


def _launch(zygote: Zygote, *args, **options) -> Forked:
    """Fork a worker (see :func:`worker` for the arguments)."""
    return zygote.launch(HERE, _worker_argv(*args, **options))


class _Output:
    """A launch's stdout and stderr, read on threads as they come, with the step it has reached
    (its START line's, then each STEP line's)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._cond = threading.Condition()
        self._step: int | None = None
        self._ended = False
        self._seen: list[float] = []
        self.last_step_s: float | None = None
        """How long the last step took (between its line and the one before; None before two)."""
        self._out: list[str] = []
        self._err: list[str] = []
        self._pumps = [threading.Thread(target=self._pump, args=(proc.stdout, self._out, True), daemon=True),
                       threading.Thread(target=self._pump, args=(proc.stderr, self._err, False), daemon=True)]
        for t in self._pumps:
            t.start()

    def _pump(self, stream, sink: list[str], watch: bool) -> None:
        for line in stream:
            sink.append(line)
            if watch and line.split()[:1] in (["START"], ["STEP"]):
                with self._cond:
                    self._step = int(line.split()[1])
                    self._seen.append(time.perf_counter())
                    if len(self._seen) > 1:
                        self.last_step_s = self._seen[-1] - self._seen[-2]
                    self._cond.notify_all()
        with self._cond:  # the process ended (or closed its output)
            self._ended = True
            self._cond.notify_all()

    def reached(self, step: int | None, timeout: float) -> int | None:
        """Wait until the launch has started (``step`` None) or finished step ``step``, or ended;
        the step it is at."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended or (self._step is not None and (step is None or self._step >= step)),
                                timeout=timeout)
            return self._step

    def collect(self, timeout: float) -> tuple[str, str]:
        """Wait for the process to exit; its whole stdout and stderr."""
        self.proc.wait(timeout=timeout)
        for t in self._pumps:
            t.join(timeout=30)
        return "".join(self._out), "".join(self._err)


def _stripes(directory: Path, stripes: int = 0) -> list[Path]:
    """The directories of a run in ``directory``: it, then its ``.stripe1``... siblings (``stripes``
    of them in all; 0: those that exist)."""
    if stripes:
        return [directory] + [directory.with_name(f"{directory.name}.stripe{i}") for i in range(1, stripes)]
    return [directory] + sorted(directory.parent.glob(f"{directory.name}.stripe*"))


def _du(directory: Path) -> tuple[int, int]:
    """Bytes of the training state's files in ``directory`` (and its stripes' directories), and of
    the offloaded activations there apart (the README's bound on extra space is the state's;
    activations spill only as far as the free space holds them)."""
    total = activations = 0
    for root, _dirs, files in (w for d in _stripes(directory) for w in os.walk(d)):
        if Path(root).name == ".tiered-offload":
            continue
        for f in files:
            try:
                n = os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                continue
            if f.endswith("activations"):
                activations += n
            else:
                total += n
    return total, activations


def reference(zygote: Zygote, work: Path, steps: int, layers: int,
              **options) -> tuple[Path, float, float, list, int, dict, str]:
    """An uninterrupted run: its weights file, its start-up time and duration, the peak disk usage
    seen (``[the state's files, the offloaded activations]``: see :func:`_du`), the state's size, a
    digest of the weights after every step, and the step modes it ran."""
    out = work / "reference.npz"
    d = work / "reference"
    peak = [0, 0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            state_files, activations = _du(d)
            peak[0], peak[1] = max(peak[0], state_files), max(peak[1], activations)
            time.sleep(0.002)
    t0 = time.perf_counter()
    proc = _launch(zygote, d, steps, layers, out, digests=True, **options)
    # a hung worker must not hang the loop (or CI): kill it after a generous deadline
    watchdog = threading.Timer(REFERENCE_TIMEOUT_S, proc.kill)
    watchdog.start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    boot, modes, torn = None, [], []
    digests = {}
    for line in proc.stdout:
        if line.startswith("START") and boot is None:
            boot = time.perf_counter() - t0
            digests[0] = line.split()[2]
        if line.startswith("STEP"):
            digests[int(line.split()[1])] = line.split()[3]
        if line.startswith("MODES"):
            modes = line.split()[1:]
        if line.startswith("TORN"):
            torn.append(int(line.split()[1]))
    stderr = proc.stderr.read()
    proc.wait(timeout=REFERENCE_TIMEOUT_S)
    watchdog.cancel()
    stop.set()
    sampler.join(timeout=10)
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {proc.returncode}; -9 after {REFERENCE_TIMEOUT_S} s means "
                         f"it hung):\n{stderr}")
    manifest = json.loads((d / ".tiered-offload" / "manifest.json").read_text().split(" ", 1)[1])
    weights_and_states = sum(t["nbytes"] for t in manifest["tensors"].values())
    state = weights_and_states // (1 + len(manifest["optimizer"]["states"])) * (2 + len(manifest["optimizer"]["states"]))
    return out, boot, time.perf_counter() - t0, peak, state, digests, " and ".join(modes) + (
        f"; steps torn in the backward, run again: {torn}" if torn else "")


def _same_file(a: Path, b: Path) -> bool:
    import numpy as np
    x, y = np.load(a), np.load(b)
    return sorted(x.files) == sorted(y.files) and all(x[k].tobytes() == y[k].tobytes() for k in x.files)


def _committed_files(directory: Path) -> set[Path]:
    """The files the committed state names: the manifest's extents and the journal's (any record)."""
    import re
    names = set()
    state = directory / ".tiered-offload"
    for f in (state / "manifest.json", state / "journal.jsonl"):
        if f.exists():
            names |= set(re.findall(r'"([^"]+@[0-9]+)"', f.read_text(errors="replace")))
    from storage_backends.base import key_to_filename
    return {d / key_to_filename(n) for n in names for d in _stripes(directory) if (d / key_to_filename(n)).exists()}


def _flip_a_bit(directory: Path, rng: random.Random) -> tuple[Path, int, int] | None:
    """Flip one bit of the journal (when it holds records) or of a committed extent; returns what to
    undo: ``(file, offset, original byte)``."""
    journal = directory / ".tiered-offload" / "journal.jsonl"
    extents = sorted(_committed_files(directory))
    choices = ([journal] if journal.exists() and journal.stat().st_size else []) + ([rng.choice(extents)] if extents else [])
    if not choices:
        return None
    path = rng.choice(choices)
    data = bytearray(path.read_bytes())
    if not data:
        return None
    at = rng.randrange(len(data))
    original = data[at]
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return path, at, original


def _unflip(flipped: tuple[Path, int, int]) -> None:
    path, at, original = flipped
    if path.exists():
        data = bytearray(path.read_bytes())
        if at < len(data):
            data[at] = original
            path.write_bytes(bytes(data))


def _manifest_step(directory: Path) -> int | None:
    """The step the manifest commits (None where it is missing or unreadable: a flipped bit)."""
    try:
        text = (directory / ".tiered-offload" / "manifest.json").read_text()
        return int(json.loads(text.split(" ", 1)[1])["step"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _version(filename: str) -> tuple[str, int]:
    """``(key, generation)`` of a versioned extent's file name (``block.1%2Fweight%407``)."""
    key, _, gen = filename.rpartition("%40")
    return key, int(gen) if gen.isdigit() else -1


_TYPED = ("CorruptionError", "CheckpointError", "ExtentNotFoundError", "ShortReadError")
"""What a start that finds a flipped bit may raise: a typed error that names the damaged file."""


def crash_loop(work: Path, kills: int, steps: int, layers: int, seed: int = 0, log=print, commit_every: int = 1,
               host_fraction: float = 1.0, device_fraction: float = 0.0, flip_bits: float = 0.0,
               optimizer: str = "adamw", buffers: bool = False, accumulate: int = 1, dropout: float = 0.0,
               own_noise: float = 0.0, in_backward: bool = False, zygote: Zygote | None = None,
               clip: float = 0.0, optimizer_device: str = "auto", stripes: int = 1, stripe_weights: str = "") -> dict:
    """Run the kill/resume loop; returns a summary (``identical``: every resume and every finished
    run matched the uninterrupted run bitwise).

    Training runs one after another, each in a fresh directory (an *episode*); each launch is
    killed after a random delay unless it finishes first, and relaunched (resuming) until it
    does. Every launch prints a digest of the weights it started from, compared with the
    uninterrupted run's at that step; every finished episode's weights are compared whole.
    ``commit_every`` > 1 or ``host_fraction`` > 1 (the state fits the host tier) exercise the
    snapshot commits; a resume then starts from a multiple of ``commit_every``. ``device_fraction``
    > 0 gives the engine a device tier of CPU memory of that share of the state (the GPU's path), and
    ``optimizer_device`` says where the update runs there (``EngineConfig.optimizer_device``).
    ``optimizer``: a key of :data:`OPTIMIZERS` (``adafactor``: one that works on whole parameters).
    ``buffers``: every block counts its calls in a persistent buffer its output depends on (the
    buffers' extent committed with each step, restored with it). ``accumulate`` > 1: each step runs
    that many micro-batches through ``engine.forward_backward`` (killed inside the vertical pass too).
    ``dropout`` > 0: the model draws random numbers in every forward (with ``accumulate``, a resumed
    engine's first step runs the loop and learns the draws, the uninterrupted run's passes replay them).
    ``own_noise`` > 0: every block masks its input with numbers drawn from a ``torch.Generator`` of
    its own (a commit saves its state; a resume restores it). ``in_backward``: each step runs in the
    backward (``backward(loss, step=True)``, ``forward_backward(..., step=True)``; no clipping; needs
    snapshot commits: ``commit_every`` > 1 or the state in memory); ``clip`` > 0 with it: clipped at
    ``clip`` there (``clip_norm``), a step torn over it run again after the backward, resumed in the
    same process (``TORN`` and a second ``START`` line). ``stripes`` > 1: the storage is that many
    directories, striped (a flipped bit may land in any of them), by ``stripe_weights`` (``"3:1"``)
    where given. ``zygote``: where the workers fork
    from (one started with :data:`WORKER_ENV`; None: a zygote of the loop's own).

    ``flip_bits`` (a probability per kill): after the kill, one bit of the journal or of a committed
    extent is flipped, and a start without a kill must either resume bitwise or refuse with a
    typed error naming the damaged file, deleting none of the committed files; then the bit is
    put back and the loop goes on (the next start must resume bitwise).
    """
    rng = random.Random(seed)
    options = dict(commit_every=commit_every, host_fraction=host_fraction, device_fraction=device_fraction,
                   optimizer=optimizer, buffers=buffers, accumulate=accumulate, dropout=dropout, own_noise=own_noise,
                   in_backward=in_backward, clip=clip, optimizer_device=optimizer_device, stripes=stripes,
                   stripe_weights=stripe_weights)
    if zygote is not None:
        return _loop(_runs_workers(zygote), work, kills, steps, layers, rng, flip_bits, options, log)
    with _zygote() as zygote:
        return _loop(zygote, work, kills, steps, layers, rng, flip_bits, options, log)


def _loop(zygote: Zygote, work: Path, kills: int, steps: int, layers: int, rng: random.Random, flip_bits: float,
          options: dict, log) -> dict:
    ref_out, boot, duration, (peak, spilled), state, ref_digests, modes = reference(zygote, work, steps, layers,
                                                                                     **options)
    log(f"uninterrupted run: {duration:.1f} s (start-up {boot:.1f} s); training state {state} bytes, peak disk "
        f"usage {peak} bytes (+{100 * (peak - state) / state:.1f}%), offloaded activations at most {spilled} bytes; "
        f"step {modes}")
    episode, done_kills, phases = 0, 0, {}
    resumes, identical_resumes, mismatches, resumed_at = 0, 0, [], set()
    finished, finished_identical = 0, 0
    flips = {"flipped": 0, "refused_typed": 0, "resumed_bitwise": 0, "bad": []}
    d, out = work / "run0", work / "run0.npz"
    while True:
        proc = _launch(zygote, d, steps, layers, out, **options)
        output = _Output(proc)
        killing = done_kills < kills
        if killing:
            # mostly while training (forward, backward, write-back, commit), timed from this start's
            # START line (a resume's start-up, reading the state back, takes longer than a fresh
            # one's); sometimes in start-up / recovery; with flipped bits only once there is a
            # committed state to damage
            early = rng.random() < 0.2 and not flip_bits
            at = None
            if early:
                time.sleep(rng.uniform(0.0, boot))
            else:  # in one of the steps this start has left, chosen evenly, at a random moment of it
                at = output.reached(None, timeout=max(60.0, 10 * duration))
                if at is not None and at < steps:
                    output.reached(rng.randint(at, steps - 1), timeout=max(60.0, 10 * duration))
                    time.sleep(rng.uniform(0.0, output.last_step_s or (duration - boot) / steps))
            # a start with no step left (resumed at the last one) only closes: let it finish
            if proc.poll() is None and not (at is not None and at >= steps):
                proc.send_signal(signal.SIGKILL)
                done_kills += 1
        try:
            stdout, stderr = output.collect(timeout=max(60.0, 10 * duration))
        except subprocess.TimeoutExpired:
            proc.kill()
            output.collect(timeout=30)
            raise SystemExit(f"a run hung: no exit {max(60.0, 10 * duration):.0f} s after its start (the uninterrupted "
                             f"run took {duration:.1f} s), after {done_kills} kills; directory {d}") from None
        if proc.returncode not in (0, -signal.SIGKILL):
            raise SystemExit(f"a resume failed (exit {proc.returncode}) after {done_kills} kills:\n{stderr}")
        lines = stdout.splitlines()
        for x in lines:
            if x.startswith("START"):
                step, digest = int(x.split()[1]), x.split()[2]
                resumed_at.add(step)
                resumes += 1
                if digest == ref_digests.get(step):
                    identical_resumes += 1
                else:
                    mismatches.append((episode, step))
        if proc.returncode != 0:
            last = lines[-1].split()[0] if lines else "START-UP"
            phases[last] = phases.get(last, 0) + 1
            if flip_bits and rng.random() < flip_bits:
                _flip_check(zygote, d, steps, layers, out, options, rng, flips, ref_digests, duration)
            continue
        finished += 1
        finished_identical += _same_file(ref_out, out)
        if not killing:
            break
        for x in _stripes(d):  # the next episode trains from scratch again
            shutil.rmtree(x, ignore_errors=True)
        episode += 1
        d, out = work / f"run{episode}", work / f"run{episode}.npz"
        if (episode % 10) == 0:
            log(f"{done_kills} kills, {episode} runs finished, {identical_resumes}/{resumes} resumes identical")
    summary_flips = {k: v for k, v in flips.items() if k != "bad"} | {"bad": flips["bad"][:10]}
    return {"kills": done_kills, "runs_finished": finished, "runs_finished_identical": finished_identical,
            **({"bit_flips": summary_flips} if flip_bits else {}),
            "resumes": resumes, "resumes_bitwise_identical": identical_resumes, "mismatched_resumes": mismatches,
            "identical": finished_identical == finished and not mismatches and not flips["bad"],
            "resumed_at_steps": sorted(resumed_at), "killed_after": phases, "state_bytes": state,
            "peak_disk_bytes": peak, "disk_overhead": (peak - state) / state, "activations_on_disk": spilled / state,
            "uninterrupted_s": duration, "uninterrupted_step_modes": modes}


def _flip_check(zygote: Zygote, d: Path, steps: int, layers: int, out: Path, options: dict, rng: random.Random, flips: dict,
                ref_digests: dict, duration: float) -> None:
    """Flip a bit, start once without a kill: a bitwise resume or a typed refusal naming the file,
    no committed file deleted; then put the bit back (the state it protects is still there)."""
    flipped = _flip_a_bit(d, rng)
    if flipped is None:
        return
    flips["flipped"] += 1
    committed, step_before = _committed_files(d), _manifest_step(d)
    proc = _launch(zygote, d, steps, layers, out, **options)
    try:
        stdout, stderr = proc.communicate(timeout=max(60.0, 10 * duration))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)
        flips["bad"].append(f"hung after a flip in {flipped[0].name}")
        return
    starts = [x.split() for x in stdout.splitlines() if x.startswith("START")]
    trained = any(x.startswith("STEP") for x in stdout.splitlines())
    # a start that trained on (or finished a step in flight) before it met the flipped bit recorded newer
    # versions first and then let the old files go, as the protocol does: only a file whose tensor the
    # committed state no longer has in any newer version counts as lost
    # committed files only; and a start that finished the step in flight (the manifest moved on)
    # let that step's gradients go with it, as the protocol does
    now = {_version(p.name) for p in _committed_files(d)}
    finished = (_manifest_step(d) or -1) > (step_before if step_before is not None else 1 << 62)
    gone = [] if trained else sorted(p.name for p in committed if not p.exists() and not any(
        key == _version(p.name)[0] and gen > _version(p.name)[1] for key, gen in now)
        and not (finished and _version(p.name)[0].endswith("%2Fgrad")))
    wrong_start = [s for s in starts if s[2] != ref_digests.get(int(s[1]))]
    # the last typed error in the output (an exit hook may log after the traceback)
    typed = [line for line in stderr.splitlines() if any(f"{name}: " in line for name in _TYPED)]
    error = typed[-1] if typed else (stderr.strip().splitlines() or [""])[-1]
    if gone and proc.returncode != 0:
        flips["bad"].append(f"a flip in {flipped[0].name} and a refused start deleted committed files {gone[:3]}")
    elif wrong_start:
        flips["bad"].append(f"a flip in {flipped[0].name}: resumed with other weights at step {wrong_start[0][1]}")
    elif proc.returncode == 0:
        flips["resumed_bitwise"] += 1  # trained to the end: its weights are compared by the next launch's START
    elif typed and (flipped[0].name in error or "journal.jsonl" in error or str(d) in error):
        flips["refused_typed"] += 1  # at start, or resumed bitwise and refused when it read the damaged file
    else:
        flips["bad"].append(f"a flip in {flipped[0].name}: exit {proc.returncode}, {error[:200]}")
    _unflip(flipped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", metavar="DIR")
    ap.add_argument("--out")
    ap.add_argument("--kills", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit-every", type=int, default=1, help="commit every N steps (snapshot commits when N > 1)")
    ap.add_argument("--host-fraction", type=float, default=1.0,
                    help="host budget as a fraction of the state (> 1: it fits, and commits are snapshots)")
    ap.add_argument("--device-fraction", type=float, default=0.0,
                    help="a device tier of CPU memory of this fraction of the state (0: none, as on a CPU machine)")
    ap.add_argument("--optimizer-device", choices=["auto", "host", "device"], default="auto",
                    help="with --device-fraction: where the optimizer step runs (EngineConfig.optimizer_device)")
    ap.add_argument("--flip-bits", type=float, default=0.0, metavar="P",
                    help="after a kill, with probability P flip a bit of the journal or a committed extent and check "
                         "the next start resumes bitwise or refuses with a typed error, deleting nothing")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                    help="adafactor: an optimizer the engine runs on whole parameters (its state packed)")
    ap.add_argument("--buffers", action="store_true",
                    help="every block counts its calls in a persistent buffer its output depends on")
    ap.add_argument("--accumulate", type=int, default=1, metavar="N",
                    help="N micro-batches per step through engine.forward_backward")
    ap.add_argument("--dropout", type=float, default=0.0, help="the model's dropout (random numbers in every forward)")
    ap.add_argument("--own-noise", type=float, default=0.0, metavar="P",
                    help="every block masks P of its input with numbers from a torch.Generator of its own")
    ap.add_argument("--try-step-modes", action="store_true",
                    help="the engine tries its step deferred once its plan is final, whatever the disk's load "
                         "(TIERED_OFFLOAD_DEFER_STEP=try): kills land across the change of step mode")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="each step run in the backward (backward(loss, step=True)); needs --commit-every 2 or more")
    ap.add_argument("--clip-in-backward", type=float, default=0.0, metavar="CLIP",
                    help="with --step-in-backward: each step clipped at CLIP in the backward (clip_norm); one torn "
                         "there (its norm over CLIP) runs again after the backward, resumed in the same process")
    ap.add_argument("--stripes", type=int, default=1, metavar="N",
                    help="the storage: N directories, striped in 16 KiB stripes (a flipped bit may land in any)")
    ap.add_argument("--stripe-weights", default="", metavar="W",
                    help="with --stripes: the directories' stripe weights (3:1: the first takes 3 of every 4)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--digests", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.layers, args.out, args.digests, args.commit_every, args.host_fraction,
               args.device_fraction, args.optimizer, args.buffers, args.accumulate, args.dropout, args.own_noise,
               args.step_in_backward, args.clip_in_backward, args.optimizer_device, args.stripes,
               args.stripe_weights)
        return
    if args.step_in_backward and args.commit_every < 2 and args.host_fraction <= 1.2:
        ap.error("--step-in-backward needs snapshot commits (--commit-every 2 or more)")
    if args.try_step_modes:  # (the zygote, and so every worker, inherits it)
        os.environ["TIERED_OFFLOAD_DEFER_STEP"] = "try"
    work = Path(tempfile.mkdtemp(prefix="crash-loop-"))
    try:
        t0 = time.perf_counter()
        summary = crash_loop(work, args.kills, args.steps, args.layers, args.seed, commit_every=args.commit_every,
                             host_fraction=args.host_fraction, device_fraction=args.device_fraction,
                             flip_bits=args.flip_bits, optimizer=args.optimizer, buffers=args.buffers,
                             accumulate=args.accumulate, dropout=args.dropout, own_noise=args.own_noise,
                             in_backward=args.step_in_backward, clip=args.clip_in_backward,
                             optimizer_device=args.optimizer_device, stripes=args.stripes,
                             stripe_weights=args.stripe_weights)
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(summary, indent=1))
        print(f"{summary['kills']} SIGKILLs over {summary['runs_finished']} training runs; "
              f"{summary['resumes_bitwise_identical']} of {summary['resumes']} starts resumed with weights bitwise "
              f"identical to the uninterrupted run's at that step; {summary['runs_finished_identical']} of "
              f"{summary['runs_finished']} runs ended bitwise identical to it; peak extra disk "
              f"{100 * summary['disk_overhead']:.1f}% of the state (and offloaded activations at most "
              f"{100 * summary['activations_on_disk']:.1f}%)")
        if "bit_flips" in summary:
            f = summary["bit_flips"]
            print(f"{f['flipped']} bits flipped after a kill: {f['refused_typed']} starts refused with a typed error "
                  f"naming the file, {f['resumed_bitwise']} resumed bitwise, {len(f['bad'])} otherwise")
        sys.exit(0 if summary["identical"] else 1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
