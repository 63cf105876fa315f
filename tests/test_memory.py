"""Peak host memory of a training run stays within the budgets plus the stated fixed overhead.

Runs in a subprocess so the measurement (peak RSS, ``VmHWM``) sees nothing of pytest's own
allocations: a fresh interpreter for the README's bound (its imports count), a fork of the suite's
zygote (tools/zygote.py; the kernel starts a child's peak at its own size) where runs are compared
with each other. The model is built with ``empty_init`` (its parameters never exist in memory) and
its training state is at least 4x the host budget.
"""

import json
import subprocess
import sys
import textwrap

MiB = 1 << 20

SCRIPT = textwrap.dedent("""
    import gc, json, os, sys
    import psutil, torch
    import torch.nn.functional as F
    import tiered_offload
    from tiered_offload.memstat import peak_rss_bytes
    from tiered_offload_examples.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=256, context=64, d_model=256, n_layers=10, n_heads=8)
    with tiered_offload.empty_init():
        model = GPT(cfg)
    batch, host, activations = (int(sys.argv[2]), sys.argv[3], sys.argv[4]) if len(sys.argv) > 2 else (2, "20MiB", "auto")
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # (a zygote's worker starts with one)
    x = torch.randint(0, 256, (batch, 65))
    gc.collect()
    base = psutil.Process().memory_info().rss
    engine = tiered_offload.Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=sys.argv[1], host_memory=host,
                                   config=tiered_offload.EngineConfig(activations=activations))
    rss = []
    for _ in range(int(sys.argv[5]) if len(sys.argv) > 5 else 3):
        logits = engine(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        gc.collect()
        rss.append(psutil.Process().memory_info().rss)
    peak = peak_rss_bytes()
    largest = 4 * 256 * 4 * 256  # the MLP matrices, 1024 x 256 fp32: the largest parameter
    print(json.dumps(dict(base=base, peak=peak, host=engine.store.capacity("host"), state=engine.state_bytes(),
                          disk_read=engine.stats().bytes_read[tiered_offload.Tier.DISK], largest_param=largest,
                          modes=engine.activation_modes, activations=engine._streamer.activation_bytes, rss=rss,
                          arena_peak=engine.stats().peak_used[tiered_offload.Tier.HOST])))
    engine.close()
""")


def test_peak_rss_growth_within_budget_plus_fixed_overhead(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "state")], capture_output=True, text=True,
                         check=True, timeout=600)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["state"] >= 4 * r["host"], r
    assert r["disk_read"] > r["state"] // 2, r  # the state really streamed from disk
    growth = r["peak"] - r["base"]
    # README, "Memory": peak RSS growth <= host budget + device budget + 96 MiB + 8 x the largest parameter
    allowed = r["host"] + 96 * MiB + 8 * r["largest_param"]
    assert growth <= allowed, f"peak RSS grew {growth / MiB:.1f} MiB, allowed {allowed / MiB:.1f} MiB: {r}"


def _run(tmp_path, zygote, name, *args):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = zygote.launch(script, [tmp_path / name, *args])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def test_saved_activations_count_in_the_budget(tmp_path, zygote):
    """Batch 16: the blocks' saved activations together are more than twice the host budget. Kept
    or offloaded through the store, they cost the process, outside the host tier's arena, no more
    than recomputing does (which stores only each block's input), up to one block's activations
    while its forward runs.

    Peak RSS is noisy, mostly upward: measured 2026-12-07, the recompute run's peak outside the
    arena spans 123-169 MiB over 8 runs (4 beside two busy processes), and a CI run put an offload
    run 78 MiB above its recompute run (209.7 against 131.5 MiB). A comparison over the limit is
    measured once more (the mode and recompute) and the lesser peaks compared: activations escaping
    the budget (the saved tensors held until the backward, checked by hand) put both keep runs
    122-141 MiB above both recompute runs, so they still fail it."""
    runs = {"recompute": [_run(tmp_path, zygote, "r0", 16, "64MiB", "recompute", 4)]}

    def outside(r):  # what the process holds outside the host tier's arena (whose pages count once touched)
        return r["peak"] - r["base"] - r["arena_peak"]

    recompute = runs["recompute"][0]
    # nothing a forward saved outlives its backward: an autograd graph holding a hook that holds the
    # graph's tensors would leak a batch's activations (140 MiB here) every step, 280 MiB from the
    # second step to the fourth; the heap itself swings from step to step (measured 2026-12-02: -71
    # to +22 MiB against the second step, and +74 once, which failed the 64 MiB this allowed before)
    assert recompute["rss"][-1] - recompute["rss"][1] < 128 * MiB, recompute
    for mode in ("keep", "offload"):
        r = _run(tmp_path, zygote, f"{mode}0", 16, "64MiB", mode, 4)
        runs[mode] = [r]
        assert r["rss"][-1] - r["rss"][1] < 128 * MiB, r
        assert r["modes"] == [mode] * 10, r  # no block fell back to recomputation
        total = sum(r["activations"].values())
        one_block = max(r["activations"].values())
        assert total > 2 * r["host"], r
        assert r["arena_peak"] <= r["host"]
        # peak RSS of two processes differs by a few tens of MiB from run to run (heap layout,
        # threads): allow 32 MiB of that; activations escaping the budget would add 122-141 MiB
        slack = 2 * one_block + 32 * MiB
        assert total > 2 * slack, r
        if outside(r) > min(map(outside, runs["recompute"])) + slack:  # (measured once more: see above)
            for m in {mode, "recompute"}:
                runs[m].append(_run(tmp_path, zygote, f"{m}{len(runs[m])}", 16, "64MiB", m, 4))
        peak, baseline = min(map(outside, runs[mode])), min(map(outside, runs["recompute"]))
        each = {m: [round(outside(x) / MiB, 1) for x in runs[m]] for m in (mode, "recompute")}
        assert peak <= baseline + slack, (
            f"{mode}: {peak / MiB:.1f} MiB of peak RSS growth outside the arena, recompute {baseline / MiB:.1f} "
            f"MiB; the activations ({total / MiB:.1f} MiB, {one_block / MiB:.1f} MiB per block) escaped the budget: "
            f"{each}")


