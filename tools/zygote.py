"""A process that imports torch and the library once and forks a fresh worker process per launch.

A fresh interpreter spends about 6 s here before a worker trains anything: 3 s importing torch
and the library, and 2.7 s more the first time an optimizer is built (``torch.optim`` imports
``torch._dynamo`` then). The crash loop and the distributed tests start dozens of workers; a fork
of a zygote that did all that once starts its worker in about 0.1 s.

Each worker is still its own process: its own pid to SIGKILL, its own stdout and stderr pipes,
its exit status reported by the zygote (its parent) as ``Popen.returncode`` reports it (-9:
killed). It runs its script as ``python script args...`` would (``__main__``, ``sys.argv``, the
script's directory first on ``sys.path``, the environment given), and ends as an interpreter
does: non-daemon threads joined, ``atexit`` hooks run, an uncaught exception printed to its
stderr with exit status 1, ``sys.exit(n)`` exiting ``n``.

    with Zygote(env={"OMP_NUM_THREADS": "1"}) as z:
        proc = z.launch("tools/crash_loop.py", ["--worker", ...], env={"RANK": "1"})
        out, err = proc.communicate(timeout=60)

What a worker inherits from the zygote besides the imports: the environment the zygote started
with (variables read at import, such as ``OMP_NUM_THREADS`` and ``PYTHONHASHSEED``, belong there),
and the state of the modules it imported (the global RNG is seeded by each worker that needs it).
The zygote never initialises CUDA (it refuses to start if an import did), so a worker can use the
GPU as a fresh process does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve()


class Zygote:
    """The driver's handle on a zygote process (see the module's docstring).

    Protocol (a ``SOCK_SEQPACKET`` pair, one message each): the zygote says ``{"ready": true}``
    once it has imported what the workers use; the driver sends a launch as JSON (script,
    arguments, environment) with the write ends of the worker's pipes; the zygote answers
    ``{"pid": n}`` and, when the worker has ended, ``{"exit": n, "code": c}``.
    """

    def __init__(self, env: dict[str, str] | None = None, ready_timeout: float = 300):
        self.env = dict(env or {})
        """What the zygote's environment sets over this process's (its workers inherit it)."""
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # torch.cuda.is_available() asks NVML, not the CUDA driver: a fork of a process that
        # initialised the driver could not use the GPU (the workers may; the zygote never does)
        self.proc = subprocess.Popen([sys.executable, str(HERE), str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     env=dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="1", **(env or {})))
        theirs.close()
        self._cond = threading.Condition()
        self._codes: dict[int, int] = {}
        self._pids: list[int] = []
        self._closed = self._ready = False
        self._launching = threading.Lock()  # one launch at a time: the n-th pid answers the n-th request
        threading.Thread(target=self._listen, daemon=True).start()
        with self._cond:  # its imports are not a worker's start-up (a caller may time that)
            self._cond.wait_for(lambda: self._ready or self._closed, timeout=ready_timeout)
        if not self._ready:
            gone = self._closed
            self.close()
            raise RuntimeError(f"the zygote exited (code {self.proc.poll()}) before it was ready: its error is above"
                               if gone else f"the zygote did not get ready in {ready_timeout:.0f} s")

    def _listen(self) -> None:
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            with self._cond:
                if not data:  # the zygote is gone: every worker it had ended with it or was killed
                    self._closed = True
                    self._cond.notify_all()
                    return
                msg = json.loads(data)
                if "ready" in msg:
                    self._ready = True
                elif "pid" in msg:
                    self._pids.append(msg["pid"])
                else:
                    self._codes[msg["exit"]] = msg["code"]
                self._cond.notify_all()

    def launch(self, script: str | Path, args: list[str], env: dict[str, str] | None = None, *,
               stderr_to_stdout: bool = False) -> "Forked":
        """Fork a worker running ``script`` with ``args`` (and ``env`` over the zygote's
        environment); ``stderr_to_stdout``: one stream for both, as ``stderr=subprocess.STDOUT``."""
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if stderr_to_stdout else os.pipe()
        request = json.dumps({"script": str(Path(script).resolve()), "args": [str(a) for a in args],
                              "env": env or {}}).encode()
        try:
            with self._launching, self._cond:
                n = len(self._pids)
                socket.send_fds(self._sock, [request], [out_w, err_w])
                self._cond.wait_for(lambda: len(self._pids) > n or self._closed, timeout=60)
                if len(self._pids) <= n:
                    raise RuntimeError(f"the zygote forked no worker (exit {self.proc.poll()})")
                pid = self._pids[n]
        finally:
            os.close(out_w)
            if err_r is not None:
                os.close(err_w)
        return Forked(self, pid, open(out_r, encoding="utf-8"),
                      None if err_r is None else open(err_r, encoding="utf-8"))

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` s for the worker ``pid`` to end; its exit status (None: still running)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or self._closed, timeout=timeout)
            return self._codes.get(pid, -signal.SIGKILL if self._closed else None)

    def close(self) -> None:
        """End the zygote (workers still running go on; their statuses are no longer reported)."""
        # shutdown, not only close: the listening thread's recv holds the socket open (it would not
        # end, nor would the zygote see the end of its socket and exit)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Forked:
    """A worker forked by a zygote, with what callers use of ``subprocess.Popen``: ``pid``,
    ``stdout``, ``stderr`` (text streams), ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``kill``, ``communicate``."""

    def __init__(self, zygote: Zygote, pid: int, stdout, stderr):
        self._zygote, self.pid, self.stdout, self.stderr = zygote, pid, stdout, stderr
        self.returncode: int | None = None
        self._readers: list[threading.Thread] = []
        self._read: dict[str, str] = {}

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid the zygote has reaped (the kernel may reuse it)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended and was reaped just now: as Popen.send_signal
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for the worker to exit; its whole stdout and stderr (None when merged into stdout)."""
        if not self._readers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    self._readers.append(threading.Thread(
                        target=lambda n=name, s=stream: self._read.__setitem__(n, s.read()), daemon=True))
                    self._readers[-1].start()
        self.wait(timeout)
        for t in self._readers:
            t.join(timeout=30)
        return self._read.get("stdout", ""), None if self.stderr is None else self._read.get("stderr", "")


