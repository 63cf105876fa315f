"""The planner, driven with numbers alone; and the engine's plan: readable, logged, overridable,
checked against the steps measured after it."""

import itertools
import logging

import pytest
import torch
import torch.nn.functional as F

from tiered_offload.engine.planner import DiskRates, Plan, StepMeasurement, make_plan
from tiered_offload.engine.schedule import Phase, Schedule, UnitLayout

MiB = 1 << 20


def base(n=4):
    return Plan(modes=["recompute"] * n, blocks=[f"block.{i}" for i in range(n)], prefetch_depth=16, overlap_step=False,
                host_split={"working_set": 60 * MiB, "activation_room": 30 * MiB, "cache": 10 * MiB})


def measured(n=4, seconds=2.0, wait=0.2, fwd=0.1, act=20 * MiB, read=400 * MiB, written=400 * MiB, busy=0.8):
    return StepMeasurement(seconds=seconds, io_wait_seconds=wait, disk_read=read, disk_written=written,
                           disk_busy_seconds=busy, forward_seconds=[fwd] * n, graph_bytes=[act] * n,
                           modes=["recompute"] * n)


FAST = DiskRates(2e9, 2e9, "test")


def test_a_disk_with_time_to_spare_takes_the_activations_instead_of_recomputing():
    plan = make_plan(base(), measured(), FAST, room=[30 * MiB] * 4, keep_room=30 * MiB, fixed=False)
    # recomputing costs 0.1 s a block; offloading 20 MiB costs 40 MiB of I/O (0.02 s), 90% of it hidden
    assert plan.modes == ["offload", "offload", "offload", "keep"]  # the last block's backward comes first
    assert plan.predicted_compute_s < 2.0 - 0.2 - 0.1  # less the recompute, plus the copies
    # the state streams (400 MiB read): the kept block's room held state, pushed out and read back
    assert plan.predicted_read == 400 * MiB + 4 * 20 * MiB and plan.predicted_written == plan.predicted_read
    text = plan.summary()
    assert "1 keep, 3 offload" in text and "predicted step" in text and "MiB read" in text


def test_kept_activations_cost_disk_bytes_only_where_the_state_streams():
    """Keeping a block's activations in the tier costs no I/O where the measured iteration read no
    state (the state fits). Where it read state, every tier was full of it: the kept activations
    push state out, written and read back (at 0.9 of the state, a plan that charged keeping
    nothing predicted 60 MiB read per step where 156-168 were measured)."""
    streams = make_plan(base(), measured(read=60 * MiB, written=60 * MiB), FAST, room=[30 * MiB] * 4,
                        keep_room=80 * MiB, fixed=False)
    fits = make_plan(base(), measured(read=0, written=60 * MiB), FAST, room=[30 * MiB] * 4, keep_room=80 * MiB,
                     fixed=False)
    assert streams.modes == fits.modes == ["keep"] * 4
    assert streams.predicted_read == 60 * MiB + 4 * 20 * MiB and streams.predicted_written == 60 * MiB + 4 * 20 * MiB
    assert fits.predicted_read == 0 and fits.predicted_written == 60 * MiB
    # measured under a plan that kept them: what the kept ones pushed out is not counted twice
    m = measured(read=140 * MiB, written=140 * MiB)
    m.modes = ["keep"] * 4
    again = make_plan(base(), m, FAST, room=[30 * MiB] * 4, keep_room=80 * MiB, fixed=True)
    assert again.predicted_read == 140 * MiB and again.predicted_written == 140 * MiB


def test_a_slow_disk_keeps_recomputing():
    slow = DiskRates(20e6, 20e6, "test")  # 20 MB/s: 40 MiB of extra I/O per block costs 2 s
    # an I/O-bound step: 42 s of disk transfers, 43 s waited for
    plan = make_plan(base(), measured(seconds=45, wait=43, busy=42), slow, room=[30 * MiB] * 4, keep_room=0,
                     fixed=False)
    assert plan.modes == ["recompute"] * 4


def test_activations_larger_than_the_room_are_recomputed_and_the_plan_says_why():
    plan = make_plan(base(), measured(act=40 * MiB), FAST, room=[30 * MiB] * 4, keep_room=30 * MiB, fixed=False)
    assert plan.modes == ["recompute"] * 4
    assert any("exceed the room" in r and "host_memory" in r for r in plan.reasons)


def test_offloaded_activations_are_planned_only_as_far_as_the_free_disk_holds_them():
    """The offloaded activations of a step sit on the disk together until the backward reads them
    back. A plan that offloads more than the free space holds would stop the run in its next step
    with DiskFullError; the plan recomputes those blocks instead and says so (a configured
    "offload" too: without the room it cannot run)."""
    plan = make_plan(base(), measured(), FAST, room=[30 * MiB] * 4, keep_room=0, fixed=False, disk_room=50 * MiB)
    assert plan.modes.count("offload") == 2 and plan.modes.count("recompute") == 2  # 20 MiB each
    assert any("free disk" in r and "50.0 MiB" in r for r in plan.reasons), plan.reasons
    roomy = make_plan(base(), measured(), FAST, room=[30 * MiB] * 4, keep_room=0, fixed=False, disk_room=1 << 40)
    assert roomy.modes == ["offload"] * 4 and not any("free disk" in r for r in roomy.reasons)
    # kept activations stay in memory: they take no disk room
    kept = make_plan(base(), measured(), FAST, room=[30 * MiB] * 4, keep_room=80 * MiB, fixed=False, disk_room=0)
    assert kept.modes == ["recompute"] * 4 or "offload" not in kept.modes
    m = measured()
    m.modes = ["offload", "offload", "offload", "keep"]
    fixed = make_plan(base(), m, FAST, room=[30 * MiB] * 4, keep_room=30 * MiB, fixed=True, disk_room=45 * MiB)
    assert fixed.modes == ["offload", "offload", "recompute", "keep"]
    assert any("free disk" in r and "block.2" in r for r in fixed.reasons), fixed.reasons


def test_the_disk_room_leaves_commits_their_space_and_shares_the_disk_among_ranks():
    from types import SimpleNamespace
    from tiered_offload.engine.plan_monitor import PlanMonitor
    monitor = lambda free, commits, ranks: SimpleNamespace(  # noqa: E731
        store=SimpleNamespace(backend=SimpleNamespace(free_bytes=lambda: free)), commit_disk_bytes=commits,
        ranks=ranks, DISK_SHARE=PlanMonitor.DISK_SHARE)
    assert PlanMonitor._disk_room(monitor(None, 0, 1)) is None  # the backend cannot tell: no limit
    assert PlanMonitor._disk_room(monitor(1000 * MiB, 100 * MiB, 1)) == int(0.9 * 900 * MiB)
    assert PlanMonitor._disk_room(monitor(1000 * MiB, 100 * MiB, 2)) == int(0.9 * 400 * MiB)
    assert PlanMonitor._disk_room(monitor(50 * MiB, 100 * MiB, 1)) == 0


