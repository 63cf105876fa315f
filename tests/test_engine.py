"""The engine trains exactly like in-memory PyTorch, within its budgets, and fails clearly."""

import copy
import math
import pickle
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES
from torch import nn

from offload_core.errors import (
    ConfigError,
    DiskFullError,
    ModelInputError,
    ModelStructureError,
    NonFiniteError,
    StepFailedError,
    TensorStateError,
    TierCapacityError,
    TieredOffloadError,
)
from storage_backends.memory import MemoryBackend
from storage_backends.testing import FaultInjectingBackend
from tiered_offload import Engine, EngineConfig, Tier, empty_init
from tiered_offload.engine.preflight import STAGED_AT_ONCE
from tiered_offload_examples.models import GPT, GPTConfig


def _transformers():
    """Hugging Face transformers, or a skip for the one test that needs it (not the whole module)."""
    return pytest.importorskip("transformers")


def gpt2(layers=8):
    cfg = _transformers().GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _transformers().GPT2LMHeadModel(cfg)


def llama(layers=8):
    cfg = _transformers().LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    return _transformers().LlamaForCausalLM(cfg)


def plain_gpt(layers=8):
    return GPT(GPTConfig(vocab_size=128, context=32, d_model=32, n_layers=layers, n_heads=4))


def hf_loss(model, x):
    return model(input_ids=x, labels=x).loss


def plain_loss(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def train_pair(make, loss_fn, tmp_path, *, optimizer=torch.optim.AdamW, kwargs=None, steps=3, accumulate=1,
               clip=None, scheduler=None, budget_fraction=0.25, storage=None, device="cpu", store_config=None,
               config=None, host_optimizer=None):
    """Train a model in memory and a copy through the engine, both on ``device``; return both losses
    and weights (on the CPU). On CUDA the device budget is below the state too. ``host_optimizer``:
    the reference's optimizer steps CPU copies of its parameters, fed the device's (clipped)
    gradients, and the new weights are copied back (what the engine's update on the host equals);
    None: it does where the engine placed its update in the host tier below a device tier."""
    kwargs = kwargs or dict(lr=1e-3, weight_decay=0.01)
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    ref.to(device)
    n = sum(p.numel() for p in ref.parameters())
    state = (2 + (2 if optimizer in (torch.optim.Adam, torch.optim.AdamW) else 1)) * 4 * n
    engine = Engine(model, optimizer, kwargs, storage=storage or tmp_path / "state", device=device,
                    host_memory=int(state * budget_fraction), device_memory=int(state * budget_fraction),
                    store_config=store_config, config=config)
    assert engine.store.capacity("host") <= engine.state_bytes() * budget_fraction + 4096
    if host_optimizer is None:  # optimizer_device="auto" places it by measured rates
        host_optimizer = engine._updater.in_lower_tier
    masters = [p.detach().cpu().clone().requires_grad_(p.requires_grad) for p in ref.parameters()]
    opt = optimizer(masters if host_optimizer else ref.parameters(), **kwargs)
    sched_ref = scheduler(opt) if scheduler else None
    sched_eng = scheduler(engine.optimizer) if scheduler else None
    g = torch.Generator().manual_seed(1)
    losses_ref, losses_eng = [], []
    for _ in range(steps):
        for _ in range(accumulate):
            x = torch.randint(0, 128, (2, 17), generator=g).to(device)  # (the loss's targets too)
            le = loss_fn(engine, x) / accumulate
            engine.backward(le)
            lr_ = loss_fn(ref, x) / accumulate
            lr_.backward()
            losses_eng.append(le.item())
            losses_ref.append(lr_.item())
        if clip is not None:
            ne = engine.clip_grad_norm_(clip)
            nr = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert torch.equal(ne, nr), (ne, nr)
        engine.step()
        if host_optimizer:
            for m, p in zip(masters, ref.parameters()):
                m.grad = None if p.grad is None else p.grad.detach().cpu()
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, ref.parameters()):
                    p.copy_(m)
            ref.zero_grad()
        else:
            opt.step()
        engine.zero_grad()
        opt.zero_grad()
        if scheduler:
            sched_eng.step()
            sched_ref.step()
    weights_eng = {k: w.detach().cpu() for k, w in engine.named_parameters()}
    weights_ref = {k: w.detach().cpu() for k, w in ref.named_parameters()}
    stats = engine.stats()
    engine.close()
    return losses_eng, losses_ref, weights_eng, weights_ref, stats


def assert_same(losses_eng, losses_ref, weights_eng, weights_ref):
    assert list(weights_eng) == list(weights_ref)  # same names, same order
    for a, b in zip(losses_eng, losses_ref):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=0), (a, b)
    worst = max(((w - weights_ref[k]).abs().max() / weights_ref[k].abs().max().clamp_min(1e-12)).item()
                for k, w in weights_eng.items())
    assert worst <= 1e-5, worst
    bitwise = all(torch.equal(w, weights_ref[k].detach()) for k, w in weights_eng.items())
    return bitwise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_parity_adamw_hf(make, device, tmp_path, deterministic):
    """GPT-2 and Llama through the engine, state on disk, host (and device) budgets a quarter of the
    state, against plain PyTorch on the same device: bitwise."""
    le, lr_, we, wr, stats = train_pair(make, hf_loss, tmp_path, device=device)
    assert assert_same(le, lr_, we, wr), "not bitwise identical"
    assert stats.bytes_read[Tier.DISK] > 0 and stats.bytes_written[Tier.DISK] > 0  # the disk tier really worked
    if device == "cuda":
        assert stats.bytes_written[Tier.DEVICE] > 0  # and the device tier


def test_parity_with_a_device_tier_on_the_cpu(tmp_path):
    """The GPU's three tiers on a CPU-only machine (a device tier of CPU memory with its own budget):
    device and host budgets a quarter of the state each, bitwise equal to plain PyTorch, and both
    memory tiers and the disk really used."""
    state = 16 * sum(p.numel() for p in plain_gpt().parameters())
    le, lr_, we, wr, stats = train_pair(plain_gpt, plain_loss, tmp_path, clip=1.0, steps=4,
                                        store_config={"device_budget_bytes": state // 4})
    assert assert_same(le, lr_, we, wr), "not bitwise identical"
    assert stats.bytes_written[Tier.DEVICE] > 0 and stats.bytes_read[Tier.DEVICE] > 0
    assert stats.bytes_read[Tier.DISK] > 0 and stats.bytes_written[Tier.DISK] > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["host", "device"])
def test_the_optimizer_runs_where_told_bitwise(tmp_path, where, device, deterministic):
    """``optimizer_device``: the update in the host tier gives PyTorch's optimizer stepping CPU
    copies of the parameters (fed the device's gradients), the update in the device tier
    PyTorch's on the device, bit for bit. On a CPU-only machine the device tier is CPU memory
    (the stand-in), where the two references are the same arithmetic; on CUDA (the GPU check runs
    it) they differ, and each placement is held to its own."""
    from tiered_offload import EngineConfig
    state = 16 * sum(p.numel() for p in plain_gpt().parameters())
    le, lr_, we, wr, stats = train_pair(plain_gpt, plain_loss, tmp_path, clip=1.0, steps=4, budget_fraction=0.4,
                                        device=device, host_optimizer=where == "host",
                                        store_config={"device_budget_bytes": state // 4} if device == "cpu" else None,
                                        config=EngineConfig(optimizer_device=where))
    assert assert_same(le, lr_, we, wr), "not bitwise identical"
    assert stats.bytes_written[Tier.DEVICE] > 0 and stats.bytes_read[Tier.DISK] > 0
    assert stats.floors["update"] == where, stats.floors


def test_the_update_on_the_host_moves_fewer_bytes_over_the_link(tmp_path, monkeypatch):
    """Measured in one run: the bytes copied into and out of the device tier per step, the update
    on the host against on the device (the states stay below; gradients go down, weights up); the
    plan's floors are lower bounds of what is measured."""
    from tiered_offload import EngineConfig
    state = 16 * sum(p.numel() for p in plain_gpt(layers=6).parameters())
    link, tiers, floors = {}, {}, {}
    from tiered_offload.store.copies import CopyChains
    landed, into_device = CopyChains._landed, {"device": set(), "host": set()}
    where = None

    def watch(self, rec, tier, version, src, extent=None, crc=None):
        if tier == Tier.DEVICE:
            into_device[where].add(rec.key)
        return landed(self, rec, tier, version, src, extent, crc)
    monkeypatch.setattr(CopyChains, "_landed", watch)
    for where in ("device", "host"):
        torch.manual_seed(0)
        engine = Engine(plain_gpt(layers=6), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / where,
                        host_memory=int(state * 0.375), durable=False, store_config={"device_budget_bytes": state // 4},
                        config=EngineConfig(optimizer_device=where))
        tiers[where] = engine._updater.tier
        g = torch.Generator().manual_seed(1)
        for step in range(5):
            if step == 2:
                engine._await()
                before = engine.stats()
            x = torch.randint(0, 128, (2, 17), generator=g)
            engine.backward(plain_loss(engine, x))
            engine.step()
            engine.zero_grad()
        engine._await()
        after = engine.stats()
        link[where] = sum(getattr(after, f)[Tier.DEVICE] - getattr(before, f)[Tier.DEVICE]
                          for f in ("bytes_read", "bytes_written")) / 3 / state
        # the plan's floors: lower bounds the measured bytes never go below
        floors[where] = after.floors
        assert f"the update runs in the {where} tier" in engine.plan.summary()
        assert after.link_per_step >= after.floors["link"] > 0
        assert after.disk_read_per_step >= after.floors["disk_read"]
        assert any("/state." in k for k in engine.store.keys())
        engine.close()
    assert tiers == {"device": Tier.DEVICE, "host": Tier.HOST}
    # the optimizer states (Adam's m and v: half the state) no longer go up and down: at least half
    # the state's size less over the link per step (the rest moves with the timing of evictions)
    assert link["host"] <= link["device"] - 0.5, link
    assert floors["host"]["link"] < floors["device"]["link"]
    # on the host the optimizer states never cross the link; on the device they do every step
    assert not any("/state." in k for k in into_device["host"]), sorted(into_device["host"])
    assert any("/state." in k for k in into_device["device"])


def test_a_deferred_step_is_exact_and_its_weights_serve_the_next_forward(tmp_path, deterministic):
    """A quarter of the state, one memory tier: the step cannot overlap the next forward, so it
    is deferred to it (each unit updated on the forward's thread just before the forward needs
    it). Bitwise PyTorch's, and per step the weights are read from the disk 1.3-1.4 times (forward
    with the update, backward) against 1.8 times inline (update, forward, backward)."""
    from tiered_offload import EngineConfig
    runs = {}
    for defer in (None, False):
        le, lr_, we, wr, _ = train_pair(plain_gpt, plain_loss, tmp_path / f"parity-{defer}", clip=1.0,
                                        config=EngineConfig(defer_step=defer))
        assert assert_same(le, lr_, we, wr), f"defer_step={defer}: not bitwise identical"
        model = plain_gpt(layers=6)
        weights = 4 * sum(p.numel() for p in model.parameters())
        torch.manual_seed(0)
        engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / f"reads-{defer}",
                        host_memory=weights, durable=False,
                        config=EngineConfig(defer_step=defer, activations="recompute"))  # no plan to vary
        assert engine._streamer.defer_step is (defer is None) and not engine.overlap_step
        assert engine.step_mode == ("deferred" if defer is None else "inline")
        g = torch.Generator().manual_seed(1)
        for step in range(10):
            if step == 5:  # no wait at the boundary (it would run the deferred update)
                before = engine.store.stats
            engine.backward(plain_loss(engine, torch.randint(0, 128, (2, 17), generator=g)))
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
        read = engine.store.stats.by_kind(("disk->host",), since=before)
        runs[defer] = {kind: n / 5 / weights for kind, n in read.items()}
        assert ("deferred to the next forward" in engine.plan.summary()) is (defer is None)
        engine.close()
    deferred, inline = runs[None], runs[False]
    # measured 1.31-1.37 and 1.78-1.81 (1.40 and 2.16-2.21 before the compute tier's prefetch window)
    assert deferred["weight"] <= 1.5 and inline["weight"] >= 1.65, runs
    assert deferred["state"] <= 1.05 * inline["state"], runs  # the states still read once
    assert sum(deferred.values()) <= 0.95 * sum(inline.values()), runs  # measured 0.92


def test_a_fragmented_tier_at_a_blocks_backward_reads_its_activations_beside_it(tmp_path, monkeypatch, deterministic):
    """The compute tier's free room can be split into holes by what is pinned, none large enough
    for a block's saved activations in its backward (CI, once: 57 KiB to place, 164 KiB free, the
    largest hole 52 KiB: a TierCapacityError mid-backward). The block's buffers are then placed
    without them and the activations read into a buffer of their own (one block's: the fixed
    overhead); the numbers are PyTorch's, bitwise."""
    from tiered_offload import EngineConfig
    from tiered_offload.store.tiered_store import TieredStore
    get_group, refused = TieredStore.get_group, []

    def fragmented(self, keys, tier=None):
        acts = [k for k in keys if k.endswith("/activations")]
        if acts and len(keys) > 1 and len(refused) < 3:  # the first three backwards that need activations
            refused.append(acts[0])
            raise TierCapacityError(f"cannot fit tensor {acts[0]!r}: largest free block too small (test)")
        return get_group(self, keys, tier)
    monkeypatch.setattr(TieredStore, "get_group", fragmented)
    le, lr_, we, wr, _ = train_pair(plain_gpt, plain_loss, tmp_path, clip=1.0,
                                    config=EngineConfig(activations="offload"))
    assert len(refused) == 3
    assert assert_same(le, lr_, we, wr), "not bitwise identical"


def test_the_update_on_the_host_moves_no_bytes_twice_over_the_link(tmp_path):
    """ZeRO-Offload's arrangement on the device stand-in (device 1/4, host 3/8 of the state, block
    inputs recomputed so no saved activation crosses): nothing of a gradient or an optimizer state
    goes up, each gradient goes down about once, and in all the link carries at most 1.5x the
    state per step. Regression: 2.8x, as the device fetched weights and gradients the update was
    about to rewrite, and moved the same copy down again and again (measured now: 1.0x, each
    gradient down once; a gradient written out through the host and left on the device went down
    twice, 1.31x on a CI machine: see test_store.py's
    ``test_a_copy_the_lookahead_writes_out_leaves_the_device_and_goes_down_once``). Counted by the
    store, per route and kind (``StoreStats.bytes_by_route``)."""
    from tiered_offload import EngineConfig
    model = plain_gpt(layers=6)
    params = sum(p.numel() for p in model.parameters())
    state = 16 * params
    torch.manual_seed(0)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path, host_memory=int(state * 0.375),
                    durable=False, store_config={"device_budget_bytes": state // 4},
                    config=EngineConfig(optimizer_device="host", activations="recompute"))
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 2:
            engine._await()
            before = engine.store.stats
        x = torch.randint(0, 128, (2, 17), generator=g)
        engine.backward(plain_loss(engine, x))
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
    engine._await()
    after = engine.store.stats
    engine.close()
    per_step = {(kind, way): n / 3 for way, route in (("up", "host->device"), ("down", "device->host"))
                for kind, n in after.by_kind((route,), since=before).items() if n}
    assert not any(kind in ("grad", "state") and way == "up" for kind, way in per_step), per_step
    assert not any(kind == "state" for kind, _ in per_step), per_step
    assert 4 * params <= per_step[("grad", "down")] <= 1.25 * 4 * params, per_step  # 2.5x before
    assert per_step[("weight", "up")] <= 2 * 4 * params, per_step
    # whole bytes: the per-step figures are thirds, and a float sum of them can miss by an ulp
    assert sum(sum(after.by_kind((route,), since=before).values()) for route in ("host->device", "device->host")) \
        == after.link_bytes - before.link_bytes
    assert sum(per_step.values()) <= 1.5 * state, {k: v / state for k, v in per_step.items()}


def _train_clipped(model, batches, *, measure_from: int | None = None):
    """AdamW (lr 1e-3) steps with clipping at 1.0 over ``batches``, on an engine or a plain model;
    ``measure_from``: the engine's store stats once its work before that step is done. Returns
    them, or None."""
    engine = model if isinstance(model, Engine) else None
    opt = None if engine else torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = None
    for step, x in enumerate(batches):
        if step == measure_from:
            engine._await()
            before = engine.store.stats
        (engine.backward if engine else torch.Tensor.backward)(plain_loss(model, x))
        if engine:
            engine.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        (engine or opt).step()
        (engine or opt).zero_grad()
    if engine:
        engine._await()
    return before


def test_optimizer_states_that_stay_in_memory_are_not_written_behind_every_step(tmp_path):
    """Volatile, device stand-in 1/4 and host 1/2 of the state, update on the host: an optimizer
    state that stayed in memory through its last two updates (no disk read since either) is not
    written behind its update. Measured: 0.56x the states written per step; before, every state
    was written behind every update (1.0x), though many were never read back. A journal still
    writes every state at every update (a resume reads them from the disk). The weights stay
    PyTorch's, bitwise, either way. (docs/RESULTS.md, tenth session: 0.90-0.96x the disk bytes on
    tools/bench_tiers.py's shape, host 3/8.)"""
    from tiered_offload import EngineConfig
    written = {}
    for durable in (False, True):
        torch.manual_seed(0)
        ref = plain_gpt(layers=6)
        model = copy.deepcopy(ref)
        params = sum(p.numel() for p in ref.parameters())
        state = 16 * params
        engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / str(durable),
                        host_memory=state // 2, durable=durable, store_config={"device_budget_bytes": state // 4},
                        config=EngineConfig(optimizer_device="host", activations="recompute"))
        assert engine.commit_mode == ("journal" if durable else "none")
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 128, (2, 17), generator=g) for _ in range(10)]
        before = _train_clipped(engine, batches, measure_from=4)
        # the states' bytes written per step, as a share of all of them (Adam's m and v)
        written[durable] = engine.store.stats.by_kind(("host->disk", "device->disk"), since=before).get("state", 0) \
            / 6 / (8 * params)
        weights = {k: w.detach().clone() for k, w in engine.named_parameters()}
        engine.close()
        _train_clipped(ref, batches)
        assert all(torch.equal(weights[k], w) for k, w in ref.named_parameters()), f"durable={durable}: not bitwise"
    assert written[False] <= 0.8, written  # measured 0.56
    assert written[True] >= 0.95, written  # the journal's: every state, every step


