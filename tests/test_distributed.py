"""Sharded training over torch.distributed (gloo on localhost), 2 and 3 ranks, each a process with
the environment torchrun gives it, against one process training plain PyTorch on all the ranks'
batches. The ranks fork from a zygote that imported torch once (tools/zygote.py: a rank starts in
0.1 s, not 6); one test launches with torchrun itself."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, build, freeze, loss_of, optimizer, schedule  # noqa: E402

WORKER = Path(__file__).parent / "dist_worker.py"
ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from zygote import Zygote  # noqa: E402


@pytest.fixture(autouse=True)
def _ranks_from(zygote, monkeypatch):
    """The ranks fork from the suite's zygote (conftest.py; OMP_NUM_THREADS=1 there, as a rank's)."""
    monkeypatch.setattr(sys.modules[__name__], "_ZYGOTE", zygote)


_ZYGOTE: Zygote | None = None
"""Where :func:`launch` forks its ranks (set for each test by the fixture above)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, out: Path, cfg: dict, timeout: float = 240, check: bool = True):
    """Run ``world`` ranks of tests/dist_worker.py; return each rank's results (``check=False``:
    each rank's exit code and output). A port another process took between the probe and the
    rendezvous is retried with another (nothing else is)."""
    for attempt in range(3):
        got = _launch(world, out, cfg, timeout)
        if attempt == 2 or not any(code and "address already in use" in log.lower() for code, log in got):
            break
    if not check:
        return got
    failed = [(rank, log) for rank, (code, log) in enumerate(got) if code != 0]
    assert not failed, "\n".join(f"rank {rank} failed:\n{log[-3000:]}" for rank, log in failed)
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(world)]


def _launch(world: int, out: Path, cfg: dict, timeout: float) -> list[tuple[int | None, str]]:
    """Each rank's exit code and output; a rank still running after ``timeout`` seconds is asked for
    every thread's stack (SIGUSR1: its log ends with them), then killed, and its code is None."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(_ZYGOTE.launch(WORKER, [str(out), json.dumps(cfg)], env, stderr_to_stdout=True))
    deadline, hung = time.monotonic() + timeout, False
    try:
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
        if hung:
            for p in procs:
                p.send_signal(signal.SIGUSR1)
            time.sleep(3)
    finally:
        for p in procs:
            p.kill()
    logs = [p.communicate()[0] for p in procs]
    for rank, log in enumerate(logs):  # whole logs beside the results, for a failure's post-mortem
        (out / f"rank-{rank}.log").write_text(log)
    return [(None if hung else p.returncode, log) for p, log in zip(procs, logs)]


def reference(world: int, cfg: dict):
    """Plain PyTorch on one process: each step's loss is the mean of the ranks' micro-batch losses."""
    model = build(cfg)
    opt = optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if cfg.get("scheduler") else None
    for step in range(cfg["steps"]):
        freeze(model, cfg, step)
        for micro in range(cfg["accumulate"]):
            moe = cfg.get("model") == "moe"
            loss = sum(loss_of(model, batch(step, micro, r), moe) for r in range(world)) / world / cfg["accumulate"]
            loss.backward()
        if cfg.get("clip_value"):
            torch.nn.utils.clip_grad_value_(model.parameters(), cfg["clip_value"])
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        if (step + 1) % cfg.get("zero_every", 1) == 0:
            opt.zero_grad()
        if sched is not None:
            sched.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("world, optimizer_name", [(2, "adamw"), (3, "sgd")], ids=["2-adamw", "3-sgd"])
def test_sharded_training_matches_one_process(world, optimizer_name, tmp_path):
    """Two parameter groups, a frozen block, clipping, accumulation over two micro-batches, an LR
    scheduler; the host budget of each rank below its share of the state (its slice streams
    through its disk)."""
    cfg = {"layers": 8, "optimizer": optimizer_name, "steps": 3, "accumulate": 2, "clip": 0.5, "frozen": True,
           "scheduler": True,
           # saved activations through the store (and recompute) as well as the planner's choice
           "activations": {2: "auto", 3: ["offload", "keep", "recompute"] * 2 + ["keep", "offload"]}[world]}
    model = build(cfg)
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kinds = 2 if optimizer_name == "adamw" else 1
    state = 4 * (n + trainable * (1 + kinds))
    cfg["host_memory"] = int(0.9 * state / world)
    results = launch(world, tmp_path, cfg)
    expected = reference(world, cfg)
    got = results[0]["weights"]
    assert list(got) == list(expected)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).norm() / want.norm()).item() <= 1e-6  # the model's weights, relative
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6  # and every single one
    frozen = [k for k in expected if k.startswith("blocks.1.")]
    assert frozen and all(torch.equal(got[k], build(cfg).state_dict()[k]) for k in frozen)  # never touched
    for r in results:
        assert r["state_bytes"] == state
        # each rank stores its slice: the state / world, give or take the padding of each unit's last slice
        assert r["local_state_bytes"] <= state / world + 4 * 4 * world * 20
        assert r["host_budget"] < state / world
        assert 0 < r["files_bytes"] <= r["local_state_bytes"] + 4096 * 64
    assert sum(r["local_state_bytes"] for r in results) >= state
    # the ranks' losses are their own batches' (they differ), all finite
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "forward_backward"])
def test_a_blocks_gradient_reduce_finds_its_slice_held_whatever_the_backward_pinned_since(fused, tmp_path):
    """Each block's backward gathers the block below ahead; then its gradients are reduced into
    its stored slice. That slice used to be placed only then: where the lookahead had not brought
    it in and the gather ahead had taken (or split) the room, the reduce died mid-step with a
    TierCapacityError (a CI run, 3 ranks, 1 in several hundred). Now it is pinned with the block's
    full buffers. Here the host tier is left with no room at all between the gather ahead and the
    reduce: training goes on, bitwise the run without that squeeze."""
    cfg = {"layers": 6, "optimizer": "sgd", "steps": 2, "accumulate": 2, "clip": 0.5, "fused": fused,
           "activations": ["offload", "keep", "recompute"] * 2}
    model = build(cfg)
    cfg["host_memory"] = int(0.9 * 4 * 3 * sum(p.numel() for p in model.parameters()) / 2)
    squeezed = launch(2, tmp_path / "squeezed", dict(cfg, no_room_after_ahead=True))
    plain = launch(2, tmp_path / "plain", cfg)
    assert squeezed[0]["gathered_ahead"] > 0
    assert squeezed[0]["losses"] == plain[0]["losses"] and squeezed[1]["losses"] == plain[1]["losses"]
    assert all(torch.equal(w, plain[0]["weights"][k]) for k, w in squeezed[0]["weights"].items())


@pytest.mark.parametrize("fused,input_grad", [(False, False), (True, False), (False, True), (False, "dropped"),
                                              (False, "zero_grad")],
                         ids=["loop", "forward_backward", "loop-after-an-input-gradient", "loop-after-a-dropped-forward",
                              "loop-zero-grad-between-forward-and-backward"])
def test_sharded_gradient_hooks_and_clipping_by_value_match_one_process(fused, input_grad, tmp_path):
    """Gradient hooks on parameters (a block's weight scaled, the embedding's upper rows masked: each
    rank's hooks run on its own gradients before they are reduced, as under DistributedDataParallel)
    and ``clip_grad_value_`` before ``clip_grad_norm_`` (each rank clamps its slice of the reduced
    gradients): the weights are one process's, up to the order of the ranks' sums (the test above).
    Also with ``torch.autograd.grad`` of an input before each micro-batch's backward: its block
    backwards gather the weights on every rank and reduce nothing, and it adds into no gradient.
    And after a forward whose graph is dropped without a backward (a loss logged without
    ``no_grad``): its block calls do not count as calls of the next backward. And with
    ``zero_grad()`` between a step's first forward and its backward."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 3, "accumulate": 2, "clip": 0.5, "clip_value": 2e-3,
           "hooks": True, "fused": fused, "input_grad": input_grad is True, "dropped_forward": input_grad == "dropped",
           "zero_grad_late": input_grad == "zero_grad"}
    model = build(cfg)
    cfg["host_memory"] = int(0.9 * 16 * sum(p.numel() for p in model.parameters()) / 2)
    got = launch(2, tmp_path, cfg)[0]["weights"]
    expected = reference(2, cfg)
    without = reference(2, dict(cfg, hooks=False, clip_value=None))
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6
    # the hooks and the clamp changed what trained, far beyond that tolerance
    for name in ("tok.weight", "blocks.2.qkv.weight", "blocks.4.fc.weight"):
        assert (expected[name] - without[name]).abs().max() > 1e-3 * expected[name].abs().max(), name


