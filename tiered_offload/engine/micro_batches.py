"""``Engine.forward_backward``: several micro-batches through the blocks with one fetch of each
block's weights per pass ("vertical" order), computing the loop's gradients bitwise.

The loop it replaces is ``for b in micro_batches: engine.backward(loss_fn(engine(b), b))``: every
micro-batch's forward and backward fetch every block again. Here each micro-batch runs on a
thread of its own, and the threads take turns (:class:`Turns`, one running at a time, in
micro-batch order) at every streamed block, forward and backward: block 0 for every micro-batch,
then block 1, ..., the losses, then the last block's backward for every micro-batch, and so on.
The store's lookahead keeps a block's weights and gradients in memory across the turns.

Why that is the loop's arithmetic, bit for bit:

* a block's forward sees the same inputs, weights and buffers (buffers change block by block, and
  each block's forwards run in micro-batch order, as in the loop);
* every gradient buffer receives its micro-batches' additions in micro-batch order (at any turn,
  micro-batch 0's thread runs first), with the same additions inside each backward;
* the RNG: the loop's micro-batch ``k`` starts from the state micro-batch ``k - 1`` left. Each
  turn starts the generators where the micro-batch's last turn left them, micro-batch ``k``'s first
  where micro-batch ``k - 1``'s forward and loss leave them in the loop. Without draws (no dropout
  in training mode, no sampling) that is where the pass started, checked at every turn. With draws,
  it is where the :class:`~.rng_script.RngScript` says, checked after each loss: learned from the
  last loop of micro-batches of the same shapes (:mod:`~tiered_offload.engine.rng_script`). A
  forward that drew other numbers is undone (its graphs dropped, the buffers and the RNG put back;
  no gradient has been added yet: every forward and loss finishes before any backward starts) and
  the micro-batches run as the loop, recorded: its draws are the next pass's script. After two
  passes in a row that the script did not predict (draws that depend on values), the loop runs
  until two loops in a row draw alike (an undone pass costs the forwards it ran). So do a
  non-finite loss (the loop stops or skips there) and an error in a forward (raised where the loop
  raises it). Draws no script can replay (``randn``'s cached sample, a generator reseeded, a
  backward that draws) run the loop alone for the next 64 calls of that shape. A generator of
  the model's own that several blocks, or modules outside them, draw from makes every call the
  loop (a pass would draw it in another order; :mod:`~tiered_offload.engine.own_generators`); one
  a block keeps to itself is drawn in the loop's order. Sharded, if any rank has a non-finite
  loss or other draws, every rank runs the loop, agreed before any backward.

A GPU runs each thread's backward on that thread (``set_multithreading_enabled(False)``), not on
autograd's device thread that every backward shares, which waiting for a turn would block.
Sharded, a block's gradients are reduced over ranks at the end of each micro-batch's backward of
it, in turn, as the loop reduces them. The rest (embeddings, final norm, head) is bound for the
whole pass and its backward spans every turn from the head to the embeddings, so each
micro-batch gets a full gradient buffer of its own for it (:class:`_RestGradients`: its
parameters' ``.grad`` point into it at each of its turns), reduced at the end of its backward:
in one buffer the micro-batches' additions met before each one's reduction (the final norm's
bias came out 9e-11 off the loop). Where the compute tier cannot hold those buffers beside the
working set, the loop runs. A single micro-batch runs the loop, and so does an engine
whose whole state fits its compute tier: no block is read again, and the turns cost compute (on
the 2-core development machine a pass of 4 was 16% slower than the loop there). Under ``torch.autocast`` the forwards and
losses run in it and the backwards outside it, as PyTorch advises; each micro-batch's forward
casts the weights for itself, as the usual loop's autocast region around each forward does (one
region's cache shared by every micro-batch changes the order in which a weight used several
times, BART's shared embedding, adds its gradient).

What differs from the loop is the order of calls, not their values: a user's hook on a block
(``register_forward_hook``, ``register_full_backward_hook``) runs for block 0 of every
micro-batch, then block 1 ..., and in the backward for each micro-batch's output gradient first,
then each one's input gradient (each call sees the loop's tensors, bitwise). A hook on a module
inside a block runs in that block's turn, micro-batch by micro-batch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Sequence

import torch

from offload_core.errors import ModelInputError, TensorStateError, TierCapacityError
from tiered_offload.engine.activations import autocast_state, replay_autocast
from tiered_offload.engine.block_attributes import changed_attributes, restore_attributes, snapshot_attributes
from tiered_offload.engine.rng_script import Expected, Recorder, RngScript, Streams, signature
from tiered_offload.engine.schedule import Phase
from tiered_offload.store.policies import walk_as
from tiered_offload.trace import span

__all__ = ["Turns", "forward_backward"]


class _Undone(BaseException):
    """Raised in a micro-batch's thread to stop it (the pass is undone, or another thread failed)."""


