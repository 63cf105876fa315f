"""The plan: what each block does with its activations, and what a step is expected to cost.

Pure numbers, no torch: :func:`make_plan` takes what the first iterations measured (each block's
forward compute time and the bytes its graph saves, the step's compute time and disk traffic)
and the disk's rates (the ``bench-io`` profile of the file system, or a probe at start), and
returns a :class:`Plan` that a person can read (``print(engine.plan)``) and a test can check.

The cost model. Compute and I/O overlap (the lookahead prefetches, write-backs run behind) as
far as the budget leaves room to work ahead; the share of the I/O time the measured
iteration did not wait for is taken as the share hidden, so a step takes about ``compute +
(1 - hidden) x I/O``:

* recomputing block ``i`` costs its forward once more: ``F_i`` seconds of compute;
* keeping its graph instead costs a copy of its saved tensors (``A_i`` bytes) into the store;
  offloading them costs ``A_i`` written and ``A_i`` read as well. Keeping them in the compute
  tier costs no I/O only where the measured iteration read no state from the disk (the state
  fits). Where it did, every tier was full of state, and the room kept activations take from
  the forward to their backward pushed state out: written and read back, as many bytes as
  offloading them (a probe at a host budget of 0.9 of the state: a plan that charged keeping
  nothing predicted 60 MiB read per step, and 156-168 were measured; docs/RESULTS.md).

Starting from "recompute every block", the planner switches blocks to a kept graph, those that
save the most compute per byte first, as long as the predicted step gets shorter (the disk has
time to spare while compute dominates). The blocks whose backward comes first (the last ones)
keep their activations in the compute tier when they fit one block's room; the others are
offloaded at once, so their write-back never stalls a later allocation.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from offload_core.errors import ConfigError

__all__ = ["DiskRates", "StepMeasurement", "Plan", "make_plan", "choose_activation_modes", "median"]


@dataclass
class DiskRates:
    """Sequential disk throughput the plan assumes, and where the numbers come from."""

    read_Bps: float
    write_Bps: float
    source: str
    """Where the figures come from: the ``bench-io`` profile of the file system, the first
    iteration's own disk traffic, or none (no disk traffic, or memory storage)."""

    def seconds(self, read: float, written: float) -> float:
        if self.read_Bps <= 0 or self.write_Bps <= 0:
            return 0.0
        return read / self.read_Bps + written / self.write_Bps


@dataclass
class StepMeasurement:
    """What one training iteration (forward, backward, step) measured."""

    seconds: float
    """Time spent in the engine's calls (forward, backward, clipping, step) from one ``step()``
    to the next."""
    io_wait_seconds: float
    """Of that, time compute spent waiting for bytes."""
    disk_read: int
    disk_written: int
    disk_busy_seconds: float
    """Time at least one disk transfer was in flight."""
    forward_seconds: list[float]
    """Per block, the forward's compute time."""
    graph_bytes: list[int]
    """Per block, what its graph saves for backward (one forward's)."""
    modes: list[str]
    """Per block, what this iteration did with its activations."""
    link: int = 0
    """Bytes copied into and out of the device tier (0 without one)."""
    forwards: list[int] | None = None
    """Per block, its forwards this iteration (micro-batches: each saves, copies and offloads its
    own activations); None: one each."""


