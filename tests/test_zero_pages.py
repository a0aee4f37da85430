"""engine/zero_pages.py: CPU pools read as zeros and take memory only where written."""

import torch

from engine.zero_pages import zeros

CPU = torch.device("cpu")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_reads_zeros_in_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = zeros((3, 5, 7), dtype, CPU)
        assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
        assert not t.float().any()
    assert zeros((0, 4), torch.float32, CPU).shape == (0, 4)


def test_memory_follows_the_pages_written():
    before = _rss_bytes()
    pool = zeros((64, 1 << 18), torch.float32, CPU)  # 64 MiB
    assert _rss_bytes() - before < (8 << 20)
    views = list(pool.unbind(0))
    views[3].fill_(2.0)  # one 1 MiB slice
    views[5][0] = 1.0  # one page of another
    grown = _rss_bytes() - before
    assert (1 << 20) <= grown < (12 << 20)
    assert pool.sum().item() == 2.0 * (1 << 18) + 1.0
    assert _rss_bytes() - before < (16 << 20)  # reading untouched pages maps the shared zero page
