"""forward_backward's random numbers: how far a forward moves each generator, counted and replayed
(``tiered_offload/engine/rng_script.py``), without a model."""

import pytest
import torch
import torch.nn.functional as F

from tiered_offload.engine.rng_script import Expected, Recorder, RngScript, RngScripts, Streams, _cpu_advance, \
    _cpu_distance, _cuda_advance, _cuda_distance, signature


@pytest.mark.parametrize("draw", [
    lambda: F.dropout(torch.ones(3, 7), 0.1, training=True),
    lambda: F.dropout(torch.ones(700, 300), 0.5, training=True),  # hundreds of blocks of 624 words
    lambda: torch.rand([]),
    lambda: torch.randint(0, 10, (1000,)),
    lambda: F.scaled_dot_product_attention(*[torch.ones(1, 2, 5, 8)] * 3, dropout_p=0.1),
    lambda: None,
], ids=["dropout", "large-dropout", "rand", "randint", "attention-dropout", "nothing"])
def test_a_cpu_draw_is_counted_and_replayed_from_another_state(draw):
    """The count of 32-bit draws from one state to another, and the same count of draws from a
    different starting state lands where that draw would have left it."""
    torch.manual_seed(3)
    torch.rand(100)  # somewhere inside a block of 624 words
    a = torch.get_rng_state()
    draw()
    n = _cpu_distance(a, torch.get_rng_state())
    assert n is not None and torch.equal(_cpu_advance(a, n), torch.get_rng_state())
    torch.manual_seed(4)  # elsewhere: the draw moves the generator as far
    b = torch.get_rng_state()
    draw()
    assert torch.equal(_cpu_advance(b, n), torch.get_rng_state())


def test_a_cached_normal_sample_is_not_counted():
    """randn caches a sample in the CPU state; draws of uniform numbers never reach it: no count,
    so no script (the loop runs)."""
    a = torch.get_rng_state()
    torch.randn(3)
    assert _cpu_distance(a, torch.get_rng_state()) is None
    assert _cpu_distance(a, torch.zeros(16, dtype=torch.uint8)) is None  # not a CPU state


def test_philox_offsets_add():
    """A CUDA state is a seed and an offset (16 bytes): the advance is the offsets' difference,
    nothing for another seed or a state that went back."""
    def state(seed, offset):
        return torch.tensor(list(seed.to_bytes(8, "little") + offset.to_bytes(8, "little")), dtype=torch.uint8)
    a, b = state(7, 12), state(7, 40)
    assert _cuda_distance(a, b) == 28 and torch.equal(_cuda_advance(a, 28), b)
    assert _cuda_distance(b, a) is None and _cuda_distance(a, state(8, 40)) is None
    assert _cuda_distance(a, torch.zeros(5056, dtype=torch.uint8)) is None


def _run(recorder, shapes, draw_in_backward=False):
    """A loop of micro-batches with two "blocks" and a loss, each drawing by its shape; returns
    the state where each micro-batch starts."""
    starts = []
    for shape in shapes:
        starts.append(recorder.streams.get())
        recorder.mark("start")
        for _ in range(2):
            F.dropout(torch.ones(shape), 0.1, training=True)
        torch.rand(shape)  # the last block, head and loss
        recorder.mark("loss")
        if draw_in_backward:
            torch.rand(1)
        recorder.mark("end")
    return starts + [recorder.streams.get()]


def test_the_script_predicts_where_each_micro_batch_of_another_loop_starts():
    """Learned from one loop, the script gives where each micro-batch of the next loop (from another
    start) starts drawing, micro-batches of different shapes included."""
    streams = Streams(torch.device("cpu"))
    torch.manual_seed(0)
    shapes = [(4, 5), (4, 5), (2, 3)]
    recorder = Recorder(streams)
    _run(recorder, shapes)
    script = recorder.script()
    assert script is not None and script.draws and len(script.advances) == 3
    torch.manual_seed(1)
    expected = Expected(script, streams.get())
    actual = _run(Recorder(streams), shapes)
    assert all(streams.equal(expected.start(k), actual[k]) for k in range(3))
    assert expected.start(3) is None  # past the script
    assert Recorder(streams).script() is None  # nothing recorded


def test_no_script_where_a_backward_draws_or_something_draws_between_micro_batches():
    """A draw in a backward (not replayed by a recompute) or between two micro-batches gives no
    script; without a script every micro-batch starts where the pass started."""
    streams = Streams(torch.device("cpu"))
    recorder = Recorder(streams)
    _run(recorder, [(2, 2)] * 2, draw_in_backward=True)
    assert recorder.script() is None
    recorder = Recorder(streams)
    _run(recorder, [(2, 2)])
    torch.rand(1)
    _run(recorder, [(2, 2)])
    assert recorder.script() is None
    start = streams.get()
    assert streams.equal(Expected(None, start).start(5), start)


def test_a_script_is_kept_per_shape_of_micro_batches_the_most_recent_few():
    """The signature of micro-batches is their tensors' shapes and dtypes and their plain values,
    not the tensors' values; the scripts are kept for the most recently used signatures."""
    a = [{"input_ids": torch.zeros(2, 9, dtype=torch.long), "use_cache": False}] * 3
    assert signature(a) == signature([{"input_ids": torch.ones(2, 9, dtype=torch.long), "use_cache": False}] * 3)
    assert signature(a) != signature([{"input_ids": torch.zeros(2, 7, dtype=torch.long), "use_cache": False}] * 3)
    assert signature(a) != signature([{"input_ids": torch.zeros(2, 9, dtype=torch.long), "use_cache": True}] * 3)
    assert signature(a) != signature(a[:2])
    scripts = RngScripts(limit=2)
    one, two, three = (RngScript(Streams(torch.device("cpu")), [(n,)]) for n in (1, 2, 3))
    scripts.put("a", one)
    scripts.put("b", two)
    assert scripts.get("a") is one  # used: "b" is now the oldest
    scripts.put("c", three)
    assert scripts.get("b") is None and scripts.get("a") is one and scripts.get("c") is three
    scripts.put("a", None)
    assert scripts.get("a") is None


def test_a_generator_reseeded_in_between_is_not_counted_for_long():
    """A forward that reseeds the generator: another seed is seen at once; the same seed again
    (the generator back at its start) is given up after the time allowed, not stepped through the
    generator's period."""
    import time
    torch.manual_seed(7)
    torch.rand(10)
    a = torch.get_rng_state()
    torch.manual_seed(8)
    assert _cpu_distance(a, torch.get_rng_state()) is None
    torch.manual_seed(7)
    t0 = time.perf_counter()
    assert _cpu_distance(a, torch.get_rng_state(), seconds=0.2) is None
    assert time.perf_counter() - t0 < 2.0


def test_a_refused_signature_runs_the_loop_for_the_next_calls_then_tries_again():
    scripts = RngScripts()
    scripts.put("a", RngScript(Streams(torch.device("cpu")), [(1,)]))
    scripts.refuse("a")
    assert scripts.get("a") is None  # its script, if any, forgotten
    assert [scripts.refused("a") for _ in range(RngScripts.REFUSE_CALLS + 2)] == [True] * RngScripts.REFUSE_CALLS + [False] * 2
    assert not scripts.refused("b")


def test_a_float_in_the_micro_batches_does_not_make_each_call_a_new_shape():
    a = [{"x": torch.zeros(2), "temperature": 0.5}]
    assert signature(a) == signature([{"x": torch.zeros(2), "temperature": 0.7}])