def test_a_state_striped_over_two_drives_is_planned_at_their_rates_together(tmp_path, monkeypatch):
    """RAID-0 over ``n`` directories: a transfer takes as long as its slowest directory's share, so the
    plan's rates (and ``optimizer_device="auto"``'s) are ``n`` x the least directory's, a file system's
    rate shared by the directories on it; they were the first directory's alone (half two drives').
    A directory whose file system has no profile leaves the rates unknown."""
    import tiered_offload.engine.plan_monitor as plan_monitor
    import tiered_offload.profile as profile
    from tiered_offload.store import TieredStore
    monkeypatch.setenv("TIERED_OFFLOAD_PROFILE", "none")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    drives = {a: 1001, b: 1002, c: 1001}  # c on a's drive

    def fs(path):
        return {"st_dev": next(d for p, d in drives.items() if str(path).startswith(str(p))), "mount_point": str(path)}
    monkeypatch.setattr(profile, "filesystem_id", fs)
    monkeypatch.setattr(plan_monitor, "filesystem_id", fs, raising=False)
    where = tmp_path / "profile.json"
    for d, (r, w) in ((a, (2.0, 1.0)), (b, (3.0, 1.5))):
        profile.save_profile({"filesystem": fs(d), "recommended": {"options": {}, "read_GBps": r, "write_GBps": w}},
                             where)

    def rates(*dirs):
        with TieredStore([str(d) for d in dirs], host_budget_bytes=1 << 20, io_profile=str(where)) as store:
            return plan_monitor.profiled_disk_rates(store)
    one = rates(a)
    assert (one.read_Bps, one.write_Bps) == (2e9, 1e9) and one.source == f"bench-io profile {where}"
    two = rates(a, b)
    assert (two.read_Bps, two.write_Bps) == (4e9, 2e9) and "2 directories striped over 2 file systems" in two.source
    shared = rates(a, c)  # one drive: its rate
    assert (shared.read_Bps, shared.write_Bps) == (2e9, 1e9)
    three = rates(a, b, c)  # a's drive serves two of the three stripes
    assert (three.read_Bps, three.write_Bps) == (3e9, 1.5e9)
    drives[tmp_path / "d"] = 1003  # a drive bench-io never measured
    assert rates(a, tmp_path / "d") is None

    def weighed(weights, *dirs):
        spec = f"posix:{','.join(map(str, dirs))}?stripe_weights={weights}"
        with TieredStore(spec, host_budget_bytes=1 << 20, io_profile=str(where)) as store:
            return plan_monitor.profiled_disk_rates(store)
    # by weight: b (3.0 / 1.5 GB/s) taking 3 of every 5 stripes, a (2.0 / 1.0) 2: each its share in the same time
    fair = weighed("2:3", a, b)
    assert (fair.read_Bps, fair.write_Bps) == (5e9, 2.5e9) and "by weights 2:3" in fair.source
    slow = weighed("3:1", a, b)  # the slower drive given the most: its share bounds the set
    assert (slow.read_Bps, slow.write_Bps) == (pytest.approx(2e9 * 4 / 3), pytest.approx(1e9 * 4 / 3))


def test_a_fixed_plan_is_predicted_not_changed():
    m = measured()
    m.modes = ["offload", "recompute", "offload", "keep"]
    plan = make_plan(base(), m, FAST, room=[30 * MiB] * 4, keep_room=30 * MiB, fixed=True)
    assert plan.modes == m.modes and plan.predicted_step_s > 0


def test_no_disk_no_io_cost():
    plan = make_plan(base(), measured(read=0, written=0, wait=0.0), DiskRates(0, 0, "none"), room=[30 * MiB] * 4,
                     keep_room=0, fixed=False)
    assert plan.predicted_io_s == 0 and plan.modes == ["offload"] * 4  # nothing to lose: no recompute


def test_the_access_sequence_reads_activations_in_backward_order():
    blocks = [UnitLayout(name=f"block.{i}", is_block=True, numel=10, grad_numel=10, state_numel=10) for i in range(2)]
    s = Schedule([*blocks, UnitLayout(name="rest", numel=5, grad_numel=5, state_numel=5)], ("m",))
    seq = s.access_sequence([Phase.FORWARD, Phase.BACKWARD], overlap=False, activations=True)
    assert seq.index("block.0/activations") < seq.index("block.1/activations")  # written in forward order
    back = seq[seq.index("block.1/grad"):]
    assert back.index("block.1/activations") < back.index("block.0/activations")  # read in backward order


def test_the_plan_checks_time_and_disk_bytes_against_the_steps_measured_under_it():
    plan = make_plan(base(), measured(), FAST, room=[0] * 4, keep_room=0, fixed=False)  # every block recomputed
    assert plan.bytes_per_step == 800 * MiB
    close = [measured(seconds=plan.predicted_step_s, read=410 * MiB, written=400 * MiB) for _ in range(3)]
    assert plan.check(close) == []
    assert plan.measured_read == 410 * MiB and "+1% against the prediction" in plan.summary()
    more_bytes = [measured(seconds=plan.predicted_step_s, read=500 * MiB, written=420 * MiB) for _ in range(3)]
    notes = plan.check(more_bytes)
    assert len(notes) == 1 and "800.0 MiB of disk traffic" in notes[0] and "920.0 MiB (15% off)" in notes[0]
    slower = [measured(seconds=1.3 * plan.predicted_step_s) for _ in range(3)]
    notes = plan.check(slower)
    assert len(notes) == 1 and "30% off" in notes[0]



def test_a_plan_that_moves_more_bytes_must_measure_faster_or_it_goes_back():
    """The planner predicts; the steps under the plan measure. A plan that moves more disk bytes than
    the iteration it was planned from (offloaded activations) is kept only if its steps ran at
    least ``Plan.EARN`` faster; else the engine goes back to that iteration's modes and says why.
    Regression (bench_train --accumulate 4): offloading predicted 10% faster, measured within
    the noise of recomputing, for 1.6x the disk reads."""
    before = measured(seconds=2.0)  # every block recomputed, 800 MiB moved
    plan = make_plan(base(), before, FAST, room=[30 * MiB] * 4, keep_room=30 * MiB, fixed=False)
    assert "offload" in plan.modes
    under = lambda seconds, moved=1200 * MiB: [measured(seconds=seconds, read=moved // 2, written=moved // 2)
                                               for _ in range(3)]  # noqa: E731
    why = plan.unearned([before], under(1.96))
    assert why is not None and "2.000 s" in why and "1.960 s" in why and "2% faster" in why and "1.5x" in why
    assert plan.unearned([before], under(2.4)) is not None  # slower: certainly back
    assert plan.unearned([before], under(1.8)) is None  # 10% faster than the one step: measure that again
    assert "1.5x the disk bytes and ran 1.800 s against 2.000 s for the one step" in plan.measure_again(
        [before], under(1.8))
    # against the medians of the step planned from and three more of its modes
    again = [before] + [measured(seconds=1.85) for _ in range(3)]
    assert plan.measure_again(again, under(1.8)) is None
    assert "3 of them measured again" in plan.unearned(again, under(1.8))  # 3% faster than 1.85: back
    assert "8% faster" in plan.earned(again, under(1.7)) and plan.unearned(again, under(1.7)) is None
    assert plan.unearned([before], under(2.4, moved=840 * MiB)) is None  # no more bytes: nothing to earn
    assert plan.measure_again([before], under(2.4, moved=840 * MiB)) is None


# ---- the engine's plan ------------------------------------------------------------------------------
def _engine(tmp_path, host=0.8, device=0.0, **config):
    """``device``: a device tier of CPU memory of that fraction of the state (the GPU's tiers)."""
    from tiered_offload import Engine, EngineConfig
    from tiered_offload_examples.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, context=32, d_model=64, n_layers=4, n_heads=4))
    n = sum(p.numel() for p in model.parameters())
    return Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory=int(16 * n * host),
                  durable=False, config=EngineConfig(**config),
                  store_config={"device_budget_bytes": int(16 * n * device)} if device else None)