def _trains_as_one_process(tmp_path, cfg: dict, share: float = 0.9) -> dict:
    """``cfg`` on 2 ranks, each at ``share`` of its share of the state: within 1e-6 of one process.
    Returns rank 0's results."""
    cfg = dict(cfg, host_memory=int(share * 16 * sum(p.numel() for p in build(cfg).parameters()) / 2))
    results = launch(2, tmp_path, cfg)[0]
    got = results["weights"]
    expected = reference(2, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6
    return results


def test_sharded_gradients_kept_past_a_clipped_step_are_the_clipped_ones(tmp_path):
    """``zero_grad()`` every second step, clipping by norm: each rank's kept slice owes the step's
    scale, applied before the next backward adds to it (test_engine.py's case, sharded)."""
    _trains_as_one_process(tmp_path, {"layers": 4, "optimizer": "adamw", "steps": 4, "accumulate": 1, "clip": 0.3,
                                      "zero_every": 2})


def test_sharded_parameters_frozen_and_unfrozen_mid_run_train_as_one_process(tmp_path):
    """Freezing mid-run on 2 ranks (a block's weight and the embedding, gradients kept past the
    step that froze them), one unfrozen again: as one process trains (test_finetune.py's case)."""
    _trains_as_one_process(tmp_path, {"layers": 4, "optimizer": "adamw", "steps": 4, "accumulate": 1, "clip": 0.3,
                                      "zero_every": 2, "freezes": {"1": {"blocks.2.qkv.weight": False,
                                                                         "tok.weight": False},
                                                                   "3": {"blocks.2.qkv.weight": True}}})


def test_sharded_blocks_frozen_whole_mid_run_read_no_optimizer_state(tmp_path):
    """Blocks frozen whole mid-run on 2 ranks, their gradients zeroed: the step updates nothing of
    them, so no rank's lookahead reads their optimizer states any more (it read them every step
    before, for nothing: test_finetune.py's case on one process). Their gradients are still reduced
    with the ranks' (that needs every rank to skip it alike). As one process trains."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 5, "accumulate": 1, "activations": "recompute",
           "freezes": {"1": {"blocks.1": False, "blocks.2": False}}}
    state = 16 * sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.9 * state / 2)  # the states cannot all stay in memory
    results = launch(2, tmp_path, cfg)
    for r in results:
        reads = r["state_reads"]  # after each step, per block: its states' reads from the disk so far
        assert all(reads[-1][b] == reads[1][b] for b in ("block.1", "block.2")), reads
        assert all(reads[-1][b] > reads[1][b] for b in ("block.0", "block.3")), reads  # the trained ones: read
    expected = reference(2, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([results[0]["weights"][k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_sharded_blocks_frozen_at_build_below_the_trained_ones_keep_no_inputs(fused, tmp_path):
    """The embeddings and the lower blocks frozen when the engine was built: those blocks hold no
    gradient on any rank, so their recomputed calls, whose inputs need no gradient either, have no
    backward to run and no reduce to join. They keep no inputs (they kept them every forward
    before, for a backward that did nothing), as on one process; the blocks above do. As one
    process trains, within tolerance."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 2, "accumulate": 2, "clip": 0.5, "frozen_below": 2,
           "activations": "recompute", "fused": fused}
    state = sum((16 if p.requires_grad else 4) * p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.9 * state / 2)  # each rank: less than its share of the state
    results = launch(2, tmp_path, cfg)
    for r in results:
        kept = r["activation_bytes"]
        assert kept[0] == kept[1] == 0 and all(kept[i] > 0 for i in range(2, 6)), kept
    expected = reference(2, cfg)
    for k, v in results[0]["weights"].items():
        assert torch.allclose(v, expected[k], rtol=1e-5, atol=1e-6), k


def test_sharded_forward_backward_gathers_each_block_once_per_pass_bitwise_as_the_loop(tmp_path):
    """forward_backward on 2 ranks: each block's weights gathered once per pass for all the
    micro-batches (the loop gathers them once per micro-batch), every gradient reduced per
    micro-batch as the loop reduces it (the rest's, embeddings to head, in a buffer of each
    micro-batch's own: in one buffer they met before each one's reduction, and the final norm's
    bias came out 9e-11 off), so the weights and losses are the loop's, bitwise, with
    activations kept, offloaded and recomputed (on one rank; the other recomputes every block), and
    with that rank's tier too fragmented for three blocks' saved activations beside their buffers."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 3, "accumulate": 3, "clip": 0.5, "frozen": True,
           "activations": ["offload", "keep", "recompute"] * 2}
    model = build(cfg)
    n = sum(p.numel() for p in model.parameters())
    cfg["host_memory"] = int(0.9 * 16 * n / 2)
    loop = launch(2, tmp_path / "loop", cfg)
    # each rank plans (and revises) its activations from its own timing: ranks whose modes differ
    # issue the same collectives and compute the same arithmetic (rank 1 recomputes every block)
    # and rank 0's tier, fragmented, cannot place 3 blocks' saved activations beside their buffers:
    # it reads them into a buffer of their own (its collectives are the other rank's)
    fused = launch(2, tmp_path / "fused", dict(cfg, fused=True, activations_by_rank={"1": "recompute"},
                                               fragmented_on_rank=0, timeout_s=60))
    assert len(fused[0]["refused_groups"]) == 3 and not fused[1]["refused_groups"], fused[0]["refused_groups"]
    assert [r["losses"] for r in fused] == [r["losses"] for r in loop]
    assert all(torch.equal(fused[0]["weights"][k], w) for k, w in loop[0]["weights"].items())
    gathered = [r["collective_bytes"]["all_gather"] for r in (loop[0], fused[0])]
    assert gathered[1] < 0.6 * gathered[0], gathered  # 3 micro-batches: a third of the blocks' gathers, and the rest's
    # one rank without room for the rest's buffers: every rank runs the loop (else the collectives mismatch)
    short = launch(2, tmp_path / "short", dict(cfg, fused=True, no_room_on_rank=1, timeout_s=60))
    assert [r["losses"] for r in short] == [r["losses"] for r in loop]
    assert all(torch.equal(short[0]["weights"][k], w) for k, w in loop[0]["weights"].items())
    # the loop's gathers, and the rest's once more (bound before the pass was given up)
    assert gathered[0] < short[0]["collective_bytes"]["all_gather"] <= 1.01 * gathered[0]



@pytest.mark.parametrize("slow", ["overlapped", "deferred-on-rank-1"])
def test_sharded_ranks_try_the_step_deferred_together_and_keep_one_mode(slow, tmp_path):
    """Where the disk bounds an overlapped step (here every rank is told to try, as
    ``TIERED_OFFLOAD_DEFER_STEP=try`` does), the ranks run the same steps deferred, agree on the mode
    to keep (deferred only if every rank measured it better) and keep training in step, bitwise
    one process's. ``overlapped``: every rank's overlapped steps are slower, so all defer;
    ``deferred-on-rank-1``: rank 1's deferred steps are slower, so all go back to overlapping (the
    collectives make rank 0 wait for it: both measure it; one rank outvoted is
    ``test_planner.py::test_sharded_ranks_keep_deferring_only_if_every_rank_measured_it_better``)."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 14, "accumulate": 1, "clip": 0.5, "activations": "recompute",
           "try_step_modes": True, "slow_step_mode": {"overlapped": {"0": "overlapped", "1": "overlapped"},
                                                      "deferred-on-rank-1": {"1": "deferred"}}[slow]}
    model = build(cfg)
    n = sum(p.numel() for p in model.parameters())
    cfg["host_memory"] = int(0.95 * 16 * n / 2)
    results = launch(2, tmp_path, cfg)
    kept = "deferred" if slow == "overlapped" else "overlapped"
    assert [r["step_modes"][0] for r in results] == ["overlapped"] * 2  # (the budget overlaps the step)
    for r in results:
        assert r["step_modes"][-1] == kept, r["step_modes"]
        assert r["step_modes"] == results[0]["step_modes"]  # tried and kept together
        assert sum(x.startswith(f"step {kept}") for x in r["plan_reasons"]) == 1, r["plan_reasons"]
    expected = reference(2, cfg)
    got = results[0]["weights"]
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6

