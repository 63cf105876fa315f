"""``backward(loss, step=True, clip_norm=c)`` and ``forward_backward(..., step=True, clip_norm=c)``:
the step in the backward with PyTorch's gradient clipping (``clip_grad_norm_(params, c)`` before
``step()``). While the total norm is within ``c`` PyTorch scales every gradient by exactly 1.0, so
the step run unclipped in the backward is the clipped step, bitwise; over it, the step runs after
the backward clipped (no unit updated yet), or is torn with :class:`ClipTornError` and the storage
keeps the last commit (tiered_offload/engine/step_in_backward.py)."""

import copy
import shutil

import pytest
import torch

from conftest import DEVICES
from offload_core.errors import ClipTornError, ConfigError, NonFiniteError, StepFailedError, TensorStateError
from test_hostile import rewrite_manifest
from test_step_in_backward import (_batches, _engine, _gpt, _grad_bytes_written, _loss, _micro_loss, _same_weights,
                                   _state_bytes)
from tiered_offload import Engine, EngineConfig, Tier
from tiered_offload.engine import micro_batches


def _pytorch_step(ref, opt, micro, clip_norm, masters=None):
    """PyTorch's clipped step over the micro-batches ``micro``: their losses and the total norm.
    ``masters``: ``opt`` steps these CPU copies of ``ref``'s parameters, fed its (clipped)
    gradients, and the new weights are copied back (what an update in the host tier below a GPU equals)."""
    losses = []
    for x in micro:
        loss = _micro_loss(ref(x), x) if len(micro) > 1 else _loss(ref, x)
        loss.backward()
        losses.append(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm)
    for m, p in zip(masters or [], ref.parameters(), strict=False):
        m.grad = None if p.grad is None else p.grad.detach().cpu()
    opt.step()
    opt.zero_grad()
    if masters:
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters(), strict=True):
                p.copy_(m)
        ref.zero_grad()
    return losses, norm


def _norms(ref, x, *prefixes):
    """The total gradient norm of ``ref``'s loss on ``x``, then that of the parameters named with
    each of ``prefixes``; the gradients are left as they were."""
    saved = [None if p.grad is None else p.grad.clone() for p in ref.parameters()]
    _loss(ref, x).backward()
    norms = [float(torch.nn.utils.get_total_norm([p.grad for n, p in ref.named_parameters() if n.startswith(prefix)]))
             for prefix in ("", *prefixes)]
    for p, g in zip(ref.parameters(), saved):
        p.grad = g
    return norms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call, where", [("backward", None), ("forward_backward", None), ("backward", "host"),
                                         ("forward_backward", "device")])