def _reference(calls):
    """The model of :func:`_engine`, trained in memory as ``_train`` trains an engine once per
    entry of ``calls`` (each call draws its batches from seed 1 again)."""
    from tiered_offload_examples.models import GPT, GPTConfig
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=128, context=32, d_model=64, n_layers=4, n_heads=4))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for steps in calls:
        torch.manual_seed(1)
        for _ in range(steps):
            x = torch.randint(0, 128, (8, 33))
            F.cross_entropy(ref(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
    return ref


def _train(engine, steps, batch=8, vocab=128):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, 33))
        engine.backward(F.cross_entropy(engine(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()))
        engine.step()
        engine.zero_grad()


def test_the_engine_plans_after_the_second_measured_step_and_logs_it(tmp_path, caplog, monkeypatch):
    """Measured iterations run from one step() to the next; the first one's optimizer finds its states
    still zero (it reads none), so the plan comes from the second: after three steps."""
    caplog.set_level(logging.INFO, logger="tiered_offload")
    monkeypatch.setattr(Plan, "unearned", lambda *_: None)  # the plan's life, not its revision (see below)
    monkeypatch.setattr(Plan, "measure_again", lambda *_: None)
    engine = _engine(tmp_path)
    assert engine.plan.predicted_step_s is None and engine.plan.modes == ["recompute"] * 4
    _train(engine, 2)
    assert engine.plan.predicted_step_s is None
    _train(engine, 1)
    plan = engine.plan
    assert plan.predicted_step_s > 0 and plan.bytes_per_step > 0
    assert set(plan.modes) <= {"keep", "offload", "recompute"} and engine.activation_modes == plan.modes
    assert any("tiered-offload plan:" in r.getMessage() and "predicted step" in r.getMessage() for r in caplog.records)
    _train(engine, 4)
    assert engine.plan.measured_step_s > 0 and engine.plan.measured_read >= 0
    assert "measured disk" in engine.plan.summary() and "against the prediction" in engine.plan.summary()
    engine.close()


def test_a_configured_choice_overrides_the_planner(tmp_path):
    engine = _engine(tmp_path, activations=["keep", "recompute", "offload", "keep"])
    _train(engine, 3, batch=2)  # (at batch 8 the kept graphs no longer fit its room: q, k, v count now)
    assert engine.activation_modes == ["keep", "recompute", "offload", "keep"]
    assert any("EngineConfig.activations" in o for o in engine.plan.overridden)
    assert engine.plan.predicted_step_s > 0
    engine.close()


def test_the_plan_offloads_no_more_activations_than_the_disk_has_room_for(tmp_path, monkeypatch):
    """A disk that holds the state but little more: the planner would offload every block's
    activations (offloading costs nothing here), and the step after the plan would stop with
    DiskFullError when they no longer fit. The plan offloads only what the free space (less what
    commits need) holds, recomputes the rest and says why; training goes on, bitwise PyTorch's."""
    from storage_backends.posix import PosixBackend
    from tiered_offload.engine.plan_monitor import PlanMonitor
    monkeypatch.setattr(PlanMonitor, "_disk_rates", lambda self, m: DiskRates(1e11, 1e11, "test"))  # offloading: free
    du = lambda: sum(f.stat().st_size for f in (tmp_path / "s").rglob("*") if f.is_file())  # noqa: E731
    size = {"bytes": None}  # the disk's size: free is what the files leave of it
    monkeypatch.setattr(PosixBackend, "free_bytes", lambda self: None if size["bytes"] is None else size["bytes"] - du())
    engine = _engine(tmp_path, host=0.9)  # (room for a block's graph, its attention's q, k, v included)
    _train(engine, 2)
    graphs = [engine._streamer.graph_bytes[i] for i in range(4)]
    size["bytes"] = du() + int((graphs[0] + graphs[1] // 2) / 0.9)  # room for one block's activations, not two
    _train(engine, 1)
    modes = engine.activation_modes
    assert modes.count("offload") <= 1 and "recompute" in modes, modes
    assert any("free disk" in r for r in engine.plan.reasons), engine.plan.reasons
    _train(engine, 3)  # would raise DiskFullError without the check (the step after the plan)
    weights = {k: w.detach().clone() for k, w in engine.named_parameters()}
    engine.close()
    ref = _reference((2, 1, 3))
    assert all(torch.equal(weights[k], w) for k, w in ref.named_parameters())


def test_the_engine_goes_back_to_recomputing_when_the_plan_does_not_earn_its_bytes(tmp_path, monkeypatch):
    """A plan whose offloaded activations made the steps slower (here: a sleep in every block from
    the planned steps on) is undone after the check: every block recomputed again, the plan says
    why, and training stays bitwise PyTorch's across the change."""
    import time
    from tiered_offload.engine.plan_monitor import PlanMonitor
    monkeypatch.setattr(PlanMonitor, "_disk_rates", lambda self, m: DiskRates(1e11, 1e11, "test"))  # offloading: free
    engine = _engine(tmp_path, host=0.9)  # (room for a block's graph, its attention's q, k, v included)
    _train(engine, 3)
    assert "offload" in engine.activation_modes
    original = engine._streamer.block_forward

    def slow(*args):
        time.sleep(0.02)
        return original(*args)
    engine._streamer.block_forward = slow
    engine.binding.install_proxies(lambda i, a, k: engine._streamer.block_forward(i, a, k))
    _train(engine, 4)
    assert engine.activation_modes == ["recompute"] * 4
    assert any("back to recomputing" in r for r in engine.plan.reasons), engine.plan.reasons
    assert engine.plan.modes == ["recompute"] * 4
    _train(engine, 2)
    assert engine.plan.measured_step_s is not None  # the revised plan checked in turn
    ref = _reference((3, 4, 2))
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], v) for k, v in ref.named_parameters())
    engine.close()


def _slowed(engine, when):
    """Every streamed block's forward sleeps ``when(modes)`` seconds (the block modes in force)."""
    import time
    original = engine._streamer.block_forward

    def slow(*args):
        time.sleep(when(list(engine._streamer.modes)))
        return original(*args)
    engine._streamer.block_forward = slow
    engine.binding.install_proxies(lambda i, a, k: engine._streamer.block_forward(i, a, k))