def test_a_budget_just_under_the_state_keeps_the_zeroed_gradients_out_of_the_way(tmp_path):
    """Host tier alone at 0.9 of the state, every block recomputed, volatile: the gradients that
    zero_grad() cleared (zeros) are made ahead of the backward in free room only, not with the room
    of optimizer states needed after them. They used to be: they held a quarter of the host tier
    through the update and the forward, and the states they pushed out were written and read back
    every step. Measured on this shape: disk reads 1.24x the plan's floor and writes 1.70-1.75x,
    against 1.91-2.08x and 4.90x before (docs/RESULTS.md, eleventh session). Bitwise PyTorch's."""
    from tiered_offload import EngineConfig
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=128, context=32, d_model=256, n_layers=6, n_heads=4))
    model = copy.deepcopy(ref)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path, host_memory=int(0.9 * state),
                    durable=False, config=EngineConfig(activations="recompute"))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 17), generator=g) for _ in range(12)]
    before = _train_clipped(engine, batches, measure_from=4)
    after, floors = engine.store.stats, engine.stats().floors
    read = (after.bytes_read[Tier.DISK] - before.bytes_read[Tier.DISK]) / 8 / floors["disk_read"]
    written = (after.bytes_written[Tier.DISK] - before.bytes_written[Tier.DISK]) / 8 / floors["disk_written"]
    weights = {k: w.detach().clone() for k, w in engine.named_parameters()}
    engine.close()
    assert read <= 1.6 and written <= 2.5, (read, written)  # measured 1.24 and 1.70-1.75; before, 1.91-2.08 and 4.90
    _train_clipped(ref, batches)
    assert all(torch.equal(weights[k], w) for k, w in ref.named_parameters())


