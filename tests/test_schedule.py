"""The schedule and the update pipeline, driven with numbers and names alone: no model, no store."""

import threading

import pytest

from offload_core.errors import DiskFullError, StepFailedError
from tiered_offload.engine.pipeline import UpdatePipeline
from tiered_offload.engine.schedule import Phase, Schedule, UnitLayout

KINDS = ("exp_avg", "exp_avg_sq")


def units(n_blocks=3, block=1000, rest=5000, frozen_rest=0, piece=1 << 22):
    blocks = [UnitLayout(name=f"block.{i}", is_block=True, numel=block, grad_numel=block, state_numel=block,
                         piece_numel=piece) for i in range(n_blocks)]
    trainable = rest - frozen_rest
    return [*blocks, UnitLayout(name="rest", numel=rest, grad_numel=trainable, state_numel=trainable, piece_numel=piece)]


def test_state_bytes_count_frozen_parameters_as_weights_only():
    s = Schedule(units(frozen_rest=2000), KINDS)
    assert s.state_bytes() == 3 * 1000 * 16 + 3000 * 16 + 2000 * 4


def test_keys_pieces_and_shapes():
    u = UnitLayout(name="rest", numel=10, grad_numel=8, state_numel=7, piece_numel=3)
    assert u.pieces() == [(0, 3), (3, 6), (6, 7)]
    assert u.piece_keys(KINDS, 1) == ["rest/state.exp_avg.1", "rest/state.exp_avg_sq.1"]
    assert u.shapes(KINDS) == {"rest/weight": 10, "rest/grad": 8, "rest/state.exp_avg.0": 3, "rest/state.exp_avg_sq.0": 3,
                               "rest/state.exp_avg.1": 3, "rest/state.exp_avg_sq.1": 3, "rest/state.exp_avg.2": 1,
                               "rest/state.exp_avg_sq.2": 1}
    one = UnitLayout(name="block.0", is_block=True, numel=5, grad_numel=5, state_numel=5, piece_numel=8)
    assert one.state_keys(KINDS) == ["block.0/state.exp_avg", "block.0/state.exp_avg_sq"]  # one piece: the plain key
    frozen = UnitLayout(name="block.1", is_block=True, numel=5)
    assert frozen.grad_key is None and frozen.state_keys(KINDS) == [] and frozen.shapes(KINDS) == {"block.1/weight": 5}


def test_access_sequence_phases_in_order_and_overlapped():
    s = Schedule(units(n_blocks=2), ("m",))
    plain = s.access_sequence([Phase.FORWARD, Phase.BACKWARD, Phase.STEP], overlap=False)
    # the cycle starts with the step, then the forward (rest bound first), backward in reverse
    assert plain[:3] == ["rest/weight", "rest/grad", "rest/state.m"]
    fwd = plain.index("block.1/state.m") + 1
    assert plain[fwd:fwd + 4] == ["rest/weight", "rest/grad", "block.0/weight", "block.1/weight"]
    assert plain[fwd + 4:] == ["block.1/weight", "block.1/grad", "block.0/weight", "block.0/grad"]
    overlapped = s.access_sequence([Phase.FORWARD, Phase.BACKWARD, Phase.STEP], overlap=True)
    # each unit's update is followed at once by the forward's use of it
    assert overlapped[:5] == ["rest/weight", "rest/grad", "rest/state.m", "rest/weight", "rest/grad"]
    assert overlapped[5:9] == ["block.0/weight", "block.0/grad", "block.0/state.m", "block.0/weight"]
    assert Phase("clip") is Phase.CLIP


def test_an_idle_unit_is_read_for_its_weights_alone():
    """A unit frozen whole mid-run (``idle``): the backward and the step leave its gradient and
    optimizer states alone, so the lookahead is told its weights alone, in both step modes."""
    s = Schedule(units(n_blocks=2), ("m",))
    for overlap in (False, True):
        seq = s.access_sequence([Phase.FORWARD, Phase.BACKWARD, Phase.STEP], overlap=overlap, idle=frozenset({"block.0"}))
        every = s.access_sequence([Phase.FORWARD, Phase.BACKWARD, Phase.STEP], overlap=overlap)
        others = lambda keys: [k for k in keys if not k.startswith("block.0/")]  # noqa: E731
        assert others(seq) == others(every) and "block.1/state.m" in seq
        assert [k for k in seq if k.startswith("block.0/")] == ["block.0/weight"] * 2  # the forward's, the backward's