@pytest.mark.parametrize("faster", ["recomputing", "offloading"])
def test_a_plan_that_moves_more_bytes_is_measured_against_the_modes_it_replaced_before_it_is_kept(
        tmp_path, monkeypatch, caplog, faster):
    """A plan that moves more disk bytes than the modes it replaced must run ``Plan.EARN`` faster.
    Those modes were measured for one step only (the one planned from), and one step is noise: a
    planning step slowed by the machine (here a sleep of 0.4 s) made a plan that was slower
    than recomputing look faster, and it was kept for good, with its extra disk bytes (a run of
    ``bench_train.py --against-profile`` on 2026-12-07: 1.7x the disk bytes at the same step
    time as a run beside it that recomputed). The engine measures the modes it replaced again for
    ``CHECK_AFTER`` steps, then keeps the faster by the medians, and says why; training stays
    bitwise PyTorch's across the changes."""
    from tiered_offload.engine.plan_monitor import PlanMonitor
    caplog.set_level(logging.INFO, logger="tiered_offload")
    monkeypatch.setattr(PlanMonitor, "_disk_rates", lambda self, m: DiskRates(1e11, 1e11, "test"))  # offloading: free
    monkeypatch.setattr(PlanMonitor, "_disk_bound", lambda self, steps: False)  # (no step-mode trial after)
    engine = _engine(tmp_path, host=0.9)  # (room for a block's graph, its attention's q, k, v included)
    _train(engine, 2)
    delay = {"planning": 0.1}
    # the planning step sleeps 0.4 s a forward pass; then, the modes that should lose sleep 0.2 s a pass more
    # (0.08 s was within the noise of a CI run beside another worker: the offloading plan once went back)
    slow_modes = "offload" if faster == "recomputing" else "recompute"
    _slowed(engine, lambda modes: delay["planning"] + (0.05 if slow_modes in modes else 0.0))
    _train(engine, 1)
    planned = engine.activation_modes
    assert "offload" in planned, planned
    delay["planning"] = 0.0
    _train(engine, PlanMonitor.CHECK_AFTER)
    # the plan ran faster than the one (slowed) step it was planned from: measured again, not kept yet
    assert engine.activation_modes == ["recompute"] * 4
    assert any("the activation modes it replaced measured again" in r.getMessage() for r in caplog.records)
    assert any("measured again for 3 steps" in r for r in engine.plan.reasons)  # (the plan as made, and why)
    assert "offload" in engine.plan.modes
    _train(engine, PlanMonitor.CHECK_AFTER)
    if faster == "recomputing":
        assert engine.activation_modes == ["recompute"] * 4 and engine.plan.modes == ["recompute"] * 4
        assert any("back to recomputing every block" in r and "measured again" in r for r in engine.plan.reasons), \
            engine.plan.reasons
    else:
        assert engine.activation_modes == planned and engine.plan.modes == planned
        assert any("kept the planned activations" in r for r in engine.plan.reasons), engine.plan.reasons
    _train(engine, 2)
    weights = {k: w.detach().clone() for k, w in engine.named_parameters()}
    engine.close()
    ref = _reference((2, 1, PlanMonitor.CHECK_AFTER, PlanMonitor.CHECK_AFTER, 2))
    assert all(torch.equal(weights[k], w) for k, w in ref.named_parameters())


def test_forward_backward_with_dropout_across_the_modes_measured_again_is_the_same_training(tmp_path, monkeypatch):
    """``forward_backward`` over 2 micro-batches with dropout 0.1: the plan offloads, the modes it
    replaced run again for 3 steps, and it goes back (the sleeps of the test above). Each change
    of modes replays the dropout draws: the losses and the weights are those of an engine that
    recomputed every block throughout, bitwise, and only the first call ran the loop (to learn
    the draws)."""
    from tiered_offload import Engine, EngineConfig
    from tiered_offload.engine.plan_monitor import PlanMonitor
    from tiered_offload_examples.models import GPT, GPTConfig

    def run(name, activations):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=128, context=32, d_model=64, n_layers=4, n_heads=4, dropout=0.1))
        n = sum(p.numel() for p in model.parameters())
        engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / name,
                        host_memory=int(16 * n * 0.9), durable=False, config=EngineConfig(activations=activations))
        if activations == "auto":
            _slowed(engine, lambda modes: (0.1 if engine.step_count == 2 else 0) + (0.05 if "offload" in modes else 0))
        torch.manual_seed(1)
        modes, losses = [], []
        for _ in range(3 * PlanMonitor.CHECK_AFTER + 1):
            ids = [torch.randint(0, 128, (1, 33)) for _ in range(2)]
            inputs = [x[:, :-1] for x in ids]
            targets = {id(i): x[:, 1:].flatten() for i, x in zip(inputs, ids)}
            modes.append("offload" in engine.activation_modes)
            losses += [x.item() for x in engine.forward_backward(
                inputs, lambda out, b: F.cross_entropy(out.flatten(0, 1), targets[id(b)]) / 2)]
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
        weights = {k: w.detach().clone() for k, w in engine.named_parameters()}
        loops = sum(engine.stats().forward_backward_loops.values())
        engine.close()
        return modes, losses, weights, loops
    monkeypatch.setattr(PlanMonitor, "_disk_rates", lambda self, m: DiskRates(1e11, 1e11, "test"))  # offloading: free
    modes, losses, weights, loops = run("planned", "auto")
    assert modes == [False] * 3 + [True] * 3 + [False] * 4, modes  # planned, measured again, back
    ref_modes, ref_losses, ref_weights, ref_loops = run("recomputed", "recompute")
    assert losses == ref_losses and loops == ref_loops == 1
    assert all(torch.equal(weights[k], w) for k, w in ref_weights.items())


