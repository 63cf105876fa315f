"""``Engine``: the training engine's facade.

It wraps a model whose fp32 training state (weights, gradients, optimizer states) does not fit in
memory, wires the parts that do the work (each owns its state; see docs/ARCHITECTURE.md) and
offers the user's API: ``engine(batch)``, ``backward``, ``clip_grad_norm_``, ``step``,
``zero_grad``, inspection, export, commit and close. What a call does beyond forwarding is the
order of the parts' hooks.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload_core.errors import (
    ConfigError,
    ModelInputError,
    NonFiniteError,
    TensorStateError,
    TieredOffloadError,
)
from tiered_offload.checkpoint.adapter import adapter_record, peft_adapter_name
from tiered_offload.checkpoint.layout import StateLayout
from tiered_offload.checkpoint.session import Commits, JournalCommits, NoCommits, SnapshotCommits, commits_for
from tiered_offload.config import EngineConfig, StoreConfig, check_engine_arguments, resolve_device
from tiered_offload.engine.binding import ModelBinding, Unit, empty_init
from tiered_offload.engine.gradients import Gradients
from tiered_offload.engine.initial_weights import load_initial_weights
from tiered_offload.engine.micro_batches import forward_backward
from tiered_offload.engine.optim_spec import OptimizerSpec, optimizer_for_resume, read_optimizer
from tiered_offload.engine.optimizer_step import UnitUpdater
from tiered_offload.engine.optimizer_view import OptimizerView
from tiered_offload.engine.pipeline import UpdatePipeline
from tiered_offload.engine.plan_monitor import PlanMonitor, profiled_disk_rates
from tiered_offload.engine.planner import choose_activation_modes
from tiered_offload.engine.preflight import (check_budgets, check_disk, check_step_mode, measure_update_rates,
                                             optimizer_tier)
from tiered_offload.engine.schedule import Phase, Schedule
from tiered_offload.engine.sharding import Local, Placement, Sharded, distributed_group, engine_storage
from tiered_offload.engine.step_in_backward import StepInBackward, open_step
from tiered_offload.engine.streaming import BlockStreamer
from tiered_offload.engine.train_state import StepUpdates, TrainState
from tiered_offload.engine.views import EngineViews
from tiered_offload.memstat import tune_allocator
from tiered_offload.store.tiered_store import TieredStore
from tiered_offload.store.tiers import Tier
from tiered_offload.trace import Tracer, span

__all__ = ["Engine", "empty_init"]

log = logging.getLogger("tiered_offload")


def _engine_time(method):
    """Count the time spent in ``method`` as the engine's (what a step costs, for the plan); refused
    once the engine is closed."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        self._check_open()
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._monitor.engine_seconds += time.perf_counter() - t0
    return timed