def test_a_rank_whose_plan_is_measured_again_keeps_the_ranks_in_step(tmp_path):
    """Each rank plans its activations; where a plan moved more disk bytes and beat the one step it
    replaced, that rank runs the replaced modes again for 3 steps (``Plan.measure_again``). Those
    end at the step where the ranks decide together whether to try the step deferred
    (``SHARDED_TRIAL_AT``): the rank first settles its modes, then votes with their steps. Rank 0's
    plan here offloads and is slowed, so it goes back; rank 1 recomputes throughout; both try the
    step deferred and keep one mode, and train as one process does."""
    from tiered_offload.engine.plan_monitor import PlanMonitor
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 12, "accumulate": 1, "clip": 0.5, "activations": "auto",
           "activations_by_rank": {"1": "recompute"}, "planned_again_on_rank": 0, "try_step_modes": True}
    model = build(cfg)
    n = sum(p.numel() for p in model.parameters())
    cfg["host_memory"] = int(0.95 * 16 * n / 2)
    results = launch(2, tmp_path, cfg)
    modes = [("offload" in m) for m in results[0]["activation_modes"]]
    plan_at, check_at = PlanMonitor.PLAN_FROM + 2, PlanMonitor.PLAN_FROM + 2 + PlanMonitor.CHECK_AFTER
    # planned after step 3, measured again after step 6, back for good after step 9
    assert modes == [False] * (plan_at - 1) + [True] * 3 + [False] * (12 - check_at + 1), modes
    reasons = results[0]["plan_reasons"]
    assert any(r.startswith("back to recomputing every block") and "3 of them measured again" in r for r in reasons), \
        reasons
    assert all(m == ["recompute"] * 6 for m in results[1]["activation_modes"])
    assert results[0]["step_modes"] == results[1]["step_modes"]  # tried and kept together
    assert len(set(results[0]["step_modes"])) == 2, results[0]["step_modes"]  # (the trial ran)
    expected = reference(2, cfg)
    got = results[0]["weights"]
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6


def test_sharded_forward_backward_with_dropout_draws_the_loops_numbers(tmp_path):
    """Dropout on 2 ranks: the first step runs the loop (every rank: they agree) and learns each
    block's draws, the next steps run the pass with the loop's numbers: the losses and weights
    are the loop's, bitwise, with a third of its gathers in those steps. A rank whose draws change
    (here: one without a script for its micro-batches' shape) takes every rank back to the loop."""
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 4, "accumulate": 3, "clip": 0.5, "dropout": 0.1,
           "activations": "recompute", "timeout_s": 60}
    n = sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.9 * 16 * n / 2)
    loop, fused = launch(2, tmp_path / "loop", cfg), launch(2, tmp_path / "fused", dict(cfg, fused=True))
    assert [r["losses"] for r in fused] == [r["losses"] for r in loop]
    assert all(torch.equal(fused[0]["weights"][k], w) for k, w in loop[0]["weights"].items())
    gathered = [r["collective_bytes"]["all_gather"] for r in (loop[0], fused[0])]
    assert gathered[1] < 0.6 * gathered[0], gathered  # steps 2-4 gathered each block once for 3 micro-batches
    # rank 1's third step has shorter micro-batches, a shape it has no script for: its pass draws
    # unscripted numbers while rank 0's follows its script; the ranks agree before any backward and
    # every rank runs the loop there (the fourth step passes again: rank 1 kept its script for the
    # full length): no hang
    cfg["short"] = [1, 2]
    loop, fused = launch(2, tmp_path / "loop-short", cfg), launch(2, tmp_path / "fused-short", dict(cfg, fused=True))
    assert [r["losses"] for r in fused] == [r["losses"] for r in loop]
    assert all(torch.equal(fused[0]["weights"][k], w) for k, w in loop[0]["weights"].items())