# ---- the step mode, measured ------------------------------------------------------------------------
def test_the_step_mode_that_moves_more_bytes_must_measure_faster_to_be_kept():
    """Overlapped, the update writes each unit's weights and the forward may read them back; deferred,
    the forward uses the weights the update just wrote, on its own thread. The plan keeps the
    mode that measured faster, and the one moving more bytes only if it earned them
    (``Plan.EARN``), as for activations."""
    steps = lambda seconds, moved: [measured(seconds=seconds, read=moved // 2, written=moved // 2)  # noqa: E731
                                    for _ in range(3)]
    plan = base()
    plan.overlap_step = True
    why = plan.choose_step_mode(steps(3.76, 807 * MiB), steps(3.28, 747 * MiB))  # the disk-bound probe's figures
    assert plan.defer_step and not plan.overlap_step
    assert "deferred" in why and "3.280 s" in why and "3.760 s" in why and "13% faster" in why, why
    assert plan.measured_step_s == 3.28 and plan.measured_read + plan.measured_written == 747 * MiB
    # overlapped 3% faster for 8% more bytes: not earned
    assert "deferred" in plan.choose_step_mode(steps(3.18, 807 * MiB), steps(3.28, 747 * MiB))
    assert plan.defer_step
    # overlapped 10% faster: kept, though it moves more
    why = plan.choose_step_mode(steps(2.95, 807 * MiB), steps(3.28, 747 * MiB))
    assert plan.overlap_step and not plan.defer_step and "overlapped" in why and plan.measured_step_s == 2.95
    # the same bytes: the faster one
    plan.choose_step_mode(steps(3.0, 800 * MiB), steps(3.1, 800 * MiB))
    assert plan.overlap_step
    plan.choose_step_mode(steps(3.1, 800 * MiB), steps(3.0, 800 * MiB))
    assert plan.defer_step
    assert "step deferred to the next forward" in plan.summary()


def _slow_when(monkeypatch, background: bool):
    """Steps in one mode (``background``: overlapped; else deferred) take longer, inside the engine's
    time: what a machine where that mode is the slower one measures (the sharded tests' helper)."""
    from dist_worker import slowed_step_mode
    from tiered_offload.engine.pipeline import UpdatePipeline
    monkeypatch.setattr(UpdatePipeline, "run", slowed_step_mode("overlapped" if background else "deferred"))


@pytest.mark.parametrize("device", [0.0, 0.6], ids=["host", "device-tier"])
def test_a_disk_bound_overlapped_step_is_deferred_when_deferring_measures_faster(tmp_path, monkeypatch, caplog, device):
    """At a budget where the step overlaps the next forward, and the disk is busy for most of a step,
    the engine tries the step deferred once its plan is final, and keeps the faster mode (on a
    300 MB/s disk at 0.34x the state, deferring ran 13% faster and moved 7.5% fewer bytes). The
    numbers are the same in both modes: training stays bitwise PyTorch's across the changes."""
    from tiered_offload.engine.plan_monitor import PlanMonitor
    caplog.set_level(logging.INFO, logger="tiered_offload")
    monkeypatch.setattr(PlanMonitor, "_disk_bound", lambda self, steps: True)
    monkeypatch.setattr(Plan, "unearned", lambda *_: None)  # (a revision would try the mode 3 steps later)
    monkeypatch.setattr(Plan, "measure_again", lambda *_: None)
    _slow_when(monkeypatch, background=True)
    engine = _engine(tmp_path, host=0.8, device=device)
    assert engine.overlap_step and not engine.defer_step
    _train(engine, PlanMonitor.FINAL_AFTER - PlanMonitor.CHECK_AFTER - 1)
    assert engine.overlap_step  # the plan made; it is checked, and the trial begins, at the next step
    _train(engine, 1)
    assert engine.defer_step and not engine.overlap_step
    assert any("trying the step deferred" in r.getMessage() for r in caplog.records)
    _train(engine, PlanMonitor.CHECK_AFTER)
    assert engine.defer_step and not engine.overlap_step and engine.plan.defer_step
    assert any(r.startswith("step deferred to the next forward, measured") for r in engine.plan.reasons), \
        engine.plan.reasons
    assert "deferred to the next forward" in engine.plan.summary()
    _train(engine, 2)
    weights = {k: w.detach().clone() for k, w in engine.named_parameters()}
    engine.close()
    ref = _reference((PlanMonitor.FINAL_AFTER - PlanMonitor.CHECK_AFTER - 1, 1, PlanMonitor.CHECK_AFTER, 2))
    assert all(torch.equal(weights[k], w) for k, w in ref.named_parameters())


def test_a_step_that_overlaps_faster_goes_back_to_overlapping(tmp_path, monkeypatch):
    from tiered_offload.engine.plan_monitor import PlanMonitor
    monkeypatch.setattr(PlanMonitor, "_disk_bound", lambda self, steps: True)
    monkeypatch.setattr(Plan, "unearned", lambda *_: None)  # (a revision would try the mode 3 steps later)
    monkeypatch.setattr(Plan, "measure_again", lambda *_: None)
    _slow_when(monkeypatch, background=False)
    engine = _engine(tmp_path, host=0.8)
    _train(engine, PlanMonitor.FINAL_AFTER - PlanMonitor.CHECK_AFTER)
    assert engine.defer_step
    _train(engine, PlanMonitor.CHECK_AFTER)
    assert engine.overlap_step and not engine.defer_step and engine.plan.overlap_step
    assert any(r.startswith("step overlapped with the next forward, measured") for r in engine.plan.reasons)
    _train(engine, 4)  # tried once: it stays
    assert engine.overlap_step
    weights = {k: w.detach().clone() for k, w in engine.named_parameters()}
    engine.close()
    ref = _reference((PlanMonitor.FINAL_AFTER - PlanMonitor.CHECK_AFTER, PlanMonitor.CHECK_AFTER, 4))
    assert all(torch.equal(weights[k], w) for k, w in ref.named_parameters())



def test_sharded_ranks_keep_deferring_only_if_every_rank_measured_it_better(tmp_path, monkeypatch):
    """Sharded, the ranks decide at the same step whether to try (``SHARDED_TRIAL_AT``, whatever
    each one's plan did: the agreement is a collective) and keep deferring only if every rank
    measured it better. Here one process stands for a rank whose peers vote against: it measured
    deferring faster, and overlaps again all the same, saying why."""
    from tiered_offload.engine.plan_monitor import PlanMonitor
    monkeypatch.setattr(PlanMonitor, "_disk_bound", lambda self, steps: True)
    _slow_when(monkeypatch, background=True)
    engine = _engine(tmp_path, host=0.8)
    votes = []
    monitor = engine._monitor
    monitor.ranks = 2
    monitor._agree = lambda flags, what: votes.append((what, flags)) or [what.startswith("whether to try")]
    _train(engine, PlanMonitor.SHARDED_TRIAL_AT)
    assert engine.overlap_step and not votes
    _train(engine, 1)
    assert engine.defer_step and votes == [("whether to try the step deferred", [True])]
    _train(engine, PlanMonitor.CHECK_AFTER)
    assert votes[1] == ("the step mode to keep", [True])  # this rank would defer; the others do not
    assert engine.overlap_step and engine.plan.overlap_step and not engine.plan.defer_step
    assert any(r.startswith("step overlapped with the next forward, as another rank measured it better") and
               "this rank measured: 3 steps deferred ran" in r for r in engine.plan.reasons), engine.plan.reasons
    engine.close()

def test_a_configured_or_compute_bound_step_mode_is_not_tried(tmp_path, monkeypatch):
    from tiered_offload.engine.plan_monitor import PlanMonitor
    monkeypatch.setattr(PlanMonitor, "_disk_bound", lambda self, steps: True)
    configured = _engine(tmp_path / "a", host=0.8, overlap_step=True)
    _train(configured, PlanMonitor.FINAL_AFTER + 1)
    assert configured.overlap_step and not configured.plan.defer_step
    configured.close()
    monkeypatch.setattr(PlanMonitor, "_disk_bound", lambda self, steps: False)
    compute_bound = _engine(tmp_path / "b", host=0.8)
    _train(compute_bound, PlanMonitor.FINAL_AFTER + 1)
    assert compute_bound.overlap_step and not any("step deferred" in r for r in compute_bound.plan.reasons)
    compute_bound.close()


def test_disk_bound_means_the_disk_busy_at_least_as_long_as_the_step_computed():
    """The step's compute is its time less the waits for bytes (the planner's measure). The disk busy for
    most of a step does not tell: on a 300 MB/s disk a step 2.4x its compute had the disk busy 0.71-0.77
    of it (0.56-0.62 waited), a compute-bound one 0.30-0.57 (0.12-0.38 waited)."""
    from types import SimpleNamespace
    from tiered_offload.engine.plan_monitor import PlanMonitor
    me = SimpleNamespace(DISK_BOUND=PlanMonitor.DISK_BOUND, _busy=PlanMonitor._busy)
    steps = lambda busy, wait: [measured(seconds=1.0, busy=busy, wait=wait) for _ in range(3)]  # noqa: E731
    assert PlanMonitor._disk_bound(me, steps(0.73, 0.6))  # the disk-bound probe's figures
    assert not PlanMonitor._disk_bound(me, steps(0.55, 0.35))  # the compute-bound one's
    assert not PlanMonitor._disk_bound(me, steps(0.9, 0.0))


def test_a_prediction_far_from_the_measured_steps_is_reported(tmp_path, caplog):
    import time
    caplog.set_level(logging.WARNING, logger="tiered_offload")
    engine = _engine(tmp_path)
    _train(engine, 3)  # planned from normal steps
    original = engine._streamer.block_forward

    def slow(*args):  # something the model did not see: every block now takes 50 ms longer
        time.sleep(0.05)
        return original(*args)
    engine._streamer.block_forward = slow
    engine.binding.install_proxies(lambda i, a, k: engine._streamer.block_forward(i, a, k))
    _train(engine, 4)
    assert any("predicted" in r.getMessage() and "% off" in r.getMessage() for r in caplog.records)
    assert any("% off" in r for r in engine.plan.reasons)
    engine.close()



class _FreesWhatItSaved(torch.nn.Module):
    """A forward that frees a tensor autograd saved, then saves another of the same shape (the
    allocator may hand it the freed address): what the plan measures of a graph must not take the
    second for the first. A GPT block does this (in the benchmark's, a ``(1024, 512)`` tensor: 2 MiB)."""

    def forward(self, x):
        out = x
        for n in (16, 256, 4096):
            h = torch.exp(x[:n])  # exp saves its output
            a = h.sum()
            del h
            out = out + torch.exp(x[:n]).sum() * a  # the same shape, allocated right after
        return out


def test_the_measure_of_a_block_graph_is_what_keeping_it_stores():
    """The planner measures a recomputed block's graph without keeping it (``count_only``). It
    counted a saved tensor the forward had freed, then took a later one at the same address for
    the same tensor: 2 MiB short of a GPT block's 28 MiB now and then, so the budget the plan
    advised left the blocks 2 MiB short of their room, and every block was recomputed at it."""
    from tiered_offload.engine.activations import SavedActivations

    block, x = _FreesWhatItSaved(), torch.randn(4096, requires_grad=True)
    for _ in range(30):
        measured = SavedActivations(None, [], count_only=True)
        with measured.hooks():
            block(x)
        kept = SavedActivations(None, [])
        with kept.hooks():
            block(x)
        assert measured.pending_bytes() == kept.pending_bytes()


def test_an_inline_step_names_the_budget_that_overlaps_it(tmp_path):
    """At a budget too short for the update beside the forward, the plan says which budget would let
    the step overlap the next forward with room for a block's activations; an engine given that
    budget does overlap, with that room. At the minimum budget the step runs inline, and the plan
    also names the (smaller) budget that defers it to the forward; an engine given it does."""
    import re

    from tiered_offload import Engine
    from tiered_offload_examples.models import GPT, GPTConfig

    def engine(path, host):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=128, context=32, d_model=64, n_layers=4, n_heads=4))
        return Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=path, host_memory=host, durable=False)
    probe = engine(tmp_path / "probe", 1 << 30)
    smallest = probe.minimum_budget()
    probe.close()
    short = engine(tmp_path / "short", smallest)
    assert not short.overlap_step
    _train(short, 3)
    advice = [r for r in short.plan.reasons if r.startswith("the step does not overlap")]
    short.close()
    assert len(advice) == 1, short.plan.summary()
    budget, acts, unit = re.search(r"host_memory >= .*? \((\d+) bytes\) .*activations \(([\d.]+) (KiB|MiB)\)",
                                   advice[0]).groups()
    acts = float(acts) * (1024 if unit == "KiB" else 1 << 20)
    assert short.plan.advised_memory == int(budget)  # the same figure, for a program to read
    assert not short.defer_step  # the minimum budget cannot hold an update beside the rest
    deferring = int(re.search(r"host_memory >= .*? \((\d+) bytes\) defers it", advice[0]).group(1))
    assert deferring < int(budget)
    deferred = engine(tmp_path / "deferred", deferring)
    assert deferred.defer_step and not deferred.overlap_step
    deferred.close()
    roomy = engine(tmp_path / "roomy", int(budget))
    assert roomy.overlap_step
    assert min(roomy._streamer.activation_room.values()) >= 0.99 * acts  # the size printed, rounded
    _train(roomy, 3)
    assert not any(r.startswith("the step does not overlap") for r in roomy.plan.reasons)
    assert roomy.plan.advised_memory is None
    roomy.close()


