"""tools/zygote.py, which the crash loop and the distributed tests start their workers from: a
worker must end, and be seen to end, as the interpreter it stands in for would. The workers fork
from the suite's zygote (conftest.py), which the other tests' workers share."""

import signal
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    import torch
    mode = sys.argv[1]
    print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_TEST"), "path0", os.path.basename(sys.path[0]),
          "main", __name__, flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    # a non-daemon thread: the interpreter joins it before it exits
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
    if mode == "raise":
        raise ValueError("the worker's own error")
    if mode == "exit":
        sys.exit(7)
    if mode == "message":
        sys.exit("a message instead of a code")
    if mode == "hang":
        print("hanging", flush=True)
        time.sleep(600)
    print("torch", torch.ones(2).sum().item(), file=sys.stderr, flush=True)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(SCRIPT)
    return path


def test_a_worker_runs_its_script_as_main_with_its_argv_environment_and_path(zygote, script):
    proc = zygote.launch(script, ["ok", "x"], {"ZYGOTE_TEST": "set"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"argv ['ok', 'x'] env set path0 {script.parent.name} main __main__" in out
    assert "thread joined" in out and out.index("thread joined") < out.index("atexit ran")
    assert err.strip() == "torch 2.0"


@pytest.mark.parametrize("mode, code, in_err", [("raise", 1, "ValueError: the worker's own error"), ("exit", 7, ""),
                                                ("message", 1, "a message instead of a code")])
def test_a_worker_exits_with_the_status_an_interpreter_would(zygote, script, mode, code, in_err):
    proc = zygote.launch(script, [mode])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert in_err in err
    assert "thread joined" in out and "atexit ran" in out  # the exit hooks ran, as on a normal exit


def test_a_killed_worker_reports_minus_nine_and_others_run_on(zygote, script):
    hung = zygote.launch(script, ["hang"])
    assert hung.stdout.readline().startswith("argv")
    assert hung.stdout.readline() == "hanging\n"
    assert hung.poll() is None
    other = zygote.launch(script, ["ok"], stderr_to_stdout=True)  # one stream for both
    out, err = other.communicate(timeout=60)
    assert other.returncode == 0 and err is None and "torch 2.0" in out
    hung.send_signal(signal.SIGKILL)
    assert hung.wait(timeout=30) == -signal.SIGKILL
    hung.kill()  # a reaped worker is not signalled again (its pid may be someone else's by now)
