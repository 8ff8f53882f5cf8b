"""The disk tier's file: named regions round-trip any tensor bit for bit, the file lives exactly as
long as its object, and a bad or small directory is refused before anything is written
(NOTE: [Offload files])."""

import gc
import math
import os

import pytest
import torch

from lazytrain import files
from lazytrain.errors import ResourceError
from lazytrain.runtime.disk import OffloadFile, aligned_empty
from lazytrain.sizes import DISK_ALIGN

CHUNK = 2 * DISK_ALIGN  # small chunks, so that a few KiB already take several


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=dtype, generator=gen)
    return torch.randn(numel, generator=gen).to(dtype)


def _takes_direct(directory) -> bool:
    """Whether files in `directory` open with O_DIRECT (tmpfs before Linux 6.6 refuses it)."""
    probe = directory / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except (AttributeError, OSError):
        return False
    finally:
        probe.unlink(missing_ok=True)


def test_regions_round_trip_bit_for_bit(tmp_path):
    gen = torch.Generator().manual_seed(0)
    page = aligned_empty(3 * CHUNK + 2 * 1000)  # page-aligned: 3 chunks go direct, 1000 bf16 elements after
    assert page.data_ptr() % DISK_ALIGN == 0
    tensors = {
        "bf16_unaligned": _random(3 * CHUNK // 2 + 7, torch.bfloat16, gen),  # 3 chunks and a partial block
        "fp32": _random(5 * CHUNK // 4, torch.float32, gen),  # 5 whole chunks
        "uint8_small": _random(13, torch.uint8, gen),
        "bf16_page_aligned": page.view(torch.bfloat16).copy_(_random(page.numel() // 2, torch.bfloat16, gen)),
        "empty": torch.empty(0, dtype=torch.float32),
    }
    sizes = {name: t.nbytes + 100 for name, t in tensors.items()}  # regions larger than their tensors
    with OffloadFile(tmp_path, sizes, threads=3, chunk_bytes=CHUNK) as disk:
        direct = disk.direct
        spans = sorted(disk.regions.values())
        assert all(offset % DISK_ALIGN == 0 for offset, _ in spans)
        assert all(a + size <= b for (a, size), (b, _) in zip(spans, spans[1:]))  # disjoint
        assert sorted(size for _, size in spans) == sorted(sizes.values())
        writes = [disk.write(name, t) for name, t in tensors.items()]
        assert [w.result(timeout=10) for w in writes] == [None] * len(writes)
        back = {name: torch.full_like(t, 0) for name, t in tensors.items()}
        reads = [disk.read(name, back[name]) for name in tensors]
        disk.wait()
        assert all(r.done() and r.exception() is None for r in reads)
        for name, t in tensors.items():
            assert torch.equal(_bits(back[name]), _bits(t)), name
        # written again, and read into a tensor at an unaligned address: the new bits
        disk.write("fp32", tensors["fp32"] * 2).result()
        other = torch.empty(tensors["fp32"].numel() + 1)[1:]
        disk.read("fp32", other).result()
        assert torch.equal(other, tensors["fp32"] * 2)
        assert disk.direct == direct  # the filesystem took every direct chunk it was given


def test_aligned_chunks_go_direct_and_the_rest_buffered(tmp_path, monkeypatch):
    if not _takes_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    calls = []

    def spy(real):
        def call(fd, buffers, offset):
            calls.append((fd, offset, sum(len(b) for b in buffers)))
            return real(fd, buffers, offset)
        return call

    monkeypatch.setattr(os, "pwritev", spy(os.pwritev))
    monkeypatch.setattr(os, "preadv", spy(os.preadv))
    nbytes = 3 * DISK_ALIGN + 10
    with OffloadFile(tmp_path, {"pad": 1, "a": nbytes}, chunk_bytes=2 * DISK_ALIGN) as disk:
        assert disk.direct
        buffered, direct = disk._handles.fds
        base = disk.regions["a"][0]
        buf = aligned_empty(nbytes).fill_(7)
        disk.write("a", buf).result()
        assert sorted(calls) == sorted([(direct, base, 2 * DISK_ALIGN), (direct, base + 2 * DISK_ALIGN, DISK_ALIGN),
                                        (buffered, base + 3 * DISK_ALIGN, 10)])
        calls.clear()
        unaligned = torch.zeros(nbytes + 1, dtype=torch.uint8)[1:]
        disk.read("a", unaligned).result()
        assert {fd for fd, _, _ in calls} == {buffered} and bool((unaligned == 7).all())
        assert disk.direct


def test_short_transfers_are_continued(tmp_path, monkeypatch):
    """The kernel may move fewer bytes than asked; the rest follows (through the buffered descriptor
    once what is left is no longer aligned)."""
    def short(real):
        return lambda fd, buffers, offset: real(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "pwritev", short(os.pwritev))
    monkeypatch.setattr(os, "preadv", short(os.preadv))
    data = aligned_empty(3 * DISK_ALIGN + 5).copy_(torch.randint(0, 256, (3 * DISK_ALIGN + 5,), dtype=torch.uint8))
    with OffloadFile(tmp_path, {"a": data.nbytes}, chunk_bytes=2 * DISK_ALIGN) as disk:
        disk.write("a", data).result()
        back = torch.zeros_like(data)
        disk.read("a", back).result()
    assert torch.equal(back, data)


def test_the_file_is_preallocated_and_removed_on_close_and_collection(tmp_path):
    disk = OffloadFile(tmp_path, {"a": 10, "b": DISK_ALIGN, "c": DISK_ALIGN + 1})
    assert disk.nbytes == 4 * DISK_ALIGN
    assert disk.path.parent == tmp_path and disk.path.stat().st_size == 4 * DISK_ALIGN
    assert disk.path.stat().st_blocks * 512 >= 4 * DISK_ALIGN  # allocated, not sparse
    disk.write("c", torch.ones(DISK_ALIGN + 1, dtype=torch.uint8))
    disk.close()
    assert not disk.path.exists() and list(tmp_path.iterdir()) == []
    disk.close()  # again: nothing to do
    with pytest.raises(ValueError, match="closed"):
        disk.read("a", torch.empty(1))

    disk = OffloadFile(tmp_path, {"a": 10})
    path = disk.path
    assert path.exists()
    del disk
    gc.collect()
    assert not path.exists()

    with OffloadFile(tmp_path, {"a": 10}) as disk:
        assert disk.path.exists()
    assert not disk.path.exists()


def test_a_mapped_region_is_the_file(tmp_path):
    """NOTE: [Mapped regions]: a region's mapping sees what the file's transfers wrote, they see what
    was written through it, `settle` drops its pages from this process, and it outlives the file."""
    with OffloadFile(tmp_path, {"a": 4 * DISK_ALIGN, "b": 3 * DISK_ALIGN}) as disk:
        b = disk.mapped("b", (3, DISK_ALIGN // 4), torch.float32)
        written = torch.randn(3, DISK_ALIGN // 4)
        disk.write("b", written).result()
        assert torch.equal(b, written)
        b.mul_(2)
        back = torch.empty_like(b)
        disk.read("b", back).result()
        assert torch.equal(back, written * 2)
        disk.settle("b")
        assert torch.equal(b, written * 2)  # read from the file again
        assert disk.mapped("a", (0,), torch.float32).numel() == 0
        with pytest.raises(ValueError, match="holds"):
            disk.mapped("a", (4 * DISK_ALIGN + 1,), torch.uint8)
    assert torch.equal(b, written * 2)


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(ResourceError, match=r"offload directory .*nowhere does not exist.*--offload-dir"):
        OffloadFile(tmp_path / "nowhere", {"a": 10})
    (tmp_path / "file").write_text("")
    with pytest.raises(ResourceError, match="is not a directory"):
        OffloadFile(tmp_path / "file", {"a": 10})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(ResourceError, match=r"cannot create the offload file in .*--offload-dir .*writable"):
            OffloadFile(tmp_path, {"a": 10})
    finally:
        tmp_path.chmod(0o755)


def test_a_disk_too_small_is_refused_before_anything_is_created(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "free_bytes", lambda path: 5 * 2**20)
    with pytest.raises(ResourceError) as info:
        OffloadFile(tmp_path, {"a": 3 * 2**30, "b": 2**29})
    message = str(info.value)
    assert "3.5 GiB" in message and "5.0 MiB free" in message and "--offload-dir" in message
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_preallocating_removes_the_file(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ResourceError, match="needs about 8.0 KiB"):
        OffloadFile(tmp_path, {"a": 5000})
    assert list(tmp_path.iterdir()) == []


def test_a_filesystem_without_fallocate_gets_a_sized_file(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with OffloadFile(tmp_path, {"a": 5000}) as disk:
        assert disk.path.stat().st_size == 2 * DISK_ALIGN
        disk.write("a", torch.arange(1250, dtype=torch.float32)).result()
        back = torch.empty(1250)
        disk.read("a", back).result()
        assert torch.equal(back, torch.arange(1250, dtype=torch.float32))


def test_a_tensor_larger_than_its_region_is_refused(tmp_path):
    with OffloadFile(tmp_path, {"a": 100}) as disk:
        with pytest.raises(ValueError, match=r"region 'a' holds 100 bytes; a \(26,\) torch.float32 tensor has 104"):
            disk.write("a", torch.zeros(26))
        with pytest.raises(ValueError, match="region 'a' holds 100 bytes"):
            disk.read("a", torch.zeros(26))
        with pytest.raises(KeyError, match="no region 'b'"):
            disk.write("b", torch.zeros(1))
        with pytest.raises(ValueError, match="contiguous"):
            disk.write("a", torch.zeros(4, 4).t())
        disk.write("a", torch.zeros(25)).result()  # exactly the region's size


def test_profile_measures_the_disk_through_the_offload_file(tmp_path):
    from lazytrain.profile import _disk_rates

    write, read, both, direct = _disk_rates(tmp_path, nbytes=4 * 2**20 + 3, count=3)
    assert all(math.isfinite(r) and r > 0 for r in (write, read, both))
    assert direct == _takes_direct(tmp_path) and list(tmp_path.iterdir()) == []