def test_optimizer_device_is_validated_and_host_needs_its_working_set(tmp_path):
    from tiered_offload import EngineConfig
    state = 16 * sum(p.numel() for p in plain_gpt().parameters())
    with pytest.raises(ConfigError, match="optimizer_device must be"):
        Engine(plain_gpt(), torch.optim.AdamW, {}, storage=tmp_path / "a", host_memory=state,
               store_config={"device_budget_bytes": state // 4}, config=EngineConfig(optimizer_device="gpu"))
    with Engine(plain_gpt(), torch.optim.AdamW, {}, storage="memory", host_memory=state) as probe:
        largest = max(probe.schedule.unit_bytes(u, "weight") for u in probe.units)
        assert probe._updater.tier == Tier.HOST  # one memory tier: nothing to choose
    staging = STAGED_AT_ONCE * largest  # what staging needs (a multiple of the page here)
    with pytest.raises(TierCapacityError, match="optimizer_device='host'"):
        Engine(plain_gpt(), torch.optim.AdamW, {}, storage=tmp_path / "b", host_memory=staging + 8192,
               store_config={"device_budget_bytes": state}, config=EngineConfig(optimizer_device="host"))
    # "auto" on the device stand-in: the rates measured, the reason in the plan (the same CPU
    # kernels either way, so the link decides: the states would cross it both ways)
    with Engine(plain_gpt(), torch.optim.AdamW, {}, storage="memory", host_memory=state // 2,
                store_config={"device_budget_bytes": state // 4}) as auto:
        assert auto._updater.tier == Tier.HOST
        assert "the update runs in the host tier (measured: " in auto.plan.summary()


def test_a_host_budget_below_a_device_tier_stages_a_load_and_a_victim_wherever_the_first_lands(tmp_path):
    """Below a device tier, a load into the device and a device victim on its way to the disk are
    staged in the host tier at once. With room for two of the largest unit, the first copy could
    land in the middle and leave two holes too small for the second: a fuzzed run (``tools/
    fuzz_options.py --seed 74049``: 44 KiB, 20 KiB copies, holes of 16 and 8 KiB) failed mid-step
    for room, under load, about one run in two. Such a budget is refused when the engine is built,
    with the least it takes; at that least, the run trains as PyTorch does."""
    state = 16 * sum(p.numel() for p in plain_gpt().parameters())
    with Engine(plain_gpt(), torch.optim.AdamW, {}, storage="memory", host_memory=state) as probe:
        largest = max(probe.schedule.unit_bytes(u, "weight") for u in probe.units)
    least = STAGED_AT_ONCE * largest  # (a multiple of the page here)
    with pytest.raises(TierCapacityError, match=rf"cannot stage the largest unit .* at least {least // 1024}\.00 KiB"):
        Engine(plain_gpt(), torch.optim.SGD, dict(lr=1e-2, momentum=0.9), storage=tmp_path / "a",
               host_memory=least - 4096,
               store_config={"device_budget_bytes": state // 2}, config=EngineConfig(optimizer_device="device"))
    torch.manual_seed(0)
    ref = plain_gpt()
    engine = Engine(copy.deepcopy(ref), torch.optim.SGD, dict(lr=1e-2, momentum=0.9), storage=tmp_path / "b",
                    host_memory=least, store_config={"device_budget_bytes": state // 2},
                    config=EngineConfig(optimizer_device="device"))
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        engine.backward(plain_loss(engine, x))
        plain_loss(ref, x).backward()
        engine.step(), opt.step()
        engine.zero_grad(), opt.zero_grad()
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], w) for k, w in ref.named_parameters())


def test_a_resumed_auto_run_keeps_its_optimizer_placement(tmp_path, monkeypatch):
    """``optimizer_device="auto"`` decides from rates measured when the engine is built; a resume
    on the same state keeps what the run it continues used (the host's and the GPU's kernels can
    differ in the last bits), even where the rates now say otherwise; a new run measures."""
    import tiered_offload.engine.facade as facade
    from tiered_offload.engine.preflight import UpdateRates
    state = 16 * sum(p.numel() for p in plain_gpt().parameters())
    kw = dict(host_memory=state // 2, store_config={"device_budget_bytes": state // 4})
    with Engine(plain_gpt(), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "run", **kw) as engine:
        assert engine._updater.tier == Tier.HOST  # the stand-in: the link decides
        for _ in range(2):
            engine.backward(plain_loss(engine, torch.randint(0, 128, (2, 17))))
            engine.step()
            engine.zero_grad()
    weak_cpu = UpdateRates(host_Bps=1e3, device_Bps=1e12, link_Bps=1e12)
    monkeypatch.setattr(facade, "measure_update_rates", lambda spec, device, disk, journal, link: weak_cpu)
    with Engine(plain_gpt(), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "run", resume=True, **kw) as engine:
        assert engine.step_count == 2 and engine._updater.tier == Tier.HOST
        assert "as the run this one resumes was trained ('host'" in engine.plan.summary()
    with Engine(plain_gpt(), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "new", **kw) as engine:
        assert engine._updater.tier == Tier.DEVICE and "measured: " in engine.plan.summary()


def test_auto_weighs_the_disk_that_a_bench_io_profile_measured(tmp_path, monkeypatch):
    """A device tier of half the state holds more than the weights: under an update on the device
    its room keeps optimizer states off the disk. On the stand-in the link alone puts the update on
    the host; with a bench-io profile of a slow disk ``"auto"`` weighs the disk bytes too and puts it
    on the device, and the plan says which numbers decided."""
    from tiered_offload.profile import filesystem_id, save_profile
    monkeypatch.setenv("TIERED_OFFLOAD_PROFILE", "none")  # (not the user's own profile: the one named below)
    state = 16 * sum(p.numel() for p in plain_gpt().parameters())
    slow = save_profile({"filesystem": filesystem_id(tmp_path),
                         "recommended": {"options": {}, "read_GBps": 1e-4, "write_GBps": 1e-4}}, tmp_path / "p.json")
    kw = dict(host_memory=state // 4, durable=False)
    with Engine(plain_gpt(), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "run", **kw,
                store_config={"device_budget_bytes": state // 2}) as engine:
        assert engine._updater.tier == Tier.HOST and "the disk not weighed" in engine.plan.summary()
    with Engine(plain_gpt(), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "profiled", **kw,
                store_config={"device_budget_bytes": state // 2, "io_profile": str(slow)}) as engine:
        assert engine._updater.tier == Tier.DEVICE
        assert "disk 0.00 / 0.00 GB/s read / written" in engine.plan.summary()


def test_device_and_host_tiers_together_cut_disk_reads(tmp_path):
    """With a device tier, the host tier caches what the device does not hold (it was a second copy
    of the same tensors, and prefetched so far ahead that it evicted what it needed next): with
    both budgets a quarter of the state, a step reads about the state once from the disk, where it
    read it twice."""
    torch.manual_seed(0)
    model = plain_gpt(layers=8)
    state = 16 * sum(p.numel() for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory=state // 4,
                    durable=False, store_config={"device_budget_bytes": state // 4})
    g = torch.Generator().manual_seed(1)
    reads = []
    for _ in range(5):
        before = engine.stats().bytes_read[Tier.DISK]
        x = torch.randint(0, 128, (2, 17), generator=g)
        engine.backward(plain_loss(engine, x))
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        reads.append((engine.stats().bytes_read[Tier.DISK] - before) / state)
    host = engine.store.capacity("host")
    assert engine.plan.lower_tier == {"budget": host, "prefetch_window": host // 8}
    assert "host tier below it" in engine.plan.summary()
    engine.close()
    steady = reads[2:]
    assert max(steady) <= 1.4, reads  # 2.0-2.2 before
    assert min(steady) > 0.25, reads  # the state does not fit: the disk is really used


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep-activations"])
def test_parity_when_the_state_fits_in_memory(recompute, tmp_path):
    """A budget larger than the state: 'auto' keeps activations; both modes give the same numbers."""
    torch.manual_seed(0)
    ref = llama()
    engine = Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s",
                    host_memory="16MiB", recompute=recompute)
    assert engine.recompute is recompute
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        le = hf_loss(engine, x)
        engine.backward(le)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        lr_ = hf_loss(ref, x)
        lr_.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert le.item() == lr_.item()
    weights = dict(ref.named_parameters())
    assert all(torch.equal(v, weights[k]) for k, v in engine.named_parameters())
    engine.close()


def test_auto_recompute_follows_the_budget(tmp_path):
    big = Engine(plain_gpt(2), storage="memory", host_memory="16MiB")
    small = Engine(plain_gpt(8), storage="memory", host_memory="400KiB")
    assert not big.recompute and small.recompute
    assert not big.overlap_step  # nothing to hide: no background update competing for cores
    big.close()
    small.close()


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_parity_with_clipping(make, tmp_path):
    assert assert_same(*train_pair(make, hf_loss, tmp_path, clip=0.5)[:4])


def test_parity_with_gradient_accumulation(tmp_path):
    assert assert_same(*train_pair(llama, hf_loss, tmp_path, accumulate=3, clip=1.0)[:4])


def test_parity_plain_pytorch_model_with_tied_head(tmp_path):
    assert assert_same(*train_pair(plain_gpt, plain_loss, tmp_path, steps=4)[:4])


@pytest.mark.parametrize("optimizer,kwargs", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, nesterov=False, weight_decay=1e-3)),
    (torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.95))),
], ids=["sgd-momentum", "sgd-dampening", "adam"])
def test_parity_other_optimizers(optimizer, kwargs, tmp_path):
    assert assert_same(*train_pair(gpt2, hf_loss, tmp_path, optimizer=optimizer, kwargs=kwargs)[:4])


def test_lr_scheduler_takes_effect(tmp_path):
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # noqa: E731
    assert assert_same(*train_pair(gpt2, hf_loss, tmp_path, scheduler=sched, steps=4)[:4])


def test_lr_change_through_param_groups(tmp_path):
    torch.manual_seed(0)
    ref = gpt2()
    engine = Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-2), storage="memory", host_memory="1MiB")
    before = dict(engine.named_parameters())
    engine.param_groups[0]["lr"] = 0.0
    x = torch.randint(0, 128, (2, 9))
    engine.backward(hf_loss(engine, x))
    engine.step()
    after = dict(engine.named_parameters())
    # lr 0 and weight decay scaled by lr: nothing may move
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(storage=123), r"storage must be a directory.*got int 123"),
    (dict(durable="no"), r"durable must be True, False or None, got 'no'"),
    (dict(commit_every=True), r"commit_every must be an integer >= 1, got True"),
    (dict(device="tpu"), r"device 'tpu'.*'cpu', 'cuda'"),
    (dict(device="meta"), r"device 'meta'.*'cpu', 'cuda'"),
    (dict(trace=123), r"trace must be a file path.*got int"),
    (dict(init_from=123), r"init_from must be a directory or file.*got int"),
    (dict(init_from=["a", 1]), r"init_from must be a directory or file.*got list"),
    (dict(store_config="fast"), r"store_config must be a dict of StoreConfig's fields, got str"),
    (dict(store_config={"bogus": 1, "prefetch_depth": 2}), r"store_config: no StoreConfig field 'bogus'.*prefetch_depth"),
    (dict(store_config={"wait_timeout_s": -1}), r"wait_timeout_s must be > 0, got -1"),
    (dict(config={"activations": "keep"}), r"config must be an EngineConfig.*EngineConfig\(activations='keep'\)"),
    # (they were named as StoreConfig's fields, host_budget_bytes and device_budget_bytes)
    (dict(host_memory="lots"), r"^host_memory: cannot read 'lots' as a byte size; write e\.g\. 4GiB"),
    (dict(host_memory=-1), r"^host_memory: a size cannot be negative \(-1\)"),
    (dict(device_memory="1 GB of it"), r"^device_memory: cannot read '1 GB of it' as a byte size")])
def test_an_engine_argument_of_the_wrong_kind_is_refused_naming_it(tmp_path, monkeypatch, kwargs, match):
    """Found by trying each argument with a value of another kind: ``storage=123`` trained in a
    directory ``./123`` it made, ``durable="no"`` (truthy) made the run durable, and a device
    string torch does not know, a trace or a config of the wrong type raised ``RuntimeError``,
    ``TypeError`` and ``AttributeError`` from deep inside."""
    monkeypatch.chdir(tmp_path)
    kwargs.setdefault("storage", tmp_path / "s")
    with pytest.raises(ConfigError, match=match):
        Engine(plain_gpt(2), torch.optim.AdamW, dict(lr=1e-3), **{"host_memory": "1MiB", **kwargs})
    assert not (tmp_path / "123").exists()


@pytest.mark.parametrize("then", ["backward", "step-again", "clip-again", "optimizer-zero-grad"])
@pytest.mark.parametrize("durable", [False, True])
def test_gradients_kept_past_a_clipped_step_are_the_clipped_ones(tmp_path, then, durable):
    """A loop that steps without ``zero_grad()`` after it (accumulating across steps) and clips by
    norm: PyTorch's clipping scaled the gradients in place, so what the next backward adds to, the
    next clip measures and a step again applies are the clipped gradients. The engine applies the
    scale on the way through the update and kept the unclipped ones: the next clip measured 1.72
    where PyTorch measured 1.27, and every parameter then differed. Now the scale is owed to the
    kept gradients and applied before anything reads or adds to them (a ``zero_grad()`` forgets it)."""
    torch.manual_seed(0)
    ref = plain_gpt(3)
    model = copy.deepcopy(ref)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", durable=durable,
                    host_memory=16 * sum(p.numel() for p in ref.parameters()) * 6 // 10)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randint(0, 128, (2, 17), generator=g)
        if then != "step-again" or i % 2 == 0:
            engine.backward(plain_loss(engine, x))
            plain_loss(ref, x).backward()
        if then != "clip-again" or i % 2 == 1:
            assert torch.equal(engine.clip_grad_norm_(0.3), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3))
        engine.step()
        opt.step()
        if then == "clip-again" and i % 2 == 0:  # (a clip after the step: it measures the clipped gradients)
            assert torch.equal(engine.clip_grad_norm_(0.3), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3))
        if i % 2 == 1:  # (every second step: the gradients of two steps' batches were accumulated)
            (engine.optimizer.zero_grad if then == "optimizer-zero-grad" else engine.zero_grad)()
            opt.zero_grad()
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())
    engine.close()


@pytest.mark.parametrize("zero", ["engine", "optimizer"])
def test_a_clip_whose_gradients_were_zeroed_scales_nothing_after(tmp_path, zero):
    """``clip_grad_norm_``, then ``zero_grad()`` (the engine's, or the optimizer's), then another
    backward and the step: PyTorch's clip scaled gradients that are gone, and the step uses the new
    ones as they are. The engine kept the clip's scale for the step and applied it to the new
    gradients: every parameter differed. Now the scale goes to the gradients it was measured on."""
    torch.manual_seed(0)
    ref = plain_gpt(3)
    model = copy.deepcopy(ref)
    mine = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(model, mine, storage=tmp_path / "s", host_memory=16 * sum(p.numel() for p in ref.parameters()) // 2)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = (torch.randint(0, 128, (2, 17), generator=g) for _ in range(2))
        engine.backward(plain_loss(engine, x))
        plain_loss(ref, x).backward()
        assert torch.equal(engine.clip_grad_norm_(0.1), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
        (engine if zero == "engine" else mine).zero_grad()
        opt.zero_grad()
        engine.backward(plain_loss(engine, y))
        plain_loss(ref, y).backward()
        engine.step(), opt.step()
        engine.zero_grad(), opt.zero_grad()
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())
    engine.close()


def test_saving_the_model_or_the_engine_whole_is_refused_naming_the_way(tmp_path):
    """``torch.save(model, PATH)`` (the model whole, a common way to save one) and ``pickle.dumps(engine)``
    raised ``AttributeError: Can't pickle local object '_hook_model_calls.<locals>.left'``. Each
    is now a ``TensorStateError`` naming ``export_safetensors`` (as a copy of a parameter is); the
    engine trains on."""
    import io
    torch.manual_seed(0)
    model = plain_gpt(2)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory="1MiB")
    for save in (lambda: torch.save(model, io.BytesIO()), lambda: pickle.dumps(model), lambda: pickle.dumps(engine),
                 lambda: copy.deepcopy(engine), lambda: copy.deepcopy(model)):
        with pytest.raises(TensorStateError, match=r"engine\.export_safetensors\(DIR\)"):
            save()
    x = torch.randint(0, 128, (2, 17))
    engine.backward(plain_loss(engine, x))
    assert engine.step() and engine.step_count == 1
    engine.close()


def test_a_closed_engine_refuses_every_call_saying_it_is_closed(tmp_path):
    """An engine used after ``close()`` (its ``with`` block left, or closed in a handler): the forward
    raised ``RuntimeError: shape '[1104]' is invalid``, the step and the weights' read
    ``AttributeError: 'NoneType' object has no attribute ...``. Now each is an
    ``EngineClosedError`` saying what to do; closing again and ``zero_grad`` stay quiet."""
    from offload_core.errors import EngineClosedError
    torch.manual_seed(0)
    engine = Engine(plain_gpt(2), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory="1MiB")
    x = torch.randint(0, 128, (2, 17))
    engine.backward(plain_loss(engine, x))
    engine.step()
    engine.close()
    for call in (lambda: engine(x), lambda: engine.backward(x.float().sum()), engine.step, engine.commit,
                 lambda: engine.clip_grad_norm_(1.0), lambda: engine.clip_grad_value_(1.0),
                 lambda: engine.forward_backward([x], lambda out, b: out.sum()), lambda: dict(engine.named_parameters()),
                 lambda: engine.export_safetensors(tmp_path / "out")):
        with pytest.raises(EngineClosedError, match=r"this engine is closed.*resume=True"):
            call()
    engine.close()
    engine.zero_grad()


def test_every_config_field_of_the_wrong_kind_is_refused_naming_it():
    """``EngineConfig`` and ``StoreConfig`` took any value in most fields (a string for a flag: truthy;
    ``None`` for a count: a ``TypeError`` from a comparison); now every field's type is checked when
    the config is built, naming the field and what it takes. Each field is tried with a value of
    every other kind."""
    import dataclasses
    from tiered_offload.config import StoreConfig
    for cls in (EngineConfig, StoreConfig):
        for f in dataclasses.fields(cls):
            kinds = [k.strip() for k in str(f.type).split("|")]
            for value, kind in (("x", "str"), (7, "int"), (0.5, "float"), (True, "bool"), (None, "None"),
                                ([1], "list[str]")):
                if kind in kinds or (kind == "int" and "float" in kinds) or "Callable" in kinds and callable(value):
                    continue
                with pytest.raises(ConfigError, match=rf"{cls.__name__}\.{f.name} must be "):
                    cls(**{f.name: value})


@pytest.mark.parametrize("written, read", [
    ("4GiB", 4 << 30), ("4 gib", 4 << 30), ("1.5GB", 1_500_000_000), ("64M", 64_000_000), ("512", 512),
    (1048576, 1 << 20), (1e9, 10**9), ("1e9", 10**9), ("2.5e3KiB", 2560000), ("0.1MiB", 104857),
    (True, "expected a byte size"), (-5, "cannot be negative"), ("ninety", "cannot read 'ninety'"), ("", "cannot read"),
    (float("nan"), "a finite number"), (float("inf"), "a finite number"), ("1e400", "a finite number"),
    ("-1GiB", "cannot read"), ("4 GiB of RAM", "cannot read")])