def test_a_nan_loss_on_one_rank_in_forward_backward_stops_every_rank_typed(tmp_path):
    """One rank's micro-batch gives a NaN loss in a vertical pass: the ranks agree before any
    backward, every one runs the loop instead (so their collectives stay matched), and the loop
    raises NonFiniteError on every rank, as it does without forward_backward: no hang, no
    DistributedError."""
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 3, "accumulate": 3, "clip": 1.0, "fused": True,
           "activations": "offload", "nan": [1, 1], "timeout_s": 30}
    n = sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.9 * 16 * n / 2)
    for code, log in launch(2, tmp_path, cfg, timeout=120, check=False):
        assert code != 0 and "NonFiniteError" in log and "DistributedError" not in log, log[-2000:]


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "forward_backward"])
def test_sharded_ranks_step_in_the_backward_as_they_step_after_it(fused, tmp_path):
    """``backward(loss, step=True)`` (the loop's last micro-batch) and ``forward_backward(...,
    step=True)`` on 2 ranks, each rank's budget below its share of the state: each block's slice is
    updated inside the backward, right after the ranks reduced its gradient; through the pass no
    gradient byte reaches a rank's disk (stepping after the backward, some do); the losses and weights are those
    of the same ranks stepping after the backward, bitwise (one process's within 1e-6: the test above)."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 3, "accumulate": 2, "scheduler": True, "fused": fused,
           "activations": "recompute"}
    n = sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.6 * 16 * n / 2)
    after = launch(2, tmp_path / "after", cfg)
    inside = launch(2, tmp_path / "in", dict(cfg, in_backward=True))
    assert list(inside[0]["weights"]) == list(after[0]["weights"])
    assert all(torch.equal(inside[0]["weights"][k], w) for k, w in after[0]["weights"].items())
    for a, b in zip(after, inside):
        assert b["losses"] == a["losses"]
        assert b["updated_in_backward"].count(True) == 3 * 6  # each step: the 6 blocks in the backward,
        assert b["updated_in_backward"].count(False) == 3  # the rest after it
        # (the loop's first micro-batch's gradients wait for the second's on disk, as on one process)
        written = (a["grad_written"], b["grad_written"])
        assert (b["grad_written"] == 0 if fused else b["grad_written"] < a["grad_written"]), written
        assert a["grad_written"] > 0


@pytest.mark.parametrize("clip", [50.0, 1e-3], ids=["within", "over-at-once"])
def test_sharded_ranks_clip_in_the_backward_as_they_clip_after_it(clip, tmp_path):
    """``forward_backward(..., step=True, clip_norm=c)`` on 2 ranks against ``clip_grad_norm_(c)``
    then ``step()`` on the same ranks: the same norms (each rank's ``on_norm``, before the commit),
    losses and weights, bitwise. Within the limit each block is updated in the backward (from the
    second step: the first, after it, learns how the norm grows from its first bound); a limit the
    last block's slices already exceed (``over-at-once``: the ranks agree on the bound) updates none
    there, and the step runs after the backward, clipped."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 3, "accumulate": 2, "scheduler": True, "fused": True,
           "activations": "recompute", "clip": clip}
    n = sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.6 * 16 * n / 2)
    after = launch(2, tmp_path / "after", cfg)
    inside = launch(2, tmp_path / "in", dict(cfg, in_backward=True))
    assert all(torch.equal(inside[0]["weights"][k], w) for k, w in after[0]["weights"].items())
    for a, b in zip(after, inside):
        assert b["losses"] == a["losses"] and b["norms"] == a["norms"] == after[0]["norms"] and len(a["norms"]) == 3
        assert (max(a["norms"]) < clip) == (clip == 50.0) and min(a["norms"]) > 1e-3
        assert b["updated_in_backward"].count(True) == (2 * 6 if clip == 50.0 else 0)


