"""The CPU memory counters behind run.json's peak memory and the model profile's activations."""
import pytest
import torch

from runtime.metrics import HEAP_READER, HeapPeak, LiveTensorBytes, cpu_counter

pytestmark = pytest.mark.skipif(HEAP_READER is None, reason="no glibc mallinfo2 here: LiveTensorBytes is used")

MiB = 2 ** 20


def test_views_of_parameters_allocate_nothing_and_the_output_counts():
    lin = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weight
    x = torch.randn(64, 1024)
    with torch.no_grad():
        lin(x)  # the first call sets up the matmul library's one-time state
    counter, name = cpu_counter()
    assert isinstance(counter, HeapPeak) and "HeapPeak" in name
    with torch.no_grad(), counter:
        y = lin(x)  # uses weight.t(): a view, no allocation
        held = counter.current_bytes  # the process's first dispatch mode: its one-time caches are not counted
    assert 0.9 * y.nbytes <= held <= y.nbytes + 0.25 * MiB
    # the storage-identity count sees the weight's view as new bytes
    live = LiveTensorBytes()
    with torch.no_grad(), live:
        lin(x)
    assert live.peak_bytes >= 4 * MiB


def test_the_peak_sees_a_transient_that_is_freed_before_the_end():
    counter = HeapPeak(HEAP_READER)
    with counter:
        big = torch.ones(4 * MiB // 4)  # 4 MiB
        small = big.sum()
        del big
    assert counter.peak_bytes >= 4 * MiB * 0.95
    assert counter.current_bytes < 0.5 * MiB
    del small