def test_working_set_does_not_scale_with_the_largest_units_optimizer_state():
    # a vocabulary-sized rest (50M elements) and small blocks: the step streams its states in pieces
    s = Schedule(units(n_blocks=4, block=3_000_000, rest=50_000_000, piece=4 << 20), KINDS)
    ws = s.working_set()
    mib = 1 << 20
    assert ws.forward_backward == (2 * 50_000_000 + 3 * 3_000_000) * 4
    assert ws.optimizer == 2 * 50_000_000 * 4 + 2 * 16 * mib  # weights + gradients + one piece per state
    assert ws.slack == 16 * mib  # the larger of a block's weights and one state piece, not the largest unit
    assert ws.need < 0.5 * s.state_bytes()
    assert ws.largest_block == "block.0"


def test_overlap_needs_room_for_an_update_beside_the_forward():
    s = Schedule(units(n_blocks=20), KINDS)
    ws = s.working_set()
    assert not s.overlap_fits(s.state_bytes())  # everything fits: nothing to hide
    assert s.overlap_fits(ws.optimizer + ws.forward_backward + ws.slack)
    assert not s.overlap_fits(ws.optimizer + ws.forward_backward + ws.slack - 1)


def test_commit_window_keeps_extra_disk_within_a_quarter():
    s = Schedule(units(n_blocks=8, rest=1000), KINDS)
    # units (the rest too) of 12000 bytes of weights and states; a quarter of 144000 is 36000
    assert s.commit_window() == 36000 and s.rewrite_bytes(s.blocks[0]) == s.rewrite_bytes(s.rest) == 12000
    assert s.commit_admits([12000, 12000], 12000) and not s.commit_admits([12000, 12000, 12000], 12000)
    assert s.extra_disk_bytes("journal") <= 0.25 * s.state_bytes()
    assert s.extra_disk_bytes("none") == 0
    # a unit larger than a quarter of the state goes alone (the bound is then that unit)
    big = Schedule(units(n_blocks=1, rest=50_000), KINDS)
    assert big.commit_admits([], big.rewrite_bytes(big.rest))
    assert not big.commit_admits([big.rewrite_bytes(big.blocks[0])], big.rewrite_bytes(big.rest))
    assert big.extra_disk_bytes("journal") == big.rewrite_bytes(big.rest) > 0.25 * big.state_bytes()


def test_the_commit_window_counts_bytes_so_small_units_share_it_after_a_large_one():
    """One large unit among small ones (a GPT-2's tied embedding among its blocks): the large one goes
    alone, the small ones several at a time, and whatever order they come in, the bytes in flight
    never exceed extra_disk_bytes."""
    import random
    # rewrites (weights + 2 states, 4 bytes): the rest 360000, each block 12000; state 800000, a
    # quarter 200000: the rest alone, then up to 16 blocks at once (a count of units allowed one)
    s = Schedule(units(n_blocks=20, block=1000, rest=30_000), KINDS)
    assert s.state_bytes() == 800_000 and s.rewrite_bytes(s.rest) == 360_000 > s.commit_window() == 200_000
    assert s.commit_admits([12000] * 15, 12000) and not s.commit_admits([12000] * 16, 12000)
    assert not s.commit_admits([12000], 360_000)
    bound = s.extra_disk_bytes("journal")
    assert bound == 360_000
    rng = random.Random(0)
    for _ in range(200):  # units start when admitted and finish (are recorded) in any order
        todo = [s.rewrite_bytes(u) for u in s.units]
        rng.shuffle(todo)
        flight: list[int] = []
        while todo or flight:
            if todo and s.commit_admits(flight, todo[0]) and (not flight or rng.random() < 0.7):
                flight.append(todo.pop(0))
            else:
                flight.pop(rng.randrange(len(flight)))
            assert sum(flight) <= bound


def test_a_schedule_needs_one_rest_unit():
    with pytest.raises(ValueError, match="exactly one rest unit"):
        Schedule([UnitLayout(name="a", is_block=True, numel=1)], KINDS)


# ---- the update pipeline --------------------------------------------------------------------------
def test_inline_pipeline_updates_in_order_and_runs_deferred_work():
    done = []
    p = UpdatePipeline(lead=2)
    p.run(["rest", "block.0", "block.1"], done.append, background=False)
    assert done == ["rest", "block.0", "block.1"]
    p.after_update("block.0", lambda: done.append("zero block.0"))  # nothing in flight: runs now
    assert done[-1] == "zero block.0"