def test_a_byte_size_is_read_as_people_write_it_or_refused_typed(written, read):
    """``host_memory=`` and the other budgets: a YAML ``1e9`` (a string there) was refused, and a
    NaN a ``ValueError`` from ``int()``, untyped."""
    from offload_core.sizes import parse_size
    if isinstance(read, int):
        assert parse_size(written) == read
    else:
        with pytest.raises(ConfigError, match=read):
            parse_size(written, what="host_memory")


def test_the_optimizers_step_with_a_closure_runs_it_as_pytorchs_does(tmp_path):
    """PyTorch's ``loss = opt.step(closure)`` (the closure zeroes the gradients, computes the loss
    and back-propagates it): the engine's optimizer ignored the closure without a word, stepped on
    no gradient, returned ``True``, and the model never trained. Now it runs the closure (with
    gradients enabled, as ``torch.optim`` does), steps, and returns its loss; a closure that calls
    ``loss.backward()`` instead of ``engine.backward(loss)`` is refused, typed."""
    torch.manual_seed(0)
    ref = plain_gpt(4)
    model = copy.deepcopy(ref)
    mine = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(model, mine, storage=tmp_path / "s", host_memory=4 * state // 10)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)

        def closure():
            mine.zero_grad()
            loss = plain_loss(engine, x)
            engine.backward(loss)
            return loss

        def reference():
            opt.zero_grad()
            loss = plain_loss(ref, x)
            loss.backward()
            return loss
        with torch.no_grad():  # (a loop's evaluation habit: the closure still computes gradients)
            got = mine.step(closure)
        assert torch.equal(got, opt.step(reference))
    assert mine.step() is None is opt.step()  # (no closure: None, as PyTorch's; no gradient: nothing moves)
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], v.detach()) for k, v in ref.named_parameters())

    def autograds():
        loss = plain_loss(engine, x)
        loss.backward()
        return loss
    with pytest.raises(TieredOffloadError, match=r"engine\.backward"):
        mine.step(autograds)
    engine.close()


@pytest.mark.parametrize("how", ["scheduler-built-before", "scheduler-built-after", "lr-set", "its-step"])
def test_the_optimizer_given_to_the_engine_is_its_optimizer(tmp_path, how):
    """``opt = AdamW(model.parameters()); engine = Engine(model, opt)``, then PyTorch's habits on
    ``opt``: an LR scheduler over it (built before or after the engine; ``get_cosine_schedule_with_warmup
    (opt)``), a learning rate set in ``opt.param_groups``, ``opt.step()`` / ``opt.zero_grad()``.
    The engine read the hyperparameters once and kept its own groups: every one of those was
    ignored without a word, and the model trained at the first learning rate. Now ``opt`` becomes
    the engine's optimizer (``engine.optimizer is opt``, still an AdamW): the weights are PyTorch's,
    bitwise; its state is refused, typed, as ``engine.optimizer``'s."""
    torch.manual_seed(0)
    ref = plain_gpt(4)
    model = copy.deepcopy(ref)
    schedule = lambda s: 1.0 / (1 + s)  # noqa: E731
    mine = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = how in ("scheduler-built-before", "its-step")  # (the last: PyTorch's loop whole, on opt)
    sched = torch.optim.lr_scheduler.LambdaLR(mine, schedule) if before else None
    engine = Engine(model, mine, storage=tmp_path / "s", host_memory=4 * 16 * sum(p.numel() for p in ref.parameters()) // 10)
    if how == "scheduler-built-after":
        sched = torch.optim.lr_scheduler.LambdaLR(mine, schedule)
    assert engine.optimizer is mine and isinstance(mine, torch.optim.AdamW)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if sched is not None else None
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a scheduler stepped "before optimizer.step()" warns)
        for i in range(4):
            x = torch.randint(0, 128, (2, 17), generator=g)
            if how == "lr-set":
                for o in (mine, opt):
                    o.param_groups[0]["lr"] = 1e-2 / (1 + i)
            engine.backward(plain_loss(engine, x))
            mine.step() if how == "its-step" else engine.step()
            mine.zero_grad() if how == "its-step" else engine.zero_grad()
            plain_loss(ref, x).backward()
            opt.step()
            opt.zero_grad()
            for s in (sched, ref_sched):
                if s is not None:
                    s.step()
    assert mine.param_groups[0]["lr"] == opt.param_groups[0]["lr"] != 1e-2
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], v.detach()) for k, v in ref.named_parameters())
    for copying in (lambda o: o.state_dict(), copy.deepcopy, pickle.dumps):  # (a checkpoint of it holds nothing)
        with pytest.raises(TensorStateError, match="lives in the engine's store"):
            copying(mine)
    engine.close()


def test_budgets_hold_at_every_allocation_and_disk_is_used(tmp_path):
    torch.manual_seed(0)
    model = plain_gpt(layers=8)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory="400KiB")
    assert engine.state_bytes() >= 4 * engine.store.capacity("host")
    seen = []
    for tier, arena in ((t, engine.store.arena(t)) for t in (Tier.DEVICE, Tier.HOST)):
        original = arena.alloc

        def checked(n, arena=arena, original=original, **kw):
            off = original(n, **kw)
            seen.append(arena.used <= arena.capacity)
            return off
        arena.alloc = checked
    x = torch.randint(0, 128, (2, 17))
    for _ in range(2):
        engine.backward(plain_loss(engine, x))
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
    assert seen and all(seen)
    s = engine.stats()
    assert s.peak_used[Tier.HOST] <= engine.store.capacity("host")
    assert s.bytes_read[Tier.DISK] > engine.store.capacity("host")
    engine.close()


def test_learned_sequence_makes_prefetch_hit(tmp_path):
    """After the first step the engine declares the observed access order; later steps mostly hit."""
    torch.manual_seed(0)
    # I/O that takes no time: a get() hits exactly when the lookahead loaded the tensor before it
    engine = Engine(plain_gpt(layers=8), torch.optim.AdamW, dict(lr=1e-3), storage=MemoryBackend(threads=0),
                    host_memory="640KiB", config=EngineConfig(overlap_step=False))
    assert engine.state_bytes() > 2 * engine.store.capacity("host")
    x = torch.randint(0, 128, (2, 17))
    engine.backward(plain_loss(engine, x))
    engine.step()
    engine.zero_grad()
    first = engine.stats()
    # a gradient zero_grad() cleared is zeros: made ahead in free room only, else when backward gets
    # it; no read either way
    reads, get = [], engine.store.get
    engine.store.get = lambda key, tier=None: reads.append(
        not (engine.store.record(key).zero or engine.store.record(key).valid(Tier.HOST))) or get(key, tier)
    for _ in range(2):
        engine.backward(plain_loss(engine, x))
        engine.step()
        engine.zero_grad()
    s = engine.stats()
    hits = s.hits[Tier.HOST] - first.hits[Tier.HOST]
    assert hits > 0 and not any(reads), (hits, sum(reads))
    engine.close()


# ---- initialisation on the meta device --------------------------------------------------
def test_meta_model_is_initialised_unit_by_unit_with_its_own_init(tmp_path):
    with empty_init():
        model = plain_gpt(layers=4)
    assert all(p.device.type == "meta" for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=3e-3), storage=tmp_path / "s", host_memory="1MiB")
    w = dict(engine.named_parameters())
    assert torch.equal(w["blocks.0.ln1.weight"], torch.ones(32))
    assert torch.equal(w["ln_f.bias"], torch.zeros(32))
    for name in ("blocks.3.fc.weight", "tok.weight", "blocks.0.qkv.weight"):  # the model's own init: N(0, 0.02)
        assert abs(w[name].std().item() - 0.02) < 0.002, name
    assert torch.equal(w["blocks.1.fc.bias"], torch.zeros(128))
    x = torch.randint(0, 128, (4, 17))
    losses = []
    for _ in range(8):
        loss = plain_loss(engine, x)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    engine.close()


def test_meta_hf_model_uses_init_weights(tmp_path):
    cfg = _transformers().GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=4)
    with empty_init():
        model = _transformers().GPT2LMHeadModel(cfg)
    engine = Engine(model, storage=tmp_path / "s", host_memory="1MiB")
    w = dict(engine.named_parameters())
    assert abs(w["transformer.wte.weight"].std().item() - cfg.initializer_range) < 0.005
    assert torch.equal(w["transformer.h.2.ln_1.weight"], torch.ones(32))
    engine.close()


def test_parameter_without_initialiser_is_reported(tmp_path):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.scale

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Odd(), Odd()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    with empty_init():
        m = M()
    with pytest.raises(ModelStructureError) as info:
        Engine(m, storage="memory", host_memory="1MiB")
    assert "blocks.0.scale" in str(info.value) and "reset_parameters" in str(info.value)


# ---- bad input --------------------------------------------------------------------------
def test_an_optimizer_whose_step_fails_is_refused_at_construction_typed():
    """AdamW with a learning rate past float32's range (``lr=1e38``: the step's size overflows)
    stopped the engine's construction with PyTorch's bare ``RuntimeError`` from its probe step (a
    traceback through the engine's internals). It is a ``ConfigError`` naming the optimizer, the
    group and PyTorch's message; PyTorch's own first step fails alike."""
    model = plain_gpt(2)
    with pytest.raises(RuntimeError, match="overflow"):  # (PyTorch's own step on the model's parameters)
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.ones_like(p)
        torch.optim.AdamW(params, lr=1e38).step()
    with empty_init():
        model = plain_gpt(2)
    with pytest.raises(ConfigError, match=r"AdamW cannot take a step with the hyperparameters of group 0 .*"
                                          r"lr.*1e\+38.*overflow"):
        Engine(model, torch.optim.AdamW, dict(lr=1e38), storage="memory", host_memory="1MiB")


def test_model_without_blocks_needs_a_hint():
    with pytest.raises(ModelStructureError) as info:
        Engine(nn.Linear(4, 4), storage="memory", host_memory="1MiB")
    assert "blocks=" in str(info.value)
    with pytest.raises(ModelStructureError, match=r"no submodule 'nope.layers'.* its layer sequences: blocks \(2 "
                                                  r"layers, \d[\d,]* parameters\)"):
        Engine(plain_gpt(2), storage="memory", host_memory="1MiB", blocks="nope.layers")  # (a name mistyped)
    with pytest.raises(ModelStructureError, match=r"'head' is a Linear, not an nn.ModuleList.*: blocks \(2 layers"):
        Engine(plain_gpt(2), storage="memory", host_memory="1MiB", blocks="head")


def test_explicit_block_hint(tmp_path):
    engine = Engine(plain_gpt(2), storage="memory", host_memory="1MiB", blocks="blocks")
    assert engine.seq_name == "blocks" and len(engine.blocks) == 2
    engine.close()


def test_batch_the_model_rejects():
    engine = Engine(plain_gpt(2), storage="memory", host_memory="1MiB")
    with pytest.raises(ModelInputError) as info:
        engine(torch.randn(2, 8))
    assert "GPT.forward rejected the batch" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    # the engine is still usable afterwards
    x = torch.randint(0, 128, (2, 9))
    engine.backward(plain_loss(engine, x))
    assert engine.step()
    engine.close()


def test_budget_too_small_names_the_block_and_the_bytes():
    with pytest.raises(TierCapacityError) as info:
        Engine(plain_gpt(2), storage="memory", host_memory="100KiB")
    msg = str(info.value)
    assert "block.0" in msg and "at least" in msg and "KiB" in msg


@pytest.mark.parametrize("budget, written", [(100, "100 B"), (4095, "4.00 KiB = 4095 bytes"), ("1.5KiB", "1.50 KiB = 1536 bytes")])
def test_a_budget_that_is_not_whole_pages_is_reported_as_written(budget, written):
    """A budget the arena rounds down to whole 4 KiB pages was reported as the rounded figure: host_memory=100
    was "the host budget (0 B) cannot hold ...", as if the user had asked for nothing."""
    with pytest.raises(TierCapacityError) as info:
        Engine(plain_gpt(2), storage="memory", host_memory=budget)
    msg = str(info.value)
    assert f"host budget ({written}" in msg and "rounded down to whole 4.00 KiB pages" in msg, msg


