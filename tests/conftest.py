import logging
import os

import pytest

logging.getLogger("storage_backends").setLevel(logging.ERROR)


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
