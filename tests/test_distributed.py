"""Sharded training over torch.distributed (gloo on localhost), 2 and 3 ranks, each launched as
torchrun launches it, against one process training plain PyTorch on all the ranks' batches."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, build, loss_of, optimizer  # noqa: E402

WORKER = Path(__file__).parent / "dist_worker.py"
ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, out: Path, cfg: dict, timeout: float = 240) -> list[dict]:
    """Run ``world`` ranks of tests/dist_worker.py; return each rank's results."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out), json.dumps(cfg)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(world)]


def reference(world: int, cfg: dict):
    """Plain PyTorch on one process: each step's loss is the mean of the ranks' micro-batch losses."""
    model = build(cfg)
    opt = optimizer(model, cfg)
    for step in range(cfg["steps"]):
        for micro in range(cfg["accumulate"]):
            loss = sum(loss_of(model, batch(step, micro, r)) for r in range(world)) / world / cfg["accumulate"]
            loss.backward()
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_training_matches_one_process(world, optimizer_name, tmp_path):
    """Two parameter groups, a frozen block, clipping, accumulation over two micro-batches; the
    host budget of each rank below its share of the state (its slice streams through its disk)."""
    cfg = {"layers": 8, "optimizer": optimizer_name, "steps": 3, "accumulate": 2, "clip": 0.5, "frozen": True}
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
