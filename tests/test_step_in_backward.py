"""``backward(loss, step=True)`` and ``forward_backward(..., step=True)``: the optimizer step run in
the backward, each unit updated once its gradient is final, trains as ``loss.backward();
opt.step(); opt.zero_grad()`` in PyTorch, bitwise; gradients never reach the disk; what it cannot
run exactly is refused before anything runs (tiered_offload/engine/step_in_backward.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from offload_core.errors import ConfigError, NonFiniteError, TensorStateError
from tiered_offload import Engine, EngineConfig, format_size
from tiered_offload.engine.step_in_backward import StepInBackward
from tiered_offload_examples.models import GPT, GPTConfig


def _gpt(dropout=0.0, layers=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, context=33, d_model=32, n_layers=layers, n_heads=4, dropout=dropout))


def _loss(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def _state_bytes(model):
    return 16 * sum(p.numel() for p in model.parameters())


def _engine(ref, tmp_path, optimizer=torch.optim.AdamW, kwargs=None, fraction=0.4, activations="recompute",
            optimizer_device="auto", **more):
    more.setdefault("durable", False)
    return Engine(copy.deepcopy(ref), optimizer, kwargs or dict(lr=1e-2), storage=tmp_path / "s",
                  host_memory=int(_state_bytes(ref) * fraction),
                  config=EngineConfig(activations=activations, optimizer_device=optimizer_device), **more)


def _batches(n, seed=1, batch=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (batch, 33), generator=g) for _ in range(n)]


def _same_weights(engine, ref):
    ours = dict(engine.named_parameters())
    return all(torch.equal(ours[name], p.detach().cpu()) for name, p in ref.named_parameters())


def _beside_pytorch(engine, ref, opt, batches):
    """A step in the backward (``backward(loss, step=True)``) for each of ``batches``, and PyTorch's
    ``loss.backward(); opt.step(); opt.zero_grad()`` on ``ref``: the same loss each step, bitwise."""
    for x in batches:
        loss = _loss(engine, x)
        assert engine.backward(loss, step=True) is True
        expected = _loss(ref, x)
        expected.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss.detach(), expected.detach())


def _grad_bytes_written(engine, since):
    return engine.store.stats.by_kind(("host->disk",), since=since).get("grad", 0)


OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
              "nadam": (torch.optim.NAdam, dict(lr=1e-2)),  # (scalars kept per parameter: mu_product)
              "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))}


@pytest.mark.parametrize("activations", ["recompute", "keep", "offload"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_in_the_backward_trains_as_pytorch_bitwise_and_writes_no_gradient(tmp_path, activations, name):
    """At 0.4 of the state (a unit's update fits beside the backward's pins, the state does not),
    four steps of ``backward(loss, step=True)``: PyTorch's losses and weights, bitwise, and not a
    byte of gradient written to disk (the deferred and inline steps write them: checked beside)."""
    cls, kwargs = OPTIMIZERS[name]
    ref = _gpt()
    engine = _engine(ref, tmp_path, cls, kwargs, activations=activations)
    capacity = engine.store.capacity(engine.store.compute_tier)
    assert engine.schedule.defer_budget() <= capacity and not engine.schedule.fits(capacity)
    opt = cls(ref.parameters(), **kwargs)
    before = engine.store.stats
    with engine:
        _beside_pytorch(engine, ref, opt, _batches(4))
        assert engine.step_count == 4 and _same_weights(engine, ref)
        assert _grad_bytes_written(engine, before) == 0
        floors = engine.stats().floors  # the plan names the floor of this order, below the step()'s
        assert 0 < floors["in_backward"]["disk_read"] < floors["disk_read"]
    # the same engine without it writes gradients at this budget
    unfused = _engine(_gpt(), tmp_path / "b", cls, kwargs, activations=activations)
    with unfused:
        before = unfused.store.stats
        for x in _batches(4):
            unfused.backward(_loss(unfused, x))
            unfused.step()
            unfused.zero_grad()
        assert _grad_bytes_written(unfused, before) > 0 and _same_weights(unfused, ref)


def _micro_loss(out, x):
    """``forward_backward``'s loss of a micro-batch ``x`` of 33 tokens (the model predicts each next one)."""
    return F.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def test_accumulated_backwards_and_a_forward_backward_pass_step_in_their_last_backward(tmp_path):
    """``backward(l1); backward(l2, step=True)`` and ``forward_backward(micro_batches, loss_fn,
    step=True)`` (the vertical pass: a block updated after the last micro-batch's turn at it):
    PyTorch's accumulation loop, bitwise. Only the pass keeps every gradient off the disk."""
    ref = _gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    looped, passed = _engine(ref, tmp_path / "a"), _engine(ref, tmp_path / "b")
    with looped, passed:
        before = [looped.store.stats, passed.store.stats]
        for step in range(3):
            micro = _batches(3, seed=10 + step, batch=2)
            for i, x in enumerate(micro):
                looped.backward(_micro_loss(looped(x), x), step=i == len(micro) - 1)
            got = passed.forward_backward(micro, _micro_loss, step=True)
            want = []
            for x in micro:
                loss = _micro_loss(ref(x), x)
                loss.backward()
                want.append(loss.detach())
            opt.step()
            opt.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert passed.stats().forward_backward_loops == {}  # every call ran the pass
        assert looped.step_count == passed.step_count == 3
        # the loop's earlier backwards keep their gradients for the last one (here some on disk); the pass none
        assert _grad_bytes_written(looped, before[0]) > 0 and _grad_bytes_written(passed, before[1]) == 0
        assert _same_weights(looped, ref) and _same_weights(passed, ref)