def _warm_up() -> None:
    """Import what the workers use, and build an optimizer once (its first construction imports
    ``torch._dynamo``)."""
    import numpy  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401

    import tiered_offload  # noqa: F401
    import tiered_offload_examples.models  # noqa: F401

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))])
    if torch.cuda.is_initialized():  # a fork of a process that initialised CUDA cannot use it
        raise RuntimeError("CUDA was initialised in the zygote: its workers could not use the GPU")


def _run_worker(request: dict, fds: list[int]) -> None:
    """In the fork: become the worker (its pipes, argv, environment, ``__main__``) and exit as an
    interpreter exits."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in set(fds):
            os.close(f)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
        os.environ.update(request["env"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = str(Path(request["script"]).parent)
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:  # as an interpreter's exit: join the threads, run the exit hooks, flush
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(fd: int) -> None:
    """The zygote: import, then fork a worker per message until the driver closes its end."""
    _warm_up()
    sock = socket.socket(fileno=fd)
    send = threading.Lock()
    running = threading.Semaphore(0)

    def reap() -> None:
        while True:
            running.acquire()  # a worker is running: wait for one to end
            pid, status = os.waitpid(-1, 0)
            with send:
                try:
                    sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    return

    threading.Thread(target=reap, daemon=True).start()
    sock.send(b'{"ready": true}')
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 2)
        if not msg:
            return  # the driver is done (or gone)
        with send:  # not while the reaper sends: the fork must not inherit a lock it holds
            pid = os.fork()
        if pid == 0:
            sock.close()
            _run_worker(json.loads(msg), fds)
        for f in set(fds):
            os.close(f)
        with send:
            sock.send(json.dumps({"pid": pid}).encode())
        running.release()


if __name__ == "__main__":
    main(int(sys.argv[1]))