@dataclass
class Plan:
    """What the engine does, and what it expects a step to cost."""

    modes: list[str]
    """Per streamed block: ``keep``, ``offload`` or ``recompute`` (None: plain PyTorch, the state fits)."""
    blocks: list[str]
    prefetch_depth: int
    overlap_step: bool
    host_split: dict[str, int]
    """How the compute tier's budget is used: ``working_set`` (what one step pins at once),
    ``activation_room`` (the most saved activations one block's backward may pin
    beside it), ``cache`` (the rest: state and activations kept across phases)."""
    lower_tier: dict[str, int] | None = None
    """With a device tier: the host tier below it, ``budget`` and ``prefetch_window`` (the most
    bytes its lookahead fetches from the disk ahead of need). None on a CPU machine."""
    predicted_step_s: float | None = None
    """Predicted seconds per iteration (None until measured)."""
    predicted_compute_s: float | None = None
    predicted_io_s: float | None = None
    io_hidden: float | None = None
    """Share of the I/O time hidden behind compute (as the measured iteration hid it)."""
    predicted_read: int | None = None
    """Disk bytes read per iteration."""
    predicted_written: int | None = None
    rates: DiskRates | None = None
    overridden: list[str] = field(default_factory=list)
    """Decisions the configuration fixed instead of the planner."""
    reasons: list[str] = field(default_factory=list)
    measured_step_s: float | None = None
    """The median step time measured after the plan took effect (None until measured)."""
    measured_read: int | None = None
    """Median disk bytes read per step after the plan took effect (None until measured)."""
    measured_written: int | None = None
    defer_step: bool = False
    """Not overlapped: each unit's update runs on the next forward's thread just before it needs
    the unit (``EngineConfig.defer_step``)."""
    advised_memory: int | None = None
    """The compute tier's budget the plan advises where the step runs deferred or inline for want
    of room: the least at which it overlaps the next forward (None: it overlaps, or the
    configuration fixed the choice)."""
    floors: dict | None = None
    """The bytes a step cannot avoid (:meth:`Schedule.floors`) and where the update runs:
    ``disk_read``, ``disk_written``, ``link`` (None without a device tier), ``update`` (the tier)
    and ``update_why``,
    ``gradients`` (where they wait for the update)."""

    @property
    def bytes_per_step(self) -> int | None:
        if self.predicted_read is None:
            return None
        return self.predicted_read + self.predicted_written

    def _step_mode(self) -> str:
        if self.overlap_step:
            return "overlapped with the next forward"
        if self.defer_step:
            return "deferred to the next forward (each unit updated just before the forward needs it)"
        return "inline"

    def summary(self) -> str:
        """The plan in a few lines (what ``engine.plan`` prints and the engine logs at INFO)."""
        mib = 1 << 20
        if self.modes is None:
            acts = "kept in memory as plain PyTorch (the state fits the compute tier)"
        else:
            counts = {m: self.modes.count(m) for m in ("keep", "offload", "recompute") if m in self.modes}
            acts = ", ".join(f"{n} {m}" for m, n in counts.items())
            if len(set(self.modes)) > 1:
                acts += " (" + " ".join(f"{b}:{m[0]}" for b, m in zip(self.blocks, self.modes)) + ")"
        lines = [f"activations: {acts}",
                 f"prefetch depth {self.prefetch_depth}; step {self._step_mode()}",
                 "compute tier: " + ", ".join(f"{k.replace('_', ' ')} {v / mib:.1f} MiB" for k, v in self.host_split.items())]
        if self.lower_tier:
            lines.append("host tier below it (caching what the compute tier does not hold): " + ", ".join(
                f"{k.replace('_', ' ')} {v / mib:.1f} MiB" for k, v in self.lower_tier.items()))
        if self.floors:
            f = self.floors
            link = "" if f["link"] is None else f"; device link >= {f['link'] / mib:.1f} MiB"
            lines.append(f"floors per step: disk >= {f['disk_read'] / mib:.1f} MiB read + {f['disk_written'] / mib:.1f} "
                         f"MiB written{link}; the update runs in the {f['update']} tier"
                         + (f" ({f['update_why']})" if f.get("update_why") else "") + f", gradients {f['gradients']}"
                         + ("" if not f.get("in_backward") else
                            f"; with the step in the backward (backward(loss, step=True)) disk >= "
                            f"{f['in_backward']['disk_read'] / mib:.1f} MiB read + "
                            f"{f['in_backward']['disk_written'] / mib:.1f} MiB written"
                            + ("" if f["in_backward"].get("link") is None else
                               f", device link >= {f['in_backward']['link'] / mib:.1f} MiB"))
                         + ("" if not f.get("in_backward_needs") else
                            f"; backward(loss, step=True) steps after the backward at this budget (a unit's "
                            f"update does not fit beside the backward's pins: {f['in_backward_needs']} runs it "
                            f"in the backward)"))
        if self.predicted_step_s is None:
            lines.append("predicted step: not yet (measured over the first iterations)")
        else:
            lines.append(f"predicted step {self.predicted_step_s:.3f} s = compute {self.predicted_compute_s:.3f} s + "
                         f"{1 - self.io_hidden:.0%} of I/O {self.predicted_io_s:.3f} s (the rest hidden behind compute); "
                         f"disk {self.predicted_read / mib:.1f} MiB read + {self.predicted_written / mib:.1f} MiB written "
                         f"per step")
        if self.rates is not None:
            lines.append(f"disk: read {self.rates.read_Bps / 1e9:.2f} GB/s, write {self.rates.write_Bps / 1e9:.2f} GB/s "
                         f"({self.rates.source})")
        if self.measured_step_s is not None:
            lines.append(f"measured step {self.measured_step_s:.3f} s")
        if self.measured_read is not None:
            lines.append(f"measured disk {self.measured_read / mib:.1f} MiB read + {self.measured_written / mib:.1f} MiB "
                         f"written per step ({_off(self.measured_read + self.measured_written, self.bytes_per_step):+.0%} "
                         f"against the prediction)")
        lines += [f"overridden: {o}" for o in self.overridden]
        lines += self.reasons
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    STEP_TOLERANCE = 0.2
    """How far the measured step time may be from the prediction before the plan says so."""
    BYTES_TOLERANCE = 0.1
    """How far the measured disk bytes per step may be from the prediction before the plan says so."""

    def check(self, steps: list[StepMeasurement]) -> list[str]:
        """Record the medians of ``steps`` (measured under this plan) and return what is further
        from the prediction than the tolerances, in words (empty: the prediction held)."""
        self.keep_measured(steps)
        notes = []
        off = _off(self.measured_step_s, self.predicted_step_s)
        if abs(off) > self.STEP_TOLERANCE:
            notes.append(f"the plan predicted {self.predicted_step_s:.3f} s per step and {len(steps)} steps measured "
                         f"{self.measured_step_s:.3f} s ({abs(off):.0%} off): the cost model misses something on this "
                         f"machine (other load, page cache, compute that changes with the batch)")
        moved = self.measured_read + self.measured_written
        off = _off(moved, self.bytes_per_step)
        if abs(off) > self.BYTES_TOLERANCE:
            mib = 1 << 20
            notes.append(f"the plan predicted {self.bytes_per_step / mib:.1f} MiB of disk traffic per step and "
                         f"{len(steps)} steps measured {moved / mib:.1f} MiB ({abs(off):.0%} off): the iteration it was "
                         f"planned from did not move what later ones do (a cache still filling, a budget that "
                         f"changed, other processes on the disk)")
        return notes

    def keep_measured(self, steps: list[StepMeasurement]) -> None:
        """The medians of ``steps`` as the plan's measured step time and disk bytes."""
        self.measured_step_s = median([m.seconds for m in steps])
        self.measured_read = median([m.disk_read for m in steps])
        self.measured_written = median([m.disk_written for m in steps])

    EARN = 0.05
    """How much faster than the modes it replaced a plan's steps must run when they move more disk
    bytes (offloaded activations): a gain below that is within the noise of a step, not worth the
    disk traffic, and the engine goes back (:meth:`unearned`)."""

    def _more_bytes(self, before: list[StepMeasurement], after: list[StepMeasurement]) -> tuple[int, int] | None:
        """The disk bytes per step of ``before`` and of ``after`` (medians), where ``after`` moved more
        than :attr:`BYTES_TOLERANCE` beyond ``before``; else None."""
        was, moved = (median([m.disk_read + m.disk_written for m in steps]) for steps in (before, after))
        return (was, moved) if moved > was * (1 + self.BYTES_TOLERANCE) else None

    def unearned(self, before: list[StepMeasurement], after: list[StepMeasurement]) -> str | None:
        """Why this plan should give way to the modes of ``before``, steps measured under the modes
        it replaced (None: it stays): its steps ``after`` moved more disk bytes than they did
        (beyond :attr:`BYTES_TOLERANCE`) and did not run :attr:`EARN` faster (medians). The
        prediction is a model; this is the measurement of both choices on this machine."""
        more = self._more_bytes(before, after)
        then, seconds = median([m.seconds for m in before]), median([m.seconds for m in after])
        if more is None or then <= 0 or seconds <= then * (1 - self.EARN):
            return None
        was, moved = more
        gain = 1 - seconds / then
        back = ("recomputing every block" if set(before[0].modes) == {"recompute"}
                else "the activation modes it was planned from")
        mib = 1 << 20
        return (f"back to {back}: the planned activations moved {moved / max(was, 1):.1f}x the disk bytes "
                f"({moved / mib:.1f} against {was / mib:.1f} MiB per step) and {len(after)} steps under them ran "
                f"{seconds:.3f} s against {then:.3f} s for {_steps_before(before)} "
                f"({abs(gain):.0%} {'faster' if gain >= 0 else 'slower'}; a plan that moves more bytes must run "
                f"{self.EARN:.0%} faster)")

    def measure_again(self, before: list[StepMeasurement], after: list[StepMeasurement]) -> str | None:
        """Why the modes planned from should run again before this plan is kept (None: no need).
        Its steps ``after`` moved more disk bytes than ``before`` and ran faster, but ``before``
        is one step (the one planned from): too few to tell a gain from a slow step (the machine's
        other load, a cache filling)."""
        more = self._more_bytes(before, after)
        if len(before) > 1 or more is None:
            return None
        (was, moved), seconds = more, median([m.seconds for m in after])
        return (f"the planned activations moved {moved / max(1, was):.1f}x the disk bytes and ran {seconds:.3f} s "
                f"against {before[0].seconds:.3f} s for {_steps_before(before)}: too few to tell a gain from a slow "
                f"step")

    def earned(self, before: list[StepMeasurement], after: list[StepMeasurement]) -> str:
        """Why this plan stays after ``before`` measured the modes it replaced again (medians)."""
        then, seconds = median([m.seconds for m in before]), median([m.seconds for m in after])
        return (f"kept the planned activations: {len(after)} steps under them ran {seconds:.3f} s against {then:.3f} s "
                f"for {_steps_before(before)}: {1 - seconds / then:.0%} faster for their extra disk bytes")

    def choose_step_mode(self, overlapped: list[StepMeasurement], deferred: list[StepMeasurement]) -> str:
        """Keep the step mode that measured better, from steps run ``overlapped`` with the next
        forward and then ``deferred`` to it (medians), and say why. The mode that moves fewer disk
        bytes (deferred, usually: the forward uses the weights the update just wrote, where
        overlapped it may read them back) is kept unless the other ran :attr:`EARN` faster, as for
        activations; with the same bytes, the faster. Sets :attr:`overlap_step`,
        :attr:`defer_step` and the measured medians to the kept mode's."""
        seconds = [median([m.seconds for m in ms]) for ms in (overlapped, deferred)]
        moved = [median([m.disk_read + m.disk_written for m in ms]) for ms in (overlapped, deferred)]
        if abs(moved[0] - moved[1]) <= 0.01 * max(moved):
            defer = seconds[1] < seconds[0]
        else:
            fewer = int(moved[1] < moved[0])  # 1: deferred moves fewer bytes
            defer = bool(fewer) != (seconds[1 - fewer] <= seconds[fewer] * (1 - self.EARN))
        self.keep_measured(deferred if defer else overlapped)
        self.overlap_step, self.defer_step = not defer, defer
        gain = 1 - seconds[1] / seconds[0] if seconds[0] > 0 else 0.0
        mib = 1 << 20
        return (f"step {'deferred to' if defer else 'overlapped with'} the next forward, measured: {len(deferred)} "
                f"steps deferred ran {seconds[1]:.3f} s and moved {moved[1] / mib:.1f} MiB against {seconds[0]:.3f} s "
                f"and {moved[0] / mib:.1f} MiB overlapped ({abs(gain):.0%} {'faster' if gain >= 0 else 'slower'}; "
                f"the mode that moves more bytes must run {self.EARN:.0%} faster)")


