import logging
import os

import pytest
import torch

logging.getLogger("storage_backends").setLevel(logging.ERROR)

# Parity tests compare the engine with plain PyTorch on the same device. Most build their reference
# on the CPU, so the engine's device="auto" means the CPU in the suite, on a GPU machine too; the
# tests parametrized over DEVICES run both sides on each device there is (CUDA included).
os.environ.setdefault("TIERED_OFFLOAD_DEVICE", "cpu")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for the CUDA parity tests
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# One intra-op thread in the suite's process: its models are small, so a second thread mostly waits
# on the first, and takes the core the store's I/O threads and the forked workers need (the suite
# ran 10-15% faster on 2 cores). Both sides of a parity test run on the same setting; the parity
# over several intra-op threads is `test_finetune.py::test_parity_with_several_intra_op_threads`.
SUITE_THREADS = 1
torch.set_num_threads(SUITE_THREADS)


@pytest.fixture(scope="session")
def zygote():
    """One zygote for the suite's workers (tools/zygote.py; a fresh interpreter takes 3-6 s to
    import torch and the library, a fork of this 0.1 s): the crash loops' and the ranks', in the
    crash loop's worker environment (read when the zygote starts, as a worker's would be)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    from crash_loop import WORKER_ENV
    from zygote import Zygote
    with Zygote(env=WORKER_ENV) as z:
        yield z


@pytest.fixture
def deterministic():
    """Deterministic kernels (CUDA's atomics-based backward kernels are not), restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def tmpfs_dir():
    """A directory on tmpfs (no O_DIRECT there), or skip where the machine has none."""
    base = "/dev/shm"
    if not os.path.isdir(base) or not os.access(base, os.W_OK):
        pytest.skip("no writable /dev/shm tmpfs on this machine")
    import shutil
    import tempfile
    d = tempfile.mkdtemp(dir=base, prefix="tiered-offload-test-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