def test_an_inline_step_whose_overlap_needs_the_whole_state_is_told_so(tmp_path):
    """A large tied embedding (the rest unit) dominates: updating it beside the forward needs more
    than the whole state, so the plan names the budget that holds the state instead."""
    from tiered_offload import Engine
    from tiered_offload_examples.models import GPT, GPTConfig

    def engine(path, host):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=2048, context=32, d_model=32, n_layers=4, n_heads=4))
        return Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=path, host_memory=host, durable=False)
    probe = engine(tmp_path / "probe", 1 << 30)
    smallest, state = probe.minimum_budget(), probe.state_bytes()
    probe.close()
    short = engine(tmp_path / "short", smallest)
    _train(short, 3, vocab=2048)
    advice = [r for r in short.plan.reasons if r.startswith("the step does not overlap")]
    short.close()
    advised = short.plan.advised_memory
    assert len(advice) == 1 and advice[0].endswith(f"({advised} bytes) holds the whole training state"), advice
    assert state <= advised <= state + 4096 * 4 * 5  # its tensors, each aligned to 4 KiB in the tier
    whole = engine(tmp_path / "whole", advised)  # and at that budget the engine holds it whole
    assert "the state fits the compute tier" in str(whole.plan)
    whole.close()

# ---- the step timeline and the per-step figures -------------------------------------------------------
def test_the_trace_shows_compute_io_waits_updates_and_commits(tmp_path):
    import json

    from tiered_offload import Engine
    from tiered_offload_examples.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, context=32, d_model=64, n_layers=4, n_heads=4))
    n = sum(p.numel() for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory=int(16 * n * 0.8),
                    trace=tmp_path / "run.json")
    _train(engine, 2)
    with engine.tracing(tmp_path / "one.json"):  # a stretch of it, on its own
        _train(engine, 1)
    stats = engine.stats()
    engine.close()
    for name in ("run.json", "one.json"):
        events = json.loads((tmp_path / name).read_text())["traceEvents"]
        cats = {e.get("cat") for e in events}
        assert {"phase", "compute", "io", "optimizer", "commit"} <= cats, (name, cats)
        io = [e for e in events if e.get("cat") == "io"]
        assert all(e["args"]["bytes"] > 0 and e["args"]["tensor"] for e in io)
        assert any(e["name"].startswith("disk->host") for e in io) and any("->disk" in e["name"] for e in io)
        assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")
    # tools/trace_summary.py: where each step's time went, the phases adding up to the iteration
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from trace_summary import summarize
    steps, rows, moved = summarize(json.loads((tmp_path / "run.json").read_text())["traceEvents"], skip=0)
    assert steps == 1 and rows["forward: forward compute"] > 0 and rows["backward: wall"] > 0
    parts = sum(rows[f"{p}: wall"] for p in ("forward", "loss", "backward", "step", "outside the engine"))
    assert abs(parts - rows["iteration: wall"]) < 1e-6 * steps
    assert rows.get("step: optimizer updates", 0) + rows.get("background step: updates", 0) > 0
    assert moved["disk->host"] > 0 and moved["host->disk"] > 0
    assert stats.steps_measured == 2 and stats.step_seconds > 0
    assert stats.read_bytes_per_param_per_step > 0 and stats.written_bytes_per_param_per_step > 0
    assert stats.io_bound_seconds > 0 and stats.bytes_read == stats.store.bytes_read  # the store's counters too