def _between_collectives(method):
    """Sharded, an error out of ``method`` (other than a non-finite loss or gradient, which every
    rank sees alike) may have left this rank between two collectives: no further one is issued."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except NonFiniteError:
            raise
        except BaseException as e:
            self._placement.mark_broken(e)
            raise
    return guarded


class Engine(EngineViews):
    """Train ``model`` with its state streamed through device memory, a host budget and disk.

    Args:
        model: an ``nn.Module`` (possibly built with :func:`empty_init` or on the meta device)
            whose bulk is a sequence of blocks.
        optimizer: a ``torch.optim`` class (Adam, AdamW, SGD, ...) whose per-parameter state is
            elementwise, or an instance of one built over the model's parameters (parameter
            groups included; on an :func:`empty_init` model too). The engine never steps the
            instance: it reads its class, groups and hyperparameters.
        optimizer_kwargs: the class's hyperparameters (``lr``, ``weight_decay``...); not with an instance.
        storage: a directory, a list of directories (striped), or a backend spec
            (``"posix:/mnt/a,/mnt/b"``, ``"memory"``). Default: a temporary directory.
        host_memory: host budget (pinned on CUDA); ``"auto"``: a quarter of available memory.
        device_memory: device budget on CUDA (``"auto"``: half the free memory); unused on the CPU.
        blocks: dotted name of the block sequence when it cannot be found automatically.
        device: ``"auto"`` (CUDA when available; under torchrun with several ranks, the GPU
            numbered ``LOCAL_RANK``), ``"cuda"``, ``"cuda:N"``, ``"cpu"``.
        on_nonfinite: ``"raise"`` (default) or ``"skip"``: what to do when a loss or gradient is NaN or
            infinite. Either way no weight or optimizer state is touched (but see ``backward(step=True)``).
        recompute: recompute every block in backward from its input (True), or keep its activations and
            its weights resident until backward, as plain PyTorch does (False). ``"auto"``: False when the
            whole training state fits the compute tier, else each block as :attr:`EngineConfig.activations`
            says (by default the planner chooses, per block: keep, offload or recompute its activations).
        store_config: extra :class:`StoreConfig` fields (policy, prefetch_depth...).
        durable: keep the storage directory a consistent, resumable training state after every
            step (see :mod:`.durable`). Default: on when ``storage`` is a directory (or several),
            off for a temporary directory, ``"memory"`` or a backend object.
        commit_every: with ``durable``, commit every Nth step (and at :meth:`close`): a crash loses at
            most N-1 steps and resumes exactly from the last commit. N > 1 (and any state that fits the
            compute tier) commits by snapshot, in the background beside the next forward and backward,
            and may use up to twice the state's disk space while it does.
        resume: continue the training state in ``storage`` (True: it must hold one; ``"auto"``:
            if it holds one, else start fresh). False refuses a directory that holds a state.
        init_from: a safetensors file, or a directory of safetensors shards with its index (or, without
            those, PyTorch's ``pytorch_model.bin`` or its shards, memory-mapped), to load the weights from
            (Hugging Face parameter names), streamed one tensor at a time; for a PEFT model,
            ``[BASE, ADAPTER]``: the base's checkpoint and a directory its ``save_pretrained`` wrote.
        config: tuning knobs (:class:`~tiered_offload.config.EngineConfig`).
        trace: write a step timeline (Chrome / Perfetto trace JSON) of the whole run to this file
            at :meth:`close`; :meth:`tracing` records a stretch of it instead.
        process_group: shard the training state over this ``torch.distributed`` group (default: the default
            group, when it is initialised with more than one rank). Each rank stores its slice of every unit
            in its own directory inside ``storage`` (``rank-R-of-W``); see :mod:`tiered_offload.engine.sharding`.
    """

    def __init__(self, model: nn.Module, optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer = torch.optim.AdamW,
                 optimizer_kwargs: dict | None = None, storage=None, host_memory: int | str = "auto",
                 device_memory: int | str = "auto", *, blocks: str | None = None, device: str = "auto",
                 on_nonfinite: str = "raise", recompute: bool | str = "auto", store_config: dict | None = None,
                 durable: bool | None = None, commit_every: int = 1, resume: bool | str = False,
                 init_from: str | os.PathLike | list | None = None, config: EngineConfig | None = None,
                 trace: str | os.PathLike | None = None, process_group=None):
        check_engine_arguments(on_nonfinite=on_nonfinite, resume=resume, durable=durable, commit_every=commit_every,
                               trace=trace, config=config, init_from=init_from, store_config=store_config,
                               host_memory=host_memory, device_memory=device_memory)
        tracer = Tracer(trace) if trace is not None else None  # (first: its path is refused before a lock is taken)
        tune_allocator()  # freed temporaries go back to the system: resident memory tracks the budget
        self.model = model
        self.on_nonfinite = on_nonfinite
        self.config = config or EngineConfig()
        """Tuning knobs (see :class:`EngineConfig`)."""
        group = distributed_group(process_group)
        self.device = resolve_device(device)
        if device in (None, "auto") and self.device.type == "cuda" and "LOCAL_RANK" in os.environ and group is not None:
            # one GPU per rank, as torchrun numbers them on each machine (not every rank on GPU 0)
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(self.device)
        spec, durable, self._tmpdir = engine_storage(storage, group, durable, resume, commit_every)
        self.durable = durable
        """Whether the storage directory holds a committed, resumable state after every step."""
        self.commit_every = commit_every
        """Commit every this many steps (durable mode)."""

        self.binding = ModelBinding(model, blocks, self.device, self.config.stream_modules_numel)
        """The model split into units, its parameters as slots in flat buffers, its proxies."""
        self.seq_name, self.blocks, self.rest = self.binding.seq_name, self.binding.blocks, self.binding.rest
        self.units: list[Unit] = self.binding.units
        self._spec: OptimizerSpec = read_optimizer(optimizer, optimizer_kwargs, (p for _, p in model.named_parameters()))
        self.optimizer_class = self._spec.cls
        self.train_state = TrainState([dict(g) for g in self._spec.groups], self.binding.param_order, self.device)
        """Step count, parameter groups, user state, scheduler, per-parameter step counts."""
        group_of = self._spec.group_of()
        self._spec.members = []  # no reference to the user's (possibly meta) parameters is kept
        self.binding.arrange(group_of, self.config.state_piece_numel, whole_params=self._spec.per_parameter is not None)
        self._placement: Placement = Sharded(group, self.device) if group is not None else Local()
        if self._placement.world > 1 and self._spec.per_parameter is not None:
            raise ConfigError(f"{self._spec.cls.__name__} works on whole parameters, which sharding splits between "
                              f"ranks; train it on one process, or use an elementwise optimizer (AdamW) sharded")
        """Where this process's share of the state lives (all of it, or its rank's slice)."""
        self._placement.check_same(self.binding.signature(self._spec, self.param_groups))
        kinds = tuple(self._spec.kinds)
        self.layout = StateLayout(self.units, self.binding.param_order, self._spec.name, kinds,
                                  len(self.param_groups), self._placement)
        """What the manifest says about the model and the optimizer."""

        cuda = self.device.type == "cuda"
        self.store = TieredStore(spec, StoreConfig(**{
            "host_budget_bytes": host_memory, "device": self.device, "device_budget_bytes": device_memory if cuda else 0,
            "policy": "lookahead", "prefetch_depth": self.config.prefetch_depth, "versioned_writes": self.durable,
            **(store_config or {})}))
        self.store.open()
        self.schedule = Schedule(self.units, kinds, lambda n: self.store.footprint(n, self.store.compute_tier),
                                 world=self._placement.world)
        """Unit order, access sequence and budget arithmetic (pure numbers)."""
        self._units_by_name = {u.name: u for u in self.units}
        snapshot = commit_every > 1 or self._placement.all_agree(  # (every rank commits alike)
            self.schedule.share_fits(self.store.capacity(self.store.compute_tier)), "whether each rank's share fits")
        self._commits: Commits = commits_for(self.train_state, self.store, self.layout, self.binding.model_config,
                                             durable=self.durable, snapshot=snapshot, every=commit_every,
                                             peft=adapter_record(self.binding) if self.durable else None)
        """How a step becomes durable: no commits, the journal, or snapshots."""
        try:
            recovered = self._take_state(resume)
            # every refusal comes before the weights move in: a refused engine leaves the model as it was, to reuse
            measure = functools.partial(measure_update_rates, self._spec, self.device,
                                        profiled_disk_rates(self.store), self.commit_mode == "journal")
            update_tier = optimizer_tier(self.config.optimizer_device, self.store, self.schedule, self.train_state,
                                         measure, self._placement.all_agree)
            check_step_mode(self.config, self.store, self.schedule, update_tier[0])
            choose_activation_modes(recompute, self.config.activations, [b.name for b in self.blocks], False)
            self._fill_state(recovered, init_from)
        except BaseException:
            self._commits.release()
            self.store.close(flush=False)
            raise

        try:  # (a failure from here on: the directory released, the store closed)
            self._phases: list[Phase] = []
            self._updater = UnitUpdater(self.store, self._spec, self.config.optimizer_chunk_numel, *update_tier)
            self._pipeline = UpdatePipeline(
                self.config.step_lead,
                before_each=lambda name: self._commits.before_unit(
                    self.schedule.rewrite_bytes(self._units_by_name[name]), self.schedule.commit_admits),
                on_error=lambda e: self._commits.fail(e),
                on_flush=lambda: self._declare([Phase.FORWARD, Phase.BACKWARD, Phase.STEP], stepping=True, inline=True),
                how_to_go_on=lambda: self._commits.how_to_go_on())
            """The optimizer step over units: inline, in the background or deferred to the next forward."""
            self._optimizer_view: OptimizerView | None = None
            self._streamer = BlockStreamer.for_budget(self.store, self.binding, self._pipeline, self.device,
                                                      self.schedule, self._placement, self.config, recompute)
            """Forward and backward through the store."""
            self._gradients = Gradients(self.store, self.binding, self._streamer, self._placement, self._pipeline,
                                        self.schedule)
            """Which parameters have a gradient, finiteness, the clipping scale, zeroing."""
            self._monitor = PlanMonitor(self.store, self.schedule, self._streamer, [b.name for b in self.blocks],
                                        self.config, recompute,
                                        sum(s.numel for _, s in self.binding.param_order), self._floors(),
                                        self.extra_disk_bytes(), self._placement.world, self._placement.all_agree_each)
            """The plan, the measurements, the prediction check, stats()."""
            self._tracer: Tracer | None = None
            if tracer is not None:
                self._attach_tracer(tracer)
            self._declare([Phase.FORWARD, Phase.BACKWARD, Phase.STEP])
            self._streamer.unbind_rest()
            by_name = self._units_by_name
            self._commits.start(self.layout, lambda name, *args: self._update_unit(by_name[name], *args),
                                [u.name for u in self.schedule.update_order()],
                                lambda name: self.schedule.rewrite_bytes(by_name[name]), self.schedule.commit_admits)
        except BaseException:
            self._commits.release()
            self.store.close(flush=False)
            raise
        self._model_hooks = _hook_model_calls(model, self._streamer)
        if isinstance(optimizer, torch.optim.Optimizer):  # the one it was built from: its optimizer from now on
            self._optimizer_view = OptimizerView.adopt(optimizer, self)
        _close_at_exit(self)

    @classmethod
    def resume(cls, storage, model: nn.Module, optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer | None = None,
               optimizer_kwargs: dict | None = None, **kwargs) -> "Engine":
        """Continue the training state in ``storage`` with ``model`` (built as before, e.g. with
        :func:`empty_init`). The optimizer, its parameter groups and their hyperparameters default
        to the saved ones (a ``torch.optim`` class; another one must be passed)."""
        optimizer, optimizer_kwargs = optimizer_for_resume(storage, model, optimizer, optimizer_kwargs)
        return cls(model, optimizer, optimizer_kwargs, storage=storage, resume=True, **kwargs)

    # ---- set-up -------------------------------------------------------------------------
    def _take_state(self, resume):
        """Take and read the directory (durable) and check the budgets; the committed state, or None."""
        recovered = self._commits.open(resume, self._placement, self.layout)
        self.layout.delete_stale_activations(self.store.backend)  # once this process holds the directory
        check_budgets(self.store, self.schedule, self.config.state_piece_numel)
        return recovered

    def _fill_state(self, recovered, init_from) -> None:
        """Adopt the committed state or register and fill a fresh one; then bind the blocks' proxies."""
        rest = self.binding.rest  # pinned through every forward: at the compute tier's end (splits no free room)
        self.store.place_at_end([k for k in (rest.weight_key, rest.grad_key, rest.key("weight.full"),
                                             rest.key("grad.full")) if k])
        if recovered is None:
            check_disk(self.store.backend, self.state_bytes(), self.extra_disk_bytes())
            load_initial_weights(self.store, self.binding, self._placement, self.schedule.state_kinds, init_from)
        else:
            if init_from is not None:
                raise ConfigError("init_from and a resumed state both give the weights; pass only one")
            self.layout.adopt(self.store, recovered)
            self.binding.release_parameters()
        self.binding.install_proxies(lambda i, args, kwargs: self._streamer.block_forward(i, args, kwargs), self.zero_grad)
        self.train_state.bind(self.binding)

    # ---- forward and backward -----------------------------------------------------------------
    def _to_device(self, tree):
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, tree)

    def _await(self, unit: Unit | None = None) -> None:
        """Wait until the step in flight has updated ``unit`` (every unit if None); re-raise its error."""
        self._pipeline.wait(None if unit is None else unit.name)

    def _phase(self, phase: Phase) -> None:
        """Record what the caller does this iteration (forward, backward, clip, step)."""
        if not self._phases or self._phases[-1] != phase or phase == Phase.BACKWARD:
            self._phases.append(phase)

    def _declare(self, phases: list[Phase], stepping: bool = False, inline: bool = False) -> None:
        """Tell the store's lookahead the order (``inline``: a deferred step run whole before the
        forward); a device tier the step does not run in sees the forward and backward only
        (``stepping``: from a step that is about to rewrite them)."""
        order = functools.partial(self._streamer.access_sequence, self.schedule, inline=inline)
        self.store.declare_access_sequence(order(phases))
        if self._updater.in_lower_tier:
            self._updater.device_sequence(order([p for p in phases if p != Phase.STEP]),
                                          self.schedule.update_order() if stepping else [])

    @_engine_time
    @_between_collectives
    def __call__(self, *args, **kwargs):
        """Run the model's forward, streaming its blocks; returns what the model returns."""
        args, kwargs = self._to_device((args, kwargs))
        self.binding.check_call(kwargs)
        self._placement.set_phase(f"step {self.step_count + 1}, forward")
        with span(self._tracer, "forward", "phase"):  # binding the rest (its waits) included
            self._phase(Phase.FORWARD)
            self._gradients.settle_owed()  # (before the rest's gradients are bound)
            self._streamer.bind_rest()
            try:
                return self.model(*args, **kwargs)
            except TieredOffloadError:
                raise
            except (TypeError, ValueError, RuntimeError, IndexError) as e:
                raise ModelInputError(f"{type(self.model).__name__}.forward rejected the batch: {e}. Check the "
                                      f"inputs' shapes, dtypes and keyword names against what the model expects") from e

    @_engine_time
    @_between_collectives
    def backward(self, loss: torch.Tensor, step: bool = False, clip_norm=None, on_norm=None) -> bool | None:
        """Back-propagate ``loss`` (any scalar computed from the engine's output), accumulating gradients.
        ``step=True``: :meth:`step` and :meth:`zero_grad` too, run in the backward; ``clip_norm``: clipped first
        (``on_norm(total norm)`` before the step's commit; exact, or ``ClipTornError``: :mod:`.step_in_backward`)."""
        if step or clip_norm is not None or on_norm is not None:  # (StepInBackward.check_clip)
            return StepInBackward.run(self, lambda arm: self._backward(loss), True, step, clip_norm, on_norm)[1]
        self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        _check_loss(loss)
        self._placement.set_phase(f"step {self.step_count + 1}, backward")
        # every rank backpropagates, or none does
        if not self._placement.all_agree(bool(torch.isfinite(loss.detach()).all()), "the losses' finiteness"):
            self._streamer.unbind_rest()
            if self.on_nonfinite == "skip":
                self._gradients.skip_step = True
                return
            raise NonFiniteError(f"the loss is {loss.item()}; no gradient was computed and the training state is "
                                 f"unchanged. Lower the learning rate, check the data, or pass on_nonfinite='skip'")
        self._phase(Phase.BACKWARD)
        self._gradients.settle()
        self._commits.before_backward(self._await)
        self._streamer.in_backward = True
        try:
            with span(self._tracer, "backward", "phase"), self._streamer.backward_of(loss):
                loss.backward()
            self._streamer.backward_done()
        except BaseException as e:
            # this rank left the backward between two collectives: the cleanup below must not issue more
            self._placement.mark_broken(e)
            raise
        finally:
            self._streamer.backward_ran()
            self._streamer.unbind_rest()

    def forward_backward(self, micro_batches, loss_fn, step=False, clip_norm=None, on_norm=None) -> list[torch.Tensor]:
        """``for b in micro_batches: self.backward(loss_fn(self(b), b))`` with each block's weights fetched once
        for all of them (block 0 for every micro-batch, then block 1, ...; backward in reverse): the same gradients
        bitwise; returns the losses (detached). A dict micro-batch gives keyword arguments. With dropout a shape's
        first call runs as the loop, learning the draws (:mod:`.micro_batches`; ``stats().forward_backward_loops``
        counts such calls, by reason). ``step``, ``clip_norm``, ``on_norm``: as :meth:`backward`'s."""
        self._check_open()
        self._gradients.settle()
        if step or clip_norm is not None or on_norm is not None:
            return StepInBackward.run(self, lambda arm: forward_backward(self, micro_batches, loss_fn, arm), False,
                                      step, clip_norm, on_norm)[0]
        return forward_backward(self, micro_batches, loss_fn)

    # ---- optimizer ----------------------------------------------------------------------
    @_engine_time
    @_between_collectives
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the global gradient norm over the parameters that have a gradient, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` (its keywords; ``foreach`` changes no value).

        Returns the total norm before clipping. The L2 norms of each unit come from the backward
        that last changed its gradient (no pass over the gradients on disk); the scaling is applied in :meth:`step`."""
        self._placement.set_phase(f"step {self.step_count + 1}, clipping")
        self._streamer.unbind_rest()
        self._await()
        self._phase(Phase.CLIP)
        return self._gradients.clip(max_norm, norm_type, error_if_nonfinite)

    @_engine_time
    @_between_collectives
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``, as
        ``torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)`` (a pass over them)."""
        self._placement.set_phase(f"step {self.step_count + 1}, clipping")
        self._streamer.unbind_rest()
        self._await()
        self._phase(Phase.CLIP)
        self._gradients.clip_value(clip_value)

    @_engine_time
    @_between_collectives
    def step(self) -> bool:
        """Apply one optimizer update to every parameter that has a gradient. Returns False if the
        step was skipped (non-finite).

        As ``torch.optim`` does, a parameter without a gradient since the last :meth:`zero_grad`
        (frozen, outside the optimizer, or unused by this step's batches) is left as it is: no
        weight decay, no moment update, its step count unchanged.

        With :attr:`overlap_step` (the budget allows it) the update runs in the background, unit
        by unit in forward order, and returns at once: the next forward waits for each unit's
        update just before it needs the unit, so the update's disk traffic overlaps compute.
        Every other engine call waits for the units it touches; the numbers are the same.
        """
        self._streamer.unbind_rest()
        self._await()
        self._placement.set_phase(f"step {self.step_count + 1}, step")
        self.train_state.check_scheduler()
        if not self._gradients.usable(self.on_nonfinite):
            return False
        hypers = open_step(self)
        scale = self._gradients.take_scale()
        updates = self.train_state.advance(
            (lambda group, count, scalars: self._spec.next_scalars(hypers[group], count, scalars))
            if self._spec.scalars else None)
        try:
            then = self._commits.begin_step(hypers, scale, updates,
                                            barrier=self._placement.barrier if self._placement.world > 1 else None)
            self._declare(self._phases, stepping=True)
            self._phases = []
            by_name = self._units_by_name
            self._pipeline.run([u.name for u in self.schedule.update_order()],
                               lambda name: self._update_unit(by_name[name], hypers, scale, updates),
                               background=self.overlap_step, deferred=self._streamer.defer_step, then=then)
        except BaseException as e:  # the step is neither done nor going on: no commit may wait for it
            self._commits.fail(e)
            raise
        return True

    def _update_unit(self, unit: Unit, hypers: list[dict], scale: torch.Tensor | None, updates: StepUpdates) -> None:
        """One unit's optimizer step (see :class:`UnitUpdater`), recorded by the commit when durable."""
        journal = self._commits.weights_behind
        # the state does not fit in memory (device and host tiers together): the optimizer states
        # the update changed go to the disk at once (the first to give up their room, then at no
        # cost), but without a journal not those memory kept from update to update (keep_resident).
        # The weights only when the journal needs them there: the next forward wants them soon,
        # and a write is wasted where they stay in memory until then (docs/STEP_TIME.md)
        memory = self.store.capacity(Tier.DEVICE) + self.store.capacity(Tier.HOST)
        write_behind = journal or not self.schedule.fits(memory)
        with span(self._tracer, f"update {unit.name}", "optimizer"):
            futures = self._updater.update(unit, hypers, scale, updates.before, write_behind=write_behind,
                                           weights_behind=journal, keep_resident=not journal, scalars=updates.scalars,
                                           shard=self._placement.sharding and self._placement.layout(unit))
        self._commits.unit_updated(unit.name, futures, self.schedule.rewrite_bytes(unit))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every gradient, as ``model.zero_grad()`` (which calls this) does: no parameter has a
        gradient until the next backward gives it one (``set_to_none=False``: what had one keeps one,
        of zeros). No I/O: the store just forgets the bytes. (``engine.optimizer.zero_grad()`` forgets
        the optimizer's parameters' only, as PyTorch's.) A unit the step in flight has not reached yet
        is zeroed right after its update."""
        self._gradients.forget(optimized_only=False, to_none=set_to_none)

    # ---- committing -----------------------------------------------------------------------
    @property
    def commit_mode(self) -> str:
        """How steps become durable: ``"none"`` (scratch storage), ``"journal"`` (every step, unit by
        unit; the state does not fit in memory) or ``"snapshot"`` (every ``commit_every`` steps)."""
        return {NoCommits: "none", JournalCommits: "journal", SnapshotCommits: "snapshot"}[type(self._commits)]

    def commit(self) -> int:
        """Commit the last step now (with ``commit_every`` > 1, between the scheduled commits) and
        wait until it is durable; returns its number."""
        self._check_open()
        self._streamer.unbind_rest()
        self._await()
        return self._commits.commit()

    def wait_committed(self) -> int:
        """Wait until the last commit is durable in the storage directory; returns its step (with
        ``commit_every`` > 1 it may be behind :attr:`step_count`: :meth:`commit` commits now)."""
        self._await()
        return self._commits.wait()

    @property
    def optimizer(self) -> "OptimizerView":
        """A ``torch.optim.Optimizer`` view of the engine, for learning-rate schedulers."""
        if self._optimizer_view is None:
            self._optimizer_view = OptimizerView(self)
        return self._optimizer_view

    # ---- closing --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish writing the last step, release memory, files and the directory's lock
        (a temporary storage directory is removed)."""
        if self.store is None:
            return
        _open_engines.discard(self)
        try:
            for hook in self._model_hooks:
                hook.remove()
            self._streamer.close()
            self._streamer.unbind_rest()
            self._pipeline.settle()  # (a failed or torn step already reported is not raised again: no commit follows)
            if not self._pipeline.failed and self._torn is None:
                self._commits.close()  # the last commit finished; no journal work left running when the backend closes
        finally:
            if self._tracer is not None:
                self._tracer.write()
            try:
                # durable: the committed state is complete; what is dirty now (gradients) is not part of it
                self.store.close(flush=not self.durable)
            finally:
                self._commits.release()
                self.store = None
                if self._tmpdir is not None:
                    self._tmpdir.cleanup()

    def __enter__(self) -> "Engine":
        return self

    def __reduce_ex__(self, protocol):
        raise TensorStateError(_NOT_SAVED.format(what="an engine"))

    def __deepcopy__(self, memo):
        raise TensorStateError(_NOT_SAVED.format(what="an engine"))

    def __exit__(self, *exc) -> None:
        self.close()


def _hook_model_calls(model: nn.Module, streamer) -> list:
    """Calls of the model itself (``model.generate()``, an evaluation loop) find its rest bound
    too; a forward without grad has no backward to wait for, so the outermost such call lets go of
    the rest after (unless a forward with grad still waits for its backward:
    ``BlockStreamer.forward_ended``). What ``generate()`` calls besides the model's own forward is
    hooked too: a PEFT model's base model (prompt learning's embeddings and prompt encoder), an
    encoder-decoder's encoder (``get_encoder()``, run alone before the decoding; inside the model's
    forward it lets go of nothing, the decoder still to run). The hooks after a forward run also
    when it raises, so the count of calls stays true."""
    called = {id(model): model}
    if peft_adapter_name(model):
        base = model.get_base_model()
        called[id(base)] = base
        # prompt learning's generate() embeds the tokens and computes the prompt outside any forward of the model
        extra = [getattr(model, "word_embeddings", None), *getattr(model, "prompt_encoder", {}).values()]
        called.update({id(m): m for m in extra if isinstance(m, nn.Module)})
    for m in list(called.values()):
        try:
            encoder = m.get_encoder() if callable(getattr(m, "get_encoder", None)) else None
        except Exception:  # noqa: BLE001 - a model without one (transformers' default may raise): nothing to hook
            encoder = None
        if isinstance(encoder, nn.Module):
            called.setdefault(id(encoder), encoder)
    depth = [0]

    def entered(_m, _args) -> None:
        depth[0] += 1
        streamer.bind_rest()

    def left(_m, _args, _out) -> None:
        depth[0] = max(0, depth[0] - 1)
        if not depth[0]:
            streamer.forward_ended()
    return [hook for m in called.values() for hook in (m.register_forward_pre_hook(_Unsaved(entered)),
                                                       m.register_forward_hook(_Unsaved(left), always_call=True))]


class _Unsaved:
    """A hook the engine puts on the model: a model saved whole (``torch.save(model)``, pickle, a
    deep copy) is refused with the way to save its weights, as a copy of one of its parameters is."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __reduce_ex__(self, protocol):
        raise TensorStateError(_NOT_SAVED.format(what="the model"))


_NOT_SAVED = ("{what} cannot be saved or copied whole (torch.save, pickle, copy.deepcopy): its weights and "
              "optimizer state live in the engine's store. Save the weights with engine.export_safetensors(DIR) "
              "(from_pretrained(DIR), or init_from=DIR, reads them back); a durable storage directory keeps the "
              "whole training state (resume=True)")


def _check_loss(loss) -> None:
    """What ``engine.backward`` can take: a scalar tensor that requires a gradient."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise ModelInputError(f"engine.backward needs a scalar tensor computed from the engine's output (in "
                              f"forward_backward: what loss_fn returns; keep what you log aside), got {got}")
    if not loss.requires_grad:
        raise ModelInputError("the loss does not require a gradient: it was computed under torch.no_grad() or "
                              "torch.inference_mode(), or from detached tensors (.detach(), .item()); compute it "
                              "from the engine's output with gradients on")


_open_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_exit_hook: list = []


def _close_at_exit(engine: Engine) -> None:
    """Close ``engine`` when the interpreter exits normally (an exception leaving the training loop
    included), so the steps ``step()`` returned are committed without an explicit ``close()``.

    The hook runs among threading's exit hooks, before ``concurrent.futures`` shuts its thread pools
    down (the commit needs them); a SIGKILL runs no hook: what is committed then is what
    :meth:`Engine.wait_committed` last returned, or the step after it."""
    if not _exit_hook:
        register = getattr(threading, "_register_atexit", None) or atexit.register
        register(_close_open_engines)
        _exit_hook.append(register)
    _open_engines.add(engine)


def _close_open_engines() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except BaseException as e:  # noqa: BLE001 - at exit: report, and close the others
            log.error("tiered-offload: closing an engine at exit failed: %s: %s", type(e).__name__, e)