def test_background_pipeline_never_runs_more_than_lead_units_ahead_of_the_forward():
    lead, names = 1, [f"u{i}" for i in range(6)]
    started, forward_at, ahead = [], [-1], []
    lock = threading.Lock()

    def update(name):
        with lock:
            ahead.append(names.index(name) - forward_at[0])
            started.append(name)
    p = UpdatePipeline(lead=lead)
    p.run(names, update, background=True)
    for i in range(len(names)):
        p.wait(names[i]) if i > lead + 1 else None
        with lock:
            forward_at[0] = i
        p.forward_reached(i)
        p.wait(names[i])
    p.wait()
    assert started == names and max(ahead) <= lead + 1


def test_background_error_reaches_the_next_wait_and_deferred_work_still_runs():
    errors, zeroed = [], []
    gate = threading.Event()

    def update(name):
        gate.wait(10)
        if name == "u1":
            raise OSError("disk gone")
    p = UpdatePipeline(lead=10, on_error=errors.append)
    p.run(["u0", "u1", "u2"], update, background=True)
    p.after_update("u0", lambda: zeroed.append("u0"))  # still pending: deferred until u0 is updated
    assert zeroed == []
    gate.set()
    with pytest.raises(StepFailedError, match="update of u1: OSError: disk gone") as info:
        p.wait()
    assert isinstance(info.value.__cause__, OSError)
    assert zeroed == ["u0"] and len(errors) == 1
    with pytest.raises(StepFailedError, match="update of u1"):  # every later wait: u0 holds the new step, u1 the old
        p.wait("u2")
    assert p.failed
    p.settle()  # (a close: reported already, not raised again)


def test_a_deferred_pipeline_updates_on_the_waiting_thread_up_to_the_unit_it_needs():
    """Deferred: ``run`` returns at once; a wait for a unit runs the updates up to it on the
    waiting thread (the next forward, just before it needs the unit), the last one's ``then``
    after every unit; work queued for a unit runs right after its update."""
    done, threads = [], set()

    def update(name):
        threads.add(threading.get_ident())
        done.append(name)
        p.wait(name)  # an update waiting on its own step (re-entrant) returns at once
    flushed = []
    p = UpdatePipeline(lead=1, on_flush=lambda: flushed.append(len(done)))
    p.run(["rest", "block.0", "block.1"], update, background=False, deferred=True,
          then=lambda: done.append("commit"))
    assert done == []
    p.after_update("block.0", lambda: done.append("zero block.0"))
    p.wait("block.0")
    assert done == ["rest", "block.0", "zero block.0"]
    p.wait("rest")  # already updated: nothing runs
    p.wait()
    assert done == ["rest", "block.0", "zero block.0", "block.1", "commit"]
    assert threads == {threading.get_ident()}
    p.after_update("block.1", lambda: done.append("now"))  # nothing in flight: runs now
    assert done[-1] == "now"
    assert flushed == []  # the forward ran the first units: the order it declared holds
    p.run(["rest", "block.0"], update, background=False, deferred=True)
    p.wait()  # not the forward: the whole step runs here, told first (the lookahead's order changes)
    assert flushed == [len(done) - 2]


@pytest.mark.parametrize("error", [OSError("disk gone"), DiskFullError("disk gone")], ids=["untyped", "typed"])
def test_a_deferred_updates_error_reaches_the_wait_that_ran_it_and_no_step_follows(error):
    """The first report is the library's own error as it came (an error of PyTorch's or the
    optimizer's code: a StepFailedError naming the unit); from then on every wait, and so every
    later step, raises StepFailedError: the units hold a mix of two steps' weights."""
    errors = []

    def update(name):
        if name == "u1":
            raise error
    p = UpdatePipeline(lead=1, on_error=errors.append, how_to_go_on=lambda: "Resume it.")
    p.run(["u0", "u1", "u2"], update, background=False, deferred=True, then=lambda: errors.append("committed"))
    with pytest.raises(type(error) if isinstance(error, DiskFullError) else StepFailedError, match="disk gone"):
        p.wait("u2")
    assert errors == [error]  # no commit after a failed unit
    ran = []
    with pytest.raises(StepFailedError, match="update of u1: .*disk gone.*cannot train on.*Resume it.$"):
        p.run(["u0"], ran.append, background=False, deferred=True)
    assert ran == []