class Turns:
    """Threads that run one at a time, in a fixed rotation (micro-batch order): :meth:`take_turn`
    hands over to the next thread and waits for this one's next turn. Each turn starts the
    generators where the micro-batch's last turn left them (the first where ``expected`` says) and
    checks, where it ends, what it drew (see :mod:`~tiered_offload.engine.rng_script`)."""

    def __init__(self, n: int, expected: Expected, streams: Streams, on_turn: Callable[[int], None] | None = None,
                 agree_on_misses: bool = False):
        self._cond = threading.Condition()
        self.on_turn = on_turn
        """Called on a micro-batch's thread, with its index, at the start of each of its turns."""
        self._order = list(range(n))
        self._turn = 0
        self._stop = False
        self.expected, self.streams = expected, streams
        self.agree_on_misses = agree_on_misses
        """Sharded: a forward that drew other numbers (than its script says, or any without one)
        does not stop the pass at once; the ranks agree on it with the losses, before any backward
        (else one rank's loop would meet the others' pass: a rank may have a script for its
        micro-batches' shapes where another has none for its own)."""
        self.final: list[torch.Tensor] | None = None
        """Where the last micro-batch left the generators (where the loop leaves them)."""
        self._n = n
        self._where: dict[int, Any] = {}
        """Turn number -> where the first micro-batch to reach it was."""
        self.backward_started = False
        self.why: tuple[str, str] | None = None
        """Why the pass stopped (the first reason given) and its particulars, for
        :attr:`EngineStats.forward_backward_loops` and the log."""
        self._local = threading.local()

    def index(self) -> int | None:
        """The micro-batch this thread runs (None on other threads)."""
        return getattr(self._local, "index", None)

    def begin(self, k: int) -> None:
        """Called first on micro-batch ``k``'s thread: wait for its first turn."""
        self._local.index = k
        self._wait(k)

    def take_turn(self, where) -> None:
        """Hand over to the next micro-batch's thread; return when it is this one's turn again.
        ``where`` (a block's forward or backward, the loss) must be where the other micro-batches
        are at the same turn: their graphs are alike, so each buffer's additions come in order."""
        k = self.index()
        if k is None:
            return
        self._arrive(k, where)
        with self._cond:
            i = self._order.index(k)
            self._turn = self._order[(i + 1) % len(self._order)]
            self._cond.notify_all()
        self._wait(k)

    def end(self) -> None:
        """This thread's micro-batch has finished its backward: check where it left the generators."""
        if self.index() is not None:
            self._arrive(self.index(), "end")

    def _arrive(self, k: int, where) -> None:
        turn = self._local.turns = getattr(self._local, "turns", 0) + 1
        alike = self._where.setdefault(turn, where) == where
        now = self.streams.get()
        drew_as_expected = self._drew_as_expected(k, where, now)
        if alike and not drew_as_expected and self.agree_on_misses and not self.backward_started:
            self.expected.missed = drew_as_expected = True  # the ranks agree on it after the losses
        if alike and drew_as_expected:
            self._local.state = now
            if where == "end" and k == self._n - 1:
                self.final = now
            return
        if alike:
            self.stop(f"micro-batch {k} at {_where(where)} drew other random numbers than "
                      f"{'its script says' if self.expected.script else 'none'}",
                      self.streams.describe(self._expected_now(k, where), now))
        else:
            self.stop(f"micro-batch {k} at {_where(where)} took another path than micro-batch 0",
                      f"that was at {_where(self._where[turn])}")
        self.expected.missed = alike and self.expected.script is not None
        if self.backward_started:
            raise TensorStateError(
                "in forward_backward a micro-batch's backward " + ("drew random numbers" if alike else
                "took another path through the blocks than the others'") + ", so the loop's order cannot be "
                "kept; the gradients of this call are incomplete: call zero_grad() and run the micro-batches as "
                "a loop (engine.backward per micro-batch)")
        raise _Undone()

    def _expected_now(self, k: int, where) -> list[torch.Tensor] | None:
        """Where the generators should be at ``where`` (for the reason a pass stops)."""
        if self.expected.script is None:
            return self.expected.start(0)
        loss = getattr(self._local, "loss", None)
        return loss if loss is not None and where != "loss" else (
            self.expected.start(k + 1) if k + 1 < self._n else None)

    def _drew_as_expected(self, k: int, where, now: list[torch.Tensor]) -> bool:
        """Without a script: nothing drawn. With one: the forward and loss end where the next
        micro-batch started (the last's may end anywhere), and the backward draws nothing."""
        if self.expected.script is None:
            return self.streams.equal(now, self.expected.start(0))
        loss = getattr(self._local, "loss", None)
        if loss is not None:
            return self.streams.equal(now, loss)
        if where != "loss":
            return True
        self._local.loss = now
        after = self.expected.start(k + 1) if k + 1 < self._n else now
        return after is not None and self.streams.equal(now, after)

    def is_last(self) -> bool:
        """Whether this thread's micro-batch is the last in the rotation (the others had this turn)."""
        with self._cond:
            return bool(self._order) and self.index() == self._order[-1]

    def finish(self) -> None:
        """This thread's micro-batch is done: the others go on without it."""
        k = self.index()
        with self._cond:
            if k in self._order:
                i = self._order.index(k)
                self._order.remove(k)
                if self._order:
                    self._turn = self._order[i % len(self._order)]
            self._cond.notify_all()

    def stop(self, why: str | None = None, detail: str = "") -> None:
        """Stop every thread at its next turn (``why``: the reason, if it is the first; ``detail``:
        its particulars, for the log)."""
        with self._cond:
            if self.why is None and why is not None:
                self.why = (why, detail)
            self._stop = True
            self._cond.notify_all()

    def _wait(self, k: int) -> None:
        with self._cond:
            while self._turn != k and not self._stop:
                self._cond.wait()
            if self._stop:
                raise _Undone()
        if self.expected.script is not None:  # without one, each turn ended where the pass started (checked)
            state = getattr(self._local, "state", None) or self.expected.start(k)
            if state is None:  # the script has fewer micro-batches: a miss
                self.stop(f"micro-batch {k} is past the {len(self.expected.script.advances)} its script knows")
                self.expected.missed = True
                raise _Undone()
            self.streams.set(state)
        if self.on_turn is not None:
            self.on_turn(k)


