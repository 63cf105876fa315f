"""``Engine``: the training engine's facade.

It wraps a model whose fp32 training state (weights, gradients, optimizer states) does not fit in
memory, and composes the parts that do the work, each owning its state:

* :class:`~tiered_offload.engine.binding.ModelBinding`: the model split into units (blocks,
  large untied modules, the rest), parameters as slots in flat buffers, blocks replaced by proxies
  so the model's own ``forward`` runs unchanged;
* :class:`~tiered_offload.engine.schedule.Schedule`: keys, access sequence, working set (numbers);
* :class:`~tiered_offload.store.TieredStore`: the bytes, in device memory, a host budget and disk;
* :class:`~tiered_offload.engine.streaming.BlockStreamer`: forward and backward through the store;
* :class:`~tiered_offload.engine.optimizer_step.UnitUpdater` and
  :class:`~tiered_offload.engine.pipeline.UpdatePipeline`: the optimizer step, unit by unit,
  inline or overlapped with the next forward;
* :class:`~tiered_offload.checkpoint.session.CheckpointSession`: the storage directory as a
  committed, resumable training state (durable mode).

What stays here is the user's API and what ties the parts together: the budget checks, the step's
bookkeeping (which parameters have a gradient, clipping, non-finite checks, step counts), and
what the committed state records of the model and the optimizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload_core.errors import (
    CheckpointError,
    ConfigError,
    DiskFullError,
    DistributedError,
    ModelInputError,
    NonFiniteError,
    TierCapacityError,
    TieredOffloadError,
)
from offload_core.sizes import format_size, format_size_up
from storage_backends import resolve_storage
from tiered_offload.checkpoint.durable import (
    FORMAT,
    CommittedState,
    decode_rng,
    decode_tensor,
    encode_rng,
    encode_tensor,
    manifest_checksum,
)
from tiered_offload.checkpoint.session import CheckpointSession
from tiered_offload.config import EngineConfig, StoreConfig, resolve_device
from tiered_offload.engine.binding import ModelBinding, Unit, empty_init
from tiered_offload.engine.optim_spec import OptimizerSpec, read_optimizer
from tiered_offload.engine.optimizer_step import UnitUpdater
from tiered_offload.engine.pipeline import UpdatePipeline
from tiered_offload.engine.planner import DiskRates, Plan, StepMeasurement, make_plan
from tiered_offload.engine.schedule import FP32_BYTES, Phase, Schedule
from tiered_offload.engine.sharding import Sharding, distributed_group
from tiered_offload.engine.stats import EngineStats
from tiered_offload.engine.streaming import BlockStreamer
from tiered_offload.memstat import tune_allocator
from tiered_offload.store.tiered_store import TieredStore
from tiered_offload.store.tiers import Tier
from tiered_offload.trace import Tracer, span

__all__ = ["Engine", "empty_init"]

log = logging.getLogger("tiered_offload")


def _engine_time(method):
    """Count the time spent in ``method`` as the engine's (what a step costs, for the plan).

    Sharded, an error out of it (other than a non-finite loss or gradient, which every rank sees
    alike) may have left this rank between two collectives: no further collective is issued."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        except NonFiniteError:
            raise
        except BaseException as e:
            sharding = getattr(self, "_sharding", None)
            if sharding is not None and sharding.broken is None:
                sharding.broken = f"{type(e).__name__}: {str(e)[:300]}"
            raise
        finally:
            self._engine_seconds += time.perf_counter() - t0
    return timed