def test_nan_loss_raises_and_leaves_state_untouched():
    engine = Engine(plain_gpt(2), storage="memory", host_memory="1MiB")
    before = dict(engine.named_parameters())
    x = torch.randint(0, 128, (2, 9))
    loss = plain_loss(engine, x) * float("nan")
    with pytest.raises(NonFiniteError):
        engine.backward(loss)
    engine.step()  # nothing accumulated: a no-op update of zero gradients is still an update...
    engine.close()
    # ...so check untouched-ness where it matters: the step after a non-finite gradient
    engine = Engine(plain_gpt(2), storage="memory", host_memory="1MiB")
    before = dict(engine.named_parameters())
    out = engine(x)
    loss = torch.sqrt(out.abs().sum() * 0)  # finite loss (0), infinite gradient
    engine.backward(loss)
    with pytest.raises(NonFiniteError) as info:
        engine.step()
    assert "block" in str(info.value) or "rest" in str(info.value)
    after = dict(engine.named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.zero_grad()
    engine.backward(plain_loss(engine, x))
    assert engine.step()
    engine.close()


def test_the_models_own_gradient_calls_are_the_engines_or_a_clear_error(tmp_path):
    """Training loops written for PyTorch call ``model.zero_grad()`` and
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``. The gradients live in the store,
    so both were silent no-ops: the gradients kept accumulating, and the clipping returned 0 and
    clipped nothing. Now ``model.zero_grad()`` is ``engine.zero_grad()`` (``set_to_none=False``
    keeps "has a gradient", as PyTorch's zeros do), and using a parameter's ``.grad`` (clipping,
    a norm for a log) is a TensorStateError naming the engine's call. A deep copy of the model
    (an EMA, DPO's frozen reference) would hold stand-ins that run the engine's current weights,
    silently not a copy: refused, naming the export."""
    from offload_core.errors import TensorStateError
    torch.manual_seed(0)
    ref = plain_gpt(4)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 3)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        plain_loss(ref, x).backward()
        opt.step()
        ref.zero_grad(set_to_none=step == 0)
        engine.backward(plain_loss(engine, x))
        engine.step()
        model.zero_grad(set_to_none=step == 0)
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())
    engine.backward(plain_loss(engine, torch.randint(0, 128, (2, 17), generator=g)))
    with pytest.raises(TensorStateError, match="engine.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(TensorStateError, match="engine.named_parameters"):
        float(next(model.parameters()).grad.norm())
    model.to("cpu")  # what modules do to every .grad still works
    with pytest.raises(TensorStateError, match="export_safetensors"):  # a copy's blocks would run the engine's
        copy.deepcopy(model)
    engine.close()


def one_step(model, loss, opt=None) -> None:
    """One training step of ``loss``: on an engine (``model``), or on PyTorch's model with ``opt``."""
    if isinstance(model, Engine):
        model.backward(loss)
        model.step()
        model.zero_grad()
    else:
        loss.backward()
        opt.step()
        opt.zero_grad()


def _engine_beside_pytorch(tmp_path, fits):
    """An engine (its state streamed, or fitting the host budget) and the same model in PyTorch
    with its AdamW."""
    torch.manual_seed(0)
    ref = plain_gpt(4)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=2 * state if fits else state // 3)
    return engine, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)


def _goes_on_as_pytorch(engine, ref, opt, g):
    """After ``engine.zero_grad()``, two steps train the engine bitwise as PyTorch trains ``ref``."""
    engine.zero_grad()
    for _ in range(2):
        x = torch.randint(0, 128, (2, 17), generator=g)
        plain_loss(ref, x).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(plain_loss(engine, x))
        engine.step()
        engine.zero_grad()
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


def _steps_beside_pytorch(engine, ref, opt, clip):
    """Three steps of the engine beside PyTorch's with ``clip(ref, engine)`` between the backward
    and the step; then :func:`_goes_on_as_pytorch`."""
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        plain_loss(ref, x).backward()
        engine.backward(plain_loss(engine, x))
        clip(ref, engine)
        opt.step()
        opt.zero_grad()
        engine.step()
        engine.zero_grad()
    _goes_on_as_pytorch(engine, ref, opt, g)


@pytest.mark.parametrize("fits", [False, True], ids=["streams", "fits"])
def test_loss_backward_instead_of_engine_backward_is_a_clear_error(tmp_path, fits):
    """``loss.backward()`` (a PyTorch loop's habit) instead of ``engine.backward(loss)``: the
    engine's bookkeeping around the backward (the rest's gradients into the store, the commit
    ordering) did not run, and the step silently used other gradients. Now the first gradient that
    arrives outside engine.backward raises, naming it; after engine.zero_grad() training goes on
    as PyTorch's."""
    from offload_core.errors import TensorStateError
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits)
    assert (engine.activation_modes is None) == fits
    g = torch.Generator().manual_seed(1)
    with pytest.raises(TensorStateError, match=r"engine.backward\(loss\)"):
        plain_loss(engine, torch.randint(0, 128, (2, 17), generator=g)).backward()
    _goes_on_as_pytorch(engine, ref, opt, g)


@pytest.mark.parametrize("fits", [False, True], ids=["streams", "fits"])
def test_a_second_backward_through_one_forward_is_a_typed_error_naming_the_fix(tmp_path, fits):
    """Two losses of one forward, a backward each (``loss1.backward(retain_graph=True)`` in a
    PyTorch loop): the second raised PyTorch's RuntimeError, which says to pass
    ``retain_graph=True`` (engine.backward has no such argument). Now a ``TensorStateError`` says
    to add the losses into one backward, and that ``engine.zero_grad()`` drops what the failed one
    added; after it, training goes on as PyTorch's."""
    from offload_core.errors import TensorStateError
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits)
    g = torch.Generator().manual_seed(1)
    logits = engine(torch.randint(0, 128, (2, 16), generator=g))
    engine.backward(logits.pow(2).mean())
    with pytest.raises(TensorStateError, match=r"a second backward through one forward.*engine\.backward\(loss1 "
                                               r"\+ loss2\).*engine\.zero_grad\(\)"):
        engine.backward(logits.abs().mean())
    _goes_on_as_pytorch(engine, ref, opt, g)


@pytest.mark.parametrize("activations", ["recompute", "keep", "offload"])
def test_a_forward_dropped_without_a_backward_leaves_nothing_behind_at_once(tmp_path, activations):
    """A loss computed with grad and never back-propagated (logged without ``no_grad``): its graph
    goes when the loss does, by reference counting, and with it its saved activations in the store
    (and its block calls: sharded, the next backward was refused as a block called twice,
    ``test_distributed.py``). A kept graph of attention, whose transposed q, k, v views are kept
    by reference, held its store tensor in a cycle through autograd's C++ objects: never freed,
    one per block and forward. And a lookahead that found no room kept the forward's frames in its
    future's error until the garbage collector ran. Training after them is PyTorch's, bitwise."""
    import gc
    torch.manual_seed(0)
    ref = plain_gpt(4)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=state // 2, config=EngineConfig(activations=activations))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)

    def saved() -> list[str]:
        return [k for k in engine.store.keys() if "activations" in k]
    gc.collect()
    gc.disable()  # (what is freed must be freed without the collector)
    try:
        for _ in range(3):
            x = torch.randint(0, 128, (2, 17), generator=g)
            for _ in range(3):
                plain_loss(engine, x).item()  # logged, never back-propagated
            loss = plain_loss(engine, x)
            assert len(saved()) == 4  # this forward's alone
            one_step(engine, loss)
            assert saved() == []
            one_step(ref, plain_loss(ref, x), opt)
    finally:
        gc.enable()
    assert engine.activation_modes == [activations] * 4
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


@pytest.mark.filterwarnings("ignore:forward hooks")
def test_a_forward_backward_pass_an_error_undid_leaves_nothing_behind(tmp_path):
    """An error in a micro-batch's forward undoes ``forward_backward``'s pass, and the loop runs the
    micro-batches (raising where the loop raises; here it does not: the error came once). The
    threads' errors held the pass's frames, and those the list of errors, a cycle: the pass's
    saved activations stayed in the store until the garbage collector ran."""
    import gc
    torch.manual_seed(0)
    model = plain_gpt(4)
    state = 16 * sum(p.numel() for p in model.parameters())
    armed = [True]

    def fails_once(mod, args, out):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("a transient error in block 2")
    model.blocks[2].fc.register_forward_hook(fails_once)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 2,
                    config=EngineConfig(activations="offload"))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    gc.collect()
    gc.disable()  # (what is freed must be freed without the collector)
    try:
        losses = engine.forward_backward([x, x], lambda out, b: out.pow(2).mean())
        assert not armed[0] and len(losses) == 2
        engine.step()
        engine.zero_grad()
        out = engine(x)
        assert len([k for k in engine.store.keys() if "activations" in k]) == 4  # this forward's alone
        del out
    finally:
        gc.enable()
    engine.close()


@pytest.mark.filterwarnings("ignore:forward hooks")
@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_views_with_gaps_a_kept_graph_saves_go_into_the_store(tmp_path, activations):
    """Attention's q, k and v sliced from one projection's output (GPT-2's fused qkv) are views
    with gaps. A kept graph held them by reference, and with them that output's whole storage:
    about a sixth of each block's saved activations stayed in memory outside the budget (on a GPU,
    in its memory), never offloaded. They go into the store now, with the span of the storage
    they cover together copied once, so the views keep their strides and places: training is
    PyTorch's, bitwise."""
    import weakref
    torch.manual_seed(0)
    ref = plain_gpt(4)
    model = copy.deepcopy(ref)
    outputs = []
    for block in model.blocks:
        block.qkv.register_forward_hook(lambda mod, args, out: outputs.append(weakref.ref(out.untyped_storage())))
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 2,
                    config=EngineConfig(activations=activations))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        outputs.clear()
        loss = plain_loss(engine, x)
        assert len(outputs) == 4 and not any(o() is not None for o in outputs)  # none held outside the store
        one_step(engine, loss)
        one_step(ref, plain_loss(ref, x), opt)
    assert engine.activation_modes == [activations] * 4
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


def test_a_graph_the_store_has_no_room_for_stays_in_memory_this_once_bitwise(tmp_path, monkeypatch):
    """A block's graph that the compute tier cannot take when it is sealed (what is pinned splits
    it) stays in memory for its backward, as PyTorch keeps it, and the block recomputes from then
    on: attention's views with gaps among its saved tensors, too."""
    from offload_core.errors import TierCapacityError
    from tiered_offload.store.tiered_store import TieredStore
    torch.manual_seed(0)
    ref = plain_gpt(4)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 2,
                    config=EngineConfig(activations="keep"))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    create, full = TieredStore.create, [False]

    def no_room_for_block_1(self, key, *args, **kwargs):
        if full[0] and key.startswith("block.1/activations"):
            raise TierCapacityError("no room (the test)")
        return create(self, key, *args, **kwargs)
    monkeypatch.setattr(TieredStore, "create", no_room_for_block_1)
    for step in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        full[0] = step == 1
        one_step(engine, plain_loss(engine, x))
        one_step(ref, plain_loss(ref, x), opt)
    assert engine.activation_modes == ["keep", "recompute", "keep", "keep"]
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


def _gpt_beside_pytorch(tmp_path, activations, frozen_rest=False):
    """The tests' GPT on an engine (its blocks' ``activations`` at half the state's budget; None:
    the whole state fits) and in PyTorch with its AdamW, and a generator for the batches;
    ``frozen_rest``: only the blocks train (the embeddings and head frozen, a LoRA-style run)."""
    torch.manual_seed(0)
    ref = plain_gpt(4)
    for name, p in ref.named_parameters():
        p.requires_grad_(name.startswith("blocks.") or not frozen_rest)
    state = 16 * sum(p.numel() for p in ref.parameters())
    config = EngineConfig(activations=activations) if activations else None
    engine = Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=state // 2 if activations else 3 * state, config=config)
    assert (engine.activation_modes is None) == (activations is None)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    return engine, ref, opt, torch.Generator().manual_seed(1)


@pytest.mark.parametrize("activations", ["recompute", "keep", None], ids=["recompute", "keep", "fits"])
def test_a_forward_without_grad_before_the_backward_leaves_the_training_graph_whole(tmp_path, activations):
    """A forward under ``no_grad`` between a training forward and its backward (a target from the
    same model, old log-probabilities, a metric): it let go of the rest's weights, which the
    training graph still needed, and the backward failed in PyTorch's kernels ("more than one
    element of the written-to tensor refers to a single memory location"). The rest stays bound
    now until that backward: PyTorch's, bitwise."""
    engine, ref, opt, g = _gpt_beside_pytorch(tmp_path, activations)

    def loss_of(model, x):
        out = model(x)
        with torch.no_grad():
            target = model(x).softmax(-1)
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))
    for _ in range(3):
        x = torch.randint(0, 128, (2, 16), generator=g)
        one_step(engine, loss_of(engine, x))
        one_step(ref, loss_of(ref, x), opt)
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


@pytest.mark.parametrize("activations, between", [
    (a, b) for a in ("recompute", "keep", None)
    for b in ("zero_grad", "zero_grad(set_to_none=False)", "named_parameters", "accumulating")
    if a != "keep" or b in ("zero_grad", "accumulating")], ids=lambda v: {None: "fits"}.get(v, v))
def test_zero_grad_or_reading_the_weights_between_forward_and_backward_is_pytorchs(tmp_path, activations, between):
    """``loss = model(x); optimizer.zero_grad(); loss.backward(); optimizer.step()``, PyTorch's
    loops' other order, and the weights read (a norm logged) between the forward and the
    backward: each let go of the rest's weights the training graph still held, and the backward
    failed in PyTorch's kernels. With accumulation, the zero_grad after the first micro-batch's
    forward zeroes what the step before left, not what this step has added. PyTorch's, bitwise."""
    engine, ref, opt, g = _gpt_beside_pytorch(tmp_path, activations)
    for _ in range(3):
        xs = [torch.randint(0, 128, (2, 17), generator=g) for _ in range(2 if between == "accumulating" else 1)]
        for model, optimizer in ((engine, engine.optimizer), (ref, opt)):
            backward = model.backward if model is engine else torch.Tensor.backward
            for i, x in enumerate(xs):
                loss = plain_loss(model, x)
                if between == "named_parameters":
                    norms = [w.norm() for _, w in (model.named_parameters())]
                    assert len(norms) == len(list(ref.parameters()))
                elif i == 0:
                    optimizer.zero_grad(set_to_none=between != "zero_grad(set_to_none=False)")
                backward(loss)
            optimizer.step()
            if between == "named_parameters":
                optimizer.zero_grad()
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