class _RestGradients:
    """Sharded: a full gradient buffer of the rest for each micro-batch (the first is the one
    ``bind_rest`` acquired, the others scratch tensors of the compute tier, zeroed), its
    parameters' ``.grad`` pointed into micro-batch ``k``'s at each of ``k``'s turns, and ``k``'s
    reduced over ranks at the end of its backward (see the module's docstring)."""

    def __init__(self, streamer, n: int):
        self.streamer, self.rest = streamer, streamer.rest
        self.keys = [self.rest.key(f"grad.full.micro-batch-{k}") for k in range(1, n)]
        self.buffers: list[torch.Tensor] = []

    def open(self, schedule) -> bool:
        """Acquire the buffers; False (nothing acquired): the compute tier cannot hold them beside
        the working set, run the loop."""
        first = self.streamer.rest_grad_buffer()
        store = self.streamer.store
        extra = len(self.keys) * first.numel() * first.element_size()
        if extra + schedule.working_set().need > store.capacity(store.compute_tier):
            return False
        for key in self.keys:
            store.register(key, tuple(first.shape), scratch=True)  # zeros
        try:
            self.buffers = [first, *store.get_group(self.keys)]
        except BaseException as e:
            for key in self.keys:
                store.unregister(key)
            if isinstance(e, TierCapacityError):  # what is pinned split the room into holes
                return False
            raise
        return True

    def point(self, k: int) -> None:
        """Micro-batch ``k``'s turn: the rest's gradients go into its buffer."""
        self.streamer.point_rest_grads(self.buffers[k])

    def reduce(self, k: int) -> None:
        """Micro-batch ``k``'s backward is done: its rest gradients reduced over ranks into this
        rank's slice (the buffer zeroed), as the loop does at the end of each backward."""
        s = self.streamer
        s.sharding.reduce_gradients(self.rest, self.buffers[k], s.store, s.gradients[self.rest.name])

    def close(self) -> None:
        """Give the scratch buffers back; the rest's ``.grad`` into the first again (reduced and
        zeroed by now: ``unbind_rest`` adds nothing more)."""
        if not self.buffers:
            return  # not opened
        self.point(0)
        for key in self.keys:
            self.streamer.store.release(key)
            self.streamer.store.unregister(key)
        self.buffers = []