def test_defer_needs_room_for_an_update_beside_the_rest():
    s = Schedule(units(n_blocks=20), KINDS)
    ws = s.working_set()
    assert not s.defer_fits(s.state_bytes())  # everything fits: no disk traffic to save
    update = s.unit_bytes(s.blocks[0], "weight") + s.unit_bytes(s.blocks[0], "grad") + s.unit_bytes(s.blocks[0], "piece")
    need = max(ws.need, ws.rest_bytes + update + ws.slack)
    assert s.defer_budget() == need and s.defer_fits(need) and not s.defer_fits(need - 1)
    assert need < ws.optimizer + ws.forward_backward + ws.slack  # less than overlapping asks


def test_the_access_sequence_names_each_micro_batchs_activations():
    """forward_backward over 3 micro-batches: the forward of a block writes ``activations``,
    ``activations.1``, ``activations.2`` (the keys the streamer gives them), and its backward reads
    them in the same order: the lookahead knows when each is needed again (the backward), not at
    the next micro-batch's write of a different key."""
    s = Schedule(units(n_blocks=2), ("m",))
    seq = s.access_sequence([Phase.FORWARD, Phase.BACKWARD, Phase.STEP], overlap=True, activations=True, repeat=3)
    acts = [k for k in seq if k.startswith("block.1/activations")]
    assert acts == ["block.1/activations", "block.1/activations.1", "block.1/activations.2"] * 2
    backward = seq[seq.index("block.1/grad", seq.index("block.1/state.m")):]
    assert backward[:6] == ["block.1/grad", "block.1/activations", "block.1/weight", "block.1/grad",
                            "block.1/activations.1", "block.1/weight"]


def test_a_step_in_the_backward_is_declared_after_each_blocks_backward():
    """``fused`` (``backward(step=True)``): each block's update (its weights, gradients and optimizer
    states) right after its backward's keys (over every micro-batch), the rest's after the last
    block, and no step phase after."""
    s = Schedule(units(n_blocks=2), ("m",))
    seq = s.access_sequence([Phase.BACKWARD, Phase.FORWARD], overlap=False, fused=True, repeat=2)
    backward = ["block.1/weight", "block.1/grad"] * 2 + ["block.1/weight", "block.1/grad", "block.1/state.m"]
    backward += ["block.0/weight", "block.0/grad"] * 2 + ["block.0/weight", "block.0/grad", "block.0/state.m"]
    assert seq == backward + ["rest/weight", "rest/grad", "rest/state.m", "rest/weight", "rest/grad",
                              "block.0/weight", "block.0/weight", "block.1/weight", "block.1/weight"]
    assert s.access_sequence([Phase.FORWARD, Phase.BACKWARD, Phase.STEP], overlap=False, fused=True) == \
        s.access_sequence([Phase.FORWARD, Phase.BACKWARD], overlap=False, fused=True)


def test_a_step_in_the_backward_moves_what_memory_cannot_hold_of_the_weights_and_states_once_each_way():
    """``Schedule.floors_in_backward``: no gradient waits for the update, so the disk floor is the
    weights and states beyond memory (read), and of those the rewritten ones (written: a frozen
    unit's weights are read only), below :meth:`Schedule.floors`, which counts the gradients."""
    s = Schedule(units(n_blocks=3, block=1000, rest=5000, frozen_rest=5000), ("m", "v"))
    weights, states = (3 * 1000 + 5000) * 4, 2 * 3 * 1000 * 4
    got = s.floors_in_backward(10_000)
    assert got == {"disk_read": weights + states - 10_000, "disk_written": 3 * 1000 * 4 + states - 10_000, "link": None}
    plain = s.floors(10_000, 0, update_on_host=True, journal=False)
    assert got["disk_read"] <= plain["disk_read"] and got["disk_written"] < plain["disk_written"]
    assert s.floors_in_backward(10 ** 9) == {"disk_read": 0, "disk_written": 0, "link": None}
    # a device tier of 6,000 bytes under an update on the host holds weights only (it has room for
    # 6,000 of their 32,000 bytes): the host's 4,000 and those hold the rest; the link as the step's
    device = s.floors_in_backward(10_000, 6_000, update_on_host=True)
    assert device == {"disk_read": weights + states - 4_000 - 6_000, "disk_written": 3 * 1000 * 4 + states - 10_000,
                      "link": s.floors(10_000, 6_000, update_on_host=True, journal=False)["link"]}
    # a device tier larger than the weights: the room beyond them holds nothing of the states
    wide = s.floors_in_backward(40_000, 36_000, update_on_host=True)
    assert wide["disk_read"] == states - 4_000
    assert wide["disk_written"] == max(0, 3 * 1000 * 4 + states - 4_000 - weights)