@pytest.mark.parametrize("between", ["another backward", "clip_grad_norm_", "step"])
@pytest.mark.parametrize("activations", ["recompute", "keep", None], ids=["recompute", "keep", "fits"])
def test_a_backward_after_the_engine_let_go_of_its_forwards_weights_is_refused(tmp_path, activations, between):
    """Two forwards and a backward each (``l1 = model(a); l2 = model(b); l1.backward();
    l2.backward()``), or ``clip_grad_norm_`` / ``step`` between a forward and its backward: the
    engine lets go of the weights outside the blocks after those, and the second graph read
    placeholders for them. With the embeddings and head frozen (a LoRA-style run) that was silent:
    other gradients for every block. Now the backward is refused, typed, naming the fix; after
    ``zero_grad()`` training goes on as PyTorch's."""
    from offload_core.errors import TensorStateError
    engine, ref, opt, g = _gpt_beside_pytorch(tmp_path, activations, frozen_rest=True)
    x = torch.randint(0, 128, (2, 17), generator=g)
    loss = plain_loss(engine, x)
    if between == "another backward":
        engine.backward(plain_loss(engine, x))
    elif between == "clip_grad_norm_":
        engine.clip_grad_norm_(1.0)
    else:
        engine.step()
    with pytest.raises(TensorStateError, match=r"let go of.*engine\.backward\(loss1 \+ loss2\)"):
        engine.backward(loss)
    del loss
    _goes_on_as_pytorch(engine, ref, opt, g)


def test_a_model_an_engine_already_streams_is_refused_by_name(tmp_path):
    """A second engine on the same model object (another run in a notebook, a resume that reuses
    the model): its blocks are the first engine's stand-ins. It said "no block sequence"; now it
    says what happened and what to pass instead."""
    model = plain_gpt(4)
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, {}, storage=tmp_path / "a", host_memory=state // 2):
        pass
    with pytest.raises(ConfigError, match="already streams"):
        Engine(model, torch.optim.AdamW, {}, storage=tmp_path / "b", host_memory=state // 2)


def _distillation_pair(tmp_path, activations, teacher_trains=lambda name: True):
    """A teacher (the tests' GPT, 6 blocks; its parameters whose name ``teacher_trains`` accepts
    trainable) and a student (4 blocks), each on an engine of its own at half its state, and the
    same two in PyTorch with the student's AdamW."""
    torch.manual_seed(0)
    teacher, student = plain_gpt(6), plain_gpt(4)
    for name, p in teacher.named_parameters():
        p.requires_grad_(teacher_trains(name))
    engines = []
    for name, model in (("teacher", teacher), ("student", student)):
        state = 16 * sum(p.numel() for p in model.parameters())
        engines.append(Engine(copy.deepcopy(model), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / name,
                              host_memory=state // 2, config=EngineConfig(activations=activations)))
    teacher.eval()
    engines[0].eval()
    return engines, teacher, student, torch.optim.AdamW(student.parameters(), lr=1e-2)


def _distillation_loss(student, teacher, x):
    logits = student(x[:, :-1])
    soft = F.kl_div(logits.log_softmax(-1), teacher(x[:, :-1]).log_softmax(-1), log_target=True, reduction="batchmean")
    return soft + F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


@pytest.mark.parametrize("activations", ["recompute", "keep"])
def test_a_teacher_on_its_own_engine_distils_into_a_student_bitwise(tmp_path, activations):
    """Distillation with both models streamed, one engine each, in one process: the teacher's
    outputs under ``no_grad`` in the student's loss; the student trains as PyTorch's, the teacher
    is left as it was."""
    (t_engine, s_engine), teacher, student, opt = _distillation_pair(tmp_path, activations)
    before = {k: v.clone() for k, v in t_engine.named_parameters()}
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        with torch.no_grad():
            soft = t_engine(x[:, :-1])
        one_step(s_engine, _distillation_loss(s_engine, lambda _: soft, x))
        with torch.no_grad():
            soft = teacher(x[:, :-1])
        one_step(student, _distillation_loss(student, lambda _: soft, x), opt)
    weights = dict(s_engine.named_parameters())
    assert all(torch.equal(weights[k], p) for k, p in student.named_parameters())
    assert all(torch.equal(before[k], v) for k, v in t_engine.named_parameters())
    t_engine.close()
    s_engine.close()


@pytest.mark.parametrize("activations", ["recompute", "keep"])
@pytest.mark.parametrize("trains", ["everything", "blocks"])
def test_a_backward_through_another_engines_forward_is_refused_naming_it(tmp_path, activations, trains):
    """The teacher's outputs taken with grad: the student's backward reaches the teacher engine's
    parameters. It was refused with the message for ``loss.backward()`` ("call engine.backward
    instead"), which the user had called; now the message says that the loss runs through
    another engine's forward and how to take its outputs. Then training goes on as PyTorch's."""
    from offload_core.errors import TensorStateError
    # the teacher's embeddings and head frozen: its blocks' gradients arrive first
    trained = (lambda name: True) if trains == "everything" else (lambda name: name.startswith("blocks."))
    (t_engine, s_engine), teacher, student, opt = _distillation_pair(tmp_path, activations, trained)
    x = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with pytest.raises(TensorStateError, match=r"another engine.*torch\.no_grad\(\)"):
        s_engine.backward(_distillation_loss(s_engine, t_engine, x))
    t_engine.zero_grad()
    with torch.no_grad():  # the teacher still gives PyTorch's outputs
        assert torch.equal(t_engine(x[:, :-1]), teacher(x[:, :-1]))
    t_engine.close()
    _goes_on_as_pytorch(s_engine, student, opt, torch.Generator().manual_seed(2))


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "forward_backward"])
def test_hooks_registered_after_the_engine_see_pytorchs_tensors(tmp_path, fused):
    """Hooks a user puts on a block, and on a module inside one, after the engine was built
    (gradient logging: ``register_full_backward_hook`` / ``_pre_hook``, ``register_forward_hook``)
    see PyTorch's tensors, bitwise. Through ``forward_backward`` the calls come in the pass's order
    (``engine/micro_batches.py``): a block's for every micro-batch before the next block's; in its
    backward every micro-batch's output gradient, then every one's input gradient."""
    import tiered_offload
    torch.manual_seed(0)
    ref = llama(4)
    model = copy.deepcopy(ref)
    n = sum(p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory=8 * n)
    calls = {"pytorch": [], "engine": []}

    def hook(into, what):
        def fn(module, *tensors):
            if what == "forward" and tiered_offload.recomputing():  # (a recompute runs forward hooks again)
                return
            out = tensors[-1] if what == "forward" else tensors[-1][0]
            calls[into].append((what, (out[0] if isinstance(out, tuple) else out).detach().clone()))
        return fn
    for into, m in (("pytorch", ref), ("engine", model)):
        for where in (m.model.layers[2], m.model.layers[1].mlp.down_proj):
            where.register_forward_hook(hook(into, "forward"))
            where.register_full_backward_pre_hook(hook(into, "output gradient"))
            where.register_full_backward_hook(hook(into, "input gradient"))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 128, (2, 17), generator=g) for _ in range(2)]
    if fused:
        engine.forward_backward([dict(input_ids=x, labels=x) for x in xs], lambda out, b: out.loss)
    else:
        for x in xs:
            engine.backward(hf_loss(engine, x))
    for x in xs:
        hf_loss(ref, x).backward()
    mine, theirs = calls["engine"], calls["pytorch"]
    assert len(mine) == len(theirs) == 2 * 6
    if fused:  # the loop's calls, in the pass's order: inner module, block; forward, then backward
        per = [theirs[:6], theirs[6:]]  # the loop's: micro-batch 0's, then micro-batch 1's
        order = [(0, 0), (1, 0), (0, 1), (1, 1),  # layer 1's down_proj, then block 2, each for both micro-batches
                 (0, 2), (1, 2), (0, 3), (1, 3),  # block 2's output gradients, then its input gradients
                 (0, 4), (0, 5), (1, 4), (1, 5)]  # down_proj's, inside block 1's turn for each micro-batch
        theirs = [per[k][i] for k, i in order]
    for (what, a), (same, b) in zip(mine, theirs):
        assert what == same and torch.equal(a, b), what
    engine.close()


def test_engine_train_and_eval_switch_the_models_mode_as_pytorchs_do(tmp_path):
    """``engine.eval()`` and ``engine.train()`` as ``nn.Module``'s (DeepSpeed's engine has them):
    dropout off, then on again; each returns the engine."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, context=32, d_model=32, n_layers=4, n_heads=4, dropout=0.5))
    ref = copy.deepcopy(model)
    state = 16 * sum(p.numel() for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=state // 2)
    x = torch.randint(0, 128, (2, 16))
    assert engine.eval() is engine and not engine.training and not model.training
    with torch.no_grad():
        assert torch.equal(engine(x), ref.eval()(x))
    assert engine.train() is engine and engine.training and all(m.training for m in model.modules())
    with torch.no_grad():
        assert not torch.equal(engine(x), ref(x))  # dropout on again
    assert engine.train(False) is engine and not engine.training
    engine.close()


def _gpt2_with_dropout_streamed(tmp_path):
    """A GPT-2 with dropout 0.5 everywhere, a copy of it, and an engine streaming the first at half the state."""
    cfg = _transformers().GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                                     resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    torch.manual_seed(0)
    model = _transformers().GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    state = 16 * sum(p.numel() for p in model.parameters())
    return model, ref, Engine(model, torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=state // 2)


def test_model_apply_reaches_the_blocks_modules_as_pytorchs_does(tmp_path):
    """``model.apply(fn)`` after the engine was built (turning dropout off for a phase, a user's
    attribute on every attention module) reaches the modules inside the streamed blocks, in
    PyTorch's order, and the engine's forward then computes what PyTorch's does. It reached the
    blocks' stand-ins only: their dropout stayed on, silently."""
    model, ref, engine = _gpt2_with_dropout_streamed(tmp_path)
    seen = {"engine": [], "pytorch": []}

    def no_dropout(into):
        def fn(m):
            seen[into].append(type(m).__name__)
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return fn

    assert model.apply(no_dropout("engine")) is model
    ref.apply(no_dropout("pytorch"))
    assert seen["engine"] == seen["pytorch"] and seen["engine"].count("Dropout") > 4
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert model.training and torch.equal(engine(x).logits, ref(x).logits)
    engine.backward(hf_loss(engine, x))
    hf_loss(ref, x).backward()
    opt = torch.optim.AdamW(ref.parameters())
    engine.step()
    opt.step()
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())
    with pytest.raises(TensorStateError, match=r"transformer\.h\.0\.attn\.c_attn\.weight: zero_"):
        model.apply(lambda m: nn.init.zeros_(m.weight) if type(m).__name__ == "Conv1D" else None)
    engine.close()


def test_a_walk_over_model_modules_reaches_the_blocks_modules_as_pytorchs_does(tmp_path):
    """TRL's ``disable_dropout_in_model`` and the like: ``for m in model.modules(): if isinstance(m,
    nn.Dropout): m.p = 0``, after the engine was built. The walk stopped at the blocks' stand-ins, so
    every block's dropout stayed on, silently. ``model.modules()`` / ``named_modules()`` now reach
    the modules inside the blocks under PyTorch's names (the stand-in where the block is), and the
    engine computes what PyTorch does; the parameters and buffers listed are PyTorch's."""
    model, ref, engine = _gpt2_with_dropout_streamed(tmp_path)
    assert [n for n, _ in model.named_modules()] == [n for n, _ in ref.named_modules()]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()]
    for walked in (model, ref):
        for m in walked.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert model.training and torch.equal(engine(x).logits, ref(x).logits)
    engine.close()


def test_clip_grad_norm_takes_pytorchs_keywords(tmp_path):
    """``engine.clip_grad_norm_`` takes ``torch.nn.utils.clip_grad_norm_``'s keywords, so a loop's
    call ports as it is (it raised ``TypeError``): ``error_if_nonfinite=True`` refuses a non-finite
    norm before anything is clipped, ``foreach`` changes no value."""
    torch.manual_seed(0)
    ref = plain_gpt(2)
    engine = Engine(copy.deepcopy(ref), storage=tmp_path / "s", host_memory="1MiB")
    x = torch.randint(0, 128, (2, 9))
    engine.backward(torch.sqrt(engine(x).abs().sum() * 0))  # a finite loss, non-finite gradients
    assert not torch.isfinite(engine.clip_grad_norm_(1.0, error_if_nonfinite=False))
    with pytest.raises(NonFiniteError, match=r"total norm of order 2\.0.*non-finite.*error_if_nonfinite=False"):
        engine.clip_grad_norm_(1.0, 2.0, error_if_nonfinite=True)
    engine.zero_grad()
    opt = torch.optim.AdamW(ref.parameters())
    for foreach in (True, False, None):
        engine.backward(plain_loss(engine, x))
        plain_loss(ref, x).backward()
        mine = engine.clip_grad_norm_(0.1, norm_type=2.0, error_if_nonfinite=True, foreach=foreach)
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=2.0, error_if_nonfinite=True,
                                                foreach=foreach)
        assert torch.equal(mine, theirs)
        engine.step()
        opt.step()
        engine.zero_grad()
        opt.zero_grad()
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())
    engine.close()


