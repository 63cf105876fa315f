"""The checks an engine makes before it moves a byte: budgets that cannot hold one step's working
set, and a disk that cannot hold the state, are refused up front with the numbers (never in the
middle of a step)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from offload_core.errors import ConfigError, DiskFullError, TierCapacityError
from offload_core.sizes import format_size, format_size_up
from tiered_offload.engine.planner import DiskRates
from tiered_offload.engine.schedule import FP32_BYTES, Schedule
from tiered_offload.store.tiers import Tier

__all__ = ["check_budgets", "check_step_mode", "check_disk", "optimizer_tier", "measure_update_rates", "UpdateRates"]


STAGED_AT_ONCE = 3
"""Largest units a host tier below a device tier must hold: a load into the device and a device
victim moved down (each staged there, on a GPU without GPUDirect) are two copies at once; where the
first copy sits in the middle of the arena, the holes either side of it hold the second only if the
arena holds three, each as the arena rounds it (``tools/fuzz_options.py --seed 74049``: 44 KiB,
two 20 KiB copies, holes of 16 and 8 KiB, and a step that failed for room)."""


def check_budgets(store, schedule: Schedule, state_piece_numel: int) -> None:
    """Refuse budgets that cannot hold one step's working set (and, below a device tier, a host
    budget that cannot stage :data:`STAGED_AT_ONCE` of the largest unit)."""
    compute = store.compute_tier
    cap = store.capacity(compute)
    ws = schedule.working_set()
    need = ws.need
    if need > cap:
        raise TierCapacityError(
            f"the {compute.name.lower()} budget ({_budget(store, compute)}) cannot hold one step's working set: "
            f"{format_size_up(need)} ({need} bytes) needed. Forward and backward keep the weights and gradients of "
            f"the parameters bound for the whole pass ({format_size(ws.rest_bytes)}) plus a streamed unit's weights "
            f"and gradients and the next one's weights (largest: {ws.largest_block} = {format_size(ws.block_bytes)} "
            f"of weights): "
            f"{format_size(ws.forward_backward)}; the optimizer keeps one unit's weights and gradients and one "
            f"{format_size(state_piece_numel * FP32_BYTES)} piece of each of its {len(schedule.state_kinds)} "
            f"state(s): {format_size(ws.optimizer)}; plus {format_size(ws.slack)} of slack against fragmentation. "
            f"Raise host_memory{' / device_memory' if compute == Tier.DEVICE else ''} to at least "
            f"{format_size_up(need)}")
    largest = max(schedule.unit_bytes(u, "weight") for u in schedule.units)
    staging = STAGED_AT_ONCE * store.footprint(largest, Tier.HOST)
    if compute == Tier.DEVICE and store.capacity(Tier.HOST) < staging:
        raise TierCapacityError(
            f"host_memory ({_budget(store, Tier.HOST)}) cannot stage the largest unit "
            f"({format_size_up(largest)}) to the GPU: a load and a device victim on its way down pass through the "
            f"host tier at once, and the holes the first leaves must still hold the second, so it must hold "
            f"{STAGED_AT_ONCE} of them. Raise host_memory to at least {format_size_up(staging)}")


def _budget(store, tier: Tier) -> str:
    """A tier's budget as the user gave it, and what the arena made of it where it rounded it down to whole
    pages (``host_memory=100`` is no page at all: reported as "0 B" alone, it read as a budget never given)."""
    cap = store.capacity(tier)
    given = store.config.host_budget_bytes if tier == Tier.HOST else store.config.device_budget_bytes
    if given == cap:
        return format_size(cap)
    text = format_size(given)
    text = text if text.endswith(" B") else f"{text} = {given} bytes"  # 4095 is "4.00 KiB" to two places
    return f"{text}, {format_size(cap)} once rounded down to whole {format_size(store.footprint(1, tier))} pages"


def check_step_mode(config, store, schedule: Schedule, update_tier: Tier) -> None:
    """Refuse a step mode ``config`` forces (``overlap_step=True``, else ``defer_step=True``) where
    the update runs in the compute tier and that tier cannot hold the unit being updated beside
    what the forward pins there (the least budget the planner would choose the mode at): the
    update would fail mid-step for room (a fuzzed run: RMSprop's three states, deferred, 120 KiB
    against 144 KiB). Where the state fits, no mode moves a byte of disk: nothing to refuse."""
    tier = store.compute_tier
    cap = store.capacity(tier)
    if update_tier != tier or schedule.fits(cap):
        return
    name, need, beside = (("overlap_step", schedule.overlap_budget(0), "the next forward's working set")
                          if config.overlap_step else
                          ("defer_step", schedule.defer_budget(), "the weights and gradients the forward pins"))
    if getattr(config, name) and cap < need:
        where = tier.name.lower()
        raise TierCapacityError(
            f"EngineConfig.{name}=True runs a unit's update beside {beside}: the {where} budget "
            f"({format_size(cap)}) cannot hold both, {format_size_up(need)} ({need} bytes) needed. Raise "
            f"{where}_memory to at least that, or leave {name} unset (None: the engine uses the mode where it fits)")


def check_disk(backend, state_bytes: int, extra_bytes: int) -> None:
    """Refuse a storage location whose free space cannot hold the state and what a step adds."""
    free = backend.free_bytes()
    need = state_bytes + extra_bytes
    if free is not None and need > free:
        raise DiskFullError(
            f"the training state needs {format_size(need)} ({need} bytes) in {backend.location} "
            f"but {format_size(free)} ({free} bytes) is free; free space or add storage directories",
            path=backend.location, needed_bytes=need, free_bytes=free)


@dataclass
class UpdateRates:
    """What an optimizer step costs in each place, measured (``optimizer_device="auto"``)."""

    host_Bps: float
    """Bytes of training state (weights, gradients, optimizer states) PyTorch's optimizer steps
    through per second on the host (its CPU kernels)."""
    device_Bps: float
    """The same on the device."""
    link_Bps: float
    """Bytes per second copied between the host and the device, both ways."""
    disk: DiskRates | None = None
    """The disk's rates (its bench-io profile); None: not known, the disk is not weighed."""
    journal: bool = False
    """Whether the commits write every rewritten tensor and the gradients each step (the disk's
    written floor, the same under both placements)."""

    def seconds(self, schedule: Schedule, host_budget: int, device_budget: int) -> dict[str, float]:
        """Predicted seconds per step of each placement: the update over the whole state at its
        rate, plus the placement's floors: the link's (:meth:`Schedule.floors`) at its rate and,
        where its rates are known, the disk's in the step mode that moves least (the step in
        the backward, :meth:`Schedule.floors_in_backward`, where it can run: the commits are no
        journal, and an update on the device has room beside the backward's pins, as
        :meth:`StepInBackward.short_of_room` requires). The placements differ on the disk where
        the device tier holds more than the weights: its room keeps optimizer states off the
        disk under an update on the device, weights only under one on the host."""
        state, memory = schedule.state_bytes(), host_budget + device_budget
        times = {}
        for where, rate in (("host", self.host_Bps), ("device", self.device_Bps)):
            on_host = where == "host"
            floors = schedule.floors(memory, device_budget, update_on_host=on_host, journal=self.journal)
            disk = 0.0
            if self.disk is not None:
                in_backward = not self.journal and (on_host or device_budget >= schedule.defer_budget())
                modes = [floors] + ([schedule.floors_in_backward(memory, device_budget, update_on_host=on_host)]
                                    if in_backward else [])
                disk = min(self.disk.seconds(f["disk_read"], f["disk_written"]) for f in modes)
            times[where] = state / rate + floors["link"] / self.link_Bps + disk
        return times