def test_the_link_floor_is_a_floor_of_each_placement():
    """The device link per step: to an update on the host, every rewritten weight up once more
    plus what the device cannot keep between a block's forward and backward, and the gradients
    down; to an update on the device, what of the weights and states it cannot keep, both ways."""
    s = Schedule(units(n_blocks=4, block=1000, rest=1000), KINDS)
    w = g = 5 * 1000 * 4
    states = 2 * w
    assert s.floors(0, 10 ** 9, update_on_host=True, journal=False)["link"] == w + g  # all weights fit
    small = w // 2
    assert s.floors(0, small, update_on_host=True, journal=False)["link"] == w + (w + 4000 - small) + g
    assert s.floors(0, small, update_on_host=False, journal=False)["link"] == 2 * (w + states + 4000 - small)
    assert s.floors(0, 10 ** 9, update_on_host=False, journal=False)["link"] == 0
    assert s.floors(0, 0, update_on_host=True, journal=False)["link"] is None  # no device tier
    # the disk: an update on the host keeps no optimizer state on the device, which holds weights only
    device, host = w + states, states // 2
    assert s.floors(device + host, device, update_on_host=False, journal=False)["disk_read"] == 0
    assert s.floors(device + host, device, update_on_host=True, journal=False)["disk_read"] == states // 2


def test_the_disk_floor_counts_what_the_update_reads():
    """The update reads every weight, gradient and state of the units it updates; what memory did
    not hold when it began comes from the disk (the gradients are all there before the step
    begins), and each was written since the last update rewrote it or backward made it. A floor
    that counted weights and states only was 1/4 of the state too low."""
    s = Schedule(units(n_blocks=4, block=1000, rest=1000), KINDS)
    w = g = 5 * 1000 * 4
    states = 2 * w
    memory = w + states  # what the old floor called enough to read nothing
    f = s.floors(memory, 0, update_on_host=True, journal=False)
    assert f["disk_read"] == f["disk_written"] == g  # the gradients, or what they pushed out, went out and back
    assert s.floors(w, 0, update_on_host=True, journal=False)["disk_read"] == g + states
    assert s.floors(w + g + states, 0, update_on_host=True, journal=False)["disk_read"] == 0

class TwoTiers:
    """A store's budgets as :func:`~tiered_offload.engine.preflight.optimizer_tier` sees them."""

    def __init__(self, device, host):
        from tiered_offload.store.tiers import Tier
        self.compute_tier = Tier.DEVICE
        self.caps = {Tier.DEVICE: device, Tier.HOST: host}

    def capacity(self, tier):
        return self.caps[tier]

    def link_rate(self):
        return 1e10