def test_nonfinite_skip_mode():
    engine = Engine(plain_gpt(2), storage="memory", host_memory="1MiB", on_nonfinite="skip")
    before = dict(engine.named_parameters())
    x = torch.randint(0, 128, (2, 9))
    engine.backward(plain_loss(engine, x) * float("inf"))
    assert engine.step() is False
    assert all(torch.equal(before[k], v) for k, v in engine.named_parameters())
    engine.backward(plain_loss(engine, x))
    assert engine.step() is True
    engine.close()


def test_disk_too_small_is_refused_up_front():
    backend = FaultInjectingBackend(MemoryBackend(), write_quota_bytes=10_000)
    with pytest.raises(DiskFullError) as info:
        Engine(plain_gpt(2), storage=backend, host_memory="1MiB")
    assert info.value.needed_bytes > info.value.free_bytes == 10_000


@pytest.mark.parametrize("refusal", ["update on the host", "activations per block", "step deferred"])
def test_a_refused_engine_leaves_the_model_and_its_directory_as_they_were(tmp_path, refusal):
    """An engine refused at construction (its budgets or its configuration) leaves the model's
    weights in the model and the storage directory free, so the same model builds the next engine
    with what the error said to change. Before, three refusals came after the weights had moved
    into the refused engine's store: the model kept empty placeholders, the next engine refused
    it ("an engine already streams this GPT") and its directory stayed locked by this process."""
    torch.manual_seed(0)
    model = plain_gpt(8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = 16 * sum(p.numel() for p in model.parameters())
    wrong = {"update on the host": dict(host_memory=100_000, store_config={"device_budget_bytes": state // 2},
                                        config=EngineConfig(optimizer_device="host")),
             "activations per block": dict(host_memory=state // 4, config=EngineConfig(activations=["keep"] * 3)),
             "step deferred": dict(host_memory=280_000, config=EngineConfig(defer_step=True))}[refusal]
    with pytest.raises((TierCapacityError, ConfigError)):
        Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", **wrong)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory=state // 4) as engine:
        assert all(torch.equal(before[k], w) for k, w in engine.named_parameters())
        engine.backward(plain_loss(engine, torch.randint(0, 128, (2, 17))))
        engine.step()


@pytest.mark.parametrize("mode", ["overlap_step", "defer_step"])
def test_a_step_mode_forced_below_its_budget_is_refused_up_front(tmp_path, mode):
    """``overlap_step=True`` / ``defer_step=True`` run a unit's update beside what the forward pins
    in the compute tier. Below the budget the planner would choose the mode at, the update failed
    mid-step for room (a fuzzed run: RMSprop's three states deferred, 120 KiB against 144 KiB;
    ``tools/fuzz_options.py``); it is refused when the engine is built, with the budget it needs,
    and accepted from that budget on."""
    with Engine(plain_gpt(8), storage=None, host_memory=10 ** 9) as sizing:
        sizes = sizing.schedule
        need = sizes.overlap_budget(0) if mode == "overlap_step" else sizes.defer_budget()
        assert sizes.working_set().need < need  # (a budget between the two: the engine runs, not in this mode)
    with pytest.raises(TierCapacityError, match=rf"EngineConfig.{mode}=True .* \({need} bytes\) needed"):
        Engine(plain_gpt(8), storage=tmp_path / "a", host_memory=need - 8192, config=EngineConfig(**{mode: True}))
    with Engine(plain_gpt(8), storage=tmp_path / "b", host_memory=need, config=EngineConfig(**{mode: True})) as engine:
        assert engine.step_mode == ("overlapped" if mode == "overlap_step" else "deferred")


def test_storage_full_in_mid_training_is_a_clear_error():
    """Writes start failing with ENOSPC after the preflight passed: the error surfaces, typed, with numbers."""
    torch.manual_seed(0)
    model = plain_gpt(8)
    n = sum(p.numel() for p in model.parameters())
    backend = FaultInjectingBackend(MemoryBackend(), write_quota_bytes=16 * 4 * n + 200_000)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=backend, host_memory="400KiB")
    x = torch.randint(0, 128, (2, 17))
    with pytest.raises(DiskFullError) as info:
        for _ in range(20):
            engine.backward(plain_loss(engine, x))
            engine.step()
            engine.zero_grad()
        engine.named_parameters().__next__()
    assert info.value.needed_bytes > 0 and info.value.free_bytes is not None
    # the injected ENOSPC of a write, or the reservation before one (which disk step meets the
    # quota first depends on the order of writes): either names the tensor and the numbers
    assert "injected ENOSPC" in str(info.value) or "not enough free disk for tensor" in str(info.value)
    try:
        engine.close()  # it flushes, and the disk is still full: it may say so again
    except DiskFullError:
        pass


@pytest.mark.parametrize("call", ["add_param_group", "state_dict", "load_state_dict", "GradScaler", "state[p]"])
def test_what_the_engines_optimizer_cannot_honour_is_refused_naming_the_way(tmp_path, call):
    """``engine.optimizer`` stands in for the optimizer (for LR schedulers). A new parameter group
    was taken and never trained; ``state_dict()`` gave an empty state that a checkpoint saved as if
    it were the optimizer's, and ``load_state_dict`` loaded into nothing (silently, each); a
    ``GradScaler`` stopped with "No inf checks were recorded for this optimizer"; ``state[p]`` (a
    moment read to log it) gave ``{}``. Each is now a typed error that names what to do; training
    goes on as PyTorch's after it."""
    from offload_core.errors import TensorStateError
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (2, 17), generator=g)
    if call == "add_param_group":
        with pytest.raises(ConfigError, match=r"add_param_group.*export_safetensors.*init_from"):
            engine.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    elif call == "state_dict":
        with pytest.raises(TensorStateError, match=r"state_dict.*store.*Engine.resume"):
            engine.optimizer.state_dict()
    elif call == "load_state_dict":
        with pytest.raises(TensorStateError, match=r"load_state_dict.*store.*Engine.resume"):
            engine.optimizer.load_state_dict(opt.state_dict())
    elif call == "state[p]":
        p = next(engine.model.parameters())
        with pytest.raises(TensorStateError, match=r"engine\.optimizer\.state\[\.\.\.\]:.*store.*Engine.resume"):
            engine.optimizer.state[p]["exp_avg"]
        with pytest.raises(TensorStateError, match=r"engine\.optimizer\.state"):
            len(engine.optimizer.state)
    else:
        scaler = torch.amp.GradScaler("cpu")
        engine.backward(scaler.scale(plain_loss(engine, x)))
        with pytest.raises(TensorStateError, match=r"GradScaler.*bfloat16"):
            scaler.step(engine.optimizer)
    assert len(engine.param_groups) == 1
    _goes_on_as_pytorch(engine, ref, opt, g)


@pytest.mark.parametrize("edit", ["nn.init", "clamp_ under no_grad", "new .data", "model.to(bfloat16)"])
@pytest.mark.parametrize("where", ["blocks.1.qkv.weight", "ln_f.weight"])
def test_a_weight_changed_between_the_engines_calls_is_refused_naming_it(tmp_path, edit, where):
    """Between the engine's calls a parameter holds a placeholder (its weights are in the store):
    ``nn.init`` on it, a weight constraint clamped in place after ``step()``, new ``.data``: each
    was made to nothing and training went on as if it had not happened (silently);
    ``model.to(torch.bfloat16)`` failed in a matmul, blamed on the batch. An in-place change is now
    refused where it is made, new data and another dtype at the next forward, each naming the
    parameter and the way."""
    from offload_core.errors import TensorStateError
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits=False)
    model = engine.model
    x = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    engine.backward(plain_loss(engine, x))
    engine.step()
    engine.zero_grad()
    p = model.get_parameter(where)
    with torch.no_grad():
        if edit in ("nn.init", "clamp_ under no_grad"):
            with pytest.raises(TensorStateError, match=rf"{where}: (normal_|clamp_) changes its values.*lost.*"
                                                         rf"init_from.*parametriz"):
                nn.init.normal_(p) if edit == "nn.init" else p.clamp_(-0.01, 0.01)
            engine.close()
            return
        if edit == "new .data":
            p.data = torch.zeros(ref.get_parameter(where).shape)
        else:
            model.to(torch.bfloat16)
    error, match = (ConfigError, r"bfloat16.*model.float\(\)") if edit == "model.to(bfloat16)" else \
        (TensorStateError, rf"{where}.*changed after the engine was built.*init_from.*parametriz")
    with pytest.raises(error, match=match):
        engine(x[:, :-1])
    engine.close()


@pytest.mark.parametrize("fits", [False, True], ids=["streams", "fits"])
def test_model_parameters_lists_every_parameter_with_its_name_and_shape(tmp_path, fits):
    """``model.parameters()`` of the engine's model listed the parameters outside the streamed
    blocks only, each of shape ``[0]``: a parameter count (``sum(p.numel() ...)``, Hugging Face's
    ``num_parameters()``, a "trainable parameters" log line) said 0, silently. It now lists every
    parameter, by the names and in the order of the model before, each with its shape, dtype and
    ``requires_grad``; its values stay in the store (next test)."""
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits)
    ref.blocks[1].fc.weight.requires_grad_(False)
    engine.model.blocks[1].fc.weight.requires_grad_(False)  # (refused at the next forward: only the listing here)
    before = [(n, p.shape, p.dtype, p.requires_grad) for n, p in ref.named_parameters()]
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in engine.model.named_parameters()] == before
    assert sum(p.numel() for p in engine.model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert all(isinstance(p, nn.Parameter) for p in engine.model.parameters())
    engine.close()


def test_moving_the_model_moves_placeholders_and_float_puts_it_back(tmp_path):
    """``model.to(torch.bfloat16)`` between the engine's calls gives each parameter a placeholder of
    that dtype (one element: nothing of the model's size is allocated); ``model.float()`` and a
    ``model.to("cpu")`` that changes nothing put it back, and training goes on as PyTorch's."""
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits=False)
    model = engine.model
    model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(set(p.stride()) <= {0} for p in model.parameters())  # (expanded: one element each)
    model.float()
    model.to("cpu")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    _goes_on_as_pytorch(engine, ref, opt, torch.Generator().manual_seed(1))


@pytest.mark.parametrize("when, use", [
    (w, u) for u in ("an L2 penalty over model.parameters()", "parameters_to_vector", "an EMA's copy", "p.data",
                     "the head's weight outside the forward", "print")
    for w in ("between the calls", "after the forward")
    if w == "after the forward" or u in ("an L2 penalty over model.parameters()", "an EMA's copy", "p.data")])
def test_a_parameters_values_read_outside_the_engine_are_refused_naming_it(tmp_path, use, when):
    """Between the engine's calls a parameter holds no values (they are in the store), and a
    streamed block's never does outside the block's forward. An L2 penalty summed over
    ``model.parameters()`` after the forward summed the rest's weights and left the blocks' out;
    before it, it was 0. An EMA copying the parameters copied empty tensors, and the embedding's
    weight read for a tied output outside the forward was empty too. Each went on silently. Each
    is now a TensorStateError that names the parameter and the way; training goes on as
    PyTorch's after it."""
    from offload_core.errors import TensorStateError
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits=False)
    model = engine.model
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (2, 17), generator=g)
    reads = {
        "an L2 penalty over model.parameters()": lambda: sum(p.pow(2).sum() for p in model.parameters()),
        "parameters_to_vector": lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
        "an EMA's copy": lambda: {n: p.detach().clone() for n, p in model.named_parameters()},
        "p.data": lambda: [p.data.norm() for p in model.parameters()],
        "the head's weight outside the forward": lambda: x.float() @ model.blocks[0].qkv.weight[:17],
        "print": lambda: [repr(p) for p in model.parameters()],
    }
    out = engine(x[:, :-1]) if when == "after the forward" else None
    first = "blocks.0.qkv.weight" if use == "the head's weight outside the forward" else \
        "tok.weight" if when == "between the calls" else "blocks.0.ln1.weight"
    with pytest.raises(TensorStateError, match=rf"{re.escape(first)}.*store.*engine.named_parameters"):
        reads[use]()
    if out is not None:
        engine.backward(F.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()))
        plain_loss(ref, x).backward()
        opt.step()
        opt.zero_grad()
        engine.step()
    _goes_on_as_pytorch(engine, ref, opt, g)


