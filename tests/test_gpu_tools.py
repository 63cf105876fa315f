"""The GPU check's step benchmark runs on the CPU: a lent GPU's minutes must not find it broken.

``tools/bench_gpu_step.py`` is what the GPU check times (``tools/gpu_check.py``); a tiny model on
the CPU exercises the same code: the engine's steps through ``forward_backward``, the traced step
set apart, the steady state against the plan's floors and bench-io's rates, and ``--summarize``
on the saved report.
"""

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_gpu_step  # noqa: E402 (tools/)

BENCH_IO = {"recommended": {"backend": "posix", "read_GBps": 2.0, "write_GBps": 2.5}}


def test_the_step_benchmark_sets_the_traced_step_apart_and_measures_against_the_floors(tmp_path, capsys):
    bench_io, out = tmp_path / "bench_io.json", tmp_path / "step.json"
    bench_io.write_text(json.dumps(BENCH_IO))
    args = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "512", "--context", "32", "--device", "cpu",
            "--steps", "3", "--warmup", "1", "--plain-steps", "2", "--host-memory", "1500KiB", "--micro-batches", "2",
            "--bench-io", str(bench_io), "--storage", str(tmp_path / "state"), "--json", str(out)]
    assert bench_gpu_step.main(args) == 0
    report = json.loads(out.read_text())
    engine, against = report["engine"], report["against_floors"]
    assert len(engine["steps"]) == 3 and "traced_step" in engine  # the traced step is not a timed one
    assert all(step["loops"] == {} for step in engine["steps"])  # forward_backward ran passes, not the loop
    # each step's activation modes as its forward ran them, by count: every block recomputed until planned
    counts = [step["activations"] for step in engine["steps"]]
    assert set(counts[0]) == {"recompute"} and all(sum(c.values()) == counts[0]["recompute"] for c in counts), counts
    # the disk bytes by kind per step: the optimizer states read back (a step may find them all in
    # memory, as the lookahead left them: CI once, with the compute tier's prefetch window)
    assert any(step["disk_read_by_kind"].get("state", 0) > 0 for step in engine["steps"][1:]), engine["steps"]
    floors = engine["floors"]
    floor_s = floors["disk_read"] / 2.0e9 + floors["disk_written"] / 2.5e9
    assert against["steady_steps"] == "2-3"
    assert against["disk_floor_s"] == pytest.approx(floor_s)
    assert against["step_over_disk_floor"] == pytest.approx(against["step_s"] / floor_s)
    assert against["disk_over_floor"] >= 1.0  # no step moves less than its floor
    # the writes no read used before the next one replaced them: a part of the writes
    assert all(0 <= step["disk_written_unread"] <= step["disk_written"] for step in engine["steps"])
    assert 0 <= against["unread_write_share"] <= 1
    printed = capsys.readouterr().out.strip().splitlines()[-1]

    # --summarize reads the saved report and says the same
    assert bench_gpu_step.main(["--summarize", str(out), "--warmup", "1", "--bench-io", str(bench_io)]) == 0
    assert capsys.readouterr().out.strip() == printed

    # a report from before the traced step was set apart timed it last: it is left out
    old = copy.deepcopy(report)
    old["engine"]["steps"].append(dict(engine["traced_step"], s=100.0))
    del old["engine"]["traced_step"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    for step in old["engine"]["steps"]:  # (nor did it count the writes no read used)
        del step["disk_written_unread"]
    again = bench_gpu_step.against_floors(old["engine"], 1, BENCH_IO)
    assert again["steady_steps"] == "2-3" and again["step_s"] == pytest.approx(against["step_s"])
    assert "unread_write_share" not in again


def test_the_gpu_check_given_a_relative_directory_hands_its_commands_absolute_paths(tmp_path, monkeypatch):
    """The check's commands run in the repository's root, so an output directory given relative to
    another directory named a place that did not exist for them: bench-io refused to write its
    report there, and the check's disk-rate section failed in 2.5 s (a CPU smoke run,
    2026-12-07: ``python tools/gpu_check.py gq --quick`` from another directory)."""
    import gpu_check  # (tools/)
    ran = []
    monkeypatch.setattr(gpu_check.Check, "run", lambda self, cmd, limit, env=None: (ran.append(cmd), (0, ""))[1])
    monkeypatch.chdir(tmp_path)
    others = "env,pinned,tests,step_time,tiers,suite"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "out", "--quick", "--skip", others])
    gpu_check.main()
    [cmd] = ran
    named = [cmd[i + 1] for i, a in enumerate(cmd) if a in ("--json", "--save-profile")]
    assert named == [str(tmp_path / "out" / "bench_io.json"), str(tmp_path / "out" / "io-profile.json")]
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["sections"]["bench_io"]["exit"] == 0