def test_a_norm_over_the_limit_on_one_rank_tears_the_clipped_step_in_the_backward_on_every_rank_alike(tmp_path):
    """Rank 1's embeddings' gradient scaled 1e4 at step 1 (the blocks' norms within the limit, so
    their slices are updated in the backward): the total norm, reduced over the ranks after the
    backward, is over it on every rank, so every rank raises :class:`ClipTornError` with the same
    norm, its step count still 1 (a step-after-the-backward run clips that step instead)."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 3, "accumulate": 2, "scheduler": True, "fused": True,
           "activations": "recompute", "clip": 50.0, "big_grad": [1, 1, 1e4], "in_backward": True}
    n = sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.6 * 16 * n / 2)
    results = launch(2, tmp_path, cfg)
    assert all(r["torn"] is not None and "over clip_norm=50" in r["torn"] and "half applied" in r["torn"]
               for r in results), [r["torn"] for r in results]
    norms = [float(re.search(r"total norm is ([0-9.e+]+)", r["torn"])[1]) for r in results]
    assert norms[0] == norms[1] > 50.0 and all(r["step_count"] == 1 for r in results)
    assert all(r["updated_in_backward"].count(True) == 6 for r in results)  # (step 1's blocks; step 0 learnt)


def test_sharded_lora_steps_in_the_backward_on_ranks_whose_slice_of_a_block_holds_no_gradient(tmp_path):
    """PEFT's LoRA on a Llama over 3 ranks, the step in the backward (found by ``tools/fuzz_options.py
    --sharded --in-backward``): a block's trainable adapters are a prefix of its layout, so the
    last rank's slice of it holds no gradient (nothing registered); that rank's update of the
    block forgot a gradient it does not store ("no tensor registered as 'block.3/grad'"). Now one
    process's weights within 1e-6, each block updated in the backward on every rank."""
    cfg = {"layers": 3, "optimizer": "adamw", "steps": 3, "accumulate": 2, "scheduler": True, "model": "llama",
           "in_backward": True, "activations": "recompute"}
    cfg["host_memory"] = 160 << 10  # (the working set is 140 KiB: three blocks' gathered weights do not fit beside)
    results = launch(3, tmp_path, cfg)
    expected = reference(3, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([results[0]["weights"][k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6
    inside = [r["updated_in_backward"] for r in results]
    assert all(updates.count(True) == 3 * 3 for updates in inside), inside


@pytest.mark.parametrize("block, says", [(5, "no weight or optimizer state was updated"), (0, "half applied")],
                         ids=["top-block", "below-updated-blocks"])
def test_a_gradient_not_finite_on_one_rank_stops_the_step_in_the_backward_on_every_rank_alike(block, says, tmp_path):
    """One rank's gradient of one block turns infinite (after the reduce, one rank's slice holds
    it): the ranks agree on each block's finiteness before its update, so every rank stops alike,
    typed, no hang. In the top block (the first final one) no update has run: the step raises as
    ``step()`` does, nothing changed; below blocks already updated, the step is torn on every rank."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 3, "accumulate": 1, "activations": "recompute",
           "in_backward": True, "inf_grad": [1, 1, block], "timeout_s": 30}
    n = sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.6 * 16 * n / 2)
    for code, log in launch(2, tmp_path, cfg, timeout=120, check=False):
        assert code != 0 and "NonFiniteError" in log and says in log and "DistributedError" not in log, log[-2000:]


@pytest.mark.parametrize("fused, model", [(False, "llama"), (True, "llama"), (True, "mixtral")],
                         ids=["loop", "forward_backward", "moe-experts-forward_backward"])
def test_a_sharded_lora_run_at_a_budget_it_accepted_trains_to_the_end(fused, model, tmp_path):
    """PEFT's LoRA on a Llama, 2 ranks, each rank's host budget 2.2 times its share of the state
    (found by ``tools/fuzz_options.py --sharded``): the engine was built, then the first backward
    died with a ``TierCapacityError`` for a block's full gradient buffer, 38 KiB where the
    block's trainable part is 1 KiB, the tier's free room in holes of at most 32 KiB. Also LoRA on
    an MoE's router and experts (PEFT's ``ParamWrapper``, re-parametrizing them in every forward).
    That one died in its first forward: "cannot fit tensor 'block.3/weight.full' (138.81 KiB)". Its
    whole state fits the budget, so the blocks kept their graphs and gathered weights until the
    backward, as plain PyTorch; sharded, that is the rank's share beside every unit's gathered
    weights and gradients, which did not fit."""
    cfg = {"layers": 3, "optimizer": "adamw", "steps": 3, "accumulate": 2, "clip": 0.5, "scheduler": True,
           "model": model, "fused": fused}
    model = build(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = 4 * (sum(p.numel() for p in model.parameters()) + 3 * trainable)
    cfg["host_memory"] = int(1.1 * state)  # each rank: 2.2 times its share
    got = launch(2, tmp_path, cfg)[0]["weights"]
    expected = reference(2, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6


def test_sharded_experts_with_a_device_tier_are_refused_up_front_or_train_to_the_end(tmp_path):
    """A mixture of experts on 2 ranks, each with a device tier (CPU memory standing in for its
    GPU) of 0.8 of its host budget (found by ``tools/fuzz_options.py --sharded``): the engine was
    built, then the first backward died with a ``TierCapacityError`` in the device tier: the
    gathered buffers and the stored slices beside them, each rounded up to the tier's blocks, left
    24 KiB free in holes of 8 KiB for a 12 KiB gradient slice. The working set now counts the
    slices: that budget is refused when the engine is built, and the least budget the refusal names
    trains to the end."""
    cfg = {"model": "moe", "layers": 4, "optimizer": "adamw", "steps": 3, "accumulate": 1, "clip": None,
           "durable": True, "activations": ["keep", "keep", "recompute", "recompute"]}
    model = build(cfg)
    state = 16 * sum(p.numel() for p in model.parameters())
    cfg["host_memory"] = int(0.9 * state / 2)
    cfg["device_budget"] = int(0.8 * cfg["host_memory"])
    refused = launch(2, tmp_path / "refused", cfg, check=False)
    assert all(code != 0 and "cannot hold one step's working set" in log for code, log in refused)
    need = int(re.search(r"\((\d+) bytes\) needed", refused[0][1]).group(1))
    assert need > cfg["device_budget"]
    got = launch(2, tmp_path / "least", dict(cfg, device_budget=need))[0]["weights"]
    expected = reference(2, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6


def test_experts_without_tokens_on_some_ranks(tmp_path):
    """A mixture of experts: an expert that gets tokens on one rank only has a gradient (the
    mean over ranks of its one rank's), one that gets tokens on no rank has none and is not
    updated (no momentum, no decay), as in one process training on every rank's batch."""
    cfg = {"model": "moe", "layers": 4, "optimizer": "sgd", "steps": 3, "accumulate": 1, "clip": None,
           "host_memory": "64MiB"}
    got = launch(2, tmp_path, cfg)[0]["weights"]
    expected = reference(2, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6
    idle = [k for k in expected if ".experts.3." in k]
    start = build(cfg).state_dict()
    assert idle and all(torch.equal(got[k], start[k]) for k in idle)
    assert not torch.equal(got["blocks.0.ffn.experts.1.up.weight"], start["blocks.0.ffn.experts.1.up.weight"])


def test_a_rank_that_dies_mid_step_stops_its_peers_with_a_clear_error(tmp_path):
    cfg = {"layers": 4, "optimizer": "sgd", "steps": 3, "accumulate": 1, "clip": None, "host_memory": "64MiB",
           "die": [1, 1], "timeout_s": 30}
    (code0, log0), (code1, _) = launch(2, tmp_path, cfg, timeout=120, check=False)
    assert code1 == 17
    assert code0 != 0
    assert "DistributedError" in log0 and "rank 0 of 2" in log0 and "during step 2" in log0, log0[-2000:]


def test_the_sharded_kill_loop_resumes_bitwise():
    """``tools/crash_loop_dist.py`` at a few kills (its long runs: docs/RESULTS.md): a random rank
    SIGKILLed at random moments, the job started again until a run ends bitwise as an uninterrupted
    one; no start hangs (the tool stops a start after 180 s, asking for every thread's stack)."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "crash_loop_dist.py"), "--kills", "2", "--steps", "4",
                          "--seed", "0"], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0 and re.search(r"over (\d+) runs: \1 of \1 bitwise", out.stdout), \
        out.stdout[-3000:] + out.stderr[-3000:]


def test_a_rank_killed_in_its_backward_stops_its_peer_in_the_gradients_reduce(tmp_path):
    """Rank 1 is SIGKILLed in step 2's backward, as it would reduce a block's gradients: rank 0,
    waiting in that reduce-scatter, stops with a DistributedError (gloo reports the closed connection
    on each wait, but never marks that collective completed: it waited forever)."""
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 3, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "timeout_s": 300, "kill_in_reduce": [1, 1]}
    (code0, log0), (code1, _) = launch(2, tmp_path, cfg, timeout=60, check=False)
    assert code1 == -9 and code0 != 0, log0[-2000:]
    assert "DistributedError" in log0 and "reduce-scatter" in log0, log0[-2000:]


def test_a_rank_whose_update_failed_and_lives_on_stops_its_peers_at_once_naming_its_error(tmp_path):
    """Rank 1's update fails part-way (an error in the optimizer's code, an out-of-memory) and its
    loop catches the error and lives on (a log, a retry, a notebook). Rank 0 went on into the next
    forward's all-gather, which rank 1 never joins: it waited there until the group's timeout (or
    rank 1's exit), then blamed a closed connection. Now rank 1's error is published in the
    group's store, and rank 0's wait stops within a second with a DistributedError naming it."""
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 4, "accumulate": 1, "clip": None, "host_memory": "64MiB",
           "fail": [1, 1, 2], "linger": 30, "timeout_s": 90}
    results = launch(2, tmp_path, cfg, timeout=150, check=False)
    assert [code for code, _ in results] == [18, 18], "\n".join(log[-2000:] for _, log in results)
    got = (tmp_path / "rank-0.error").read_text()
    assert got.startswith("DistributedError: rank 0 of 2:") and "rank 1 stopped" in got, got
    assert "StepFailedError: the optimizer step failed in the update of" in got, got
    assert "an error in the optimizer's code" in got and "Restart every rank" in got, got
    assert (tmp_path / "rank-1.error").read_text().startswith("StepFailedError: the optimizer step failed")


def test_a_rank_whose_update_in_the_backward_failed_stops_its_peers_at_once_naming_its_error(tmp_path):
    """The same, with the step in the backward: rank 1's update of its third step fails inside the
    backward after 2 blocks (the step is torn there: half applied); rank 0, waiting in a collective
    of the same backward, stops within a second with a DistributedError naming rank 1's error."""
    cfg = {"layers": 6, "optimizer": "adamw", "steps": 4, "accumulate": 1, "clip": None, "activations": "recompute",
           "in_backward": True, "fail": [1, 1, 2], "linger": 30, "timeout_s": 90}
    n = sum(p.numel() for p in build(cfg).parameters())
    cfg["host_memory"] = int(0.6 * 16 * n / 2)
    results = launch(2, tmp_path, cfg, timeout=150, check=False)
    assert [code for code, _ in results] == [18, 18], "\n".join(log[-2000:] for _, log in results)
    got = (tmp_path / "rank-0.error").read_text()
    assert got.startswith("DistributedError: rank 0 of 2:") and "during step 3, backward" in got, got
    assert "rank 1 stopped with RuntimeError: an error in the optimizer's code" in got, got
    assert (tmp_path / "rank-1.error").read_text() == "RuntimeError: an error in the optimizer's code"


def test_ranks_that_build_different_models_are_refused_at_start(tmp_path):
    cfg = {"layers": 4, "optimizer": "sgd", "steps": 1, "accumulate": 1, "clip": None, "host_memory": "64MiB",
           "odd_rank": 1}
    results = launch(2, tmp_path, cfg, timeout=120, check=False)
    for code, log in results:
        assert code != 0
        assert "DistributedError" in log and "rank(s) [1] built a different units and params than rank 0" in log, log[-2000:]


def test_two_machines_with_torchrun_on_localhost(tmp_path):
    """``torchrun --nnodes 2``, one process per "machine", each machine with its own storage root:
    the launch a two-box run uses, on localhost."""
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 2, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "export": True}
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = []
    for node in range(2):
        out = tmp_path / f"machine{node}"
        out.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(WORKER), str(out), json.dumps(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    result = torch.load(tmp_path / "machine0" / "rank-0.pt", weights_only=False)
    got = result["weights"]
    # export_safetensors: rank 0 wrote the one model, gathered from both machines' slices
    from safetensors.torch import load_file
    exported = load_file(tmp_path / "machine0" / "export" / "model.safetensors")
    assert set(exported) >= set(got) and all(torch.equal(exported[k], got[k]) for k in got)
    assert torch.load(tmp_path / "machine1" / "rank-1.pt", weights_only=False)["exported"] == []
    assert result["gathered_ahead"] > 0  # the next block's weights were gathered while a block computed
    expected = reference(2, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([got[k].flatten() for k in expected])
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-6
    # each machine's root holds only its rank's directory
    assert [d.name for d in (tmp_path / "machine1" / "state").iterdir()] == ["rank-1-of-2"]


@pytest.mark.parametrize("after_units,fused,striped,model", [(2, False, False, None), (-1, False, True, None),
                                                            (2, True, False, None), (2, False, False, "bare")],
                         ids=["mid-update", "before-its-intent-striped", "mid-update-after-forward-backward",
                              "mid-update-blocks-only"])
def test_a_rank_killed_mid_step_resumes_exactly(after_units, fused, striped, model, tmp_path):
    """Durable sharded training: rank 1 is SIGKILLed in step 3, while its update is half done
    (rank 0 has committed the step: rank 1 finishes it at the restart), or just before its intent
    (rank 0 has written its own: it drops it at the restart, since no rank updated anything); rank
    0 fails on its next collective. The job is started again with the same command: the weights
    after step 5 are bitwise those of a run that was never interrupted. Also with 3 micro-batches
    a step through ``forward_backward`` (4 steps). Each rank at 0.9 of its share of the state: the
    state streams through its disk, and the steps commit through the journal. Killed before its intent,
    each rank's state is striped over two directories (each rank's in each root). A model with no parameter
    outside its blocks (the rest unit empty, which one process could not resume) resumes alike."""
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 5, "accumulate": 1, "clip": 1.0,
           "durable": True, "timeout_s": 30, "scheduler": True, "striped": striped, "model": model}
    cfg["host_memory"] = int(0.9 * 16 * sum(p.numel() for p in build(cfg).parameters()) / 2)
    if fused:
        cfg.update(accumulate=3, fused=True, activations="offload", steps=4)
    (tmp_path / "once").mkdir()
    (tmp_path / "killed").mkdir()
    once = launch(2, tmp_path / "once", cfg)
    assert once[0]["commits"] == "JournalCommits"
    whole = once[0]["weights"]
    (code0, log0), (code1, _) = launch(2, tmp_path / "killed", dict(cfg, kill=[1, 2, after_units]), check=False)
    assert code1 == -9 and code0 != 0, log0[-2000:]
    assert "DistributedError" in log0
    resumed = launch(2, tmp_path / "killed", cfg)[0]["weights"]
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    if striped:  # the bytes really are striped, each rank's in its own directory of each root
        stripes = [tmp_path / "killed" / "stripe" / f"rank-{r}-of-2" for r in range(2)]
        assert all(any(p.name.startswith("block") for p in d.iterdir()) for d in stripes)


@pytest.mark.parametrize("when", ["before", "after"])
def test_ranks_a_crash_left_one_snapshot_commit_apart_resume_from_the_one_every_rank_made(when, tmp_path, capsys):
    """Sharded snapshot commits (``commit_every=2``; the state fits each rank's memory): rank 1 is
    SIGKILLed as it commits step 4, ``before`` its new manifest is written (rank 0 has committed step
    4 and kept step 2's commit: it goes back to it at the restart) or ``after`` (both at step 4). The
    job started again ends bitwise where an uninterrupted run does, and every rank keeps at most the
    commit before its last, and none at rest once every rank has the last."""
    from tiered_offload.checkpoint.durable import STATE_DIR, StateFiles
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 6, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "durable": True, "timeout_s": 30, "scheduler": True, "commit_every": 2}
    (tmp_path / "once").mkdir()
    (tmp_path / "killed").mkdir()
    once = launch(2, tmp_path / "once", cfg)
    assert once[0]["commits"] == "SnapshotCommits"
    (code0, log0), (code1, _) = launch(2, tmp_path / "killed", dict(cfg, kill_in_commit=[1, 4, when]), check=False)
    assert code1 == -9 and code0 != 0, log0[-2000:]
    files = [StateFiles(tmp_path / "killed" / "state" / f"rank-{r}-of-2" / STATE_DIR) for r in range(2)]
    assert files[0].read_manifest()["step"] == 4 and files[1].read_manifest()["step"] == (2 if when == "before" else 4)
    # rank 0 saw its peer die (out of step): its close leaves step 2's commit kept, which inspect tells
    # apart from rank 1's leftovers (the step it was writing)
    assert files[0].read_previous()["step"] == 2
    from tiered_offload.cli import main as cli_main
    assert cli_main(["inspect", str(tmp_path / "killed" / "state")]) == 0
    text = capsys.readouterr().out
    assert "(step 2's commit kept)" in text and "only the commit before the last (step 2) names" in text
    resumed = launch(2, tmp_path / "killed", cfg)
    assert all(torch.equal(resumed[0]["weights"][k], once[0]["weights"][k]) for k in once[0]["weights"])
    log0 = (tmp_path / "killed" / "rank-0.log").read_text()
    assert ("going back from step 4 to step 2" in log0) == (when == "before"), log0[-2000:]
    for f in files:  # (each close let go of the commit before the last: every rank had the last)
        assert f.read_manifest()["step"] == 6 and f.read_previous() is None


def test_the_step_ranks_resume_at_is_one_every_rank_holds_or_refused():
    """:func:`reconcile_resume` on each rank's ``[manifest step, step in flight, commit before kept]``:
    a journal's step in flight dropped where a rank lacks it; snapshots: back to the oldest manifest,
    where every rank holds it; anything else refused, naming the steps."""
    from offload_core.errors import DistributedError
    from tiered_offload.engine.sharding import reconcile_resume

    def each(positions):
        return [reconcile_resume(positions, r) for r in range(len(positions))]
    assert each([None, None]) == [(None, False, False)] * 2
    assert each([[3, 4], [3, None]]) == [(3, True, False), (3, False, False)]  # (rank 1 never wrote its intent)
    assert each([[3, 4], [4, None]]) == [(4, False, False), (4, False, False)]  # (rank 0 finishes it)
    assert each([[4, None, 2], [2, None, 2]]) == [(2, False, True), (2, False, False)]
    assert each([[4, None, 2], [2, None, None]]) == [(2, False, True), (2, False, False)]
    assert each([[4, None, 2], [4, None, 2], [4, None, None]]) == [(4, False, False)] * 3
    for apart in ([[6, None, 4], [2, None, None]], [[4, None, 2], [3, 4, None]], [[4, None, None], [2, None, 2]]):
        with pytest.raises(DistributedError, match="cannot be reconciled"):
            reconcile_resume(apart, 0)
    with pytest.raises(DistributedError, match=r"rank\(s\) \[1\] of 2 hold a training state"):
        reconcile_resume([None, [2, None, None]], 0)
    # (a first start killed between one rank's first manifest and another's: that first commit, the
    # starting weights, is made again by every rank, as a fresh start makes it)
    assert each([None, [0, None, None]]) == [(None, False, False)] * 2
    assert each([[0, None, None], None, [0, None, None]]) == [(None, False, False)] * 3
    with pytest.raises(DistributedError, match=r"rank\(s\) \[1, 2\] of 3 hold a training state"):
        reconcile_resume([None, [0, None, None], [1, None, None]], 0)


def test_a_first_start_killed_between_the_ranks_first_commits_starts_again(tmp_path):
    """A job killed in its first start after one rank wrote its first manifest (step 0: the starting
    weights) and before another did (a kill or Ctrl-C while a large model is initialised): its next
    start refused, "rank(s) [1] of 2 hold a training state and the others none", and the directory
    had to be deleted by hand (found by ``tools/crash_loop_dist.py --seed 38``). Every rank now
    starts fresh, rank 1 saying it forgets its first commit, and the run ends bitwise where an
    uninterrupted one does."""
    from tiered_offload.checkpoint.durable import StateFiles
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 3, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "durable": True, "timeout_s": 30, "commit_every": 1}
    (tmp_path / "once").mkdir()
    (tmp_path / "killed").mkdir()
    whole = launch(2, tmp_path / "once", cfg)[0]["weights"]
    launch(2, tmp_path / "killed", dict(cfg, steps=0))  # (both ranks' first commits) ...
    first = StateFiles(tmp_path / "killed" / "state" / "rank-0-of-2" / ".tiered-offload")
    first.manifest_path.unlink()  # ... then rank 0's as if it was killed before it wrote it
    resumed = launch(2, tmp_path / "killed", cfg)[0]["weights"]
    assert "forgets its first commit" in (tmp_path / "killed" / "rank-1.log").read_text()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_commit_that_failed_on_one_rank_stops_every_rank_typed_and_the_job_resumes_before_it(tmp_path):
    """Rank 1's snapshot commit of step 2 fails (a full disk) and rank 1 lives on: at the next step
    the ranks' agreement stops both, rank 1 with its own error and rank 0 with a DistributedError
    naming the step; rank 0 kept step 0's commit, so the job started again goes back to it there and
    ends bitwise as an uninterrupted run."""
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 4, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "durable": True, "timeout_s": 30, "commit_every": 2}
    (tmp_path / "once").mkdir()
    (tmp_path / "failed").mkdir()
    whole = launch(2, tmp_path / "once", cfg)[0]["weights"]
    (code0, log0), (code1, log1) = launch(2, tmp_path / "failed", dict(cfg, fail_commit=[1, 2]), check=False)
    assert code0 != 0 and code1 != 0
    assert "DiskFullError" in log1, log1[-2000:]
    assert "DistributedError" in log0 and "another rank could not commit step 2" in log0, log0[-2000:]
    resumed = launch(2, tmp_path / "failed", cfg)[0]["weights"]
    assert "going back from step 2 to step 0" in (tmp_path / "failed" / "rank-0.log").read_text()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


@pytest.mark.parametrize("share,every", [(0.9, 3), (2.0, 1), (2.0, 2)])
def test_sharded_snapshot_commits_train_as_one_process(share, every, tmp_path):
    """Snapshot commits over 2 ranks leave the numbers as one process's: ``commit_every=3`` where the
    state streams through each rank's disk (0.9 of a share), and every step or every second where
    each rank's share fits its memory (2.0 of a share: the whole state, not aligned; every block recomputed,
    beside the gathered buffers) as on one process whose state fits: no state is read back, and
    none is written but by the commits. At rest, no rank keeps the commit before its last: each
    let go of it at close once every rank's manifest had the last step (it kept it, up to a whole
    state's bytes, until the next start)."""
    from tiered_offload.checkpoint.state_dir import ShardedStateDirectory
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 5, "accumulate": 1, "clip": 1.0, "durable": True,
           "commit_every": every, "activations": "recompute" if share > 1 else "auto"}
    results = _trains_as_one_process(tmp_path, cfg, share)
    assert results["commits"] == "SnapshotCommits"
    ranks = ShardedStateDirectory(tmp_path / "state").inspect()["ranks"]
    assert [(r["step"], r["previous_commit_step"]) for r in ranks] == [(5, None), (5, None)], ranks
    assert not list((tmp_path / "state").rglob("previous.json"))
    if share > 1:
        assert not any(results["state_reads"][-1].values())
        # the first weights, then weights and states at each commit (steps 2 and 4, the rest at close, or all 5)
        local = results["local_state_bytes"]  # (weights, gradients, Adam's two states: 1/4, 1/4, 1/2 of it)
        commits = 3 if every == 2 else 5
        assert results["disk_written"] <= 1.02 * (local / 4 + commits * 3 * local / 4)


def test_resuming_with_another_number_of_ranks_is_refused(tmp_path):
    cfg = {"layers": 4, "optimizer": "sgd", "steps": 1, "accumulate": 1, "clip": None, "host_memory": "64MiB",
           "durable": True}
    launch(2, tmp_path, cfg)
    for code, log in launch(3, tmp_path, dict(cfg, steps=2), check=False):
        assert code != 0 and "re-sharding is not supported" in log, log[-2000:]


def test_the_export_command_gathers_a_sharded_lora_runs_adapter(tmp_path, capsys):
    """``tiered-offload export ROOT OUT --adapter-only`` of a sharded PEFT run: the adapter the
    ranks trained, gathered from their slices, as the engine's own export wrote it (bitwise). Its
    model has no Hugging Face config, so ``--merged`` cannot rebuild it: refused, naming the
    adapter export."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from tiered_offload.cli import main as cli_main
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 2, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "durable": True, "lora": True, "export": True}
    launch(2, tmp_path, cfg)
    assert cli_main(["export", str(tmp_path / "state"), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    live, offline = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "export", tmp_path / "adapter"))
    assert list(live) == list(offline) and all(torch.equal(live[k], offline[k]) for k in live)
    assert any(torch.count_nonzero(v) for k, v in live.items() if "lora_B" in k)
    assert (tmp_path / "export" / "adapter_config.json").read_text() == (tmp_path / "adapter" / "adapter_config.json").read_text()
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "state"), str(tmp_path / "x"), "--merged"]) == 2
    assert re.search(r"does not record its base model's config.json.*--adapter-only", capsys.readouterr().err)
    assert not (tmp_path / "x").exists()


def test_the_export_command_merges_a_sharded_lora_runs_adapter_as_the_ranks_merge_it(tmp_path):
    """``tiered-offload export ROOT OUT --merged`` of a sharded PEFT run of a Hugging Face model:
    the base model with the adapter merged, gathered from the ranks' slices, bitwise the ranks'
    own merged export (``export_safetensors(merged=True)``), with its ``config.json``."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from tiered_offload.cli import main as cli_main
    cfg = {"layers": 3, "optimizer": "adamw", "steps": 2, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "durable": True, "model": "llama", "export": "merged"}
    launch(2, tmp_path, cfg)
    assert cli_main(["export", str(tmp_path / "state"), str(tmp_path / "merged"), "--merged"]) == 0
    live, offline = (load_file(d / "model.safetensors") for d in (tmp_path / "export", tmp_path / "merged"))
    assert list(live) == list(offline) and all(torch.equal(live[k], offline[k]) for k in live)
    assert "model.layers.0.self_attn.q_proj.weight" in live and not any("lora" in k for k in live)
    assert (tmp_path / "export" / "config.json").read_text() == (tmp_path / "merged" / "config.json").read_text()


def test_a_sharded_peft_model_starts_from_a_base_and_a_saved_adapter(tmp_path):
    """``init_from=[BASE, ADAPTER]`` on 2 ranks: each rank reads its slices of the base's weights
    and of the saved adapter's; the weights the ranks start from (gathered) are
    ``PeftModel.from_pretrained(base, ADAPTER)``'s, bitwise."""
    peft = pytest.importorskip("peft")
    import dist_worker
    cfg = {"layers": 3, "optimizer": "adamw", "steps": 0, "accumulate": 1, "clip": None, "host_memory": "64MiB",
           "model": "llama"}
    tuned = dist_worker.build(cfg)
    with torch.no_grad():  # a trained adapter and base, not the worker's own start
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    tuned.save_pretrained(tmp_path / "adapter")
    tuned.unload().save_pretrained(tmp_path / "base")  # (the base without PEFT's layers)
    results = launch(2, tmp_path, dict(cfg, init_from=[str(tmp_path / "base"), str(tmp_path / "adapter")]))
    import transformers
    expected = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True), tmp_path / "adapter")
    weights = results[0]["weights"]
    assert list(weights) == [n for n, _ in expected.named_parameters()]
    assert all(torch.equal(weights[n], p) for n, p in expected.named_parameters())


