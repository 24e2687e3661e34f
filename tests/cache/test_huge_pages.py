"""The KV cache asks for 2 MiB transparent huge pages (decode streams it every step), and for
small pages with TREEATTN_HUGE_PAGES=0."""

import sys
from pathlib import Path

import pytest
import torch

from treeattn._host import empty_huge, huge_page_bytes
from treeattn.cache import ShardedKVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    if not sys.platform.startswith("linux") or not THP.exists():
        return None
    return THP.read_text().split("[")[1].split("]")[0]


def test_empty_huge_is_an_empty_tensor():
    for shape, dtype in [((3, 5), torch.float32), ((2, 1 << 20), torch.bfloat16), ((0,), torch.float16)]:
        t = empty_huge(*shape, dtype=dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        t.fill_(1.5)
        assert bool((t == 1.5).all())


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages: {thp_mode()}")
def test_cache_buffers_on_huge_pages(monkeypatch):
    for env, huge in [(None, True), ("0", False), ("1", True)]:
        if env is None:
            monkeypatch.delenv("TREEATTN_HUGE_PAGES", raising=False)
        else:
            monkeypatch.setenv("TREEATTN_HUGE_PAGES", env)
        h0 = huge_page_bytes()
        cache = ShardedKVCache(2, 1, 4, 128, dtype=torch.bfloat16, capacity=65536)  # 2 x 2 x 64 MiB
        for t in cache.k + cache.v:
            t.zero_()  # first touch: the kernel backs the advised ranges with 2 MiB pages
        got, alloc = huge_page_bytes() - h0, cache.memory_bytes()["allocated"]
        if huge:
            assert got >= alloc // 2, (env, got, alloc)
        else:  # MADV_NOHUGEPAGE: small pages even when the host's mode is "always"
            assert got < alloc // 8, (env, got, alloc)
        del cache, t


def test_mapped_from_file(tmp_path):
    """pack_linears copies only tensors mapped from a file: the test tells a memory-mapped
    tensor (a safetensors file opened as transformers does) from memory of its own."""
    import torch

    from treeattn._host import mapped_from_file, trim_free_memory

    f = tmp_path / "w.bin"
    torch.arange(1 << 16, dtype=torch.float32).numpy().tofile(f)
    mm = torch.from_file(str(f), shared=False, size=1 << 16, dtype=torch.float32)
    own = torch.zeros(1 << 16)
    mapped = mapped_from_file()
    assert mapped(mm.data_ptr()) and mapped(mm[100:].data_ptr())
    assert not mapped(own.data_ptr()) and not mapped(mm.clone().data_ptr())
    assert trim_free_memory() in (True, False)