def test_the_trace_summary_gives_each_phase_its_disk_time_and_bytes():
    """tools/trace_summary.py on a trace written by hand (microseconds): a forward [0, 100), a
    backward [100, 300), the next forward at 400; a transfer counts its time in every phase it
    overlaps and its bytes in the phase of its midpoint; one between the memory tiers is the
    link's, not the disk's."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from trace_summary import by_phase, summarize

    def span(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}
    events = [{"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "MainThread"}},
              {"ph": "M", "name": "thread_name", "tid": 2, "args": {"name": "tiered-offload-posix_0"}},
              span("forward", "phase", 0, 100), span("backward", "phase", 100, 200),
              span("update block.0", "optimizer", 300, 50),  # the step: from the backward's end to here
              span("forward", "phase", 400, 10),
              span("disk->host b/weight", "io", 0, 50, tid=2, bytes=10),
              span("host->disk b/grad", "io", 80, 40, tid=2, bytes=20),  # midpoint 100: the backward's
              span("disk->host b/state", "io", 200, 60, tid=2, bytes=30),
              span("host->disk b/weight", "io", 290, 40, tid=2, bytes=40),
              span("host->device b/weight", "io", 150, 30, tid=2, bytes=5)]
    steps, rows, moved = summarize(events, skip=0)
    assert steps == 1
    assert rows["forward: disk busy"] == pytest.approx(70e-6)  # [0, 50) and [80, 100)
    assert rows["backward: disk busy"] == pytest.approx(90e-6)  # [100, 120), [200, 260), [290, 300)
    assert rows["backward: link busy"] == pytest.approx(30e-6) and "forward: link busy" not in rows
    assert rows["step: disk busy"] == pytest.approx(30e-6)  # [300, 330)
    assert dict(moved) == {"disk->host": 40, "host->disk": 60, "host->device": 5, "forward: disk->host": 10,
                           "backward: host->disk": 20, "backward: disk->host": 30, "backward: host->device": 5,
                           "step: host->disk": 40}
    # one traced step (tools/bench_gpu_step.py): the step runs from the backward's end to the last span's
    one = by_phase([e for e in events if not (e["name"] == "forward" and e["ts"] == 400)])
    assert one["forward"] == {"disk busy": pytest.approx(70e-6), "disk->host": 10}
    assert one["backward"]["link busy"] == pytest.approx(30e-6) and one["backward"]["host->device"] == 5
    assert one["step"] == {"disk busy": pytest.approx(30e-6), "host->disk": 40}


def test_the_foresight_reference_keeps_what_is_needed_soonest():
    """tools/bench_step_modes.py's reference cache (docs/RESULTS.md's "a cache that sees the
    future"), on accesses worked by hand: a tier of two 4-byte tensors."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_step_modes import foresight
    get = lambda k: ("get", f"u/{k}", 4)  # noqa: E731
    # a, b, c, a: c evicts b (never needed again), not a; nothing dirty, nothing written
    assert foresight([get("weight"), get("grad"), get("state"), get("weight")], 8, 0, 4) == (
        {"weight": 4, "grad": 4, "state": 4}, {})
    # a dirty tensor needed furthest ahead is evicted and written, then read again
    events = [get("weight"), ("dirty", "u/weight", 4), get("grad"), get("state"), get("grad"), get("state"),
              get("weight")]
    assert foresight(events, 8, 0, len(events)) == ({"weight": 8, "grad": 4, "state": 4}, {"weight": 4})
    # a tensor zeroed is not read; a dirty one overwritten before its next read is dropped unwritten
    events = [("zero", "u/grad", 4), get("grad"), ("dirty", "u/grad", 4), get("state"), get("weight"),
              ("write", "u/grad", 4), get("grad")]
    assert foresight(events, 8, 0, len(events)) == ({"state": 4, "weight": 4}, {})
    # only events in [count_from, count_to) are counted; the cache fills before them
    assert foresight([get("weight"), get("weight"), get("grad")], 8, 1, 2) == ({}, {})



def test_the_fused_order_moves_each_update_into_the_backward_after_its_units_last_access():
    """tools/bench_step_modes.py ``--fused-order``: a deferred step's updates (run in the next
    forward) moved into the backward before, each right after its unit's last access there, with
    the zeroing of its gradient; other threads' accesses and the counted steps stay where they were."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_step_modes import fused_order
    events, marks = [], []

    def mark(*what):
        marks.append((len(events), what))

    def use(unit, kind, op="get"):
        events.append((op, f"{unit}/{kind}", 4))
    mark("step", 0)
    use("b0", "weight"), use("b1", "weight")  # forward
    mark("backward-start")
    use("b1", "weight"), use("b1", "grad", "dirty"), use("b0", "weight"), use("b0", "grad", "dirty")
    mark("backward-end")
    mark("step", 1)
    mark("update-start", "b0")
    use("b0", "state"), use("rest", "weight"), use("b0", "weight", "dirty")  # (rest: another thread's)
    mark("update-end", "b0")
    use("b0", "grad", "zero"), use("b0", "weight")
    mark("update-start", "b1")
    use("b1", "state"), use("b1", "weight", "dirty")
    mark("update-end", "b1")
    use("b1", "grad", "zero"), use("b1", "weight")
    mark("step", 2)
    reordered, first, last = fused_order(events, marks, 1, 2)
    assert [f"{op} {key}" for op, key, _ in reordered] == [
        "get b0/weight", "get b1/weight",
        "get b1/weight", "dirty b1/grad", "get b1/state", "dirty b1/weight", "zero b1/grad",
        "get b0/weight", "dirty b0/grad", "get b0/state", "dirty b0/weight", "zero b0/grad",
        "get rest/weight", "get b0/weight", "get b1/weight"]
    assert (first, last) == (12, 15)  # step 1: from the other thread's access on
    # an update with no backward before it stays where it ran
    assert fused_order(events[11:], [(p - 11, w) for p, w in marks if p >= 11], 1, 2) == (events[11:], None, 4)


def _cheapest_by_trying_every_cache(events, capacity, count_from, count_to, pins):
    """The least bytes of :func:`bench_step_modes.least`'s program, found by trying every keep-or-drop choice."""
    from bench_step_modes import as_caching
    stretches, versions, pinned, fetched, flushed = as_caching(events, pins)
    best = None
    for choice in itertools.product((0, 1), repeat=len(stretches)):
        if any(pinned[t] + sum(s[2] for s, k in zip(stretches, choice) if k and s[0] <= t < s[1]) > capacity
               for t in range(len(events))):
            continue
        read = sum(s[2] for s, k in zip(stretches, choice) if not k and count_from <= s[1] < count_to)
        read += sum(nbytes for at, nbytes, _ in fetched if count_from <= at < count_to)
        dropped = {s[3] for s, k in zip(stretches, choice) if not k} | flushed
        written = sum(versions[v][1] for v in dropped if versions[v][2] and count_from <= versions[v][0] < count_to)
        best = read + written if best is None else min(best, read + written)
    return best