def _call(engine, batch):
    """``engine(batch)`` as the loop writes it (a dict is passed as keyword arguments)."""
    return engine(**batch) if isinstance(batch, dict) else engine(batch)


def _loop(engine, micro_batches: Sequence, loss_fn, recorder: Recorder | None = None, arm=None) -> list[torch.Tensor]:
    """The loop, each backward outside the caller's autocast (as PyTorch advises, and as the
    micro-batches' threads run theirs), each forward with autocast's casts of its own (as in the
    usual loop's region per forward, and as each thread's cache of them is); ``recorder`` notes what
    each micro-batch draws; ``arm`` is called as the last backward starts (a step run in it)."""
    losses = []
    state = autocast_state(engine.device)
    outside = [(kind, dtype) for kind, dtype, _ in state]
    mark = recorder.mark if recorder is not None else lambda where: None
    for i, b in enumerate(micro_batches):
        if state:  # a weight used several times: its cached cast shared would sum its gradient otherwise
            torch.clear_autocast_cache()
        mark("start")
        loss = loss_fn(_call(engine, b), b)
        mark("loss")
        if arm is not None and i == len(micro_batches) - 1:
            arm()
        with contextlib.ExitStack() as stack:
            for kind, dtype in outside:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=False))
            engine.backward(loss)
        mark("end")
        losses.append(loss.detach())
    return losses