BIN_SCRIPT = textwrap.dedent("""
    import sys, torch
    from tiered_offload.checkpoint import torch_bin
    from tiered_offload.checkpoint.safetensors_io import PretrainedReader
    if sys.argv[2] == "kept":
        torch_bin._libc = None  # (the pages not let go of: the test's control)
    torch.save({f"w{i}": torch.full((1 << 20,), float(i)) for i in range(12)}, sys.argv[1])

    def file_pages():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile"))

    reader = PretrainedReader(sys.argv[1])
    out, base, grown = torch.empty(1 << 20), file_pages(), 0
    for i in range(12):
        reader.read_into(f"w{i}", out)
        assert torch.equal(out, torch.full((1 << 20,), float(i)))
        grown = max(grown, file_pages() - base)
    print(grown)
""")


def test_a_pytorch_file_is_read_without_holding_it_in_memory(tmp_path):
    """``init_from`` of PyTorch's ``pytorch_model.bin`` maps the file; each tensor's pages are let
    go of once it is copied into the engine's buffer, so the process holds about one tensor of a
    file of any size (48 MiB here), not the file: its mapped pages grow by at most 8 MiB. Kept
    (the control), they grow by the file."""
    grown = {}
    for how in ("released", "kept"):
        run = subprocess.run([sys.executable, "-c", BIN_SCRIPT, str(tmp_path / f"{how}.bin"), how],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        grown[how] = int(run.stdout.split()[-1])
    assert grown["released"] <= 8 * MiB and grown["kept"] >= 40 * MiB, grown


def test_a_host_budget_beyond_the_machines_memory_is_refused_up_front(tmp_path, caplog):
    """``host_memory`` larger than this machine's memory (a typo, ``64GiB`` on a 24 GiB machine, or
    a budget written for another machine): the host tier's mapping failed with the untyped
    ``OSError: [Errno 12] Cannot allocate memory`` (``OverflowError`` past 8 EiB), or, where the
    kernel overcommits, was granted and the process killed when the tier filled. It is refused when
    the engine is built, naming the budget, the memory there is, and what ``auto`` would give; a
    budget above the memory available now (but within the machine's) is a warning."""
    import pytest
    import torch
    from offload_core.errors import ConfigError
    from tiered_offload import Engine
    from tiered_offload.memstat import available_memory_bytes, memory_limit_bytes
    from tiered_offload_examples.models import GPT, GPTConfig

    def build(host):
        model = GPT(GPTConfig(vocab_size=64, context=16, d_model=32, n_layers=2, n_heads=4))
        return Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=str(tmp_path / "s"), host_memory=host)
    limit, _ = memory_limit_bytes()
    for host in (limit + (1 << 30), 10 ** 19):
        with pytest.raises(ConfigError, match=r"host_memory .* is more than this machine's memory .*lower it.*auto"):
            build(host)
    within = available_memory_bytes() + (limit - available_memory_bytes()) // 2
    if within > available_memory_bytes() + (64 << 20):  # (a machine with memory in use to stand between them)
        with caplog.at_level("WARNING", logger="tiered_offload"):
            build(within).close()
        assert "more than the memory available now" in caplog.text, caplog.text