def test_with_dropout_the_loop_that_learns_the_draws_and_the_passes_after_it_step_in_their_backward(tmp_path):
    """Dropout: ``forward_backward``'s first call of a shape runs the loop (its last backward
    carries the step), the next ones the pass: PyTorch's, bitwise, both ways."""
    ref = _gpt(dropout=0.1)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = _engine(ref, tmp_path)
    got, want = [], []
    torch.manual_seed(5)
    with engine:
        for step in range(3):
            got += engine.forward_backward(_batches(2, seed=20 + step, batch=2), _micro_loss, step=True)
        loops = engine.stats().forward_backward_loops
        torch.manual_seed(5)
        for step in range(3):
            for x in _batches(2, seed=20 + step, batch=2):
                loss = _micro_loss(ref(x), x)
                loss.backward()
                want.append(loss.detach())
            opt.step()
            opt.zero_grad()
        assert sum(loops.values()) == 1 and _same_weights(engine, ref)  # the first call learned the draws
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _link_bytes(engine, since):
    """Bytes copied into and out of the device tier since ``since`` (a store's stats), by kind."""
    return engine.store.stats.by_kind(("host->device", "device->host"), since=since)


@pytest.mark.parametrize("where", ["host", "device"])
def test_with_a_device_tier_the_step_in_the_backward_trains_as_pytorch_wherever_the_update_runs(tmp_path, where):
    """A device tier (the CPU stand-in: a quarter of the state) over a host tier (3/8): with the
    update in either tier, ``backward(loss, step=True)`` gives PyTorch's losses and weights,
    bitwise (on the stand-in the two placements' references are the same arithmetic; the GPU check
    holds each to its own on CUDA), and not a byte of gradient reaches the disk. In the host tier
    the device sends each gradient down once, receives no state, and sends a block's weights down
    about once (the host keeps its copy for the update: ``TieredStore.keep_twins``; the new weights
    it is offered after the update go down again in the forward), within 1.15x the state a step
    (0.67x before the offer: link bytes for disk bytes, the next test; issue 21's 0.8x is stated for
    ``step()``); the plan states the link's floor for this order, and the bytes are not below it."""
    ref = _gpt(layers=10)
    state = _state_bytes(ref)
    engine = _engine(ref, tmp_path, fraction=0.375, optimizer_device=where,
                     store_config={"device_budget_bytes": state // 4})
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    grads = sum(p.numel() for p in ref.parameters()) * 4
    in_backward = []  # per unit updated: whether it ran inside the backward (the blocks) or after it (the rest)
    update_unit = engine._update_unit
    engine._update_unit = lambda unit, *a: (in_backward.append(StepInBackward.updating(engine)),
                                            update_unit(unit, *a))[1]
    with engine:
        assert engine._updater.tier.name.lower() == where
        batches = _batches(5)
        _beside_pytorch(engine, ref, opt, batches[:2])
        before = engine.store.stats
        _beside_pytorch(engine, ref, opt, batches[2:])
        assert engine.step_count == 5 and _same_weights(engine, ref)
        assert in_backward.count(True) == 5 * 10 and in_backward.count(False) == 5  # 10 blocks in, the rest after
        assert _grad_bytes_written(engine, before) == 0
        link = _link_bytes(engine, before)
        floors = engine.stats().floors["in_backward"]
        assert floors["link"] > 0 and sum(link.values()) / 3 >= floors["link"], (link, floors)
        if where == "host":
            assert "state" not in link, link
            moved = engine.store.stats.by_kind(("device->host",), since=before)
            assert moved["grad"] / 3 == grads, moved  # each gradient down once a step
            # the host keeps its copy of a block's weights until the update reads it; the device then takes
            # the new ones (offered) and gives most back in the forward: weights down 1.14-1.21x a step, 1.44-1.47x
            # without the host's copy kept; the link 0.96-1.01x the state a step (0.67x before the offer)
            assert moved.get("weight", 0) / 3 <= 1.3 * grads and sum(link.values()) / 3 <= 1.15 * state, (moved, link)


def test_with_the_update_on_the_host_a_larger_device_tier_keeps_more_optimizer_states_off_the_disk(tmp_path):
    """The update in the host tier below a device tier, in the backward: each block's new weights
    are offered to the device (room nothing needed sooner holds), and the host's copy goes first.
    Before, the host held every updated block's weights (their only current copy) until the next
    forward and gave up the optimizer states for them. The optimizer states read from the disk per
    step, in bytes a parameter (of Adam's 8), with the device at a quarter of the state and at half:
    before, 7.68 and 7.46 (a device twice as large kept 3% more of them in memory); now 5.21-5.64
    and 4.23. Bitwise PyTorch's at both sizes."""
    ref = _gpt(layers=10)
    state = _state_bytes(ref)
    reads = {}
    for device in (4, 2):
        engine = _engine(ref, tmp_path / f"d{device}", fraction=0.375, optimizer_device="host",
                         store_config={"device_budget_bytes": state // device})
        plain = copy.deepcopy(ref)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        with engine:
            batches = _batches(10)
            _beside_pytorch(engine, plain, opt, batches[:4])
            engine._await()
            before = engine.store.stats
            _beside_pytorch(engine, plain, opt, batches[4:])
            engine._await()
            assert _same_weights(engine, plain)
            reads[device] = engine.store.stats.by_kind(("disk->host",), since=before).get("state", 0) / 6 / (state / 16)
    assert reads[4] <= 0.85 * 8 and reads[2] <= 0.7 * 8, reads


def test_what_the_step_in_the_backward_cannot_run_exactly_is_refused_before_anything_runs(tmp_path):
    """Journal commits (durable, one commit a step, the state beyond memory): ``ConfigError``
    naming what to do, raised before the backward (no gradient, no update); the same engine then
    trains with ``backward``, ``step`` and ``zero_grad``."""
    ref = _gpt()
    x = _batches(1)[0]
    journal = _engine(ref, tmp_path / "j", durable=True)
    assert journal.commit_mode == "journal"
    for engine, says in ((journal, "commit_every=2 or more"),):
        with engine:
            loss = _loss(engine, x)
            with pytest.raises(ConfigError, match=says):
                engine.backward(loss, step=True)
            assert engine.step_count == 0 and _same_weights(engine, ref)
            engine.backward(loss)  # the graph is whole: the call ran nothing
            assert engine.step()


def test_where_the_budget_holds_no_update_beside_the_backwards_pins_the_step_runs_after_it(tmp_path, caplog):
    """Below :meth:`Schedule.defer_budget` the step runs after the backward, as ``step()``: the
    same numbers (and gradients written, as there); the engine warns once, and the plan gives no
    floor of the order it does not run: both say what budget would run it."""
    ref = _gpt()
    probe = _engine(ref, tmp_path / "p")
    low, least = probe.schedule.defer_budget() - 4096, probe.minimum_budget()
    probe.close()
    assert low >= least
    engine = Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", durable=False,
                    host_memory=low, config=EngineConfig(activations="recompute"))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with engine:
        for x in _batches(3):
            assert engine.backward(_loss(engine, x), step=True)
            _loss(ref, x).backward()
            opt.step()
            opt.zero_grad()
        assert engine.step_count == 3 and _same_weights(engine, ref)
        floors = engine.stats().floors
        assert floors["in_backward"] is None
        assert floors["in_backward_needs"] == f"host_memory >= {format_size(low + 4096)} ({low + 4096} bytes)"
        assert "steps after the backward at this budget" in str(engine.plan)
        said = [r.getMessage() for r in caplog.records if "backward(step=True)" in r.getMessage()]
        assert len(said) == 1 and f"host_memory >= {low + 4096} bytes runs it in the backward" in said[0], said
    roomy = _engine(ref, tmp_path / "r")
    with roomy:
        assert roomy.stats().floors["in_backward"] and roomy.stats().floors["in_backward_needs"] is None


def _inf_gradient_in(engine, block: int):
    """A hook that makes one parameter's gradient in ``block`` infinite (the loss stays finite)."""
    param = dict(engine.model.named_parameters())[f"blocks.{block}.ln1.weight"]
    return param.register_hook(lambda g: g * float("inf"))


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_non_finite_gradient_in_the_last_block_stops_the_step_before_any_update(tmp_path, on_nonfinite):
    """The last block's gradient (the first to be final) not finite: no update runs in the
    backward, and the step after it raises or skips as ``step()`` does, nothing changed; the
    engine goes on."""
    ref = _gpt()
    engine = _engine(ref, tmp_path, on_nonfinite=on_nonfinite)
    x = _batches(1)[0]
    with engine:
        hook = _inf_gradient_in(engine, 3)
        loss = _loss(engine, x)
        if on_nonfinite == "raise":
            with pytest.raises(NonFiniteError, match="blocks?.3"):
                engine.backward(loss, step=True)
            engine.zero_grad()
        else:
            assert engine.backward(loss, step=True) is False
        assert engine.step_count == 0 and _same_weights(engine, ref)
        hook.remove()
        assert engine.backward(_loss(engine, x), step=True)
        _loss(ref, x).backward()
        torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
        assert _same_weights(engine, ref)


def test_a_non_finite_gradient_below_an_updated_block_tears_the_step_and_the_storage_keeps_the_last_commit(tmp_path):
    """Durable, snapshot commits every 2 steps: two steps, committed; at the third, block 0's
    gradient turns infinite after blocks 3-1 were updated. ``NonFiniteError`` says the step is half
    applied; every later call is refused; nothing is committed; a resume goes on from step 2 as
    PyTorch does, bitwise."""
    ref = _gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches(4)
    engine = _engine(ref, tmp_path, durable=True, commit_every=2)
    assert engine.commit_mode == "snapshot"
    with engine:
        for x in batches[:2]:
            assert engine.backward(_loss(engine, x), step=True)
        assert engine.wait_committed() == 2
        _inf_gradient_in(engine, 0)
        with pytest.raises(NonFiniteError, match=r"blocks?\.0.*half applied.*resume=True"):
            engine.backward(_loss(engine, batches[2]), step=True)
        with pytest.raises(TensorStateError, match="half applied"):
            engine(batches[3][:, :-1])
    for x in batches[:2]:
        _loss(ref, x).backward()
        opt.step()
        opt.zero_grad()
    resumed = Engine.resume(tmp_path / "s", copy.deepcopy(_gpt()), host_memory=int(_state_bytes(ref) * 0.4),
                            commit_every=2, config=EngineConfig(activations="recompute"))
    with resumed:
        assert resumed.step_count == 2 and _same_weights(resumed, ref)
        for x in batches[2:]:
            assert resumed.backward(_loss(resumed, x), step=True)
            _loss(ref, x).backward()
            opt.step()
            opt.zero_grad()
        assert _same_weights(resumed, ref)


@pytest.mark.parametrize("case", ["moe", "llama-resumed", "gpt2-twice", "lora"])
def test_model_kinds_train_with_the_step_in_the_backward_as_pytorch(tmp_path, case, monkeypatch):
    """``tests/test_finetune.py::check_parity`` with the step in the last backward: a routed MoE
    (an expert no token reached keeps its weights, as ``torch.optim`` skips it), Llama with
    Trainer's groups resumed from a snapshot commit, GPT-2 with dropout whose blocks are called
    twice before each backward (the update waits for the last call), a LoRA model (frozen base)."""
    import test_finetune as tf
    opened, real = [], StepInBackward._open
    monkeypatch.setattr(StepInBackward, "_open", lambda self, unit: opened.append(real(self, unit)) or opened[-1])
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
    if case == "moe":
        weights, _, start, _ = tf.check_parity(tf.make_moe, adamw, tmp_path, routes=[[0, 1], [1, 2], [2, 0]], steps=3,
                                               accumulate=2, fused=True, in_backward=True, durable=False,
                                               host_fraction=0.6)
        assert all(torch.equal(weights[k], start[k]) for k in weights if ".experts.3." in k)
    elif case == "llama-resumed":
        tf.check_parity(tf.make_llama, lambda m: torch.optim.AdamW(tf.hf_groups(m), lr=1e-3), tmp_path,
                        loss_fn=tf.hf_loss, steps=4, accumulate=2, resume_at=2, commit_every=2, in_backward=True)
    elif case == "gpt2-twice":
        tf.check_parity(lambda: tf.make_gpt2(dropout=0.1), adamw, tmp_path, loss_fn=tf.hf_loss, steps=3, accumulate=2,
                        habits=tf.Habits(twice=True), in_backward=True, durable=False)
    else:
        tf.check_parity(tf.make_lora, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), tmp_path, storage=None,
                        host_fraction=0.6, in_backward=True)
    assert any(opened)  # the steps opened in a backward: blocks were updated there