def forward_backward(engine, micro_batches: Sequence, loss_fn: Callable[[Any, Any], torch.Tensor],
                     arm: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """Run every micro-batch's forward and backward (see the module's docstring); returns the
    losses (detached), as the loop's ``loss.detach()``. ``arm``: called as the last backward
    starts (the loop's last, the pass's only; :mod:`~tiered_offload.engine.step_in_backward`)."""
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ModelInputError("forward_backward needs at least one micro-batch")
    if not torch.is_grad_enabled():
        raise TensorStateError("forward_backward computes gradients; call it outside torch.no_grad()")
    # the whole state in the compute tier (nothing re-read), or one micro-batch: the loop
    streamer = engine._streamer
    if len(micro_batches) == 1:
        return _loop(engine, micro_batches, loss_fn, None, arm)
    if streamer.modes is None:
        engine._monitor.ran_loop("the whole state fits the compute tier: no block is read again")
        return _loop(engine, micro_batches, loss_fn, None, arm)
    key = signature(micro_batches)
    streams, script = Streams(engine.device), streamer.rng_scripts.get(key)
    refused = streamer.rng_scripts.refused(key)  # draws no pass can replay: the loop, unrecorded
    # (a generator of the model's own that several blocks draw from: only the loop draws it in order)
    why = ("a loop of micro-batches of these shapes drew what no pass can replay" if refused else
           "the last two passes drew other random numbers than their scripts" if script is not None and script.misses >= 2
           else _untrusted(streamer))
    trusted = why is None
    if engine._placement.sharding is not None:  # every rank runs the pass, or every rank the loop
        trusted = engine._placement.all_agree(trusted, "forward_backward's random numbers")
        why = why or (None if trusted else "another rank could not run the pass")
    undone: list[tuple[str, ...]] = []  # why a pass was undone: (reason, particulars)
    expected = Expected(script, streams.get())
    if trusted:
        t0 = time.perf_counter()
        try:
            losses = _vertical(engine, micro_batches, loss_fn, expected, streams, undone, arm)
        finally:
            engine._monitor.engine_seconds += time.perf_counter() - t0
        if losses is not None:
            if script is not None:
                script.misses = 0
            return losses
    engine._monitor.ran_loop(*(undone[0] if undone else (why or "its pass was undone",)))
    if refused:
        return _loop(engine, micro_batches, loss_fn, None, arm)
    recorder = Recorder(streams)
    losses = _loop(engine, micro_batches, loss_fn, recorder, arm)
    learned = recorder.script()
    if learned is None:
        streamer.rng_scripts.refuse(key)
    else:
        streamer.rng_scripts.put(key, _learned(script, learned, expected.missed))
    return losses


def _untrusted(streamer) -> str | None:
    """Why no pass may run whatever the draws (None: one may)."""
    if streamer.own.shared():
        return "a generator of the model's own that several blocks draw from"
    if streamer.keeps_tensors:
        return "a block keeps tensors on its modules that the loss reads"
    if streamer.updates_rest:
        return "a block updates a buffer outside the blocks (a pass would update it in another order)"
    return None


def _where(where) -> str:
    """A turn's place in words: ``("forward", 3)`` -> "block 3's forward"."""
    return f"block {where[1]}'s {where[0]}" if isinstance(where, tuple) else f"its {where}"


def _learned(script: RngScript | None, learned: RngScript, missed: bool) -> RngScript | None:
    """The script the next pass follows: what the loop drew (None: no draws), with the count of
    passes in a row the scripts did not predict."""
    if not learned.draws:
        return None
    if script is not None:
        learned.misses = script.misses + 1 if missed else 0 if learned == script else script.misses
    return learned


def _vertical(engine, micro_batches: list, loss_fn, expected: Expected, streams: Streams,
              why: list[tuple], arm=None) -> list[torch.Tensor] | None:
    """The micro-batches in vertical order; None if undone before any backward (run the loop;
    ``why`` says why)."""
    streamer, device, n = engine._streamer, engine.device, len(micro_batches)
    start = streams.get()
    buffers = [(mod, attr, mod._buffers[attr], mod._buffers[attr].clone()) for _, mod, attr, _ in engine.binding.buffers]
    attributes = snapshot_attributes(None, [*engine.binding.rest_modules(),
                                            *(m for u in engine.binding.blocks for m in u.module.modules())])
    sharded = engine._placement.sharding is not None
    rest_grads = _RestGradients(streamer, n) if sharded and streamer.rest.grad_key is not None else None
    bad_loss = [False] * n
    turns = Turns(n, expected, streams, rest_grads.point if rest_grads else None, agree_on_misses=sharded)
    autocast = autocast_state(device)
    losses: list[torch.Tensor | None] = [None] * n
    errors: list[BaseException | None] = [None] * n
    inputs = [engine._to_device(((), b) if isinstance(b, dict) else ((b,), {})) for b in micro_batches]

    walker = threading.get_ident()  # the micro-batches take turns: one walker of the access order

    def run(k: int) -> None:
        with walk_as(walker):
            _run(k)

    def _run(k: int) -> None:
        try:
            if device.type == "cuda":  # a new thread starts on device 0
                torch.cuda.set_device(device)
            turns.begin(k)
            with replay_autocast(autocast):
                loss = loss_fn(engine.model(*inputs[k][0], **inputs[k][1]), micro_batches[k])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad \
                    or not bool(torch.isfinite(loss.detach()).all()):
                if not sharded:  # the loop raises (or skips) at this micro-batch: let it
                    turns.stop(f"micro-batch {k}'s loss is not a finite one-element tensor that requires grad")
                    raise _Undone()
                bad_loss[k] = True  # sharded: the ranks agree first (below), or their collectives would part
            turns.take_turn("loss")  # every forward and loss is done before any backward starts
            if k == 0:
                # a generator several blocks draw from, found in these forwards: not the loop's order
                go_on = (not any(bad_loss) and not expected.missed and _untrusted(streamer) is None)
                if sharded:
                    go_on = engine._placement.all_agree(go_on, "the micro-batches' losses and random numbers")
                if not go_on:  # the loop runs (on every rank; one's raises or skips at a bad loss)
                    turns.stop("a micro-batch's loss was not finite" if any(bad_loss) else
                               "its forwards drew other random numbers than the script says" if expected.missed else
                               _untrusted(streamer) or "another rank could not run the pass")
                    raise _Undone()
                turns.backward_started = streamer.in_backward = True
                engine._commits.before_backward(engine._await)
                if arm is not None:
                    arm()
            losses[k] = loss.detach()
            with torch.autograd.set_multithreading_enabled(False), streamer.backward_of(loss):
                loss.backward()
            streamer.calls.flush()  # (still this micro-batch's turn: the buffers' additions in order)
            if rest_grads is not None:  # still this micro-batch's turn: the ranks reduce in the same order
                rest_grads.reduce(k)
            turns.end()
        except _Undone:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors[k] = e
            turns.stop(f"micro-batch {k} raised {type(e).__name__}", str(e))
        finally:
            turns.finish()

    engine.binding.check_call(*(b for b in micro_batches if isinstance(b, dict)))
    engine._placement.set_phase(f"step {engine.step_count + 1}, forward_backward")
    engine._phase(Phase.FORWARD)
    streamer.bind_rest()
    if rest_grads is not None:  # every rank runs the pass, or every rank the loop: their collectives match
        opened = rest_grads.open(engine.schedule)
        if not engine._placement.all_agree(opened, "room for the rest's gradients per micro-batch"):
            rest_grads.close()
            streamer.unbind_rest()
            why.append(("no room for the rest's gradients per micro-batch (on some rank)",))
            return None  # the loop
    streamer.micro_batches, streamer.turns = n, turns
    streamer.full.hold_for_pass(turns)
    streamer.own.pass_start()
    interrupted = None
    try:
        with span(engine._tracer, "forward_backward", "phase"):
            threads = [threading.Thread(target=run, args=(k,), name=f"tiered-offload-micro-batch-{k}", daemon=True)
                       for k in range(n)]
            for t in threads:
                t.start()
            try:
                for t in threads:
                    t.join()
            except BaseException as e:  # Ctrl-C: every thread stops at its next turn
                interrupted = e
                turns.stop("interrupted")
                for t in threads:
                    t.join()
    finally:
        streamer.turns = None
        streamer.full.end_pass()
        streamer.own.pass_end(undone=not turns.backward_started)
        if rest_grads is not None:
            rest_grads.close()
    # the threads' errors hold their frames, and the frames this list: a cycle that would keep the
    # pass's graphs (and their saved activations in the store) until the garbage collector ran
    first = interrupted or next((e for e in errors if e is not None), None)
    errors.clear()
    if turns.backward_started:
        engine._phase(Phase.BACKWARD)
        try:
            if first is not None:
                try:
                    raise first
                finally:  # (its traceback holds this frame)
                    first = interrupted = None
            streamer.shared.backward_done()
            streams.set(turns.final)  # where the loop leaves the generators
        finally:
            streamer.backward_ran()
            streamer.shared.pass_ended()
            streamer.unbind_rest(reduce=rest_grads is None)  # each micro-batch reduced its own
        return losses
    # undone before any backward: put back what the forwards changed; the loop runs them
    why.append(turns.why or ("its pass was undone",))
    streamer.unbind_rest()
    streamer.drop_orphans()
    streamer.shared.pass_ended()
    for mod, attr, tensor, value in buffers:
        tensor.copy_(value)
        mod._buffers[attr] = tensor
    restore_attributes(changed_attributes(attributes))  # (a count of calls, a history: as before the pass)
    streams.set(start)
    if interrupted is not None:
        try:
            raise interrupted
        finally:
            first = interrupted = None
    return None
