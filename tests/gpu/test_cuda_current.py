"""engines/cuda_current: the C-level device and stream contexts do what torch's own do."""

from __future__ import annotations

import pytest
import torch

from surge.engines.cuda_current import on_device, on_stream, stream_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_stream_is_current_inside_and_restored_after_even_nested_and_on_error():
    before = torch.cuda.current_stream()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with on_device(0), on_stream(stream_ids(a)):
        assert torch.cuda.current_stream() == a
        with on_stream(stream_ids(b)):
            assert torch.cuda.current_stream() == b
        assert torch.cuda.current_stream() == a
    assert torch.cuda.current_stream() == before
    with pytest.raises(RuntimeError):
        with on_stream(stream_ids(a)):
            raise RuntimeError("boom")
    assert torch.cuda.current_stream() == before


def test_work_inside_runs_on_that_stream_and_gives_the_same_numbers():
    s = torch.cuda.Stream()
    x = torch.randn(512, 512, device="cuda")
    want = (x @ x).cpu()
    s.wait_stream(torch.cuda.current_stream())
    with on_stream(stream_ids(s)):
        y = x @ x
        done = torch.cuda.Event()
        done.record()  # on the current stream: s
    done.synchronize()
    assert s.query()
    torch.testing.assert_close(y.cpu(), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_device_is_exchanged_and_restored():
    torch.cuda.set_device(0)
    with on_device(1):
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0