def test_auto_places_the_update_by_measured_rates():
    """``optimizer_device="auto"``: the device when the state fits it or the host cannot hold a
    unit's update; otherwise the placement whose update and link traffic take less time at the
    measured rates, and the reason says which numbers decided."""
    from offload_core.errors import TierCapacityError
    from tiered_offload.engine.preflight import UpdateRates, optimizer_tier
    from tiered_offload.store.tiers import Tier
    Store = TwoTiers
    s = Schedule(units(n_blocks=4, block=1000, rest=1000), KINDS)
    state = s.state_bytes()
    slow_cpu = UpdateRates(host_Bps=1e6, device_Bps=1e12, link_Bps=1e10)  # a GPU box with a weak CPU
    slow_link = UpdateRates(host_Bps=1e10, device_Bps=1e12, link_Bps=1e6)
    short = Store(state // 4, state)
    where, why = optimizer_tier("auto", short, s, measure=lambda link: slow_cpu)
    assert where == Tier.DEVICE and "measured" in why and "on the device" in why
    assert optimizer_tier("auto", short, s, measure=lambda link: slow_link)[0] == Tier.HOST
    assert optimizer_tier("host", short, s, measure=lambda link: slow_cpu)[0] == Tier.HOST  # told: no probe decides
    assert optimizer_tier("auto", Store(2 * state, state), s, measure=lambda link: slow_link) == (
        Tier.DEVICE, "the whole state fits the device tier")
    assert optimizer_tier("auto", Store(state // 4, 10), s, measure=lambda link: slow_link)[0] == Tier.DEVICE
    with pytest.raises(TierCapacityError):
        optimizer_tier("host", Store(state // 4, 10), s)

    # a resumed run keeps the placement its state was trained with; the choice is recorded
    class Record:
        update_tier = "host"
    record = Record()
    where, why = optimizer_tier("auto", short, s, record, measure=lambda link: slow_cpu)
    assert where == Tier.HOST and "resumes" in why
    assert optimizer_tier("device", short, s, record)[0] == Tier.DEVICE and record.update_tier == "device"
    record.update_tier = None
    assert optimizer_tier("auto", short, s, record, measure=lambda link: slow_link)[0] == Tier.HOST
    assert record.update_tier == "host"
    # sharded: the host only where every rank chose it
    nobody = lambda flag, what: False  # noqa: E731
    assert optimizer_tier("auto", short, s, measure=lambda link: slow_link, agree=nobody)[0] == Tier.DEVICE

    def broken(link_Bps):
        raise RuntimeError("this optimizer needs a closure")
    where, why = optimizer_tier("auto", short, s, measure=broken)
    assert where == Tier.HOST and "could not be measured: this optimizer needs a closure" in why


def test_auto_weighs_the_disk_where_its_bench_io_profile_gives_its_rates():
    """A device tier larger than the weights keeps optimizer states off the disk under an update on
    the device, only weights under one on the host. Where the disk's rates are known (its bench-io
    profile), ``"auto"`` weighs the disk's floors too: a slow disk moves to the device an update the
    link alone put on the host. A fast disk leaves it there, and so do journal commits (the step
    never runs in the backward, the one mode whose floors differ here), and so does a device tier
    without room for the step in the backward."""
    from tiered_offload.engine.planner import DiskRates
    from tiered_offload.engine.preflight import UpdateRates, optimizer_tier
    from tiered_offload.store.tiers import Tier
    s = Schedule(units(n_blocks=4, block=1000, rest=1000), KINDS)
    state = s.state_bytes()
    store = TwoTiers(state // 2, state // 4)
    host_f = s.floors_in_backward(3 * state // 4, state // 2, update_on_host=True)
    device_f = s.floors_in_backward(3 * state // 4, state // 2, update_on_host=False)
    assert host_f["disk_read"] == state // 4 and device_f["disk_read"] == 0  # the device's room holds states
    assert host_f["link"] < device_f["link"]  # the link alone: the host

    def rates(disk_Bps=None, journal=False):
        disk = DiskRates(disk_Bps, disk_Bps, "bench-io profile p.json") if disk_Bps else None
        return lambda link: UpdateRates(host_Bps=1e9, device_Bps=1e9, link_Bps=1e6, disk=disk, journal=journal)
    where, why = optimizer_tier("auto", store, s, measure=rates())
    assert where == Tier.HOST and "the disk not weighed: no bench-io profile" in why
    where, why = optimizer_tier("auto", store, s, measure=rates(1e6))
    assert where == Tier.DEVICE and "disk 0.00 / 0.00 GB/s" in why
    t = rates(1e6)(None).seconds(s, state // 4, state // 2)
    assert t["host"] - t["device"] == pytest.approx((host_f["link"] - device_f["link"]) / 1e6 + state / 2 / 1e6)
    assert optimizer_tier("auto", store, s, measure=rates(1e12))[0] == Tier.HOST
    assert optimizer_tier("auto", store, s, measure=rates(1e6, journal=True))[0] == Tier.HOST
    # an update on the device with no room beside the backward's pins steps after the backward
    # (StepInBackward.short_of_room), where the two placements' disk floors are the same
    assert s.defer_budget() <= state // 2
    s.defer_budget = lambda: state // 2 + 1
    assert optimizer_tier("auto", store, s, measure=rates(1e6))[0] == Tier.HOST


def test_a_sharded_step_runs_as_plain_pytorch_only_where_the_gathered_buffers_fit_beside_the_share():
    """Where the state fits, the blocks keep their graphs, weights and gradients from forward to
    backward (plain PyTorch). On one process those are the state; sharded, they are every unit's
    gathered weights and gradients beside the rank's share: a sharded MoE run at 1.1x its state
    per rank was accepted, then died in its first forward ("cannot fit tensor 'block.3/weight.full'")."""
    one, two = Schedule(units(), KINDS), Schedule(units(), KINDS, world=2)
    state = one.resident_bytes()
    assert one.graph_fits(state) and not one.graph_fits(state - 1)
    assert two.fits(state) and not two.graph_fits(state)
    gathered = sum(two.unit_bytes(u, "weight") + two.unit_bytes(u, "grad") for u in two.units)
    need = state // 2 + gathered + two.working_set().slack  # (the share: half of each tensor, every one even)
    assert two.graph_fits(need) and not two.graph_fits(need - 1)
