"""The CUDA path's pieces that the CPU can check: the host arena's exact allocation, the wsum64
checksum GPUDirect transfers are recorded with (its definition, its streaming form, files that
carry it verified and resumed without a GPU). On a CUDA machine the same tests run on the GPU too."""

import json

import pytest
import torch
from conftest import DEVICES
from test_durable import make_engine, train

from storage_backends import key_to_filename
from tiered_offload.checkpoint.durable import STATE_DIR, StateFiles
from tiered_offload.checkpoint.state_dir import StateDirectory
from tiered_offload.store.arena import Arena
from tiered_offload.store.checksum import (
    Hasher,
    describe,
    device_checksum,
    matches,
    wsum64,
)

M = (1 << 64) - 1
K = 0x9E3779B97F4A7C15


def wsum64_reference(data: bytes) -> int:
    """The definition, one word at a time: sum of mix(w_i) * (2i+1) * K mod 2**64, xor the length term."""
    n = len(data)
    data += b"\0" * (-n % 8)
    acc = 0
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i:8 * i + 8], "little")
        acc = (acc + ((w ^ (w >> 32)) & M) * ((2 * i + 1) * K)) & M
    return acc ^ ((n * 0xC2B2AE3D27D4EB4F) & M)


def _random_bytes(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pin", [False, True], ids=["plain", "pinned"])
def test_host_arena_allocation_is_exactly_its_budget(pin):
    if pin and not torch.cuda.is_available():
        pytest.skip("pinning needs CUDA (the GPU check measures the pinned bytes)")
    budget = (10 << 20) + 3 * 4096  # not a power of two: the caching pinned allocator would pin 16 MiB
    arena = Arena("host", budget, torch.device("cpu"), pin_memory=pin)
    arena.open()
    try:
        assert arena.backing_bytes == budget == arena.capacity
        assert arena._buffer.data_ptr() % 4096 == 0
        assert arena.pinned == pin and arena._buffer.is_pinned() == pin
        off = arena.alloc(budget)
        arena.view(off, budget).fill_(7)  # every byte of the budget is usable
        assert int(arena.view(off, budget)[-1]) == 7
    finally:
        arena.close()
    assert arena.backing_bytes == 0


def test_store_host_tier_backing_is_its_budget(tmp_path):
    from tiered_offload.config import StoreConfig
    from tiered_offload.store import Tier, TieredStore
    store = TieredStore(str(tmp_path / "s"), StoreConfig(host_budget_bytes="3MiB", device="cpu")).open()
    try:
        assert store.arena(store.compute_tier).backing_bytes in (0, 3 << 20)
        assert store.arena(Tier.HOST).backing_bytes == 3 << 20
    finally:
        store.close()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4096, 4101, 100_003])
def test_wsum64_matches_its_definition(n):
    raw = _random_bytes(n, n)
    assert wsum64(raw) == wsum64_reference(bytes(raw.numpy()))


def test_wsum64_in_pieces_equals_in_one_go_across_device_passes():
    raw = _random_bytes((1 << 20) * 8 * 2 + 12345, 3)  # more than two device passes of words
    whole = wsum64(raw)
    h = Hasher("wsum64")
    for a in range(0, raw.numel(), 1_000_003):  # pieces that split words
        h.update(raw[a:a + 1_000_003])
    assert h.value() == whole
    assert wsum64(raw[1:]) != whole  # shifted bytes, different sum


def test_wsum64_sees_every_single_bit_flip_in_a_sample():
    raw = _random_bytes(65536, 5)
    base = wsum64(raw)
    g = torch.Generator().manual_seed(9)
    for pos, bit in zip(torch.randint(0, raw.numel(), (64,), generator=g), torch.randint(0, 8, (64,), generator=g)):
        flipped = raw.clone()
        flipped[pos] ^= 1 << int(bit)
        assert wsum64(flipped) != base
    assert wsum64(torch.cat([raw, torch.zeros(1, dtype=torch.uint8)])) != base  # a trailing zero byte counts


@pytest.mark.parametrize("device", DEVICES)
def test_device_checksum_is_recorded_tagged_and_checkable_anywhere(device):
    raw = _random_bytes(3 << 20, 7).to(device)
    value = device_checksum(raw, "xxh3")
    if device == "cpu":
        assert isinstance(value, int)  # the directory's own algorithm
    else:
        assert value == f"wsum64:{wsum64(raw.cpu()):016x}"  # computed on the GPU, equal to the CPU's
    ok, _ = matches(raw.cpu(), value, "xxh3")
    assert ok
    bad = raw.cpu().clone()
    bad[12345] ^= 4
    assert not matches(bad, value, "xxh3")[0]
    assert describe(f"wsum64:{0:016x}", "xxh3") == "wsum64 " + "0" * 16


def test_directory_with_device_checksums_verifies_and_resumes_without_a_gpu(tmp_path):
    """Extents a GPUDirect run wrote carry wsum64 checksums in the manifest: verify checks them, a
    resume reads them, a damaged one is named."""
    storage = tmp_path / "s"
    engine = make_engine(storage)
    train(engine, 2)
    engine.close()
    files = StateFiles(storage / STATE_DIR)
    manifest = files.read_manifest()
    retagged = []
    for key, info in manifest["tensors"].items():
        if info["extent"] and len(retagged) < 3:
            path = storage / key_to_filename(info["extent"])
            data = path.read_bytes() if path.exists() else None
            if data is None:
                continue
            info["crc"] = f"wsum64:{wsum64_reference(data[:info['nbytes']]):016x}"
            retagged.append((key, path))
    assert retagged, json.dumps(manifest["tensors"])[:500]
    files.write_manifest(manifest)
    assert StateDirectory(storage).verify()["ok"]
    engine = make_engine(storage, resume=True)  # reads every tensor back, checking the tagged sums
    train(engine, 3)
    engine.close()
    # the resumed run rewrote those tensors with the directory's own algorithm; damage one that is tagged now
    manifest = files.read_manifest()
    key, info = next((k, v) for k, v in manifest["tensors"].items() if v["extent"])
    path = storage / key_to_filename(info["extent"])
    data = bytearray(path.read_bytes())
    info["crc"] = f"wsum64:{wsum64_reference(bytes(data[:info['nbytes']])):016x}"
    files.write_manifest(manifest)
    data[5] ^= 1
    path.write_bytes(bytes(data))
    report = StateDirectory(storage).verify()
    assert not report["ok"] and report["damaged"][0]["tensor"] == key and "wsum64" in report["damaged"][0]["problem"]