class Engine:
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
        on_nonfinite: ``"raise"`` (default) or ``"skip"``: what to do when a loss or gradient
            is NaN or infinite. Either way no weight or optimizer state is touched.
        recompute: recompute every block in backward from its input (True), or keep its
            activations and its weights resident until backward, as plain PyTorch does (False).
            ``"auto"``: False when the whole training state fits the compute tier, else each block
            as :attr:`EngineConfig.activations` says (by default the planner chooses, per block,
            between keeping its saved activations, offloading them and recomputing).
        store_config: extra :class:`StoreConfig` fields (policy, prefetch_depth...).
        durable: keep the storage directory a consistent, resumable training state after every
            step (see :mod:`.durable`). Default: on when ``storage`` is a directory (or several),
            off for a temporary directory, ``"memory"`` or a backend object.
        commit_every: with ``durable``, commit every Nth step (and at :meth:`close`): a crash loses
            at most N-1 steps and resumes exactly from the last commit. N > 1 (and any state that
            fits the compute tier) commits by snapshot, in the background beside the next forward
            and backward, and may use up to twice the state's disk space while it does.
        resume: continue the training state in ``storage`` (True: it must hold one; ``"auto"``:
            if it holds one, else start fresh). False refuses a directory that holds a state.
        init_from: a safetensors file, or a directory of safetensors shards with its index, to
            load the weights from (Hugging Face parameter names), streamed one tensor at a time.
        config: tuning knobs (:class:`~tiered_offload.config.EngineConfig`).
        trace: write a step timeline (Chrome / Perfetto trace JSON) of the whole run to this file
            at :meth:`close`; :meth:`tracing` records a stretch of it instead.
        process_group: shard the training state over this ``torch.distributed`` group (default:
            the default group, when it is initialised with more than one rank). Each rank stores
            its slice of every unit in its own directory inside ``storage``
            (``rank-R-of-W``); see :mod:`tiered_offload.engine.sharding`.
    """

    def __init__(self, model: nn.Module, optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer = torch.optim.AdamW,
                 optimizer_kwargs: dict | None = None, storage=None, host_memory: int | str = "auto",
                 device_memory: int | str = "auto", *, blocks: str | None = None, device: str = "auto",
                 on_nonfinite: str = "raise", recompute: bool | str = "auto", store_config: dict | None = None,
                 durable: bool | None = None, commit_every: int = 1, resume: bool | str = False,
                 init_from: str | os.PathLike | None = None, config: EngineConfig | None = None,
                 trace: str | os.PathLike | None = None, process_group=None):
        if on_nonfinite not in ("raise", "skip"):
            raise ConfigError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        if resume not in (True, False, "auto"):
            raise ConfigError(f"resume must be True, False or 'auto', got {resume!r}")
        tune_allocator()  # freed temporaries go back to the system: resident memory tracks the budget
        self.model = model
        self.device = resolve_device(device)
        if (device in (None, "auto") and self.device.type == "cuda" and "LOCAL_RANK" in os.environ
                and distributed_group(process_group) is not None):
            # one GPU per rank, as torchrun numbers them on each machine (not every rank on GPU 0)
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(self.device)
        self.on_nonfinite = on_nonfinite
        self.config = config or EngineConfig()
        """Tuning knobs (see :class:`EngineConfig`)."""
        self._tmpdir = None
        group = distributed_group(process_group)
        spec = resolve_storage(storage) if storage is not None else None
        if group is not None:
            spec, durable = self._rank_storage(group, spec, durable, resume, commit_every)
        if durable is None:
            durable = spec is not None and spec.names_directories
        if resume and not durable:
            raise ConfigError("resume needs durable storage: give storage= a directory (and not durable=False)")
        if storage is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="tiered-offload-")
            spec = resolve_storage(self._tmpdir.name)
        self.durable = bool(durable)
        if not isinstance(commit_every, int) or commit_every < 1:
            raise ConfigError(f"commit_every must be an integer >= 1, got {commit_every!r}")
        if commit_every > 1 and not self.durable:
            raise ConfigError("commit_every needs durable storage: give storage= a directory (and not durable=False)")
        self.commit_every = commit_every
        """Commit every this many steps (durable mode)."""
        """Whether the storage directory holds a committed, resumable state after every step."""
        self.user_state: dict = {}
        """JSON-serialisable values saved with every step (a data loader's position...) and
        restored by a resume."""
        self._scheduler = None
        self._resumed_scheduler_state = None
        self._resumed_param_groups = None
        self._checkpoint: CheckpointSession | None = None
        """The storage directory as a checkpoint (durable mode)."""
        self.binding = ModelBinding(model, blocks, self.device, self.config.stream_modules_numel)
        """The model split into units, its parameters as slots in flat buffers, its proxies."""
        self.seq_name, self.blocks, self.rest = self.binding.seq_name, self.binding.blocks, self.binding.rest
        self.units: list[Unit] = self.binding.units
        self._param_order = self.binding.param_order
        self._spec: OptimizerSpec = read_optimizer(optimizer, optimizer_kwargs, (p for _, p in model.named_parameters()))
        self.optimizer_class = self._spec.cls
        self._state_kinds = self._spec.kinds
        self.param_groups: list[dict] = [dict(g) for g in self._spec.groups]
        """The optimizer's parameter groups (hyperparameters only), in the optimizer's order: change
        ``lr`` here, or through a scheduler on :attr:`optimizer`."""
        group_of = self._spec.group_of()
        self._spec.members = []  # no reference to the user's (possibly meta) parameters is kept
        self.binding.arrange(group_of, self.config.state_piece_numel)
        self._sharding = Sharding(group, self.device) if group is not None else None
        """The process group the state is sharded over (None: this process holds all of it)."""
        if self._sharding is not None:
            self._check_ranks_agree()
        cuda = self.device.type == "cuda"
        cfg = StoreConfig(**{"host_budget_bytes": host_memory, "device": self.device,
                             "device_budget_bytes": device_memory if cuda else 0, "policy": "lookahead",
                             "prefetch_depth": self.config.prefetch_depth, "versioned_writes": self.durable,
                             **(store_config or {})})
        self.store = TieredStore(spec, cfg)
        self.store.open()
        self._delete_stale_activations()
        self.schedule = Schedule(self.units, tuple(self._state_kinds),
                                 lambda n: self.store.footprint(n, self.store.compute_tier))
        self._units_by_name = {u.name: u for u in self.units}
        self._snapshot_commits = self.durable and self._sharding is None and (
            commit_every > 1 or self.schedule.fits(self.store.capacity(self.store.compute_tier)))
        """Commit by snapshot (background, every ``commit_every`` steps) rather than by the journal's
        per-unit records (which need every step's gradients on disk first)."""
        self._pending_commit: tuple[int, dict] | None = None
        """Unit order, access sequence and budget arithmetic (pure numbers)."""
        self.step_count = 0
        recovered = None
        try:
            if self.durable:
                self._checkpoint = CheckpointSession(self.store, self._describe)
                recovered = self._checkpoint.open(resume)
                if self._sharding is not None:
                    recovered = self._agree_on_resume(recovered, resume)
                if recovered is not None:
                    self._check_layout(recovered.manifest)
                    self.store.use_checksum(manifest_checksum(recovered.manifest))  # the directory's own
                # remains of writes a crash cut short (a first start that died before its first manifest too)
                self._checkpoint.collect_garbage({k for u in self.units for k in self._shapes(u)})
            self._check_budgets()
            if recovered is None:
                self._check_disk()
                self._register_and_load(init_from)
            else:
                if init_from is not None:
                    raise ConfigError("init_from and a resumed state both give the weights; pass only one")
                self._adopt(recovered)
            self.binding.install_proxies(lambda index, args, kwargs: self._streamer.block_forward(index, args, kwargs))
            self.binding.buffers = self.binding.buffer_slots()
        except BaseException:
            self._release_directory()
            self.store.close(flush=False)
            raise
        self._grad_scale: torch.Tensor | None = None
        self._skip_step = False
        self._phases: list[Phase] = []
        self._updater = UnitUpdater(self.store, self._spec, self.config.optimizer_chunk_numel)
        self._pipeline = UpdatePipeline(
            self.config.step_lead,
            before_each=lambda name: (self._checkpoint is not None and not self._snapshot_commits
                                      and self._throttle(self._units_by_name[name])),
            on_error=lambda e: self._checkpoint is not None and self._checkpoint.fail(e))
        """The optimizer step over units, inline or in the background."""
        self._optimizer_view: _OptimizerView | None = None
        self._streamer = BlockStreamer(self.store, self.binding, self._pipeline, self.device,
                                       self._activation_modes(recompute))
        self._streamer.sharding = self._sharding
        """Forward and backward through the store."""
        overlap = self.config.overlap_step
        self.overlap_step = (self.schedule.overlap_fits(self.store.capacity(self.store.compute_tier))
                             if overlap is None else bool(overlap))
        """Whether step() returns at once and updates units in the background, ahead of the next forward."""
        self._streamer.activation_room = self._activation_room()
        if self._sharding is not None:
            self._streamer.gather_ahead = self._can_gather_ahead()
        if self.overlap_step:  # the update of a unit runs beside the forward: room for its working set
            b, big = self.schedule.unit_bytes, max(self.units, key=lambda u: self.schedule.unit_bytes(u, "weight"))
            self._streamer.step_pins = [b(big, "weight"), b(big, "grad"), b(big, "piece")]
        self._plan = self._initial_plan(recompute)
        self._tracer: Tracer | None = None
        if trace is not None:
            self._attach_tracer(Tracer(trace))
        self._meter: tuple | None = None
        self._engine_seconds = 0.0
        self._measured: list[StepMeasurement] = []
        if self._streamer.modes is not None:
            log.info("tiered-offload plan (until measured):\n%s", self._plan.summary())
        self.store.declare_access_sequence(self._sequence([Phase.FORWARD, Phase.BACKWARD, Phase.STEP]))
        self._streamer.unbind_rest()
        if self.durable:
            try:
                self._start_commits()
            except BaseException:
                self._release_directory()
                self.store.close(flush=False)
                raise

    @classmethod
    def resume(cls, storage, model: nn.Module, optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer | None = None,
               optimizer_kwargs: dict | None = None, **kwargs) -> "Engine":
        """Continue the training state in ``storage`` with ``model`` (built as before, e.g. with
        :func:`empty_init`). The optimizer, its parameter groups and their hyperparameters default
        to the saved ones (a ``torch.optim`` class; another one must be passed)."""
        from tiered_offload.checkpoint.state_dir import StateDirectory
        with StateDirectory(storage) as sd:
            saved = sd.manifest["optimizer"]
            groups = sd.manifest["meta"]["param_groups"]
        if optimizer is None:
            module, _, name = saved["class"].rpartition(".")
            if not module.startswith("torch.optim"):
                raise ConfigError(f"{storage} was trained with {saved['class']}; pass optimizer= that class to resume")
            optimizer = getattr(torch.optim, name, None)
            if optimizer is None:
                raise ConfigError(f"{saved['class']} is not a torch.optim optimizer of this torch; pass optimizer=")
        members = saved.get("groups")
        if isinstance(optimizer, type) and optimizer_kwargs is None and members is not None:
            # rebuild the saved parameter groups over this model's parameters, by name
            named = dict(model.named_parameters())
            missing = [n for names in members for n in names if n not in named]
            if missing:
                raise CheckpointError(f"{storage} was trained with parameter groups naming {missing[:3]}, which this "
                                      f"model does not have; build the same model")
            optimizer = optimizer([{"params": [named[n] for n in names], **_saved_hyper(optimizer, g)}
                                   for names, g in zip(members, groups)])
        elif optimizer_kwargs is None and isinstance(optimizer, type):
            optimizer_kwargs = _saved_hyper(optimizer, groups[0])
        return cls(model, optimizer, optimizer_kwargs, storage=storage, resume=True, **kwargs)

    # ---- set-up -------------------------------------------------------------------------
    def _delete_stale_activations(self) -> None:
        """Saved activations a process that died left on disk (``block.3/activations[.N]``)."""
        names = {u.key("activations") for u in self.units}
        for extent in self.store.backend.keys():
            base, dot, n = extent.partition("/activations")
            if f"{base}/activations" in names and (not n or (n[0] == "." and n[1:].isdigit())):
                self.store.backend.delete(extent)

    def _check_budgets(self) -> None:
        """Refuse, up front and with the numbers, budgets that cannot hold one step's working set."""
        compute = self.store.compute_tier
        cap = self.store.capacity(compute)
        ws = self.schedule.working_set()
        need = ws.need
        if need > cap:
            raise TierCapacityError(
                f"the {compute.name.lower()} budget ({format_size(cap)}) cannot hold one step's working set: "
                f"{format_size_up(need)} ({need} bytes) needed. Forward and backward keep the weights and gradients of "
                f"the parameters bound for the whole pass ({format_size(ws.rest_bytes)}) plus a streamed unit's weights "
                f"and gradients and the next one's weights (largest: {ws.largest_block} = {format_size(ws.block_bytes)} "
                f"of weights): "
                f"{format_size(ws.forward_backward)}; the optimizer keeps one unit's weights and gradients and one "
                f"{format_size(self.config.state_piece_numel * FP32_BYTES)} piece of each of its {len(self._state_kinds)} "
                f"state(s): {format_size(ws.optimizer)}; plus {format_size(ws.slack)} of slack against fragmentation. "
                f"Raise host_memory{' / device_memory' if compute == Tier.DEVICE else ''} to at least "
                f"{format_size_up(need)}")
        largest = max(self.schedule.unit_bytes(u, "weight") for u in self.units)
        if compute == Tier.DEVICE and self.store.capacity(Tier.HOST) < largest:
            raise TierCapacityError(f"host_memory ({format_size(self.store.capacity(Tier.HOST))}) must hold at least the "
                                    f"largest unit ({format_size_up(largest)}) to stage it to the GPU")

    def minimum_budget(self) -> int:
        """The smallest compute-tier budget (bytes) this engine's model and optimizer train in: see
        :meth:`Schedule.working_set`."""
        return self.schedule.working_set().need

    def state_bytes(self) -> int:
        """Bytes of training state on disk: weights of every parameter, gradients of the trainable
        ones and optimizer states of those the optimizer updates."""
        return self.schedule.state_bytes()

    @property
    def world_size(self) -> int:
        """Ranks the training state is sharded over (1: this process holds all of it)."""
        return 1 if self._sharding is None else self._sharding.world

    @property
    def rank(self) -> int:
        return 0 if self._sharding is None else self._sharding.rank

    def collective_bytes(self) -> dict[str, int]:
        """Bytes of the collectives' buffers so far, per kind (all zero on one process)."""
        if self._sharding is None:
            return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}
        return dict(self._sharding.bytes)

    def local_state_bytes(self) -> int:
        """Bytes of training state this process stores: :meth:`state_bytes`, or its slice of it when
        sharded over ranks (about ``state_bytes() / world size``)."""
        if self._sharding is None:
            return self.state_bytes()
        return FP32_BYTES * sum(n for u in self.units for n in self._sharding.layout(u).shapes(self._state_kinds).values())

    def commit_window(self) -> int:
        """Bytes of new weights and states that may coexist on disk with the committed ones (durable
        mode, journal commits): a quarter of the state. A unit waits before its update until the
        units updated but not yet recorded and it fit; a unit larger than the window goes alone."""
        return self.schedule.commit_window()

    def _throttle(self, unit: Unit) -> None:
        """Wait until ``unit``'s update fits the commit window (journal commits)."""
        self._checkpoint.throttle(self.schedule.rewrite_bytes(unit), self.schedule.commit_admits)

    def extra_disk_bytes(self) -> int:
        """Most disk space beyond :meth:`state_bytes` a step can need (durable mode: the commit window)."""
        return self.schedule.extra_disk_bytes(self.durable)

    def _check_disk(self) -> None:
        free = self.store.backend.free_bytes()
        need = self.state_bytes() + self.extra_disk_bytes()
        if free is not None and need > free:
            raise DiskFullError(
                f"the training state needs {format_size(need)} ({need} bytes) in {self.store.backend.location} "
                f"but {format_size(free)} ({free} bytes) is free; free space or add storage directories",
                path=self.store.backend.location, needed_bytes=need, free_bytes=free)

    def _register_and_load(self, init_from=None) -> None:
        """Register every unit's buffers and fill the weights (copied, loaded, or initialised if on meta)."""
        meta = self.binding.on_meta
        init = self.binding.initialiser() if meta and init_from is None else None
        reader = None
        if init_from is not None:
            from tiered_offload.checkpoint.safetensors_io import PretrainedReader
            reader = PretrainedReader(init_from)
            reader.check_covers([(s.name, s.shape) for _, s in self._param_order])
        for unit in self.units:
            if self._sharding is not None:
                self._register_shard(unit, reader, init)
                continue
            for key, numel in unit.shapes(self._state_kinds).items():
                self.store.register(key, (numel,))
            flat = self.store.get(unit.weight_key, Tier.HOST)
            try:
                self._fill_unit(unit, flat, reader, init)
                self.store.mark_dirty(unit.weight_key, Tier.HOST)
            finally:
                self.store.release(unit.weight_key, Tier.HOST)
            self.store.write_back(unit.weight_key).get()
            self.store.evict(unit.weight_key, Tier.HOST).get()
        if reader is not None:
            reader.close()
        self.binding.release_parameters()  # the model no longer holds the weights: the store does

    def _fill_unit(self, unit: Unit, flat: torch.Tensor, reader, init) -> None:
        """The unit's initial weights into ``flat``: read, initialised (a meta model) or copied."""
        if reader is not None:
            for slot in unit.params:
                reader.read_into(slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
        elif self.binding.on_meta:
            self.binding.initialise_unit(unit, flat, init)
        else:
            for slot in unit.params:
                flat[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))

    # ---- sharded over ranks -----------------------------------------------------------------
    def _rank_storage(self, group, spec, durable, resume, commit_every):
        """Each rank's own directory inside ``storage`` (``rank-R-of-W``)."""
        import torch.distributed as dist
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if spec is not None and spec.names_directories:
            root = Path(spec.location.split(",")[0])
            others = sorted(p.name for p in root.glob("rank-*-of-*") if p.name.split("-of-")[-1] != str(world)) \
                if root.is_dir() else []
            if others and resume:
                raise ConfigError(
                    f"rank {rank}: {root} holds the state of a run with another number of ranks ({others[0]}, this run "
                    f"has {world}); re-sharding is not supported. Resume with the same number of ranks, write the "
                    f"weights with export_safetensors(), and start the new run from them with init_from")
            dirs = [str(Path(d) / f"rank-{rank}-of-{world}") for d in spec.location.split(",")]
            spec = dataclasses.replace(spec, location=",".join(dirs))
        elif spec is not None and spec.backend is not None:
            raise ConfigError("sharded training needs storage= a directory (each rank keeps its files in its own "
                              "subdirectory) or None, not a backend object shared by the ranks")
        if durable is None:
            durable = spec is not None and spec.names_directories
        if durable and commit_every != 1:
            raise ConfigError("sharded training commits every step (commit_every=1): snapshot commits across ranks "
                              "are not implemented yet")
        return spec, durable

    def _can_gather_ahead(self) -> bool:
        """Whether every rank's compute tier has room for the next block's gathered weights beside
        one step's working set: the same answer on every rank, so their collectives stay in step
        (``TIERED_OFFLOAD_GATHER_AHEAD=0`` turns it off, to compare)."""
        largest = max(self.schedule.unit_bytes(u, "weight") for u in self.blocks) if self.blocks else 0
        room = self.store.capacity(self.store.compute_tier) - self.schedule.working_set().need
        wanted = os.environ.get("TIERED_OFFLOAD_GATHER_AHEAD", "1") != "0"
        ok = torch.tensor([int(wanted and bool(self.blocks) and room >= largest)], dtype=torch.uint8,
                          device=self.device)
        return bool(self._sharding.all_reduce(ok, torch.distributed.ReduceOp.MIN, "whether to gather ahead"))

    def _check_ranks_agree(self) -> None:
        """Every rank must build the same model and optimizer: compare their layouts at start."""
        sig = {"units": [(u.name, u.numel, u.grad_numel, u.state_numel) for u in self.units],
               "params": [(s.name, list(s.shape), s.requires_grad, s.group) for _, s in self._param_order],
               "optimizer": self.optimizer_class.__name__, "kinds": list(self._state_kinds),
               "groups": [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in self.param_groups],
               "device": self.device.type}
        sigs = self._sharding.all_gather_object(sig)
        differ = [r for r, other in enumerate(sigs) if other != sigs[0]]
        if differ:
            what = [k for k in sig if any(sigs[r][k] != sigs[0][k] for r in differ)]
            raise DistributedError(
                f"rank(s) {differ} built a different {' and '.join(what)} than rank 0; every rank must build the "
                f"same model (same parameters, trainable and frozen alike) and the same optimizer and groups")

    def _register_shard(self, unit: Unit, reader, init) -> None:
        """Register this rank's slice of ``unit`` and fill its weights: the full unit is built (read,
        initialised or copied) and rank 0's broadcast, as DistributedDataParallel starts every rank
        from rank 0's weights; each rank keeps its slice."""
        sh = self._sharding
        lay = sh.layout(unit)
        for key, numel in lay.shapes(self._state_kinds).items():
            self.store.register(key, (numel,))
        full = torch.zeros(lay.size * sh.world, dtype=torch.float32, device=self.device)
        self._fill_unit(unit, full[:unit.numel], reader, init)
        sh.broadcast(full, f"{unit.name}'s initial weights")
        flat = self.store.get(unit.weight_key, Tier.HOST)
        try:
            flat.copy_(full[lay.lo:lay.lo + lay.size])
            self.store.mark_dirty(unit.weight_key, Tier.HOST)
        finally:
            self.store.release(unit.weight_key, Tier.HOST)
        del full
        self.store.write_back(unit.weight_key).get()
        self.store.evict(unit.weight_key, Tier.HOST).get()

    def _full_weights(self, unit: Unit) -> torch.Tensor:
        """Sharded: the unit's whole weight buffer on the CPU, gathered from the ranks' slices."""
        sh, lay = self._sharding, self._sharding.layout(unit)
        full = torch.empty(lay.size * sh.world, dtype=torch.float32, device=self.device)
        with self.store.hold(unit.weight_key) as shard:
            sh.gather(full, shard.to(self.device), f"{unit.name}'s weights")
        return full[:unit.numel].cpu()

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every module buffer (BatchNorm statistics, counters), as
        ``model.named_buffers()`` would give them, copied to the CPU."""
        self._await()
        for name, mod, attr, _ in self.binding.buffers:
            yield name, mod._buffers[attr].detach().to("cpu", copy=True)

    # ---- durable state ------------------------------------------------------------------
    def _release_directory(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint.close()
            self._checkpoint = None

    def _layout(self) -> dict:
        """How the state's tensors map to the model and the optimizer (checked by a resume)."""
        units = []
        for u in self.units:
            entry = {"name": u.name, "numel": u.numel}
            if u.grad_numel != u.numel or u.state_numel != u.numel:  # frozen or unoptimized parameters
                entry.update(grad_numel=u.grad_numel, state_numel=u.state_numel)
            if len(u.pieces()) > 1:
                entry["piece_numel"] = u.piece_numel
            units.append(entry)
        optimizer = {"class": self._spec.name, "states": list(self._state_kinds)}
        members = [[s.name for _, s in self._param_order if s.group == i] for i in range(len(self.param_groups))]
        if len(members) != 1 or len(members[0]) != len(self._param_order):
            optimizer["groups"] = members
        layout = {
            "units": units,
            "params": [{"name": s.name, "tensor": u.weight_key, "offset": s.offset, "shape": list(s.shape)}
                       for u, s in self._param_order],
            "optimizer": optimizer,
        }
        if self._sharding is not None:  # this directory holds one rank's slices
            layout["sharding"] = {"rank": self._sharding.rank, "world_size": self._sharding.world}
        return layout

    def _check_layout(self, manifest: dict) -> None:
        mine = self._layout()
        if manifest.get("sharding") != mine.get("sharding"):
            theirs = manifest.get("sharding") or {"rank": 0, "world_size": 1}
            ours = mine.get("sharding") or {"rank": 0, "world_size": 1}
            raise CheckpointError(
                f"{self._checkpoint.files.manifest_path} holds rank {theirs['rank']} of {theirs['world_size']}'s slices, "
                f"and this process is rank {ours['rank']} of {ours['world_size']}; re-sharding is not supported. Resume "
                f"with the same number of ranks (then write the weights with export_safetensors() and start a new run "
                f"from them with init_from)")
        saved_groups = (manifest.get("optimizer") or {}).get("groups")
        if saved_groups != mine["optimizer"].get("groups"):
            everything = [[s.name for _, s in self._param_order]]
            theirs, ours = saved_groups or everything, mine["optimizer"].get("groups") or everything
            diff = f"{len(theirs)} group(s) saved, {len(ours)} now"
            for i, (a, b) in enumerate(zip(theirs, ours)):
                if a != b:
                    only_a = [n for n in a if n not in b]
                    only_b = [n for n in b if n not in a]
                    diff = (f"group {i} holds {only_a[0]!r} in the saved state but not now" if only_a else
                            f"group {i} holds {only_b[0]!r} now but not in the saved state" if only_b else
                            f"group {i} lists its parameters in another order")
                    break
            raise CheckpointError(
                f"{self._checkpoint.files.manifest_path} was trained with other optimizer parameter groups: {diff}. Build the "
                f"optimizer's groups as before (or resume with Engine.resume(...) and no optimizer=, which rebuilds them)")
        for what in ("units", "params", "optimizer"):
            if manifest.get(what) != mine[what]:
                theirs = manifest.get(what) or []
                diff = next((f"{a} != {b}" for a, b in zip(theirs, mine[what]) if a != b),
                            f"{len(theirs)} entries != {len(mine[what])}") if isinstance(theirs, list) else f"{theirs} != {mine[what]}"
                raise CheckpointError(
                    f"{self._checkpoint.files.manifest_path} was written for another model or optimizer: its {what} differ "
                    f"(saved vs. this run: {diff}). Build the same model and optimizer, or use another directory")

    def _durable_keys(self, unit: Unit) -> list[str]:
        if self._sharding is not None:
            lay = self._sharding.layout(unit)
            return [lay.weight_key, *lay.state_keys(self._state_kinds)]
        return unit.durable_keys(self._state_kinds)

    def _shapes(self, unit: Unit) -> dict[str, int]:
        """``{key: numel}`` of what this process stores of ``unit`` (its slice, when sharded)."""
        if self._sharding is not None:
            return self._sharding.layout(unit).shapes(self._state_kinds)
        return unit.shapes(self._state_kinds)

    def _grad_key(self, unit: Unit) -> str | None:
        """The key of the gradient this process stores for ``unit`` (its slice's, when sharded)."""
        return self._sharding.layout(unit).grad_key if self._sharding is not None else unit.grad_key

    def _agree_on_resume(self, recovered, resume):
        """Sharded: every rank must resume the same step. A step is committed on a rank once its intent
        is in the journal, and no rank updates anything before every rank's intent is (a barrier);
        so if one rank lacks the newest intent, no rank updated for it, and the others drop it."""
        def position(state):
            if state is None:
                return None
            step = state.manifest["step"]
            return [step, state.intent["step"] if state.intent is not None else None]
        sh = self._sharding
        sh.where = "resume"
        positions = sh.all_gather_object(position(recovered))
        if any(p is None for p in positions):
            if all(p is None for p in positions):
                return None
            have = [r for r, p in enumerate(positions) if p is not None]
            raise DistributedError(
                f"rank(s) {have} of {sh.world} hold a training state and the others none: every rank's directory must "
                f"come from the same run (storage= the same root on every rank, with resume=True)")
        target = max(i if i is not None else m for m, i in positions)
        reach = [m == target or i == target for m, i in positions]
        if not all(reach):
            target -= 1
            if not all(m == target or i == target or (i == target + 1 and m == target) for m, i in positions):
                raise DistributedError(f"the ranks' committed steps cannot be reconciled: {positions} "
                                       f"([manifest step, step in flight] per rank)")
        m, i = positions[sh.rank]
        if i is not None and i > target:  # not every rank committed it: nothing of it was updated
            log.warning("rank %d: dropping step %d's intent (not every rank had committed it); resuming at step %d",
                        sh.rank, i, target)
            recovered.intent, recovered.recorded = None, {}
            self._checkpoint.files.reset_journal()
        return recovered

    def _adopt(self, state: CommittedState) -> None:
        """Register every tensor of the committed state (and of the step in flight) without reading it."""
        tensors, grads = state.tensors(), state.grads()
        for unit in self.units:
            grad_key = self._grad_key(unit)
            for key, numel in self._shapes(unit).items():
                ref = grads.get(key) if key == grad_key else tensors.get(key)
                self.store.adopt(key, (numel,), extent=ref and ref[0], crc=ref and ref[1], generation=_generation(ref))
        self.binding.release_parameters()

    def _start_commits(self) -> None:
        """Hand the committed state to the commit protocol (finishing a step a crash interrupted)
        and restore the step counter, learning rates, RNG, buffers and user state it records."""
        units = {u.name: self._durable_keys(u) for u in self.units}
        grads = {u.name: self._grad_key(u) for u in self.units if self._grad_key(u)}
        meta = self._checkpoint.start(units, grads, self._meta, self._redo_step)
        if self._checkpoint.recovered is None:
            return
        for unit in self.units:
            if self._grad_key(unit):
                self.store.zero(self._grad_key(unit))
        self._restore_meta(meta)

    def _redo_step(self, intent: dict, todo: list[str]) -> None:
        """Re-run a committed step's update of the units ``todo`` from the bytes it started from."""
        saved = intent["hyper"] if isinstance(intent["hyper"], list) else [intent["hyper"]]
        hypers = [_hyper_from_json(h, g) for h, g in zip(saved, self.param_groups)]
        scale = None if intent["scale"] is None else torch.tensor(intent["scale"], dtype=torch.float32)
        updates = self._replayed_updates(intent)
        for unit in self.schedule.update_order():
            if unit.name in todo:
                self._throttle(unit)
                self._update_unit(unit, hypers, scale, updates)

    def _meta(self) -> dict:
        """What, besides the tensors, the state after a step is."""
        rng = {"cpu": encode_rng(torch.get_rng_state())}
        if self.device.type == "cuda":
            rng["cuda"] = encode_rng(torch.cuda.get_rng_state(self.device))
        try:
            user = json.loads(json.dumps(self.user_state, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"engine.user_state must be JSON-serialisable (it is saved with every step): {e}") from e
        scheduler = None
        if self._scheduler is not None:
            scheduler = _jsonable(self._scheduler.state_dict(), "the scheduler's state_dict()")
        # per-parameter step counts, where a parameter missed steps (it had no gradient)
        updates = {s.name: s.updates for _, s in self._param_order if s.optimized and s.updates != self.step_count}
        buffers = {name: encode_tensor(mod._buffers[attr]) for name, mod, attr, persistent in self.binding.buffers if persistent}
        return {"step_count": self.step_count, "rng": rng, "user_state": user, "scheduler": scheduler,
                "param_updates": updates, "buffers": buffers,
                "param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"}, "the optimizer's param_groups")
                                 for g in self.param_groups]}

    def _replayed_updates(self, intent: dict) -> dict[int, int]:
        """For a step a resume finishes: ``{id(slot): step count before}`` of the parameters it updated."""
        after = intent["meta"].get("param_updates", {})
        steps = intent["meta"]["step_count"]
        skipped = set(intent.get("no_grad", ()))
        return {id(s): after.get(s.name, steps) - 1 for _, s in self._param_order if s.optimized and s.name not in skipped}

    def _restore_meta(self, meta: dict) -> None:
        self.step_count = meta["step_count"]
        for group, saved in zip(self.param_groups, meta["param_groups"]):
            group.update(_hyper_from_json(saved, group))
        saved = meta.get("buffers", {})
        for name, mod, attr, persistent in self.binding.buffers:
            if persistent and name in saved:
                value = decode_tensor(saved[name])
                if value.shape != mod._buffers[attr].shape:
                    raise CheckpointError(f"buffer {name} was saved with shape {list(value.shape)}, the model has "
                                          f"{list(mod._buffers[attr].shape)}; build the same model")
                mod._buffers[attr] = value.to(device=mod._buffers[attr].device, dtype=mod._buffers[attr].dtype)
        updates = meta.get("param_updates", {})
        for _, slot in self._param_order:
            slot.updates = updates.get(slot.name, self.step_count) if slot.optimized else 0
        torch.set_rng_state(decode_rng(meta["rng"]["cpu"]))
        if "cuda" in meta["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(decode_rng(meta["rng"]["cuda"]), self.device)
        self.user_state = meta["user_state"]
        self._resumed_scheduler_state = meta["scheduler"]
        self._resumed_param_groups = meta["param_groups"]

    def _describe(self, step: int, committed: dict, meta: dict) -> dict:
        """The manifest of the committed state after ``step``."""
        backend = self.store.backend
        tensors = {}
        for unit in self.units:
            shapes = self._shapes(unit)
            for key in self._durable_keys(unit):
                ref = committed.get(key)
                tensors[key] = {"extent": ref and ref[0], "crc": ref and ref[1], "dtype": "float32",
                                "shape": [shapes[key]], "nbytes": shapes[key] * FP32_BYTES, "offset": 0}
        return {"format": FORMAT, "checksum": self.store.checksum, "step": step, "tensors": tensors, "meta": meta, "model_config": self.binding.model_config,
                "storage": {"backend": backend.name, "directories": [str(d) for d in backend.directories],
                            "stripe_bytes": backend.stripe_bytes},
                **self._layout()}

    def attach_scheduler(self, scheduler) -> None:
        """Let the engine step ``scheduler`` after each optimizer step and save its state with the step.

        Call ``engine.step()`` only (not ``scheduler.step()``). On a resumed engine the scheduler's
        saved state is loaded into it.
        """
        self._scheduler = scheduler
        if self._resumed_scheduler_state is not None:
            scheduler.load_state_dict(self._resumed_scheduler_state)
            self._resumed_scheduler_state = None
            # building the scheduler re-ran its first step, which set the learning rates from its
            # start (LambdaLR, warm-ups); loading its state does not undo that: the saved ones do
            for group, saved in zip(self.param_groups, self._resumed_param_groups):
                group.update(_hyper_from_json(saved, group))

    def export_safetensors(self, out: str | os.PathLike, max_shard_size: int | str = "2GB") -> list:
        """Write the current weights as Hugging Face sharded safetensors in ``out``, streaming.

        ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
        ``model.safetensors.index.json`` when larger than ``max_shard_size``), parameters under
        their ``model.named_parameters()`` names (a tied weight once, as ``save_pretrained``
        does), and ``config.json`` when the model has a Hugging Face config. Returns the files.

        Sharded over ranks, every rank must call it: rank 0 writes the one model (with its own
        module buffers), the others send their slices and get ``[]``.
        """
        from tiered_offload.checkpoint.safetensors_io import iter_chunks, write_private
        from tiered_offload.checkpoint.state_dir import export_params
        self._streamer.unbind_rest()
        self._await()
        params = self._layout()["params"]

        if self._sharding is None:
            def fill(p: dict, write) -> None:
                with self.store.hold(p["tensor"], Tier.HOST) as flat:
                    n = math.prod(p["shape"])
                    for chunk in iter_chunks(flat[p["offset"]:p["offset"] + n]):
                        write(chunk)
        else:
            # sharded: rank 0 writes; every rank takes part in gathering each unit, in the order the
            # export reads them (each unit once, in the order of its first parameter)
            self._sharding.where = f"export_safetensors after step {self.step_count}"
            by_key = {u.weight_key: u for u in self.units}
            sequence = list(dict.fromkeys(p["tensor"] for p in params))
            if self._sharding.rank != 0:
                for key in sequence:
                    self._full_weights(by_key[key])
                return []
            gathered = {"key": None, "flat": None}
            todo = iter(sequence)

            def fill(p: dict, write) -> None:
                if gathered["key"] != p["tensor"]:
                    key = next(todo)
                    if key != p["tensor"]:  # pragma: no cover - export_params reads units in this order
                        raise DistributedError(f"export read {p['tensor']} where {key} was expected")
                    gathered.update(key=key, flat=self._full_weights(by_key[key]))
                n = math.prod(p["shape"])
                for chunk in iter_chunks(gathered["flat"][p["offset"]:p["offset"] + n]):
                    write(chunk)
        buffers = [(name, mod._buffers[attr].detach().cpu()) for name, mod, attr, persistent in self.binding.buffers if persistent]
        files = export_params(out, params, fill, max_shard_size,
                              {"step": str(self.step_count), "source": "tiered-offload"}, buffers)
        if self.binding.model_config is not None:
            path = Path(out) / "config.json"
            write_private(path, json.dumps(self.binding.model_config, indent=2, sort_keys=True))
            files.append(path)
        return files

    def wait_committed(self) -> int:
        """Wait until the last commit is durable in the storage directory; returns its step (with
        ``commit_every`` > 1 it may be behind :attr:`step_count`: :meth:`commit` commits now)."""
        self._await()
        if self._checkpoint is None:
            return self.step_count
        return self._checkpoint.wait()

    # ---- access bookkeeping -------------------------------------------------------------
    def _phase(self, phase: Phase) -> None:
        """Record what the caller does this iteration (forward, backward, clip, step)."""
        if not self._phases or self._phases[-1] != phase or phase == Phase.BACKWARD:
            self._phases.append(phase)

    def _sequence(self, phases: list[Phase]) -> list[str]:
        """The access order of one iteration made of ``phases``, as the store's lookahead sees it."""
        return self.schedule.access_sequence(phases, overlap=self.overlap_step,
                                             activations=self._streamer.modes is not None)

    # ---- activations ----------------------------------------------------------------------
    def _activation_modes(self, recompute: bool | str) -> list[str] | None:
        """Per streamed block, what its forward does with what it saves (None: plain PyTorch, the
        graph and the block's weights kept until backward)."""
        if recompute not in (True, False, "auto"):
            raise ConfigError(f"recompute must be True, False or 'auto', got {recompute!r}")
        n = len(self.binding.blocks)
        self.recompute_auto = recompute == "auto"
        if recompute is True:
            return ["recompute"] * n
        if recompute is False or (recompute == "auto" and self.schedule.fits(self.store.capacity(self.store.compute_tier))):
            return None
        want = self.config.activations
        if isinstance(want, str):
            return [("recompute" if want == "auto" else want)] * n  # "auto": the planner decides after the first step
        if len(want) != n:
            raise ConfigError(f"EngineConfig.activations has {len(want)} entries; the model streams {n} blocks "
                              f"({', '.join(b.name for b in self.binding.blocks)})")
        return list(want)

    def _activation_room(self) -> dict[int, int]:
        """Per block, how many bytes of saved activations its backward can pin beside its weights
        and gradients, the rest's, the next block's weights (prefetched) and the slack."""
        cap = self.store.capacity(self.store.compute_tier)
        ws = self.schedule.working_set()
        b = self.schedule.unit_bytes
        step = ws.optimizer if self.overlap_step else 0  # the update running beside the forward
        return {i: max(0, cap - ws.slack - ws.rest_bytes - b(u, "weight") - b(u, "grad") - ws.block_bytes - step)
                for i, u in enumerate(self.binding.blocks)}

    # ---- the timeline ---------------------------------------------------------------------
    def _attach_tracer(self, tracer: Tracer | None) -> None:
        self._tracer = self.store.tracer = self._streamer.tracer = tracer

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
            if self._checkpoint is not None:
                try:
                    self._checkpoint.wait()
                except TieredOffloadError:
                    pass
            self._attach_tracer(previous)
            tracer.write()

    # ---- the plan -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """What the engine does with each block's activations, the prefetch depth, whether the step
        overlaps the next forward, how the compute tier's budget is used, and the predicted step
        time and disk bytes per step (after the second measured iteration). ``print(engine.plan)``."""
        now = self.activation_modes
        if now is not None and self._plan.modes is not None and now != self._plan.modes:
            fell = [b for b, was, is_ in zip(self._plan.blocks, self._plan.modes, now) if was != is_]
            self._plan.reasons.append(f"recomputed since the plan, their activations not fitting the budget at the "
                                      f"time: {', '.join(fell)}")
            self._plan.modes = now
        return self._plan

    def _initial_plan(self, recompute) -> Plan:
        cap = self.store.capacity(self.store.compute_tier)
        need = self.schedule.working_set().need
        acts = max(self._streamer.activation_room.values(), default=0) if self._streamer.modes is not None else 0
        overridden = []
        if recompute is not True and recompute is not False and self.config.activations != "auto":
            overridden.append(f"activations = {self.config.activations!r} (EngineConfig.activations)")
        elif recompute in (True, False):
            overridden.append(f"recompute={recompute}")
        if self.config.overlap_step is not None:
            overridden.append(f"overlap_step = {self.config.overlap_step} (EngineConfig.overlap_step)")
        return Plan(modes=self.activation_modes, blocks=[b.name for b in self.binding.blocks],
                    prefetch_depth=self.store.config.prefetch_depth, overlap_step=self.overlap_step,
                    host_split={"working_set": min(need, cap), "activation_room": min(acts, max(0, cap - need)),
                                "cache": max(0, cap - need - acts)},
                    lower_tier=self._lower_tier(), overridden=overridden)

    def _lower_tier(self) -> dict[str, int] | None:
        """The host tier below a device tier, as the plan shows it (None without a device tier)."""
        if self.store.compute_tier != Tier.DEVICE or not self.store.capacity(Tier.HOST):
            return None
        host = self.store.capacity(Tier.HOST)
        return {"budget": host, "prefetch_window": int(self.store.config.host_prefetch_share * host)}

    def _iteration_boundary(self) -> None:
        """A step begins: measure the iteration that ended (for the plan), start the next. Its
        time is the time spent in the engine's calls (forward, backward, clipping, step), so what
        the caller does between them (loading data, logging, evaluating) is not counted."""
        st = self.store.stats
        snapshot = (self._engine_seconds, st.bytes_read[Tier.DISK], st.bytes_written[Tier.DISK], st.io_wait_seconds,
                    st.disk_busy_seconds)
        streamer, n = self._streamer, len(self.binding.blocks)
        if self._meter is not None:
            t, read, written, wait, busy = self._meter
            self._measured.append(StepMeasurement(
                seconds=snapshot[0] - t, io_wait_seconds=st.io_wait_seconds - wait, disk_read=snapshot[1] - read,
                disk_written=snapshot[2] - written, disk_busy_seconds=snapshot[4] - busy,
                forward_seconds=[streamer.forward_seconds.get(i, 0.0) for i in range(n)],
                graph_bytes=[streamer.graph_bytes.get(i, 0) for i in range(n)],
                modes=list(streamer.modes) if streamer.modes is not None else ["keep"] * n))
            self._after_iteration()
            if len(self._measured) > 64:  # a window for stats(); the plan's entries come first
                del self._measured[self._PLAN_FROM + 1 + self._CHECK_AFTER]
        self._meter = snapshot
        streamer.forward_seconds.clear()

    _PLAN_FROM = 1
    """The measured iteration the plan is made from (0-based). Not the first: its optimizer step
    finds the optimizer states still implicitly zero (nothing to read) and its lookahead has not
    learned the access order yet, so its disk traffic is not what later steps move."""
    _CHECK_AFTER = 3
    """Iterations measured under a plan before its prediction is compared with them."""

    def _after_iteration(self) -> None:
        """After the planning iteration: plan. After a few more: compare and say if it is off."""
        measured = self._measured
        if self._streamer.modes is None:
            return  # plain PyTorch: nothing to plan
        if len(measured) == 1 + self._PLAN_FROM:
            fixed = self.config.activations != "auto" or not self.recompute_auto
            room = [self._streamer.activation_room.get(i, 0) for i in range(len(self.binding.blocks))]
            m = measured[self._PLAN_FROM]
            self._plan = make_plan(self._plan, m, self._disk_rates(m), room, max(room, default=0), fixed)
            advice = self._overlap_advice(m)
            if advice:
                self._plan.reasons.append(advice)
            self._streamer.modes = list(self._plan.modes)
            self._streamer.measure_graphs = False
            log.info("tiered-offload plan:\n%s", self._plan.summary())
        elif len(measured) == 1 + self._PLAN_FROM + self._CHECK_AFTER:
            for note in self._plan.check(measured[1 + self._PLAN_FROM:]):
                self._plan.reasons.append(note)
                log.warning("tiered-offload: %s", note)

    def _overlap_advice(self, m: StepMeasurement) -> str | None:
        """When the step runs inline only because the budget is short (the state does not fit,
        nobody configured it): the budget at which it would overlap the next forward, with room
        for the largest block's saved activations beside it."""
        cap = self.store.capacity(self.store.compute_tier)
        if self.overlap_step or self.config.overlap_step is not None or self.schedule.fits(cap):
            return None
        tier = self.store.compute_tier.name.lower()
        acts = max(m.graph_bytes, default=0)
        need = self.schedule.overlap_budget(acts)
        why = (f"the step runs inline: the {tier} budget ({format_size(cap)}) cannot hold a unit being updated "
               f"beside the forward, so reads and compute alternate in the step; ")
        if self.schedule.fits(need):  # that much holds the whole state: nothing left to overlap
            state = self.schedule.state_bytes()
            return why + f"{tier}_memory >= {format_size(state)} ({state} bytes) holds the whole training state"
        return why + (f"{tier}_memory >= {format_size(need)} ({need} bytes) lets it overlap the next forward with "
                      f"room for a block's saved activations ({format_size(acts)})")

    def _disk_rates(self, m: StepMeasurement) -> DiskRates:
        """The disk's rates for the plan: the bench-io profile of its file system, else what the
        measured iteration's own transfers achieved (bytes over the time any was in flight)."""
        backend = self.store.backend
        if backend.directories:
            from tiered_offload.profile import measured_rates
            known = measured_rates(backend.directories[0])
            if known is not None:
                return DiskRates(known[0], known[1], f"bench-io profile {known[2]}")
        moved = m.disk_read + m.disk_written
        if moved == 0 or m.disk_busy_seconds <= 0:
            return DiskRates(0.0, 0.0, "none: the measured step moved nothing to or from disk")
        rate = moved / m.disk_busy_seconds
        return DiskRates(rate, rate, "the measured step's own transfers (`tiered-offload bench-io --save-profile` "
                                     "records the disk's best)")

    @property
    def recompute(self) -> bool:
        """Whether any block is recomputed in backward (activation checkpointing)."""
        return self._streamer.modes is not None and "recompute" in self._streamer.modes

    @property
    def activation_modes(self) -> list[str] | None:
        """Per streamed block: ``keep``, ``offload`` or ``recompute`` (None: everything is kept in
        memory until backward, as plain PyTorch does, because the whole state fits)."""
        return None if self._streamer.modes is None else list(self._streamer.modes)

    # ---- forward ------------------------------------------------------------------------
    def _to_device(self, tree):
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, tree)

    def _await(self, unit: Unit | None = None) -> None:
        """Wait until the step in flight has updated ``unit`` (every unit if None); re-raise its error."""
        self._pipeline.wait(None if unit is None else unit.name)

    def _forward_reached(self, index: int) -> None:
        """The forward started on unit ``index`` of the update order: let the background step advance."""
        self._pipeline.forward_reached(index)

    @_engine_time
    def __call__(self, *args, **kwargs):
        """Run the model's forward, streaming its blocks; returns what the model returns."""
        args, kwargs = self._to_device((args, kwargs))
        if self._sharding is not None:
            self._sharding.where = f"step {self.step_count + 1}, forward"
        with span(self._tracer, "forward", "phase"):  # binding the rest (its waits) included
            self._phase(Phase.FORWARD)
            self._streamer.bind_rest()
            try:
                return self.model(*args, **kwargs)
            except TieredOffloadError:
                raise
            except (TypeError, ValueError, RuntimeError, IndexError) as e:
                raise ModelInputError(f"{type(self.model).__name__}.forward rejected the batch: {e}. Check the "
                                      f"inputs' shapes, dtypes and keyword names against what the model expects") from e

    @_engine_time
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (any scalar computed from the engine's output), accumulating gradients."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward needs a scalar tensor computed from the engine's output")
        finite = bool(torch.isfinite(loss.detach()).all())
        if self._sharding is not None:  # every rank backpropagates, or none does
            self._sharding.where = f"step {self.step_count + 1}, backward"
            flag = torch.tensor([int(finite)], dtype=torch.uint8, device=self.device)
            finite = bool(self._sharding.all_reduce(flag, torch.distributed.ReduceOp.MIN, "the losses' finiteness"))
        if not finite:
            if self.on_nonfinite == "skip":
                self._skip_step = True
                self._streamer.unbind_rest()
                return
            self._streamer.unbind_rest()
            raise NonFiniteError(f"the loss is {loss.item()}; no gradient was computed and the training state is "
                                 f"unchanged. Lower the learning rate, check the data, or pass on_nonfinite='skip'")
        self._phase(Phase.BACKWARD)
        if self._checkpoint is not None and not self._snapshot_commits:
            # the last step's gradients stay on disk until every unit of it is recorded: wait, so
            # this backward's gradients never need a second copy alongside them (the forward has
            # waited for every unit it used; a unit it skipped is updated now)
            with span(self._tracer, "wait last step's commit", "wait"):
                self._await()
                self._checkpoint.wait()
        try:
            with span(self._tracer, "backward", "phase"):
                loss.backward()
        except BaseException as e:
            if self._sharding is not None and self._sharding.broken is None:
                # this rank left the backward between two collectives: the cleanup below must not issue more
                self._sharding.broken = f"{type(e).__name__}: {str(e)[:300]}"
            raise
        finally:
            self._streamer.backward_ran()
            self._streamer.unbind_rest()

    # ---- optimizer ----------------------------------------------------------------------
    @_engine_time
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over the parameters that have a gradient, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``.

        Returns the total norm before clipping. The L2 norms of each unit come from the backward
        that last changed its gradient (no pass over the gradients on disk), and the scaling is
        applied in :meth:`step`, on the way through.
        """
        if self._sharding is not None:
            self._sharding.where = f"step {self.step_count + 1}, clipping"
        self._streamer.unbind_rest()
        self._await()
        self._phase(Phase.CLIP)
        if self._sharding is not None:
            return self._clip_sharded(max_norm, norm_type)
        norms: dict[int, torch.Tensor] = {}
        for unit in self.schedule.clip_order():
            if unit.grad_key is None:
                continue
            unit_norms = self._streamer.grad_norms(unit, norm_type)  # mostly computed by the backward
            for s, n in zip(unit.trainable(), unit_norms):
                norms[id(s)] = n
        ordered = [norms[id(s)] for _, s in self._param_order if s.has_grad]
        if not ordered:
            return torch.tensor(0.0)  # as torch: nothing to clip
        total = torch.linalg.vector_norm(torch.stack(ordered), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._grad_scale = coef if self._grad_scale is None else self._grad_scale * coef
        return total

    def _clip_sharded(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The global L2 norm from every rank's gradient slices (sum of squares, reduced over ranks)."""
        if norm_type != 2.0:
            raise ConfigError(f"sharded training clips by the L2 norm only (norm_type=2.0), got {norm_type}")
        sh = self._sharding
        sh.where = f"step {self.step_count + 1}, clipping"
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for unit in self.units:
            key = sh.layout(unit).grad_key
            if key is not None:
                with self.store.hold(key) as g:
                    total += g.double().square().sum().to(total.device)
        sh.all_reduce(total, torch.distributed.ReduceOp.SUM, "the gradient norm")
        if not any(s.has_grad for _, s in self._param_order):
            return torch.tensor(0.0)
        norm = total.sqrt().float().reshape(())
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self._grad_scale = coef if self._grad_scale is None else self._grad_scale * coef
        return norm

    @_engine_time
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
        if self._sharding is not None:  # a non-finite gradient slice on any rank stops every rank's step
            self._sharding.where = f"step {self.step_count + 1}, step"
            runs = list(self._streamer.runs.values())
            flags = torch.tensor([int(r.grads_finite) for r in runs], dtype=torch.uint8, device=self.device)
            self._sharding.all_reduce(flags, torch.distributed.ReduceOp.MIN, "the gradients' finiteness")
            for r, f in zip(runs, flags.tolist()):
                r.grads_finite = bool(f)
        bad = [name for name, run in self._streamer.runs.items() if not run.grads_finite]
        if self._skip_step or bad:
            for run in self._streamer.runs.values():
                run.grads_finite = True
            self._grad_scale = None
            if self.on_nonfinite == "skip" or self._skip_step:
                self._skip_step = False
                self.zero_grad()
                return False
            raise NonFiniteError(f"non-finite gradients in {', '.join(bad)}; no weight or optimizer state was updated. "
                                 f"Call zero_grad() and lower the learning rate, or pass on_nonfinite='skip'")
        self._phase(Phase.STEP)
        self._iteration_boundary()
        hypers = [self._spec.hyper(g) for g in self.param_groups]
        scale, self._grad_scale = self._grad_scale, None
        step_index = self.step_count
        # which parameters this step updates, and each one's step count before it
        todo = {id(s): s.updates for _, s in self._param_order if s.optimized and s.has_grad}
        no_grad = [s.name for _, s in self._param_order if s.optimized and not s.has_grad]
        for _, s in self._param_order:
            if id(s) in todo:
                s.updates += 1
        self.step_count += 1
        if self._optimizer_view is not None:
            self._optimizer_view._opt_called = True  # what an LR scheduler checks to know a step happened
        if self._scheduler is not None:
            self._scheduler.step()
        then = None
        if self._checkpoint is not None and self._snapshot_commits:
            # the last commit must have written what it snapshots before this step changes it
            self._checkpoint.wait()
            self._pending_commit = (self.step_count, self._meta())
            if self.step_count % self.commit_every == 0:
                then = self._commit_pending
        elif self._checkpoint is not None:
            # the step is committed once its gradients and this record are on disk: from here on a
            # crash resumes after it, by re-running the update of the units not yet recorded. They
            # go to disk beside the update (a unit's record follows the intent in the journal);
            # sharded, every rank's intent must be durable before any rank updates anything
            self._checkpoint.begin_step({
                "step": self.step_count, "step_index": step_index,
                "hyper": [_jsonable(h, "the optimizer's hyperparameters") for h in hypers], "no_grad": no_grad,
                "scale": None if scale is None else float(scale.item()), "meta": self._meta()},
                wait=self._sharding is not None)
            if self._sharding is not None:  # nothing is updated anywhere before every rank's intent is durable
                self._sharding.barrier("every rank's intent")
        self.store.declare_access_sequence(self._sequence(self._phases))
        self._phases = []
        by_name = self._units_by_name
        self._pipeline.run([u.name for u in self.schedule.update_order()],
                           lambda name: self._update_unit(by_name[name], hypers, scale, todo),
                           background=self.overlap_step, then=then)
        return True

    def _commit_pending(self) -> None:
        """Start the snapshot commit of the last step (its update is done)."""
        step, meta = self._pending_commit
        self._pending_commit = None
        self._checkpoint.snapshot(step, meta)

    def commit(self) -> int:
        """Commit the last step now (with ``commit_every`` > 1, between the scheduled commits) and
        wait until it is durable; returns its number."""
        self._streamer.unbind_rest()
        self._await()
        if self._checkpoint is None:
            return self.step_count
        if self._snapshot_commits and self._pending_commit is not None:
            self._checkpoint.wait()
            self._commit_pending()
        return self._checkpoint.wait()

    def _update_unit(self, unit: Unit, hypers: list[dict], scale: torch.Tensor | None, todo: dict[int, int]) -> None:
        """One unit's optimizer step (see :class:`UnitUpdater`), recorded by the commit when durable."""
        journal = self._checkpoint is not None and not self._snapshot_commits
        # the state does not fit in memory (device and host tiers together): the optimizer states
        # the update changed go to the disk at once (they are not needed again before the next
        # step, so they are the first to give up their room, and then cost no write). The weights
        # only when the journal needs them there: the next forward wants them soon, and where they
        # stay in memory until then a write now is wasted (with a CPU device tier of 1/4 and a
        # host tier of 3/8 of the state: 8% less disk traffic; docs/STEP_TIME.md)
        memory = self.store.capacity(Tier.DEVICE) + self.store.capacity(Tier.HOST)
        write_behind = journal or not self.schedule.fits(memory)
        with span(self._tracer, f"update {unit.name}", "optimizer"):
            futures = self._updater.update(unit, hypers, scale, todo, write_behind=write_behind,
                                           weights_behind=journal, shard=self._sharding and self._sharding.layout(unit))
        if journal:
            self._checkpoint.unit_updated(unit.name, futures, self.schedule.rewrite_bytes(unit))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every gradient, as ``optimizer.zero_grad()`` (set to None) does: no parameter has
        a gradient until the next backward gives it one. No I/O: the store just forgets the bytes.

        A unit the step in flight has not reached yet is zeroed right after its update.
        """
        self._streamer.unbind_rest()
        for unit in self.units:
            key = self._grad_key(unit)
            if key:
                self._pipeline.after_update(unit.name, lambda key=key: self.store.zero(key))
        for _, slot in self._param_order:
            slot.has_grad = False
        for run in self._streamer.runs.values():
            run.grads_finite = True

    # ---- inspection ---------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every parameter, in ``model.named_parameters()`` order, one at a time on the CPU."""
        self._streamer.unbind_rest()
        self._await()
        if self._sharding is not None:  # every rank takes part in each unit's gather, in the same order
            self._sharding.where = f"named_parameters() after step {self.step_count}"
            gathered = {}
            for unit in self.units:
                full = self._full_weights(unit)
                for slot in unit.params:
                    gathered[slot.name] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            for _, slot in self._param_order:
                yield slot.name, gathered[slot.name]
            return
        for unit, slot in self._param_order:
            with self.store.hold(unit.weight_key, Tier.HOST) as flat:
                value = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            yield slot.name, value

    @property
    def optimizer(self) -> "_OptimizerView":
        """A ``torch.optim.Optimizer`` view of the engine, for learning-rate schedulers."""
        if self._optimizer_view is None:
            self._optimizer_view = _OptimizerView(self)
        return self._optimizer_view

    def stats(self) -> EngineStats:
        """The store's counters (bytes per tier, hits, waits) and, per training step, the disk
        bytes read and written (per parameter too), the step time and the I/O bound."""
        m = self._measured
        median = (lambda xs: sorted(xs)[len(xs) // 2]) if m else (lambda xs: None)
        busy = sum(x.disk_busy_seconds for x in m)
        moved = sum(x.disk_read + x.disk_written for x in m)
        return EngineStats(self.store.stats, sum(s.numel for _, s in self._param_order), len(m),
                           median([x.seconds for x in m]), median([x.disk_read for x in m]),
                           median([x.disk_written for x in m]), moved / busy if busy > 0 else None)

    def close(self) -> None:
        """Finish writing the last step, release memory, files and the directory's lock
        (a temporary storage directory is removed)."""
        if self.store is None:
            return
        try:
            self._streamer.close()
            self._streamer.unbind_rest()
            self._await()
            if self._checkpoint is not None:
                self._checkpoint.wait()
                if self._pending_commit is not None:  # steps since the last scheduled commit
                    self._commit_pending()
                    self._checkpoint.wait()
                self._checkpoint.close()  # no journal work left running when the backend closes
        finally:
            if self._tracer is not None:
                self._tracer.write()
            try:
                # durable: the committed state is complete; what is dirty now (gradients) is not part of it
                self.store.close(flush=not self.durable)
            finally:
                self._release_directory()
                self.store = None
                if self._tmpdir is not None:
                    self._tmpdir.cleanup()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _OptimizerView(torch.optim.Optimizer):
    """Enough of ``torch.optim.Optimizer`` for LR schedulers: shared ``param_groups``, ``step``, ``zero_grad``."""

    def __init__(self, engine: Engine):
        self._engine = engine
        # one stand-in tensor per group: the view must look like an optimizer, but it holds no
        # parameters (the engine's are in its store) and no state
        dummies = [torch.zeros(1, requires_grad=True) for _ in engine.param_groups]
        super().__init__([{"params": [d]} for d in dummies], dict(engine._spec.defaults))
        for group, dummy in zip(engine.param_groups, dummies):
            group["params"] = [dummy]
        self.param_groups = engine.param_groups

    def step(self, closure=None):  # noqa: D102 - forwards to the engine
        return self._engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self._engine.zero_grad()


def _generation(ref) -> int:
    if not ref:
        return 0
    gen = ref[0].rpartition("@")[2]
    return int(gen) if gen.isdigit() else 0


def _jsonable(value, what: str):
    """``value`` with tensors as numbers and tuples as lists, checked to survive JSON exactly."""
    def conv(v):
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else v.tolist()
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise ConfigError(f"{what} holds a {type(v).__name__} ({v!r}), which cannot be saved with the training "
                          f"state; use numbers, strings, lists and dicts")
    out = conv(value)
    try:
        json.dumps(out, allow_nan=False)
    except ValueError as e:
        raise ConfigError(f"{what} cannot be saved with the training state: {e}") from e
    return out


def _saved_hyper(optimizer: type[torch.optim.Optimizer], saved: dict) -> dict:
    """A saved group's hyperparameters as ``optimizer``'s constructor arguments (JSON lists back to tuples)."""
    ctor = set(inspect.signature(optimizer).parameters) - {"params"}
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in ctor}


def _hyper_from_json(saved: dict, like: dict) -> dict:
    """Hyperparameters read back from JSON, with tuples where the optimizer had tuples."""
    return {k: (tuple(v) if isinstance(like.get(k), tuple) and isinstance(v, list) else v) for k, v in saved.items()}