def test_the_least_bytes_of_an_access_timeline_are_what_the_best_cache_moves():
    """tools/bench_step_modes.py's least bytes (docs/RESULTS.md, forty-fifth session): an integer
    program over keep-or-drop choices, the lower bound a cache's bytes are set against. Worked by
    hand on a tier of two 4-byte tensors, then against every cache tried on random timelines."""
    import random
    import sys
    from pathlib import Path
    pytest.importorskip("scipy")  # (a test dependency: pyproject's [test])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_step_modes import least
    get = lambda k: [("get", f"u/{k}", 4), ("release", f"u/{k}", 4)]  # noqa: E731
    total = lambda r: sum(r["read"].values()) + sum(r["written"].values())  # noqa: E731
    # a, b, c, a in two slots: keep a across (c is the one dropped), read a, b, c once each... only the
    # second read of a is a re-read, and the best cache keeps a: nothing moves after the first reads
    events = get("weight") + get("grad") + get("state") + get("weight")
    assert least(events, 8, 0, len(events))["read"] == {}
    # in one slot a is dropped for b and read again; made in memory (dirty), it is written once first
    events = get("weight")[:1] + [("dirty", "u/weight", 4)] + get("weight")[1:] + get("grad") + get("weight")
    result = least(events, 4, 0, len(events))
    assert result["proven"] and result["read"] == {"weight": 4} and result["written"] == {"weight": 4}
    # pinned: b's get while a is held needs both in memory; a tier of one tensor cannot hold them
    events = [("get", "u/weight", 4), ("get", "u/grad", 4), ("release", "u/grad", 4), ("release", "u/weight", 4)]
    with pytest.raises(ValueError, match="pins 8 bytes at once, beyond the 4"):
        least(events, 4, 0, 4)
    assert least(events, 4, 0, 4, pins=False)["read"] == {}
    # zeros carry nothing: a zeroed gradient dropped is made again, not read or written
    events = [("zero", "u/grad", 4)] + get("grad") + get("weight") + get("grad")
    assert total(least(events, 4, 0, len(events))) == 0
    # a cache over another tier: a gradient made in it and used below is written down, kept or not;
    # weights made below are read up again at the next use, kept or not
    events = get("grad")[:1] + [("dirty", "u/grad", 4)] + get("grad")[1:] + [("below_get", "u/grad", 4)]
    events += [("below_made", "u/weight", 4)] + get("weight") + get("grad")
    result = least(events, 8, 0, len(events))
    assert result["read"] == {"weight": 4} and result["written"] == {"grad": 4}
    rng = random.Random(7)
    ops = ["get", "get", "get", "dirty", "write", "create", "zero", "below_get", "below_made"]
    for case in range(40):
        events = []
        for _ in range(rng.randint(4, 9)):
            key, op = f"u{rng.randint(0, 2)}/weight", rng.choice(ops)
            size = {"u0": 4, "u1": 8, "u2": 4}[key[:2]]
            events += [(op, key, size)] + ([("release", key, size)] if op in ("get", "create") else [])
        capacity, pins = rng.choice([8, 12, 16]), rng.random() < 0.5
        lo, hi = rng.randint(0, 3), len(events) - rng.randint(0, 3)
        if len([e for e in events if e[0] in ("get", "create")]) > 7:
            continue
        best = _cheapest_by_trying_every_cache(events, capacity, lo, hi, pins)
        result = least(events, capacity, lo, hi, pins=pins)
        assert total(result) == best and result["proven"], (case, events, capacity, result, best)

def test_torch_profiler_sees_the_engine_ranges(tmp_path):
    engine = _engine(tmp_path)
    _train(engine, 1)
    with engine.tracing(tmp_path / "t.json"), torch.profiler.profile() as prof:
        _train(engine, 1)
    engine.close()
    names = {e.name for e in prof.events()}
    # the calling thread's ranges (the background step's and the I/O threads' are in the engine's trace)
    assert any(n.startswith("tiered_offload::forward block.") for n in names), sorted(names)[:20]
    assert any(n.startswith(("tiered_offload::backward block.", "tiered_offload::recompute block.")) for n in names)


def test_bench_train_times_the_steady_steps_and_leaves_the_last_deferred_update_out():
    """tools/bench_train.py's rounds: a step to lead in, untimed, then the timed window, whose disk
    counters are read when its last step returns; the work a deferred step leaves (run whole by
    ``wait_committed()``) is finished untimed. Timing it charged a deferred step one update not
    hidden behind a forward per round (docs/RESULTS.md, fifty-second session)."""
    import sys
    import time
    import types
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_train import Config
    from tiered_offload import Tier
    moved = {"read": 0}
    calls = []

    class Store:  # a snapshot of the counters, as engine.stats().store is
        def __init__(self):
            self.read = moved["read"]
            self.disk_busy_seconds = 0.0

        def by_kind(self, kinds, since):
            return {"state": self.read - since.read}

    def stats():
        return types.SimpleNamespace(bytes_read={Tier.DISK: moved["read"]}, bytes_written={Tier.DISK: 0}, store=Store())

    def step(x):  # each step reads 10 bytes; the update it leaves reads 100 in the finish
        calls.append(x)
        moved["read"] += 10

    def finish():
        time.sleep(0.3)
        moved["read"] += 100
    c = Config("disk", step, finish, engine=types.SimpleNamespace(stats=stats))
    c.run([0, 1, 2], lead_in=True)
    assert calls == [0, 1, 2]
    assert c.per_step[0] < 0.1 and c.finish_s[0] >= 0.3  # the finish is not in the steps' time
    assert c.moved["read"] == [10] and c.read_by_kind == [{"state": 10}]  # nor in their bytes
    c.run([3, 4], lead_in=False)  # --timed-finish: the round up to the end of its work
    assert c.per_step[1] >= 0.15 and c.moved["read"][1] == 60