@pytest.mark.parametrize("mode", ["recompute", "keep", "offload", "fits"])
def test_an_input_gradient_through_the_blocks_is_pytorchs_and_adds_to_no_weight(tmp_path, mode, monkeypatch):
    """``torch.autograd.grad(loss, inputs)`` through the streamed blocks (a saliency map, an
    adversarial example: FGSM on the embeddings) was refused as "a gradient arrived outside
    engine.backward", after the blocks had added their weights' gradients. PyTorch adds into no
    ``.grad`` there. Now the blocks give the inputs' gradients alone, bitwise PyTorch's, and the
    training step after it (a second forward, on the perturbed embeddings) is PyTorch's, bitwise.
    A second backward through a streamed forward (``retain_graph=True``) is refused, typed."""
    from offload_core.errors import TensorStateError
    torch.manual_seed(0)
    ref = plain_gpt(4)
    model = copy.deepcopy(ref)
    state = 16 * sum(p.numel() for p in ref.parameters())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    emb, noise = {}, {}

    def perturb(module, args, out):  # the embeddings: kept for the gradient, perturbed if asked
        emb["out"] = out
        return out + noise["d"] if "d" in noise else out
    for m in (ref, model):
        m.tok.register_forward_hook(perturb)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=2 * state if mode == "fits" else state // 3,
                    config=EngineConfig(activations="auto" if mode == "fits" else mode))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randint(0, 128, (2, 17), generator=g)
        grads = []
        for m in (ref, engine):
            noise.clear()
            gx, = torch.autograd.grad(plain_loss(m, x), emb["out"])
            grads.append(gx)
            noise["d"] = 0.01 * gx.sign()  # FGSM
            one_step(m, plain_loss(m, x), opt)
        assert torch.equal(grads[0], grads[1]), step
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())
    # input gradients alone, again and again (saliency maps): the engine keeps nothing of each
    from tiered_offload.engine.shared_inputs import SharedInputs
    monkeypatch.setattr(SharedInputs, "PRUNE_AT", 16)
    for _ in range(12):
        torch.autograd.grad(plain_loss(engine, x), emb["out"])
    assert len(engine._streamer.shared._by_id) <= 16 + 4
    noise.clear()
    loss = plain_loss(engine, x)
    torch.autograd.grad(loss, emb["out"], retain_graph=True)
    if mode == "fits":  # PyTorch's own graph kept: a second backward through it is PyTorch's
        engine.backward(loss)
    else:
        with pytest.raises(TensorStateError, match="second backward through one forward.*run the forward again"):
            engine.backward(loss)
    engine.close()


@pytest.mark.parametrize("mode", ["recompute", "offload", "fits"])
def test_a_gradient_penalty_through_the_blocks_is_pytorchs_or_refused_typed(tmp_path, mode):
    """A gradient penalty (``torch.autograd.grad(..., create_graph=True)``: WGAN-GP, R1, input
    smoothness) needs the blocks' backward itself differentiated. Through streamed blocks, their
    input gradients came back without a graph, so the penalty added nothing to the weights'
    gradients: silently PyTorch's loss without it. It is refused there, typed, before any block
    adds anything; where the state fits (PyTorch's graphs kept) it trains as PyTorch's, bitwise."""
    from offload_core.errors import TensorStateError
    from test_finetune import MLP, VOCAB, TinyLM, lm_loss
    torch.manual_seed(0)
    ref = TinyLM(lambda d: MLP(d), d=32, layers=4)  # (MLPs: PyTorch's fused attention has no double backward)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    state = 16 * sum(p.numel() for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=2 * state if mode == "fits" else state // 2,
                    config=EngineConfig(activations="auto" if mode == "fits" else mode))
    emb = {}
    for m in (ref, model):
        m.emb.register_forward_hook(lambda mod, args, out: emb.update(out=out))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randint(0, VOCAB, (2, 9), generator=g)
        for m in (ref, engine):
            loss = lm_loss(m, x)
            if m is engine and mode != "fits":
                with pytest.raises(TensorStateError, match=r"create_graph.*gradient penalty.*Not supported.*fits"):
                    torch.autograd.grad(loss, emb["out"], create_graph=True)
                engine.close()
                return
            gx, = torch.autograd.grad(loss, emb["out"], create_graph=True)
            one_step(m, loss + 0.1 * gx.pow(2).sum(), opt)
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


@pytest.mark.parametrize("first", [float("inf"), 0.5], ids=["measure-then-clip", "clip-twice"])
@pytest.mark.parametrize("fits", [False, True], ids=["streams", "fits"])
def test_clipping_twice_in_a_step_is_pytorchs_twice(tmp_path, first, fits):
    """Two ``clip_grad_norm_`` calls in one step (a norm measured for a log with ``inf``, then the
    clip; or a helper that clips and a loop that clips again): PyTorch's second call sees the first
    call's clipped gradients and scales them again. The engine's second call returned the norm
    before any clipping and scaled the step by the product of the two factors: other norms and
    other weights, silently. Now both calls return PyTorch's norms and the weights are its bits."""
    def clip(ref, engine):
        for max_norm in (first, 0.1):
            expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            assert torch.equal(engine.clip_grad_norm_(max_norm), expected)
    _steps_beside_pytorch(*_engine_beside_pytorch(tmp_path, fits), clip)


@pytest.mark.parametrize("where", ["a new head", "inside a block"])
def test_a_parameter_added_after_the_engine_is_built_is_refused_naming_it(tmp_path, where):
    """A module added or replaced after the engine was built (a new head, an adapter inside a block):
    the engine lays its store out when it is built, so the new parameters ran as plain tensors
    outside the budgets and were never trained, silently. The next forward now refuses them,
    naming the parameter and the way."""
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits=False)
    model = engine.model
    if where == "a new head":
        model.ln_f = nn.LayerNorm(32)
        name = r"ln_f\.weight"
    else:
        model.blocks[2].fc.extra = nn.Parameter(torch.zeros(1))
        name = r"blocks\.2\.fc\.extra"
    with pytest.raises(ConfigError, match=rf"{name} was added after the engine was built.*before building"):
        engine(torch.randint(0, 128, (2, 16)))
    engine.close()


@pytest.mark.parametrize("then_norm", [False, True], ids=["value", "value-then-norm"])
@pytest.mark.parametrize("fits", [False, True], ids=["streams", "fits"])
def test_clip_grad_value_is_pytorchs(tmp_path, then_norm, fits):
    """``torch.nn.utils.clip_grad_value_(model.parameters(), v)`` raised (the gradients are in the
    store), and the engine had nothing in its place: a loop that clips by value could not move.
    ``engine.clip_grad_value_(v)`` clamps every gradient as PyTorch does, before a norm clip too."""
    def clip(ref, engine):
        torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
        engine.clip_grad_value_(1e-3)
        if then_norm:
            assert torch.equal(engine.clip_grad_norm_(0.01), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    _steps_beside_pytorch(*_engine_beside_pytorch(tmp_path, fits), clip)


def test_a_device_named_with_or_without_its_index_trains(tmp_path):
    """``device="cuda"`` gives placeholders on ``cuda:0``: the check for a parameter moved to another
    device compared the two names and refused every forward. ``device="cpu:0"`` is the same case on
    the CPU (tensors made there are on ``cpu``)."""
    torch.manual_seed(0)
    model = plain_gpt(4)
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 3,
                device="cpu:0") as engine:
        for _ in range(2):
            engine.backward(plain_loss(engine, torch.randint(0, 128, (2, 17))))
            engine.step()
            engine.zero_grad()
        assert engine.step_count == 2


def test_a_cuda_device_without_an_index_is_the_current_one_by_number(monkeypatch):
    """``device="cuda"`` resolves to ``cuda:N``, the current device: ``torch.cuda.set_device`` refuses a
    device without an index, which on the GPU failed every ``forward_backward`` pass's threads (each
    step ran the loop instead). On the CPU, with torch told it sees a CUDA device."""
    from tiered_offload.config import resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("call", ["a loss without a gradient", "a loss of several elements", "not a tensor",
                                  "no micro-batch", "forward_backward under no_grad",
                                  "forward_backward, a loss without a gradient", "forward_backward, a tuple"])
def test_what_engine_backward_cannot_take_is_a_typed_error_naming_it(tmp_path, call):
    """A loss computed under ``torch.no_grad()`` (or from ``.detach()``) gave PyTorch's "element 0 of
    tensors does not require grad"; the engine's own checks raised plain ``ValueError`` and
    ``RuntimeError``. Each is now a :class:`TieredOffloadError` (still the builtin it was) that names
    what was wrong, and training goes on as PyTorch's after it."""
    from offload_core.errors import ModelInputError, TensorStateError, TieredOffloadError
    engine, ref, opt = _engine_beside_pytorch(tmp_path, fits=False)
    x = torch.randint(0, 128, (2, 17))
    with pytest.raises(TieredOffloadError) as caught:
        if call == "a loss without a gradient":
            with torch.no_grad():
                loss = plain_loss(engine, x)
            engine.backward(loss)
        elif call == "a loss of several elements":
            engine.backward(engine(x[:, :-1]))
        elif call == "not a tensor":
            engine.backward(3.0)
        elif call == "no micro-batch":
            engine.forward_backward([], lambda out, b: out.sum())
        elif call == "forward_backward, a loss without a gradient":  # (PyTorch's RuntimeError came through)
            engine.forward_backward([x[:, :-1], x[:, 1:]], lambda out, b: out.sum().detach())
        elif call == "forward_backward, a tuple":  # (a loss and what to log)
            engine.forward_backward([x[:, :-1], x[:, 1:]], lambda out, b: (out.sum(), {"tokens": b.numel()}))
        else:
            with torch.no_grad():
                engine.forward_backward([x[:, :-1]], lambda out, b: out.sum())
    expected = {"a loss without a gradient": (ModelInputError, "does not require a gradient.*no_grad"),
                "a loss of several elements": (ModelInputError, r"scalar.*got a tensor of shape \(2, 16, 128\)"),
                "not a tensor": (ModelInputError, "scalar.*got a float"),
                "no micro-batch": (ModelInputError, "at least one micro-batch"),
                "forward_backward, a loss without a gradient": (ModelInputError, "does not require a gradient"),
                "forward_backward, a tuple": (ModelInputError, r"scalar tensor.*loss_fn.*got a tuple"),
                "forward_backward under no_grad": (TensorStateError, "outside torch.no_grad")}[call]
    assert isinstance(caught.value, expected[0]) and re.search(expected[1], str(caught.value)), caught.value
    _goes_on_as_pytorch(engine, ref, opt, torch.Generator().manual_seed(1))


@pytest.mark.parametrize("durable", [False, True], ids=["scratch", "durable"])
def test_an_update_that_failed_part_way_stops_the_engine_saying_so(tmp_path, monkeypatch, durable):
    """An error in one unit's update (the optimizer's code, an out-of-memory) leaves the units
    before it with the step's new weights and the others with their old ones. The next forward,
    where the update ran beside it, reported it as the batch's fault ("TinyLM.forward rejected the
    batch"), and a loop that caught it (a skip-the-batch habit) trained on from that mix, silently,
    on scratch storage. Now every engine call that reads or changes the weights from then on raises
    ``StepFailedError``, naming the unit and how to go on; a durable engine's storage resumes, and
    trains on as PyTorch does."""
    from tiered_offload.engine.optimizer_step import UnitUpdater
    from test_finetune import MLP, TinyLM, batches, lm_loss, train

    def make():
        torch.manual_seed(0)
        return TinyLM(MLP, d=32, layers=6)
    data = batches(6, 1)
    state = 16 * sum(p.numel() for p in make().parameters())
    engine = Engine(make(), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state * 2 // 5,
                    durable=durable)
    update, calls = UnitUpdater.update, []

    def failing(self, unit, *args, **kwargs):
        calls.append(unit.name)
        if len(calls) == 3:
            raise RuntimeError("an error in the optimizer's code")
        return update(self, unit, *args, **kwargs)
    for s, step in enumerate(data[:3]):
        engine.backward(lm_loss(engine, step[0][0]))
        if s == 2:
            monkeypatch.setattr(UnitUpdater, "update", failing)
        engine.step()
        engine.zero_grad()
    for attempt in range(2):  # the loop goes on after the first report: so does the refusal
        with pytest.raises(StepFailedError) as info:
            engine.backward(lm_loss(engine, data[3][0][0]))
            engine.step()
        assert re.search(f"update of {calls[2]}.*an error in the optimizer's code.*cannot train on", str(info.value))
        assert ("resume=True" in str(info.value)) == durable, str(info.value)
    for call in (engine.step, lambda: engine.export_safetensors(tmp_path / "out"),
                 lambda: dict(engine.named_parameters())):
        with pytest.raises(StepFailedError):
            call()
    engine.zero_grad()  # (forgets gradients: nothing of the mix is read)
    monkeypatch.undo()
    engine.close()  # (reported already: the close releases the storage without raising it again)
    if durable:  # the journal finishes the step the storage recorded; training goes on as PyTorch's
        ref = make()
        train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, lm_loss, None)
        with Engine(make(), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state * 2 // 5,
                    resume=True) as engine:
            assert engine.step_count == 3
            for step in data[3:]:
                engine.backward(lm_loss(engine, step[0][0]))
                engine.step()
                engine.zero_grad()
            weights = dict(engine.named_parameters())
        assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())