def test_a_sharded_peft_model_with_a_tied_heads_copy_starts_from_the_tied_tensor(tmp_path):
    """LoRA with the head in ``modules_to_save`` on a model whose head is tied to the embeddings,
    from the base's checkpoint alone on 2 ranks: the copy's slices are read from the tensor the
    file holds once (the embeddings), as one process reads it; the start is PEFT's on
    ``from_pretrained``'s model, bitwise."""
    peft = pytest.importorskip("peft")
    import transformers

    import dist_worker
    cfg = {"layers": 3, "optimizer": "adamw", "steps": 0, "accumulate": 1, "clip": None, "host_memory": "64MiB",
           "model": "llama", "tied": True, "modules_to_save": ["lm_head"]}
    torch.manual_seed(0)  # the worker's base, saved as save_pretrained saves a tied head: once, as the embeddings
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=dist_worker.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=dist_worker.CONTEXT, tie_word_embeddings=True,
        use_cache=False)).save_pretrained(tmp_path / "base")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "base" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    results = launch(2, tmp_path, dict(cfg, init_from=[str(tmp_path / "base")]))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    torch.manual_seed(1)  # (the adapter's start, as the worker draws it)
    expected = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False, modules_to_save=["lm_head"]))
    weights = results[0]["weights"]
    assert list(weights) == [n for n, _ in expected.named_parameters()]
    assert all(torch.equal(weights[n], p) for n, p in expected.named_parameters())
    copy = "base_model.model.lm_head.modules_to_save.default.weight"
    assert torch.equal(weights[copy], base.model.embed_tokens.weight)