def _steps_before(before: list[StepMeasurement]) -> str:
    """The steps of the modes a plan replaced, in words."""
    if len(before) == 1:
        return "the one step under the modes before"
    return f"the {len(before)} steps under the modes before, {len(before) - 1} of them measured again"


def median(xs: list):
    """The middle value of ``xs`` (the upper one of an even count), as the plan's checks take it."""
    return sorted(xs)[len(xs) // 2]


def _off(measured: float, predicted: float | None) -> float:
    """Relative difference of ``measured`` from ``predicted`` (0 when there is nothing to compare)."""
    if predicted is None or predicted <= 0:
        return 0.0 if not measured else 1.0
    return measured / predicted - 1.0


def make_plan(base: Plan, m: StepMeasurement, rates: DiskRates, room: list[int], keep_room: int,
              fixed: bool, copy_Bps: float = 4e9, disk_room: int | None = None,
              must_recompute: dict[int, str] | None = None) -> Plan:
    """Choose each block's activation mode from measurement ``m`` (see the module's cost model).

    Args:
        base: the plan so far (its blocks, prefetch depth, overlap and budget split carry over).
        room: per block, the most saved-activation bytes its backward can pin (0: must recompute).
        keep_room: bytes of activations the compute tier keeps for the blocks backward reaches first.
        fixed: the configuration chose the modes: only predict, with the modes as they are.
        copy_Bps: memory copy rate (saved activations are copied into the store).
        disk_room: free disk bytes the offloaded activations may take (None: unknown, no limit).
            A step's offloaded activations are on the disk together until its backward reads
            them back: blocks beyond the room are recomputed, a configured "offload" too.
        must_recompute: blocks whose graph cannot be kept, and why (a custom Function's ctx).
    """
    n = len(m.forward_seconds)
    # every forward of the iteration saves its own activations (several micro-batches: several)
    moved = [a * k for a, k in zip(m.graph_bytes, m.forwards or [1] * n)]

    # the iteration's compute without any recomputation or copying of saved activations, and its
    # disk traffic without offloaded activations
    def extra_compute(modes: list[str]) -> float:
        recompute = sum(f for f, mode in zip(m.forward_seconds, modes) if mode == "recompute")
        copies = sum(a for a, mode in zip(moved, modes) if mode != "recompute") / max(copy_Bps, 1.0)
        return recompute + copies
    base_compute = max(0.0, m.seconds - m.io_wait_seconds - extra_compute(m.modes))
    offloaded_now = sum(a for a, mode in zip(moved, m.modes) if mode == "offload")
    kept_now = sum(a for a, mode in zip(moved, m.modes) if mode == "keep")
    # where the measured iteration read state from the disk, kept activations push state out
    displacing = ("offload", "keep") if m.disk_read > offloaded_now + kept_now else ("offload",)
    now = offloaded_now + (kept_now if "keep" in displacing else 0)
    base_read = max(0, m.disk_read - now)
    base_written = max(0, m.disk_written - now)
    # how much of the I/O the measured iteration hid behind compute (what it did not wait for)
    io_measured = rates.seconds(m.disk_read, m.disk_written)
    hidden = 1.0 if io_measured <= 0 else min(1.0, max(0.0, 1.0 - m.io_wait_seconds / io_measured))

    def cost(modes: list[str]) -> tuple[float, float, float, int, int]:
        compute = base_compute + extra_compute(modes)
        extra = sum(a for a, mode in zip(moved, modes) if mode in displacing and rates.read_Bps > 0)
        read, written = base_read + extra, base_written + extra
        io = rates.seconds(read, written)
        return compute + (1.0 - hidden) * io, compute, io, read, written

    reasons = []
    too_big, no_disk = [], []
    on_disk = 0
    disk = math.inf if disk_room is None else max(0, disk_room)
    if fixed:
        modes = list(m.modes)  # as configured, less the blocks that fell back to recomputing
        for i in range(n):
            if modes[i] == "offload" and on_disk + moved[i] > disk:
                modes[i] = "recompute"
                no_disk.append(i)
            elif modes[i] == "offload":
                on_disk += moved[i]
    else:
        modes = ["recompute"] * n
        order = sorted(range(n), key=lambda i: -(m.forward_seconds[i] / max(1, moved[i])))
        best = cost(modes)[0]
        for i in order:
            if i in (must_recompute or {}):
                continue
            if m.graph_bytes[i] > room[i]:
                too_big.append(i)
                continue
            trial = modes.copy()
            trial[i] = "offload"
            t = cost(trial)[0]
            if t < best and on_disk + moved[i] > disk:
                no_disk.append(i)
            elif t < best:
                modes, best = trial, t
                on_disk += moved[i]
        kept = 0
        for i in reversed(range(n)):  # backward reaches the last blocks first
            if modes[i] == "offload" and kept + m.graph_bytes[i] <= keep_room:
                modes[i] = "keep"
                kept += m.graph_bytes[i]
            elif modes[i] == "offload":
                break
    if must_recompute and not fixed:
        reasons.append(f"recomputed because their graphs cannot be kept: {next(iter(must_recompute.values()))}"
                       + (f" (also {', '.join(base.blocks[i] for i in sorted(must_recompute)[1:])})"
                          if len(must_recompute) > 1 else ""))
    if too_big:
        worst = max(too_big, key=lambda i: m.graph_bytes[i] - room[i])
        reasons.append(f"recomputed because their activations exceed the room their backward has in the budget: "
                       f"{', '.join(base.blocks[i] for i in too_big)} (e.g. {m.graph_bytes[worst] / 2**20:.1f} MiB "
                       f"against {room[worst] / 2**20:.1f} MiB); a larger host_memory lets them be kept or offloaded")
    if no_disk:
        reasons.append(f"recomputed because the free disk takes {disk / 2**20:.1f} MiB of a step's offloaded "
                       f"activations (after what commits need), which the other offloaded blocks fill: "
                       f"{', '.join(base.blocks[i] for i in sorted(no_disk))}; free disk space or add storage "
                       f"directories to offload them")
    step, compute, io, read, written = cost(modes)
    return Plan(modes=modes, blocks=base.blocks, prefetch_depth=base.prefetch_depth, overlap_step=base.overlap_step,
                defer_step=base.defer_step, host_split=base.host_split, lower_tier=base.lower_tier, predicted_step_s=step,
                predicted_compute_s=compute, predicted_io_s=io,
                io_hidden=hidden, predicted_read=read, predicted_written=written, rates=rates,
                overridden=base.overridden, reasons=base.reasons + reasons, floors=base.floors,
                advised_memory=base.advised_memory)


def choose_activation_modes(recompute, activations, block_names: list[str], state_fits: bool) -> list[str] | None:
    """Per streamed block, what its forward does with what it saves (None: plain PyTorch, the
    graph and the block's weights kept until backward).

    Args:
        recompute: the engine's ``recompute=`` (True, False or ``"auto"``).
        activations: :attr:`EngineConfig.activations` (``"auto"``, one mode, or one per block).
        block_names: the streamed blocks.
        state_fits: whether the step runs as plain PyTorch in the compute tier (``Schedule.graph_fits``).
    """
    if recompute not in (True, False, "auto"):
        raise ConfigError(f"recompute must be True, False or 'auto', got {recompute!r}")
    n = len(block_names)
    if recompute is True:
        return ["recompute"] * n
    if recompute is False or state_fits:
        return None
    if isinstance(activations, str):
        return [("recompute" if activations == "auto" else activations)] * n  # "auto": the planner decides later
    if len(activations) != n:
        raise ConfigError(f"EngineConfig.activations has {len(activations)} entries; the model streams {n} blocks "
                          f"({', '.join(block_names)})")
    return list(activations)