def test_within_the_limit_the_step_in_the_backward_is_pytorchs_clipped_step_and_writes_no_gradient(tmp_path, call,
                                                                                                    where, device,
                                                                                                    deterministic):
    """A limit above every step's norm: the losses, the norm each step reports (``on_norm``, before the
    step's commit) and the weights are PyTorch's clipped step's, bitwise. The first step runs after
    the backward (it learns how the norm grows from its first bound: :attr:`TrainState.clip_growth`); from
    the second on every block is updated in the backward, and from the third (the first's update,
    deferred to the second's forwards, done) no gradient byte reaches the disk. ``where``: a device
    tier (the CPU stand-in, a quarter of the state) over the host tier, the update in that tier. On
    CUDA (the GPU check runs it) the device tier is the GPU's, a quarter of the state (``where``
    None: the planner places the update), and each placement is held to its own reference: an
    update in the host tier to PyTorch's optimizer stepping CPU copies of the parameters."""
    layers = 4 if where is None and device == "cpu" else 10
    ref = _gpt(layers=layers)
    state = _state_bytes(ref)
    if device == "cpu":
        tier = {} if where is None else dict(fraction=0.375, optimizer_device=where,
                                             store_config={"device_budget_bytes": state // 4})
    else:
        tier = dict(fraction=0.375, optimizer_device=where or "auto", device=device, device_memory=state // 4)
    engine = _engine(ref, tmp_path, kwargs=dict(lr=1e-2, weight_decay=0.1), **tier)
    ref.to(device)
    masters = ([p.detach().cpu().clone().requires_grad_() for p in ref.parameters()]
               if device != "cpu" and engine._updater.in_lower_tier else None)
    opt = torch.optim.AdamW(masters or ref.parameters(), lr=1e-2, weight_decay=0.1)
    reported = []
    with engine:
        assert where is None or engine._updater.tier.name.lower() == where
        for step in range(4):
            if step == 1:
                assert engine.stats().updates_in_backward == 0 and engine.train_state.clip_growth >= 1.0
            if step == 2:
                before = engine.store.stats
            micro = [x.to(device) for x in _batches(2 if call == "forward_backward" else 1, seed=20 + step, batch=2)]
            if call == "backward":
                got = [_loss(engine, micro[0])]
                assert engine.backward(got[0], step=True, clip_norm=50.0, on_norm=reported.append) is True
            else:
                got = engine.forward_backward(micro, _micro_loss, step=True, clip_norm=50.0, on_norm=reported.append)
            want, norm = _pytorch_step(ref, opt, micro, 50.0, masters)
            assert all(torch.equal(a.detach(), b) for a, b in zip(got, want, strict=True))
            assert 0 < float(norm) < 50.0
            if device == "cpu":
                assert torch.equal(reported[-1], norm)
            else:  # (the norm is told, not applied: within the limit the step's scale is 1.0 either way)
                assert abs(float(reported[-1]) - float(norm)) <= 1e-6 * float(norm), (reported[-1], norm)
        assert engine.step_count == 4 and len(reported) == 4 and _same_weights(engine, ref)
        assert engine.stats().updates_in_backward == 3 * layers  # (every block, every step but the first)
        assert _grad_bytes_written(engine, before) == 0


def test_a_norm_over_the_limit_in_the_first_final_block_runs_the_clipped_step_after_the_backward(tmp_path):
    """A limit below the last block's own gradient norm (the first known): no unit is updated in the
    backward; the step runs after it, clipped, as PyTorch's (bitwise), and the engine goes on."""
    ref = _gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = _engine(ref, tmp_path)
    reported = []
    with engine:
        for step in range(3):
            x = _batches(1, seed=30 + step)[0]
            loss = _loss(engine, x)
            assert engine.backward(loss, step=True, clip_norm=1e-3, on_norm=reported.append) is True
            want, norm = _pytorch_step(ref, opt, [x], 1e-3)
            assert torch.equal(loss.detach(), want[0]) and torch.equal(reported[-1], norm) and float(norm) > 1e-3
        assert engine.stats().updates_in_backward == 0
        assert engine.step_count == 3 and _same_weights(engine, ref)


@pytest.mark.parametrize("where", ["in-the-rest", "in-a-block"])
def test_a_norm_over_the_limit_found_after_updates_tears_the_step_and_a_resume_goes_on_as_pytorch(tmp_path, where):
    """Durable, snapshot commits every 2 steps. Two steps within the limit, committed (the first
    after the backward, learning how the norm grows from its first bound; the second in it). The
    third's gradient jumps where the top of the backward cannot see it (a hook scales it 1e5, as a
    spike): the embeddings' (``in-the-rest``, tied to the head, so final only at the end: every block
    is updated before the total tells) or block 2's (``in-a-block``: block 3 is updated, then the
    bound with block 2 is over): :class:`ClipTornError` (a :class:`StepFailedError`) names the norm
    (or its bound) and the limit; every later call is refused; a resume goes on from step 2 and runs
    that step clipped after the backward, as PyTorch does, bitwise."""
    ref = _gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches(4)
    engine = _engine(ref, tmp_path, durable=True, commit_every=2)
    spiked = "tok.weight" if where == "in-the-rest" else "blocks.2.ln1.weight"

    def spike(model):
        return dict(model.named_parameters())[spiked].register_hook(lambda g: g * 1e5)
    with engine:
        for x in batches[:2]:
            assert engine.backward(_loss(engine, x), step=True, clip_norm=50.0)
            _pytorch_step(ref, opt, [x], 50.0)
        assert engine.wait_committed() == 2 and engine.stats().updates_in_backward == 4
        hooks = [spike(ref), spike(engine.model)]
        # (the bound counts the final norm's gradient, final before block 3's backward)
        total, top, top_two = _norms(ref, batches[2], ("blocks.3.", "ln_f."), ("blocks.3.", "blocks.2.", "ln_f."))
        assert top < 50.0 < total and (top_two < 50.0) == (where == "in-the-rest")
        with pytest.raises(ClipTornError, match=r"over clip_norm.*half applied.*resume=True") as torn:
            engine.backward(_loss(engine, batches[2]), step=True, clip_norm=50.0)
        assert isinstance(torn.value, StepFailedError) and torn.value.clip_norm == 50.0
        if where == "in-the-rest":
            assert abs(torn.value.norm - total) <= 1e-5 * total and not torn.value.bound
            assert "block.0" in str(torn.value)
            assert engine.stats().updates_in_backward == 4 + 4
        else:
            assert abs(torn.value.norm - top_two) <= 1e-5 * top_two and torn.value.bound
            assert "block.3" in str(torn.value)
            assert engine.stats().updates_in_backward == 4 + 1 and "or more" in str(torn.value)
        with pytest.raises(TensorStateError, match="half applied"):
            engine(batches[3][:, :-1])
    resumed = Engine.resume(tmp_path / "s", copy.deepcopy(_gpt()), host_memory=int(_state_bytes(ref) * 0.4),
                            commit_every=2, config=EngineConfig(activations="recompute"))
    with resumed:
        assert resumed.step_count == 2 and _same_weights(resumed, ref)
        x = batches[2]  # the torn step again, clipped after the backward (what train does)
        hook = spike(resumed.model)
        resumed.backward(_loss(resumed, x))
        norm = resumed.clip_grad_norm_(50.0)
        assert resumed.step()
        resumed.zero_grad()
        assert torch.equal(norm, _pytorch_step(ref, opt, [x], 50.0)[1]) and float(norm) > 50.0
        for h in (hook, *hooks):
            h.remove()
        assert resumed.backward(_loss(resumed, batches[3]), step=True, clip_norm=50.0)
        _pytorch_step(ref, opt, [batches[3]], 50.0)
        assert _same_weights(resumed, ref)


def test_a_resumed_engine_predicts_its_first_clipped_step_from_the_committed_growth(tmp_path):
    """Durable, snapshot commits every 2 steps: the first clipped step runs after the backward and
    learns how the norm grows from its first bound (:attr:`TrainState.clip_growth`); the second runs
    in it; both are committed with that growth. A resumed engine reads it back, so its first clipped
    step runs in the backward (every block updated there), as PyTorch's, bitwise; a state saved
    without it (before it was saved) makes that step run after the backward again, to learn it."""
    ref = _gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches(4)
    blocks = len(ref.blocks)
    with _engine(ref, tmp_path, durable=True, commit_every=2) as engine:
        for x in batches[:2]:
            assert engine.backward(_loss(engine, x), step=True, clip_norm=50.0)
            _pytorch_step(ref, opt, [x], 50.0)
        assert engine.wait_committed() == 2 and engine.stats().updates_in_backward == blocks
        growth = engine.train_state.clip_growth
        assert growth is not None and growth >= 1.0
    shutil.copytree(tmp_path / "s", tmp_path / "older")  # (as saved before the growth was: its record without it)
    rewrite_manifest(tmp_path / "older", lambda m: m["meta"].pop("clip_growth") and None)
    for state, saved in ((tmp_path / "s", True), (tmp_path / "older", False)):
        resumed = Engine.resume(state, copy.deepcopy(_gpt()), host_memory=int(_state_bytes(ref) * 0.4),
                                commit_every=2, config=EngineConfig(activations="recompute"))
        with resumed:
            assert resumed.step_count == 2 and resumed.train_state.clip_growth == (growth if saved else None)
            loss = _loss(resumed, batches[2])
            assert resumed.backward(loss, step=True, clip_norm=50.0)
            assert resumed.stats().updates_in_backward == (blocks if saved else 0)
            if saved:
                want = _pytorch_step(ref, opt, [batches[2]], 50.0)[0][0]
                assert torch.equal(loss.detach(), want) and _same_weights(resumed, ref)


@pytest.mark.parametrize("where", [None, "host"])
def test_a_norm_that_the_last_steps_growth_predicts_over_the_limit_runs_the_step_after_the_backward_not_torn(
        tmp_path, where):
    """Two clipped steps within the limit (the first after the backward, the second in it): each tells
    how its total norm grew from its bound at the first unit checked (:attr:`TrainState.clip_growth`). The
    third step's limit lies between its blocks' norm and its total, where the bound alone finds it
    over only after every block was updated (the test above: a tear). The bound at its first unit
    times that growth is over the limit: nothing runs in the backward, the step runs after it,
    clipped, as PyTorch's (bitwise); no tear. The fourth, within again, runs in the backward (its
    order told the lookahead only as it opens: the last did not). ``host``: a device tier (the CPU
    stand-in) over the host, the update there."""
    ref = _gpt(layers=4 if where is None else 10)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches(4)
    reported = []
    tier = {} if where is None else dict(fraction=0.375, optimizer_device=where,
                                         store_config={"device_budget_bytes": _state_bytes(ref) // 4})
    blocks = len(ref.blocks)
    with _engine(ref, tmp_path, durable=True, commit_every=2, **tier) as engine:
        for x in batches[:2]:
            assert engine.backward(_loss(engine, x), step=True, clip_norm=50.0, on_norm=reported.append)
            _pytorch_step(ref, opt, [x], 50.0)
        assert engine.stats().updates_in_backward == blocks
        total, of_blocks = _norms(ref, batches[2], "blocks.")
        limit = (total + of_blocks) / 2
        assert engine.backward(_loss(engine, batches[2]), step=True, clip_norm=limit, on_norm=reported.append)
        norm = _pytorch_step(ref, opt, [batches[2]], limit)[1]
        assert torch.equal(reported[-1], norm) and float(norm) > limit
        assert engine.stats().updates_in_backward == blocks and engine.step_count == 3
        assert _same_weights(engine, ref)
        assert engine.backward(_loss(engine, batches[3]), step=True, clip_norm=50.0)  # (within again: in it)
        _pytorch_step(ref, opt, [batches[3]], 50.0)
        assert engine.stats().updates_in_backward == 2 * blocks and _same_weights(engine, ref)


def test_a_step_that_runs_after_the_backward_when_it_would_open_moves_the_bytes_of_a_step_after_it(tmp_path):
    """Every step over its limit at its first bound (``forward_backward(..., step=True,
    clip_norm=1e-3)``): each runs after the backward, clipped; its disk reads are those of the
    same loop written with ``clip_grad_norm_`` and ``step()`` (within 10%; the lookahead's timing
    moves a few). The lookahead had been told the backward's order with the updates in it, and
    loaded their states for nothing: 15% more reads before the order was declared again."""
    ref = _gpt(layers=8)
    reads = {}
    for way in ("after", "inside"):
        engine = _engine(ref, tmp_path / way, fraction=0.3, durable=True, commit_every=2)
        with engine:
            for step in range(7):
                if step == 1:  # (the first step warms up)
                    before = engine.store.stats
                micro = _batches(2, seed=50 + step, batch=2)
                if way == "inside":
                    engine.forward_backward(micro, _micro_loss, step=True, clip_norm=1e-3)
                else:
                    engine.forward_backward(micro, _micro_loss)
                    engine.clip_grad_norm_(1e-3)
                    engine.step()
                    engine.zero_grad()
                engine.wait_committed()
            reads[way] = engine.store.stats.bytes_read[Tier.DISK] - before.bytes_read[Tier.DISK]
            assert engine.stats().updates_in_backward == 0 and engine.step_count == 7
    assert reads["after"] > 0 and reads["inside"] <= 1.1 * reads["after"], reads


@pytest.mark.parametrize("case", ["one-backward", "device-tier", "accumulated", "forward_backward"])
def test_an_untied_heads_gradient_bounds_the_norm_before_any_update_and_a_norm_it_puts_over_tears_nothing(
        tmp_path, monkeypatch, case):
    """A head not tied to the embeddings: its gradient is final at the top of the backward, so the
    bound at the last block (before any update) counts it, with the final norm's. A first clipped
    step (after the backward) learns how the norm grows from that bound. At the second the head's
    gradient jumps (a hook scales it 1e3, as a spike; the blocks' stay as they were): over the limit
    at the first bound, nothing runs in the backward, and the step runs after it, clipped, as
    PyTorch's (bitwise). Counted at the end only, it tore that step after every block's update.
    ``device-tier``: the rest's gradients on the CPU stand-in of a device; ``accumulated``: a first
    micro-batch's backward, then the last with the step (the head's gradient is the sum of both
    when its norm is taken); ``forward_backward``: two micro-batches through each block together
    (the head's gradient final once both backwards passed it, before the last block's last turn)."""
    ref = _gpt(layers=10 if case == "device-tier" else 4)
    ref.head.weight = torch.nn.Parameter(ref.tok.weight.detach().clone() * 3)  # untied
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    n = 1 if case in ("one-backward", "device-tier") else 2
    tier = {} if case != "device-tier" else dict(fraction=0.375, optimizer_device="device",
                                                 store_config={"device_budget_bytes": _state_bytes(ref) // 4})
    reported, passes = [], []
    vertical = micro_batches._vertical
    monkeypatch.setattr(micro_batches, "_vertical", lambda *a: passes.append(vertical(*a)) or passes[-1])
    with _engine(ref, tmp_path, **tier) as engine:
        for step in range(2):
            micro = _batches(n, seed=7 + step)
            hooks = [m.head.weight.register_hook(lambda g: g * 1e3) for m in (ref, engine.model)] if step else []
            if case == "forward_backward":
                got = engine.forward_backward(micro, _micro_loss, step=True, clip_norm=50.0, on_norm=reported.append)
            else:
                if case == "accumulated":
                    engine.backward(_micro_loss(engine(micro[0]), micro[0]))
                    got = [_micro_loss(engine(micro[1]), micro[1])]
                else:
                    got = [_loss(engine, micro[0])]
                assert engine.backward(got[0], step=True, clip_norm=50.0, on_norm=reported.append) is True
            want, norm = _pytorch_step(ref, opt, micro, 50.0)
            assert torch.equal(got[-1].detach(), want[-1]) and torch.equal(reported[-1], norm)
            for hook in hooks:
                hook.remove()
        assert float(reported[0]) < 50.0 < float(reported[1])
        assert engine.stats().updates_in_backward == 0 and engine.step_count == 2 and _same_weights(engine, ref)
        assert case != "forward_backward" or (len(passes) == 2 and None not in passes)


def test_a_parameter_of_the_rest_frozen_mid_run_is_left_out_of_the_bound_as_of_the_norm(tmp_path):
    """The final norm's weight frozen after two steps (``requires_grad_(False)``, as PyTorch
    allows): the clipped steps in the backward go on as PyTorch's, bitwise, its gradient counted in
    no bound (fuzz seed 137976 froze a T5's rest mid-run: the bound's hook raised on it)."""
    ref = _gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    reported = []
    with _engine(ref, tmp_path) as engine:
        for step, x in enumerate(_batches(4, seed=40)):
            if step == 2:
                for model in (ref, engine.model):
                    model.ln_f.weight.requires_grad_(False)
            loss = _loss(engine, x)
            assert engine.backward(loss, step=True, clip_norm=50.0, on_norm=reported.append) is True
            want, norm = _pytorch_step(ref, opt, [x], 50.0)
            assert torch.equal(loss.detach(), want[0]) and torch.equal(reported[-1], norm)
        assert engine.stats().updates_in_backward == 3 * 4 and _same_weights(engine, ref)  # (the first after)


@pytest.mark.parametrize("where", ["blocks.0.ln1.weight", "tok.weight"])
def test_a_gradient_not_finite_below_updated_blocks_is_named_so_not_a_norm_over_the_limit(tmp_path, where):
    """``clip_norm`` and a gradient that turns infinite below updated blocks (block 0, or the
    embeddings in the rest, whose total norm is then infinite too): the step is torn as without
    clipping, a :class:`NonFiniteError` naming the unit, not a :class:`ClipTornError`. (A first
    clipped step, after the backward, learns how the norm grows: the second runs in it.)"""
    ref = _gpt()
    with _engine(ref, tmp_path) as engine:
        first, second = _batches(2)
        assert engine.backward(_loss(engine, first), step=True, clip_norm=50.0)
        dict(engine.model.named_parameters())[where].register_hook(lambda g: g * float("inf"))
        with pytest.raises(NonFiniteError, match=r"(block\.0|rest).*half applied") as torn:
            engine.backward(_loss(engine, second), step=True, clip_norm=50.0)
        assert not isinstance(torn.value, ClipTornError)


def test_clip_norm_is_refused_where_it_cannot_be_exact(tmp_path):
    """``clip_norm`` without ``step=True`` (clip with ``clip_grad_norm_`` then), or not a positive
    finite number: ``ConfigError`` before anything runs; the graph stays whole."""
    ref = _gpt()
    with _engine(ref, tmp_path) as engine:
        loss = _loss(engine, _batches(1)[0])
        for kwargs, says in ((dict(clip_norm=1.0), "step=True"), (dict(step=True, clip_norm=0.0), "positive"),
                             (dict(step=True, clip_norm=float("inf")), "positive"),
                             (dict(step=True, on_norm=print), "clip_norm")):
            with pytest.raises(ConfigError, match=says):
                engine.backward(loss, **kwargs)
        assert engine.step_count == 0
        engine.backward(loss, step=True, clip_norm=50.0)
        assert engine.step_count == 1