def test_the_shared_root_of_a_sharded_run_is_a_state_directory_for_every_command(tmp_path, capsys):
    """inspect lists the ranks, verify checks every slice, export gathers the slices into the model
    the ranks trained; one rank's directory is not exported as if it were a model; one process
    restarted on the root is refused, not started fresh beside it."""
    from tiered_offload import Engine
    from tiered_offload.checkpoint.safetensors_io import PretrainedReader
    from tiered_offload.cli import main as cli_main
    from offload_core.errors import CheckpointError, ConfigError
    cfg = {"layers": 4, "optimizer": "adamw", "steps": 2, "accumulate": 1, "clip": 1.0, "host_memory": "64MiB",
           "durable": True}
    results = launch(2, tmp_path, cfg)
    root = tmp_path / "state"
    assert cli_main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert "rank 0 of 2   step 2" in text and "rank 1 of 2   step 2" in text
    # (the state fits: snapshot commits, the commit before the last let go of at close: a kept one is
    # shown apart from leftovers, test_ranks_a_crash_left_one_snapshot_commit_apart_...)
    assert "commit kept" not in text and "not part of the committed state" not in text
    assert cli_main(["verify", str(root)]) == 0
    assert cli_main(["export", str(root), str(tmp_path / "out")]) == 0
    reader = PretrainedReader(tmp_path / "out")
    for name, expected in results[0]["weights"].items():
        got = torch.empty(expected.shape)
        reader.read_into(name, got)
        assert torch.equal(got, expected), name
    assert cli_main(["export", str(root / "rank-0-of-2"), str(tmp_path / "out2")]) == 2
    assert "export the run's root" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="sharded run"):
        Engine(build(cfg), optimizer(build(cfg), cfg), storage=root, resume="auto", device="cpu")
    with pytest.raises(CheckpointError, match="export the run's root"):
        from tiered_offload.checkpoint.state_dir import StateDirectory
        StateDirectory(root / "rank-1-of-2").export(tmp_path / "out3")