def measure_update_rates(spec, device: torch.device, disk: DiskRates | None, journal: bool, link_Bps: float | None,
                         numel: int = 1 << 22) -> UpdateRates | None:
    """Time the user's optimizer (its first group's hyperparameters) on ``numel`` parameters (a
    2-D tensor: Muon takes no other) on the host and on ``device``, the second step (the first
    creates the state), best of three; ``link_Bps`` from the store
    (:meth:`~tiered_offload.store.copies.CopyChains.link_rate`; None: no rates); ``disk`` and
    ``journal``: as :class:`UpdateRates`'. Four million
    parameters: a state larger than the CPU's caches, as the real one is (on a GPU a transient
    64 MiB, before the first forward's activations). On the device stand-in (the CPU) both sides
    run the same kernels, so the update's time cancels out: a small probe there."""
    if link_Bps is None:
        return None
    cuda = device.type == "cuda"
    numel = numel if cuda else min(numel, 1 << 18)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)  # noqa: E731

    def update_Bps(where: torch.device) -> float:
        w = torch.zeros(numel // 1024, 1024, device=where)
        w.grad = torch.full_like(w, 1e-3)
        opt = spec.cls([w], **spec.hyper(spec.groups[0]))
        opt.step()
        times = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            opt.step()
            sync()
            times.append(time.perf_counter() - t)
        return numel * FP32_BYTES * (2 + len(spec.kinds)) / max(min(times), 1e-9)

    host = update_Bps(torch.device("cpu"))
    return UpdateRates(host, update_Bps(device) if cuda else host, link_Bps, disk, journal)


def optimizer_tier(setting: str, store, schedule: Schedule, state=None, measure=None, agree=None) -> tuple[Tier, str]:
    """Where the optimizer step runs (``EngineConfig.optimizer_device``), and why. With one memory
    tier (the CPU) there is nothing to choose. Below a device tier, ``"host"`` updates in the host
    tier, where the optimizer states live when they do not fit the device: ZeRO-Offload's
    arrangement, the link carries the gradients down and the weights up instead of the states
    both ways; ``"device"`` updates in the device tier; ``"auto"``: the device when the whole state
    fits it or the host budget cannot hold the step's working set, else the placement whose
    update plus link and disk floors take less time at the rates ``measure(link_Bps)`` returns
    (:class:`UpdateRates`, given the store's :meth:`link_rate`; without it, the host; the disk
    weighed where its bench-io profile gives its rates).

    ``state`` (the :class:`~tiered_offload.engine.train_state.TrainState`): a run resumed under
    ``"auto"`` keeps the placement its state was trained with (``state.update_tier``: the two
    placements' kernels can differ in the last bits, and a resume is the uninterrupted run's
    continuation), and the choice is recorded there. ``agree(flag, what)``: whether every rank
    chose the host (sharded: else every rank updates on the device)."""
    where, why = _placement(setting, store, schedule, getattr(state, "update_tier", None), measure)
    if store.compute_tier != Tier.DEVICE:
        return where, why
    if agree is not None and not agree(where == Tier.HOST, "where the optimizer step runs") and where == Tier.HOST:
        where, why = Tier.DEVICE, "another rank could not update on the host, or measured the device faster"
    if state is not None:
        state.update_tier = where.name.lower()
    return where, why


def _placement(setting: str, store, schedule: Schedule, resumed: str | None, measure) -> tuple[Tier, str]:
    """:func:`optimizer_tier` on this process."""
    if setting not in ("auto", "host", "device"):
        raise ConfigError(f"EngineConfig.optimizer_device must be 'auto', 'host' or 'device', got {setting!r}")
    if store.compute_tier != Tier.DEVICE:
        return store.compute_tier, "the only memory tier"
    if setting == "device":
        return Tier.DEVICE, "optimizer_device='device'"
    ws = schedule.working_set()
    need = ws.optimizer + ws.slack
    host = store.capacity(Tier.HOST)
    if setting == "host" and need > host:
        raise TierCapacityError(f"optimizer_device='host' runs the step in the host tier, whose budget "
                                f"({format_size(host)}) cannot hold one unit's weights, gradients and state pieces; "
                                f"raise host_memory to at least {format_size_up(need)}, or use 'device'")
    if setting == "host":
        return Tier.HOST, "optimizer_device='host'"
    if resumed in ("host", "device") and (resumed == "device" or need <= host):
        return Tier.parse(resumed), f"as the run this one resumes was trained ({resumed!r}, chosen by 'auto' then)"
    if schedule.fits(store.capacity(Tier.DEVICE)):
        return Tier.DEVICE, "the whole state fits the device tier"
    if need > host:
        return Tier.DEVICE, f"the host budget cannot hold one unit's update ({format_size_up(need)})"
    try:
        rates = measure(store.link_rate()) if measure is not None else None
    except Exception as e:  # noqa: BLE001 - an optimizer the probe cannot step: the size rule decides
        return Tier.HOST, f"the state does not fit the device tier (the update rates could not be measured: {e})"
    if rates is None:
        return Tier.HOST, "the state does not fit the device tier"
    t = rates.seconds(schedule, host, store.capacity(Tier.DEVICE))
    where = Tier.HOST if t["host"] <= t["device"] else Tier.DEVICE
    disk = (f"disk {rates.disk.read_Bps / 1e9:.2f} / {rates.disk.write_Bps / 1e9:.2f} GB/s read / written" if rates.disk
            else "the disk not weighed: no bench-io profile of it (tiered-offload bench-io --save-profile)")
    return where, (f"measured: {t['host']:.3f} s per step on the host against {t['device']:.3f} s on the device "
                   f"(update {rates.host_Bps / 1e9:.2f} / {rates.device_Bps / 1e9:.2f} GB/s of state, "
                   f"link {rates.link_Bps / 1e9:.2f} GB/s, {disk})")
