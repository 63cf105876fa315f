"""What an :class:`~tiered_offload.engine.facade.Engine` tells about itself: its sizes (the state,
the minimum budget, the commit window, the ranks), the training state besides tensors, the plan,
``stats()``, the weights and buffers (copies, read one at a time), their export and the step timeline.
Read-only views over the parts the facade wires (a base class of the engine: the split is by
concern, the state stays the parts')."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from offload_core.errors import ConfigError, EngineClosedError, TensorStateError, TieredOffloadError
from offload_core.sizes import format_size
from tiered_offload.checkpoint.adapter import export_adapter, merged_export
from tiered_offload.checkpoint.export import export_weights
from tiered_offload.checkpoint.safetensors_io import export_dtype, exporting
from tiered_offload.checkpoint.session import JournalCommits
from tiered_offload.engine.planner import Plan
from tiered_offload.engine.schedule import FP32_BYTES
from tiered_offload.engine.stats import EngineStats
from tiered_offload.engine.step_in_backward import StepInBackward
from tiered_offload.store.tiers import Tier
from tiered_offload.trace import Tracer

__all__ = ["EngineViews"]


class EngineViews:
    """The model's mode, sizes, state, plan, stats and tracing of an engine (a part of :class:`Engine`)."""

    _torn: str | None = None
    """Why every call is refused: a step run in the backward was half applied (:mod:`.step_in_backward`)."""

    def _check_open(self) -> None:
        """Refuse a call that needs the store once :meth:`~Engine.close` released it, or once a step
        was torn."""
        if self.store is None:
            raise EngineClosedError("this engine is closed (close(), or its with block ended): its storage is "
                                    "released. Build a new engine to go on: resume=True on its durable directory, "
                                    "or init_from an export")
        if self._torn is not None:
            raise TensorStateError(self._torn)

    # ---- the model's mode -----------------------------------------------------------------
    def train(self, mode: bool = True):
        """The model's training mode (dropout on), as ``nn.Module.train``; returns the engine."""
        self.model.train(mode)
        return self

    def eval(self):
        """The model's evaluation mode (dropout off), as ``nn.Module.eval``; returns the engine."""
        return self.train(False)

    @property
    def training(self) -> bool:
        """Whether the model is in training mode."""
        return self.model.training

    # ---- sizes ----------------------------------------------------------------------------
    def minimum_budget(self) -> int:
        """The smallest compute-tier budget (bytes) this engine's model and optimizer train in: see
        :meth:`Schedule.working_set`."""
        return self.schedule.working_set().need

    def state_bytes(self) -> int:
        """Bytes of training state on disk: weights of every parameter, gradients of the trainable
        ones and optimizer states of those the optimizer updates."""
        return self.schedule.state_bytes()

    def local_state_bytes(self) -> int:
        """Bytes of training state this process stores: :meth:`state_bytes`, or its slice of it when
        sharded over ranks (about ``state_bytes() / world size``)."""
        kinds = self.schedule.state_kinds
        return FP32_BYTES * sum(n for u in self.units for n in self._placement.shapes(u, kinds).values())

    def commit_window(self) -> int:
        """Bytes of new weights and states that may coexist on disk with the committed ones (durable
        mode, journal commits): a quarter of the state. A unit waits before its update until the
        units updated but not yet recorded and it fit; a unit larger than the window goes alone."""
        return self.schedule.commit_window()

    def extra_disk_bytes(self) -> int:
        """Most disk space beyond :meth:`state_bytes` a step can need: the commit window (journal
        commits), a second copy of the committed tensors (snapshot commits), or nothing."""
        return self.schedule.extra_disk_bytes(self.commit_mode)

    @property
    def world_size(self) -> int:
        """Ranks the training state is sharded over (1: this process holds all of it)."""
        return self._placement.world

    @property
    def rank(self) -> int:
        return self._placement.rank

    def collective_bytes(self) -> dict[str, int]:
        """Bytes of the collectives' buffers so far, per kind (all zero on one process)."""
        return self._placement.collective_bytes()

    # ---- the training state besides tensors --------------------------------------------------
    @property
    def step_count(self) -> int:
        """Optimizer steps taken (restored by a resume)."""
        return self.train_state.step_count

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups (hyperparameters only), in the optimizer's order: change
        ``lr`` here, or through a scheduler on :attr:`optimizer`."""
        return self.train_state.param_groups

    @property
    def user_state(self) -> dict:
        """JSON-serialisable values saved with every step (a data loader's position...) and
        restored by a resume."""
        return self.train_state.user_state

    @user_state.setter
    def user_state(self, value: dict) -> None:
        self.train_state.user_state = value

    def attach_scheduler(self, scheduler) -> None:
        """Let the engine step ``scheduler`` after each optimizer step and save its state with the step.

        Call ``engine.step()`` only (not ``scheduler.step()``). On a resumed engine the scheduler's
        saved state is loaded into it.
        """
        self.train_state.attach_scheduler(scheduler)

    # ---- the plan -------------------------------------------------------------------------
    def _floors(self) -> dict:
        """What a step cannot avoid moving (:meth:`Schedule.floors`), where the update runs, and
        where the gradients wait for it."""
        host, device = self.store.capacity(Tier.HOST), self.store.capacity(Tier.DEVICE)
        journal, on_host = isinstance(self._commits, JournalCommits), self._updater.tier == Tier.HOST
        short = StepInBackward.short_of_room(self)  # (then backward(step=True) steps after the backward)
        return {**self.schedule.floors(host + device, device, update_on_host=on_host, journal=journal),
                "in_backward": None if StepInBackward.refusal(self) or short
                else self.schedule.floors_in_backward(host + device, device, update_on_host=on_host),
                "in_backward_needs": short and f"{self.store.compute_tier.name.lower()}_memory >= {format_size(short)} "
                                               f"({short} bytes)",
                "update": self._updater.tier.name.lower(), "update_why": self._updater.why,
                "gradients": "to the disk before each step's record (a crash redoes the update from them)" if journal
                else "in memory until the update (to the disk only when memory is short)"}

    @property
    def plan(self) -> Plan:
        """What the engine does with each block's activations, the prefetch depth, whether the step
        overlaps the next forward, how the compute tier's budget is used, and the predicted step
        time and disk bytes per step (after the second measured iteration). ``print(engine.plan)``."""
        return self._monitor.plan

    @property
    def recompute(self) -> bool:
        """Whether any block is recomputed in backward (activation checkpointing)."""
        return self._streamer.modes is not None and "recompute" in self._streamer.modes

    @property
    def overlap_step(self) -> bool:
        """Whether step() returns at once and updates units in the background, ahead of the next
        forward (where the budget allows it; where the disk bounds the step, the engine measures
        it deferred too and keeps the faster: see :attr:`plan`)."""
        return self._streamer.overlap_step

    @property
    def defer_step(self) -> bool:
        """Else, whether step() returns at once and the next forward updates each unit as it needs it."""
        return self._streamer.defer_step

    @property
    def step_mode(self) -> str:
        """How the optimizer step runs: ``overlapped`` (in the background beside the next forward),
        ``deferred`` (each unit's update by the next forward as it reaches the unit) or ``inline``."""
        return "overlapped" if self.overlap_step else "deferred" if self.defer_step else "inline"

    @property
    def activation_modes(self) -> list[str] | None:
        """Per streamed block: ``keep``, ``offload`` or ``recompute`` (None: everything is kept in
        memory until backward, as plain PyTorch does, because the whole state fits)."""
        return None if self._streamer.modes is None else list(self._streamer.modes)

    def stats(self) -> EngineStats:
        """The store's counters (bytes per tier, hits, waits) and, per training step, the disk
        bytes read and written (per parameter too), the step time and the I/O bound."""
        return self._monitor.stats()

    # ---- the weights and buffers, read -------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every parameter, in ``model.named_parameters()`` order, one at a time on the CPU."""
        self._check_open()
        if not self._streamer.graph_pending:  # (between a forward and its backward the rest stays bound)
            self._streamer.unbind_rest()
        self._await()
        self._placement.set_phase(f"named_parameters() after step {self.step_count}")
        yield from self._placement.parameters(self.store, self.units, self.binding.param_order)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every module buffer (BatchNorm statistics, counters), as
        ``model.named_buffers()`` would give them, copied to the CPU."""
        self._await()
        for name, mod, attr, _ in self.binding.buffers:
            yield name, mod._buffers[attr].detach().to("cpu", copy=True)

    # ---- export ---------------------------------------------------------------------------
    def export_safetensors(self, out: str | os.PathLike, max_shard_size: int | str = "2GB",
                           adapter_only: bool = False, merged: bool = False, dtype=torch.float32) -> list:
        """Write the current weights as Hugging Face sharded safetensors in ``out``, streaming.

        ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
        ``model.safetensors.index.json`` when larger than ``max_shard_size``), parameters under
        their ``model.named_parameters()`` names (a tied weight once, as ``save_pretrained``
        does), and ``config.json`` when the model has a Hugging Face config. Returns the files.
        Sharded over ranks, every rank must call it: rank 0 writes the one model (with its own
        module buffers), the others send their slices and get ``[]``. A PEFT model's export has its
        adapter too, as its ``save_pretrained`` writes it (``checkpoint/adapter.py``), and no config;
        ``adapter_only``: that adapter alone (not the frozen weights); ``merged``: the base model
        with the adapter merged into its weights and its config, as ``merge_and_unload()`` and
        ``save_pretrained`` write it (for ``from_pretrained`` without PEFT). The files are what
        ``save_pretrained`` writes (transformers' own conversions reverted: ``checkpoint/export.py``),
        in ``dtype`` (``torch.bfloat16``, ``"bf16"``...: as ``model.to(dtype).save_pretrained`` writes them)."""
        self._check_open()
        dtype = export_dtype(dtype)
        if merged and adapter_only:
            raise ConfigError("export_safetensors(adapter_only=True, merged=True): the adapter alone, or the model "
                              "with it merged; pick one")
        params, merge, config = self.layout.describe()["params"], None, self.binding.model_config
        buffers = [(name, mod._buffers[attr].detach().cpu()) for name, mod, attr, persistent in self.binding.buffers
                   if persistent]
        if merged:
            params, buffers, merge, config = merged_export(self.binding, params, buffers)
        self._streamer.unbind_rest()
        self._await()
        self._placement.set_phase(f"export_safetensors after step {self.step_count}")
        base = self.model.get_base_model() if merged else None if self.binding.model_config is None else self.model
        with exporting(out) if self._placement.writes_exports() else contextlib.nullcontext():  # (one at a time)
            files = [] if adapter_only else export_weights(
                out, params=params, units=self.units, store=self.store, placement=self._placement, buffers=buffers,
                model_config=config, step=self.step_count, max_shard_size=max_shard_size, merge=merge, dtype=dtype,
                model=base)
            return files + ([] if merged else export_adapter(out, self.binding, self.store, self._placement,
                                                              required=adapter_only, dtype=dtype))

    # ---- the timeline ---------------------------------------------------------------------
    def _attach_tracer(self, tracer: Tracer | None) -> None:
        self._tracer = self.store.tracer = self._streamer.tracer = self._commits.tracer = tracer

    @contextlib.contextmanager
    def tracing(self, path: str | os.PathLike):
        """Record a step timeline while the block runs and write it to ``path`` (Chrome / Perfetto
        trace JSON): compute per block and phase, every read, write and prefetch with its tensor and
        bytes, waits, optimizer updates, commits. Also ``torch.profiler`` ranges."""
        previous = self._tracer
        tracer = Tracer(path)
        self._attach_tracer(tracer)
        try:
            yield tracer
        finally:
            self._await()
            try:
                self._commits.wait()
            except TieredOffloadError:
                pass
            self._attach_tracer(previous)
            tracer.write()