def test_the_options_fuzz_tells_sharded_runs_within_tolerance_from_refused_from_failed(tmp_path, zygote):
    """``tools/fuzz_options.py --sharded``: a run whose weights are one process's to 1e-6 is ``ok``;
    ranks that all raise a typed error while their engines are built are ``refused``; a rank that
    stops in the middle of training is a failure (raised, its log the one that did not just see its
    peer stop)."""
    import fuzz_options
    cfg = {"layers": 3, "optimizer": "adamw", "steps": 2, "accumulate": 1, "clip": 0.5, "world": 2,
           "host_fraction": 1.3, "activations": "auto"}
    assert fuzz_options.run_sharded(cfg, tmp_path / "a", zygote) == "ok"
    refused = fuzz_options.run_sharded(dict(cfg, host_fraction=0.05), tmp_path / "b", zygote)
    assert refused.startswith("refused: ") and "TierCapacityError" in refused
    with pytest.raises(AssertionError, match="a rank failed") as failed:
        fuzz_options.run_sharded(dict(cfg, die=[1, 1]), tmp_path / "c", zygote)
    assert "DistributedError" not in str(failed.value)  # the rank that died, not its peer
    for seed in range(20):  # every drawn configuration is one the worker takes
        drawn = fuzz_options.draw_sharded(random.Random(seed))
        assert not (drawn["fused"] and drawn.get("model") == "moe")
        # the step in the backward: clipped by norm within the limit or not at all, and no journal (which refuses it)
        assert not drawn.get("in_backward") or (drawn["clip"] in (None, 50.0) and "clip_value" not in drawn and not (
            drawn["durable"] and drawn.get("commit_every", 1) == 1)), drawn
    inside = [fuzz_options.draw_sharded(random.Random(seed)) for seed in range(40)]
    assert {d["clip"] for d in inside if d.get("in_backward")} == {None, 50.0}
    forced = fuzz_options.draw_sharded(random.Random(0), in_backward=True)
    assert forced["in_backward"] and forced["clip"] in (None, 50.0)
