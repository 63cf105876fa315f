"""Every built-in backend runs the shared conformance suite; plus backend-specific behaviour."""

import errno
import os
import re
from pathlib import Path

import pytest
import torch

import storage_backends
from offload_core.errors import (
    BackendUnavailableError,
    ConfigError,
    DirectIOUnsupportedError,
    DiskFullError,
    ShortReadError,
    StorageDirectoryError,
    UnknownBackendError,
)
from storage_backends import open_backend, parse_spec, register_backend
from storage_backends.aiofiles_backend import AiofilesBackend
from storage_backends.kvikio_backend import KvikioBackend, kvikio_status
from storage_backends.memory import MemoryBackend
from storage_backends.posix import PosixBackend
from storage_backends.testing import BackendConformanceTests, FaultInjectingBackend
from storage_backends.zarr_backend import ZarrBackend


class TestPosix(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return PosixBackend(tmp_path / "store", chunk_bytes="1MiB", threads=4)

    def test_uses_direct_io_on_a_local_disk(self, backend):
        assert backend.supports_direct_io, backend.direct_reason


class TestPosixStriped(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return PosixBackend([tmp_path / "nvme0", tmp_path / "nvme1", tmp_path / "nvme2"],
                            stripe_bytes="64KiB", chunk_bytes="256KiB", threads=4)

    def test_bytes_are_spread_over_every_directory(self, backend, tmp_path):
        backend.write_from("k", torch.zeros(1 << 20, dtype=torch.uint8)).get()
        sizes = [os.path.getsize(tmp_path / d / "k") for d in ("nvme0", "nvme1", "nvme2")]
        assert sum(sizes) == 1 << 20
        assert max(sizes) - min(sizes) <= 64 << 10


class TestPosixWeightedStripes(BackendConformanceTests):
    """Drives of unequal speed: a faster drive takes more of each tensor's stripes
    (``stripe_weights``), so the set runs at the sum of their rates, not ``n`` x the slowest."""

    large_bytes = 64 << 20

    def make_backend(self, tmp_path):
        return PosixBackend([tmp_path / "nvme0", tmp_path / "sata", tmp_path / "nvme1"], stripe_weights=[3, 1, 2],
                            stripe_bytes="64KiB", chunk_bytes="256KiB", threads=4)

    def test_each_directory_takes_its_weight_of_the_bytes(self, backend, tmp_path):
        backend.write_from("k", torch.zeros(6 << 20, dtype=torch.uint8)).get()
        sizes = [os.path.getsize(tmp_path / d / "k") for d in ("nvme0", "sata", "nvme1")]
        assert sizes == [3 << 20, 1 << 20, 2 << 20]
        backend.write_from("odd", torch.arange(100_000, dtype=torch.int32)).get()  # (ends inside a stripe)
        assert backend.size("odd") == 400_000
        out = torch.empty(100_000, dtype=torch.int32)
        backend.read_into("odd", out).get()
        assert torch.equal(out, torch.arange(100_000, dtype=torch.int32))


@pytest.mark.parametrize("weights, layout", [(None, "even"), ([1, 1], "even"), ([2, 2], "even"), ("2:1", [2, 1]),
                                             ("4,2", [2, 1])])
def test_stripe_weights_of_equal_drives_are_the_even_layout(tmp_path, weights, layout):
    """Equal weights (or none) are the even layout, byte for byte: states striped before weights
    existed read as they were written. Weights are reduced (4:2 is 2:1), and a spec string gives
    them as ``2:1`` (or ``2,1`` after the ``?``)."""
    b = PosixBackend([tmp_path / "a", tmp_path / "b"], stripe_weights=weights, stripe_bytes="4KiB")
    assert b.stripe_weights == (None if layout == "even" else layout)
    b.open()
    try:
        b.write_from("k", torch.arange(4096, dtype=torch.int32)).get()  # 16 KiB: 4 stripes
        sizes = [os.path.getsize(tmp_path / d / "k") for d in "ab"]
        assert sizes == ([8192, 8192] if layout == "even" else [12288, 4096])
        first = torch.empty(1024, dtype=torch.int32)  # stripe 0: always the first directory's first
        with open(tmp_path / "a" / "k", "rb") as f:
            first.numpy().view("u1")[:] = list(f.read(4096))
        assert torch.equal(first, torch.arange(1024, dtype=torch.int32))
    finally:
        b.close()


@pytest.mark.parametrize("weights, match", [
    ([1, 2, 3], r"stripe_weights: 3 weights for 2 directories"),
    ([0, 1], r"stripe_weights: 0 is not an integer from 1 to 64"),
    ("fast:slow", r"stripe_weights: 'fast' is not an integer from 1 to 64"),
    ([1.5, 1], r"stripe_weights: 1\.5 is not an integer from 1 to 64"),
])
def test_stripe_weights_that_name_no_layout_are_refused(tmp_path, weights, match):
    with pytest.raises(ConfigError, match=match):
        PosixBackend([tmp_path / "a", tmp_path / "b"], stripe_weights=weights)

class TestPosixBuffered(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return PosixBackend(tmp_path / "store", direct=False, chunk_bytes="1MiB")


class TestAiofiles(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return AiofilesBackend(tmp_path / "store", chunk_bytes="1MiB")


class TestZarrLocal(BackendConformanceTests):
    large_bytes = 256 << 20

    def make_backend(self, tmp_path):
        return ZarrBackend(str(tmp_path / "state.zarr"))

    def test_typed_arrays_are_readable_by_plain_zarr(self, backend, tmp_path):
        import zarr
        t = torch.randn(3, 5)
        backend.allocate("layer.weight", t.nbytes, dtype="float32", shape=(3, 5))
        backend.write_from("layer.weight", t).get()
        backend.flush()
        arr = zarr.open_group(str(tmp_path / "state.zarr"), mode="r")["layer.weight"]
        assert arr.dtype == "float32"
        assert torch.equal(torch.from_numpy(arr[:].reshape(arr.attrs["shape"])), t)


class TestZarrMemory(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return ZarrBackend("memory")


class TestMemory(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return MemoryBackend()


class TestMemorySynchronous(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return MemoryBackend(threads=0)


class TestFaultInjectingWrapper(BackendConformanceTests):
    """The wrapper itself conforms (with latency), so tests built on it exercise real behaviour."""

    def make_backend(self, tmp_path):
        return FaultInjectingBackend(PosixBackend(tmp_path / "store"), latency_s=0.001)


@pytest.mark.skipif(kvikio_status() is not None, reason=f"kvikio cannot do I/O here: {kvikio_status()}")
class TestKvikio(BackendConformanceTests):
    def make_backend(self, tmp_path):
        return KvikioBackend(tmp_path / "store")


@pytest.mark.skipif(kvikio_status() is not None, reason=f"kvikio cannot do I/O here: {kvikio_status()}")
class TestKvikioDeviceBuffers(BackendConformanceTests):
    """The whole suite with CUDA tensors: GPUDirect (or kvikio's compatibility mode) end to end."""
    buffer_device = "cuda"

    def make_backend(self, tmp_path):
        return KvikioBackend(tmp_path / "store", chunk_bytes="1MiB", threads=4)

    def test_one_cufile_per_file_for_the_backends_life(self, backend):
        t = torch.randn(3 << 20, device="cuda")
        for _ in range(3):
            backend.write_from("k", t).get()
            backend.read_into("k", torch.empty_like(t)).get()
        assert backend.open_files() == 1
        backend.delete("k")
        assert backend.open_files() == 0


@pytest.mark.skipif(kvikio_status() is not None, reason=f"kvikio cannot do I/O here: {kvikio_status()}")
class TestKvikioStripedDeviceBuffers(BackendConformanceTests):
    buffer_device = "cuda"

    def make_backend(self, tmp_path):
        return KvikioBackend([tmp_path / "nvme0", tmp_path / "nvme1"], stripe_bytes="64KiB", chunk_bytes="256KiB",
                             threads=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: there are no device buffers to refuse")
def test_posix_refuses_device_buffers_clearly(tmp_path):
    b = PosixBackend(tmp_path / "s").open()
    with pytest.raises(ValueError, match="stage through host memory"):
        b.write_from("k", torch.zeros(16, device="cuda"))
    b.close()


class TestKvikioBackendLogic(BackendConformanceTests):
    """The kvikio backend's own code on a machine without kvikio or a GPU: a stand-in module serves
    kvikio's calls with POSIX I/O, and every tensor takes the device path."""
    large_bytes = 64 << 20

    @pytest.fixture(autouse=True)
    def fake(self, monkeypatch):
        from fake_kvikio import FakeKvikio
        return FakeKvikio().install(monkeypatch)

    def make_backend(self, tmp_path):
        return KvikioBackend([tmp_path / "a", tmp_path / "b"], stripe_bytes="64KiB", chunk_bytes="128KiB", threads=3)

    def test_settings_reach_kvikio_and_each_file_is_opened_once(self, backend, fake):
        assert fake.settings == {"num_threads": 3, "task_size": 128 << 10}
        assert not backend.gds_active and "compatibility mode" in backend.gds_reason
        data = _bytes(1 << 20)
        for _ in range(3):
            backend.write_from("k", data).get()
            out = torch.empty_like(data)
            backend.read_into("k", out).get()
            assert torch.equal(out, data)
        assert sorted(fake.opened) == sorted(backend._paths("k"))  # one CuFile per stripe file, kept
        # a stripe run is one request (kvikio splits it by task size), not one per chunk: a stripe is one
        # unless it follows the one before in the same file (by weight: 2:1 puts stripes 2 and 3 in a row)
        places = [backend._where(s) for s in range((1 << 20) // (64 << 10))]
        runs = 1 + sum(not (b == (a[0], a[1] + 1)) for a, b in zip(places, places[1:]))
        reads = [c for c in fake.calls if c[0] == "read"]
        assert len(reads) == 3 * runs and runs == (16 if backend.stripe_weights is None else 11)
        backend.delete("k")
        assert sorted(fake.closed) == sorted(backend._paths("k")) and backend.open_files() == 0

    def test_close_closes_every_file(self, tmp_path, fake):
        b = self.make_backend(tmp_path).open()
        b.write_from("x", _bytes(300_000)).get()
        b.write_from("y", _bytes(10)).get()
        assert b.open_files() == 3
        b.close()
        assert len(fake.closed) == 3

    def test_auto_picks_posix_when_kvikio_would_run_in_compat_mode(self, fake, tmp_path):
        name, reason = storage_backends.auto_choice()
        assert name == "posix" and "compatibility mode" in reason
        assert storage_backends.create_backend(f"auto:{tmp_path}").name == "posix"


class TestKvikioBackendLogicByWeight(TestKvikioBackendLogic):
    """The same, the stripes by weight (kvikio's ranges come from the posix layout's parts)."""

    def make_backend(self, tmp_path):
        return KvikioBackend([tmp_path / "a", tmp_path / "b"], stripe_bytes="64KiB", chunk_bytes="128KiB", threads=3,
                             stripe_weights=[2, 1])

def test_auto_picks_kvikio_only_with_gpudirect_on(monkeypatch, tmp_path):
    from fake_kvikio import FakeKvikio
    FakeKvikio(compat=False).install(monkeypatch)
    name, reason = storage_backends.auto_choice()
    assert name == "kvikio" and "GPUDirect Storage is on" in reason
    assert storage_backends.create_backend(f"auto:{tmp_path}").name == "kvikio"


def _bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


# ---- registry and specs ---------------------------------------------------------------------
def test_builtins_are_registered_through_entry_points():
    from importlib.metadata import entry_points
    names = {ep.name for ep in entry_points(group=storage_backends.ENTRY_POINT_GROUP)}
    assert {"posix", "aiofiles", "kvikio", "zarr", "memory"} <= names


def test_third_party_backend_registration(tmp_path):
    class Mine(MemoryBackend):
        name = "mine"
    register_backend("mine-test", Mine)
    with pytest.raises(ValueError):
        register_backend("mine-test", Mine)
    register_backend("mine-test", Mine, clobber=True)
    b = open_backend("mine-test")
    assert isinstance(b, Mine)
    b.write_from("k", bytearray(b"abc")).get()
    b.close()



def test_a_plugin_installed_while_the_process_runs_is_found(monkeypatch):
    """The installed entry points are scanned once (milliseconds, which every engine built paid);
    a name not among them scans again, so a backend installed after the first engine is found, by
    name and in a spec string, and listed."""
    from importlib.metadata import EntryPoint
    storage_backends.open_backend("memory").close()  # (a first scan)
    plugin = EntryPoint("late-test", "storage_backends.memory:MemoryBackend", storage_backends.ENTRY_POINT_GROUP)
    scanned = storage_backends.entry_points(group=storage_backends.ENTRY_POINT_GROUP)
    monkeypatch.setattr(storage_backends, "entry_points", lambda group: [*scanned, plugin])
    assert storage_backends.get_backend_class("late-test") is MemoryBackend
    assert storage_backends.resolve_storage("late-test").name == "late-test"
    assert "late-test" in storage_backends.available_backends()
    monkeypatch.setattr(storage_backends, "entry_points", lambda group: scanned)
    assert "late-test" not in storage_backends.available_backends()  # (uninstalled: listed no more)


def test_spec_strings(tmp_path):
    assert parse_spec("posix:/a,/b?threads=4") == ("posix", "/a,/b", {"threads": "4"})
    assert parse_spec("/mnt/x") == ("auto", "/mnt/x", {})
    assert parse_spec("memory") == ("memory", None, {})
    b = open_backend(f"posix:{tmp_path}/a,{tmp_path}/b?threads=3&chunk_bytes=2MiB")
    assert b.threads == 3 and b.chunk_bytes == 2 << 20 and len(b.directories) == 2
    b.close()
    auto = open_backend(str(tmp_path / "auto"))
    assert auto.name in ("posix", "kvikio")
    auto.close()


def test_unknown_backend_name():
    with pytest.raises(UnknownBackendError) as info:
        open_backend("nvme-magic:/x")
    assert "posix" in str(info.value)  # lists the known ones


@pytest.mark.skipif(kvikio_status() is None, reason="kvikio works here; the missing-kvikio error cannot be shown")
def test_kvikio_missing_gives_install_hint(tmp_path):
    with pytest.raises(BackendUnavailableError) as info:
        open_backend(f"kvikio:{tmp_path}")
    assert "pip install" in str(info.value) or "CUDA" in str(info.value)
    assert isinstance(info.value, ImportError)


# ---- posix specifics --------------------------------------------------------------------
def assert_round_trip(backend):
    data = torch.arange(10_000, dtype=torch.float64)
    backend.write_from("k", data).get()
    out = torch.empty_like(data)
    backend.read_into("k", out).get()
    assert torch.equal(out, data)


def test_no_o_direct_falls_back_to_buffered_with_logged_reason(tmp_path, monkeypatch, caplog):
    """A file system that refuses O_DIRECT (simulated: the probe reports a refusal)."""
    import storage_backends.posix as posix
    monkeypatch.setattr(posix, "probe_direct_io", lambda d: "the file system refuses O_DIRECT (Invalid argument)")
    with caplog.at_level("WARNING", logger="storage_backends.posix"):
        b = PosixBackend(tmp_path / "s").open()
    try:
        assert not b.supports_direct_io and "refuses O_DIRECT" in b.direct_reason
        assert any("buffered I/O" in r.message for r in caplog.records)
        assert_round_trip(b)
    finally:
        b.close()
    with pytest.raises(DirectIOUnsupportedError) as info:
        PosixBackend(tmp_path / "s", direct=True).open()
    assert str(tmp_path / "s") in str(info.value)


def test_tmpfs_falls_back_to_buffered_with_reason(tmpfs_dir):
    from storage_backends.posix import probe_direct_io
    if probe_direct_io(tmpfs_dir) is None:
        pytest.skip("this kernel's tmpfs accepts O_DIRECT (Linux >= 6.6); the simulated refusal test covers the fallback")
    b = PosixBackend(tmpfs_dir).open()
    try:
        assert not b.supports_direct_io
        assert "O_DIRECT" in b.direct_reason
        assert_round_trip(b)
    finally:
        b.close()


def test_direct_required_on_tmpfs_is_refused(tmpfs_dir):
    from storage_backends.posix import probe_direct_io
    if probe_direct_io(tmpfs_dir) is None:
        pytest.skip("this kernel's tmpfs accepts O_DIRECT (Linux >= 6.6)")
    with pytest.raises(DirectIOUnsupportedError) as info:
        PosixBackend(tmpfs_dir, direct=True).open()
    assert tmpfs_dir in str(info.value)


def test_missing_directory_without_create(tmp_path):
    with pytest.raises(StorageDirectoryError) as info:
        PosixBackend(tmp_path / "absent", create=False).open()
    assert "absent" in str(info.value)


@pytest.mark.parametrize("spelling", ["same", "dotdot", "link"])
def test_a_directory_given_twice_is_refused_before_a_stripe_lands_on_another(tmp_path, spelling):
    """Stripe s of an extent goes to directory s % N at offset (s // N) * stripe: a directory listed twice (under
    one spelling or two, or a link to it) took stripes 0 and 1 of every extent at the same offset of the same file,
    so each overwrote the other, and a run of 9 MiB tensors died at its first read with a CorruptionError."""
    d = tmp_path / "drive"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    other = {"same": d, "dotdot": d / ".." / "drive", "link": tmp_path / "link"}[spelling]
    with pytest.raises(StorageDirectoryError, match="given twice") as info:
        PosixBackend([d, other], stripe_bytes=4096).open()
    assert str(d) in str(info.value) and str(other) in str(info.value)
    with pytest.raises(StorageDirectoryError, match="given twice"):
        PosixBackend(f"{d},{other}").open()  # (as the CLI's --storage gives them; kvikio's backend opens as this)
    PosixBackend([d, d / "sub"], stripe_bytes=4096).open().close()  # a directory inside another is another


def test_directory_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StorageDirectoryError) as info:
        PosixBackend(f).open()
    assert str(f) in str(info.value)


def test_unwritable_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("running as a user that ignores permissions (root); see test_directory_that_is_a_file")
        with pytest.raises(StorageDirectoryError):
            PosixBackend(d).open()
    finally:
        d.chmod(0o700)


def test_truncated_file_is_a_short_read_naming_the_file(tmp_path):
    b = PosixBackend(tmp_path / "s").open()
    try:
        b.write_from("w", torch.randn(1 << 18)).get()
        path = tmp_path / "s" / "w"
        os.truncate(path, 5000)
        with pytest.raises(ShortReadError) as info:
            b.read_into("w", torch.empty(1 << 18)).get()
        assert str(path) in str(info.value)
    finally:
        b.close()


def test_files_are_owner_only(tmp_path):
    b = PosixBackend(tmp_path / "s").open()
    try:
        b.write_from("w", torch.randn(10)).get()
        assert (os.stat(tmp_path / "s").st_mode & 0o777) == 0o700
        assert (os.stat(tmp_path / "s" / "w").st_mode & 0o077) == 0
    finally:
        b.close()


def test_enospc_on_a_small_file_system(tmp_path):
    """A real full disk: a 2 MiB tmpfs mounted for the test (needs mount rights)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=2m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights); the injected-fault test covers ENOSPC")
    try:
        b = PosixBackend(mnt).open()
        try:
            with pytest.raises(DiskFullError) as info:
                b.write_from("big", torch.zeros(4 << 20, dtype=torch.uint8)).get()
            e = info.value
            assert e.errno == errno.ENOSPC and str(mnt) in str(e)
            assert e.needed_bytes > 0 and e.free_bytes is not None
            with pytest.raises(DiskFullError):
                b.allocate("reserve", 8 << 20)
        finally:
            b.close()
    finally:
        os.system(f"umount {mnt}")



def _free_by_place(monkeypatch, free: dict):
    """``shutil.disk_usage`` reporting ``free[prefix]`` bytes free for a path under ``prefix``."""
    import shutil
    real = shutil.disk_usage

    def usage(path):
        got = real(path)
        return got._replace(free=next(v for k, v in free.items() if str(path).startswith(str(k))))
    monkeypatch.setattr(shutil, "disk_usage", usage)


def test_striped_directories_on_one_file_system_share_its_free_space(tmp_path, monkeypatch):
    """Stripes spread evenly over the directories, so the set holds ``n`` x the least free
    directory's space only where each is on its own file system. Two directories on one file
    system share its free space: the set was said to hold twice what it can, so the engine's
    check before training passed a state the disk could not hold, and the run failed with a full
    disk after it began. Now the check refuses it up front."""
    _free_by_place(monkeypatch, {tmp_path: 10 << 20})
    b = PosixBackend([tmp_path / "a", tmp_path / "b"]).open()
    try:
        assert b.free_bytes() == 10 << 20  # (before: 20 MiB)
    finally:
        b.close()
    from tiered_offload.engine.preflight import check_disk
    b = PosixBackend([tmp_path / "a", tmp_path / "b"]).open()
    try:
        with pytest.raises(DiskFullError, match=r"needs 16\.00 MiB .* but 10\.00 MiB .* is free"):
            check_disk(b, 16 << 20, 0)
    finally:
        b.close()


def test_striped_directories_over_file_systems_hold_what_the_fullest_share_allows(tmp_path, monkeypatch):
    """A file system holding ``k`` of ``n`` directories takes ``k / n`` of the set's bytes."""
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system (/dev/shm); the test above covers one")
    shm = other / f"tiered-offload-test-{os.getpid()}"
    _free_by_place(monkeypatch, {tmp_path: 10 << 20, other: 30 << 20})
    try:
        b = PosixBackend([tmp_path / "a", tmp_path / "b", shm]).open()
        try:
            assert b.free_bytes() == 15 << 20  # (10 MiB for 2 of 3 stripes; before: 30 MiB, 3 x the least)
        finally:
            b.close()
        b = PosixBackend([tmp_path / "a", shm]).open()
        try:
            assert b.free_bytes() == 20 << 20  # (each its own: 2 x the least, as before)
        finally:
            b.close()
    finally:
        import shutil
        shutil.rmtree(shm, ignore_errors=True)


def test_injected_enospc_is_reported_not_swallowed(tmp_path):
    b = FaultInjectingBackend(MemoryBackend(), write_quota_bytes=1000).open()
    try:
        b.write_from("a", bytearray(800)).get()
        with pytest.raises(DiskFullError) as info:
            b.write_from("b", bytearray(800)).get()
        assert info.value.needed_bytes == 800 and info.value.free_bytes == 200
        assert not b.exists("b")  # nothing reported written that was not
    finally:
        b.close()


def test_zarr_zip_is_refused_for_training_with_a_clear_error(tmp_path):
    """A zip archive only appends: every rewrite would add an entry and nothing could be deleted."""
    from offload_core.errors import BackendCapabilityError, ConfigError
    from tiered_offload import TieredStore
    backend = ZarrBackend(str(tmp_path / "state.zip")).open()
    assert not backend.supports_rewrite
    buf = torch.ones(16)
    backend.write_from("t", buf).get()
    with pytest.raises(BackendCapabilityError, match="only appends"):
        backend.delete("t")
    backend.close()
    with pytest.raises(ConfigError, match="zip archive only appends"):
        TieredStore(f"zarr:{tmp_path / 'other.zip'}", host_budget_bytes="1MiB", device_budget_bytes=0).open()
    assert ZarrBackend(str(tmp_path / "dir")).supports_rewrite


def test_a_spec_naming_no_backend_before_a_path_is_refused_naming_them(tmp_path, monkeypatch):
    """``storage="zarrr:/mnt/state"`` (a backend's name mistyped) was read as a directory whose name
    holds a colon: the state went to ``./zarrr:/mnt/state`` under the working directory, and a
    resume from the intended spec found nothing. A spec whose unknown name stands before a path is
    refused, naming the backends; a directory with a colon in its name stays one (``run:1``, or any
    path given as a ``Path``)."""
    from storage_backends import resolve_storage
    monkeypatch.chdir(tmp_path)
    for spec in ("zarrr:/mnt/state", "posx:./state", "memroy:~/state"):
        with pytest.raises(UnknownBackendError, match=rf"storage {re.escape(repr(spec))} names no storage backend "
                                                     rf"{spec.split(':')[0]!r}; they are .*posix.*zarr.*pathlib\.Path"):
            resolve_storage(spec)
    assert not list(tmp_path.iterdir())
    assert resolve_storage("run:1").location == "run:1"
    assert resolve_storage(Path("zarrr:") / "state").location == str(Path("zarrr:") / "state")


def test_storage_argument_is_read_in_one_place(tmp_path):
    from storage_backends import resolve_storage
    assert resolve_storage(tmp_path).names_directories and resolve_storage(tmp_path).name == "auto"
    striped = resolve_storage([tmp_path / "a", tmp_path / "b"])
    assert (striped.name, striped.location) == ("posix", f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert striped.first_directory == str(tmp_path / "a")
    spec = resolve_storage("posix:/x,/y?threads=8")
    assert (spec.name, spec.location, spec.options, spec.text) == ("posix", "/x,/y", {"threads": "8"}, "posix:/x,/y?threads=8")
    assert not resolve_storage("memory").names_directories
    assert not resolve_storage(MemoryBackend()).names_directories
    assert resolve_storage("run:1").location == "run:1"  # a directory with a colon in its name


def test_an_asyncio_backends_io_runs_in_no_context_of_the_caller(tmp_path):
    """The aiofiles backend's coroutines ran in a copy of the submitting thread's context
    (``asyncio.run_coroutine_threadsafe``). A forward holds state there (transformers records a
    MoE's router logits in a context variable), so each write of a block's saved activations kept
    the forward's outputs, their graph and the activations in a cycle through the task, freed only
    by the garbage collector: the store's bytes held past the graph, and a dropped forward's block
    call still counted at the next backward (``tools/fuzz_options.py --zoo --loops --wide --stores``
    seed 115101, refused mid-step). They now run in an empty context."""
    import contextvars
    import gc
    import weakref

    from storage_backends import _aio
    var = contextvars.ContextVar("forward_state", default=None)

    class State:
        pass
    backend = AiofilesBackend(tmp_path)
    backend.open()

    def forward(state):  # what a forward does: state in a context variable, then I/O
        var.set(state)
        seen = _aio.submit(_read_var(var)).result(timeout=10)
        backend.write_from("k", torch.arange(4096, dtype=torch.uint8), 0).get(timeout=10)
        return seen
    state, context = State(), contextvars.copy_context()
    assert context.run(forward, state) is None
    backend.close()
    gone = weakref.ref(state)
    gc.disable()
    try:
        del state, context
        assert gone() is None, "the backend's tasks still hold the caller's context"
    finally:
        gc.enable()


async def _read_var(var):
    return var.get()
