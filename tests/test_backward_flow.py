"""What a block's backward holds beyond its saved activations (planner.memory.backward_flow_bytes
plus the new weight gradient, accumulation_bytes), measured on the C heap of one process."""
import dataclasses
import gc
from types import SimpleNamespace

import pytest

from planner.memory import backward_flow_bytes, largest_param_on_device
from planner.zoo import ZOO


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize("micro_batch, seq_len", [(1, 64), (2, 32), (4, 64)])
def test_a_blocks_backward_holds_at_most_what_the_planner_counts(name, micro_batch, seq_len):
    """A tiny block (fp32, gradients already there, so each backward adds a new one to them, as
    every micro-batch after a step's first does) runs its backward from the output gradient: the
    heap grows above what the forward left by at most the flow and a new weight gradient, and by
    more than 60% of that, so the moment the flow counts is there. Measured when written: 297-778
    KiB over 416-1088 (SwiGLU), 392-775 over 416-896 (GELU); a backward counted as two
    hidden-size gradients (256-512 KiB with the weight gradient) was short in every case."""
    import torch
    from runtime.metrics import HEAP_READER, HeapPeak
    from runtime.model import Block, rope_tables
    if HEAP_READER is None:
        pytest.skip("the C library does not report its heap here")
    torch.manual_seed(0)
    cfg = dataclasses.replace(ZOO[name], seq_len=seq_len)
    cos, sin = (t[:seq_len] for t in rope_tables(cfg))
    block = Block(cfg)

    def forward():
        x = torch.randn(micro_batch, seq_len, cfg.hidden, requires_grad=True)
        return block(x, cos, sin)

    y = forward()
    y.backward(torch.randn_like(y))  # the parameters' gradients exist from here on
    y = forward()
    grad = torch.randn_like(y)
    gc.collect()
    gc.disable()  # the collector freeing other tests' garbage in the middle would read as less
    try:
        with HeapPeak(HEAP_READER) as heap:
            y.backward(grad)
    finally:
        gc.enable()
    t = SimpleNamespace(dtype="fp32", seq_len=seq_len, master_weights=False, elementwise_kernels="eager",
                        sp_saved_inputs="shard")
    counted = backward_flow_bytes(cfg, t, 1, False, 1, micro_batch) + 4 * largest_param_on_device(cfg, 1, 1)
    assert 0.6 * counted < heap.peak_bytes <= counted, (heap.peak_bytes / 1024, counted / 1024)
