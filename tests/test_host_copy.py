"""engine/host_copy.py: host values to device tensors; on CUDA through a ring of pinned buffers
that must not be rewritten while a queued copy still reads them."""

from array import array

import pytest
import torch

from engine import host_copy
from engine.host_copy import to_device


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_values_and_dtypes_on_cpu(dtype):
    out = to_device([3, 1, 2], dtype, torch.device("cpu"))
    assert out.dtype == dtype and out.tolist() == [3, 1, 2]
    assert to_device([], dtype, torch.device("cpu")).numel() == 0


def test_cpu_tensor_owns_its_memory():
    values = array("q", [5, 6])
    out = to_device(values, torch.int64, torch.device("cpu"))
    values[0] = 9
    assert out.tolist() == [5, 6]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ring_buffers_are_not_rewritten_before_their_copy_runs():
    """The stream is held back by a sleeping kernel while more copies than the ring has
    buffers are queued, some larger than the buffers (they grow): every copy must still carry
    its own values."""
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copies
    sizes = [7, 70_000, 3, 40_000, 1, 9000] * (host_copy.RING_SLOTS // 2)
    expected = [[i * 1000 + j % 1000 for j in range(n)] for i, n in enumerate(sizes)]
    outs = [to_device(v, torch.int64, device) for v in expected]
    assert [o.tolist() for o in outs] == expected
