"""The eager memory-bound traffic the planner prices (planner.pointwise) is what the runtime's own
modules run: every aten operation of a block's (and the head's and loss's) forward and backward is
counted as the bytes of its inputs and outputs, matmuls and attention left out (priced as FLOPs).
On a GPU F.rms_norm is one fused kernel (aten::_fused_rms_norm); on this CPU it decomposes, so the
traced modules stand native LayerNorm in for it, which moves the same bytes (one read and one
write forward; two reads and one write backward)."""
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from planner.pointwise import eager_bytes, fused_bytes
from planner.zoo import ZOO
from runtime.model import Block, Head, rope_tables
from runtime.loss import cross_entropy

FLOPS_OPS = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward"}
# operations that read one entry per row of an input, not the whole of it: their outputs only
PARTIAL_READS = {"nll_loss_forward", "nll_loss_backward", "gather"}
# operations that update one entry per row of a tensor in place: a few bytes per row; allocations
NO_TRAFFIC = {"scatter_add_", "empty", "empty_like", "new_empty"}
# in-place random fills: they write the tensor and read nothing of it
WRITE_ONLY = {"bernoulli_", "zeros_like", "new_zeros"}
# operations that read as much of their input as they write (the rows they select)
SELECTS = {"index_select", "index"}


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


class ByteCounter(TorchDispatchMode):
    """Bytes read and written by the memory-bound kernels dispatched under it."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # views alias their input and move nothing; in-place and out= operations alias what they write
        views = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns) \
            or name == "_unsafe_view"
        if name not in FLOPS_OPS and not views and name not in NO_TRAFFIC:
            inputs = list(args) + [v for k, v in (kwargs or {}).items() if k != "out"]  # out= is written
            reads = 0 if name in PARTIAL_READS or name in WRITE_ONLY else _bytes(out) if name in SELECTS \
                else _bytes(inputs)
            # in-place foreach operations (the optimizer's) return nothing: they write their first list;
            # the fused AdamW kernel its parameters and both moments
            writes = (_bytes(args[0]) if name.startswith("_foreach_") and name.endswith("_")
                      else _bytes([args[0], args[2], args[3]]) if name.startswith("_fused_adam") else _bytes(out))
            self.total += reads + writes
        return out


def _traced(fn, x):
    fwd, bwd = ByteCounter(), ByteCounter()
    with fwd:
        y = fn(x)
    grad = torch.ones_like(y)
    with bwd:
        y.backward(grad)
    return fwd.total, bwd.total


class _OneKernelNorm(nn.LayerNorm):
    """A LayerNorm with its weights in its input's dtype, as runtime.model.RMSNorm casts them."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def _gpu_norms(module, cfg, dtype):
    """The module with each RMSNorm replaced by a LayerNorm: one kernel, as on a GPU (module doc)."""
    for name, child in list(module.named_modules()):
        if type(child).__name__ == "RMSNorm":
            parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            setattr(parent, name.rpartition(".")[2], _OneKernelNorm(child.weight.shape[0]).to(dtype))
    return module


def _small(name, **kw):
    m = ZOO[name]
    shape = dict(layers=1, hidden=256, heads=4, vocab=512, seq_len=32)
    shape.update(kv_heads=2, ffn_hidden=688) if m.arch == "llama" else shape.update(kv_heads=4, ffn_hidden=1024)
    shape.update(kw)
    return dataclasses.replace(m, **shape)


def _kept_bytes(block, x, cos, sin, autocast: bool = False) -> int:
    """Bytes a block's forward keeps for its backward: the storages its saved tensors use (each
    once), less its parameters' and the shared rotary tables'."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x, cos, sin)
    shared = {t.untyped_storage().data_ptr() for t in [*block.parameters(), cos, sin]}
    return sum(v for k, v in kept.items() if k not in shared)


@pytest.mark.parametrize("name", ["llama3-8b", "tiny-gpt", "qwen3-8b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_block_traffic_is_what_the_runtime_block_moves(name, dtype):
    cfg = _small(name)
    b, s, e = 8, 32, torch.tensor([], dtype=dtype).element_size()
    block = _gpu_norms(Block(cfg).to(dtype), cfg, dtype)
    cos, sin = rope_tables(cfg)
    x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
    fwd, bwd = _traced(lambda t: block(t, cos, sin), x)
    pf, pb = eager_bytes(cfg, 1, b, s, 1, False, e, False, "flash")
    assert pf == pytest.approx(fwd, rel=0.03) and pb == pytest.approx(bwd, rel=0.03), (pf, fwd, pb, bwd)


@pytest.mark.parametrize("sp", [False, True])
def test_eager_hidden_dropout_traffic_is_what_the_runtime_block_moves(sp):
    """A block with the runtime's hidden dropout (runtime.dropout): masks drawn for the whole
    sequence and, as a sequence-parallel rank of two keeps half the tokens, its rows copied out."""
    from runtime.dropout import Dropout
    cfg, dtype = _small("tiny-gpt"), torch.bfloat16
    b, s = 8, 32
    block = _gpu_norms(Block(cfg).to(dtype), cfg, dtype)
    local = s // 2 if sp else s
    x = torch.randn(b, local, cfg.hidden, dtype=dtype, requires_grad=True)
    without = _traced(lambda t: block(t), x)
    block.dropout = block.attention.dropout = Dropout(0.1, 0.0, 0, s, 0, torch.arange(local) if sp else None, 0, 0,
                                                      torch.device("cpu"))
    block.zero_grad(set_to_none=True)  # else the second backward adds into the first's gradients
    x.grad = None
    with_ = _traced(lambda t: block(t, key=(0, 0, b, 1)), x)
    plain = eager_bytes(cfg, 1, b, local, 1, False, 2, False, "flash")
    priced = eager_bytes(cfg, 1, b, local, 1, False, 2, True, "flash", attention_dropout=False, draws=2 if sp else 1)
    for i in (0, 1):  # the dropouts' own bytes, forward and backward, within 3% of what they move
        assert priced[i] - plain[i] == pytest.approx(with_[i] - without[i], rel=0.03), (i, priced, plain, with_, without)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_head_and_loss_traffic_is_what_the_runtime_moves(dtype):
    cfg = _small("llama3-8b")
    b, s, e = 8, 32, torch.tensor([], dtype=dtype).element_size()
    head = _gpu_norms(Head(cfg).to(dtype), cfg, dtype)
    targets = torch.randint(0, cfg.vocab, (b, s))
    x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
    fwd, bwd = _traced(lambda t: cross_entropy(head(t), targets), x)
    index = cfg.num_layers_total - 1
    pf, pb = eager_bytes(cfg, index, b, s, 1, False, e, False, "flash")
    assert pf == pytest.approx(fwd, rel=0.03) and pb == pytest.approx(bwd, rel=0.03), (pf, fwd, pb, bwd)


def test_eager_llama_blocks_move_several_times_what_fused_kernels_would():
    """Rotary embeddings in float32 and SwiGLU in two kernels: a bf16 Llama 2 7B block moves about
    twice what fused kernels would, a GPT-3 block (native LayerNorm and GELU) the same forward;
    under TP with SP everything shrinks with tp."""
    llama, gpt = ZOO["llama2-7b"], ZOO["gpt3-175b"]
    eager = eager_bytes(llama, 1, 1, 4096, 1, False, 2, False, "flash")
    fused = fused_bytes(llama, 1, 1, 4096, 1, False, 2, False, "flash")
    assert 1.6 < eager[0] / fused[0] < 2.4 and 1.6 < eager[1] / fused[1] < 2.4
    g_eager = eager_bytes(gpt, 1, 1, 2048, 1, False, 2, False, "flash")
    g_fused = fused_bytes(gpt, 1, 1, 2048, 1, False, 2, False, "flash")
    assert g_eager[0] == pytest.approx(g_fused[0])
    tp4 = eager_bytes(llama, 1, 1, 4096, 4, True, 2, False, "flash")
    assert tp4[0] == pytest.approx(eager[0] / 4)


def _traffic_of_step(opt, params, grads_from):
    """Bytes of one optimizer step (the second: the first creates the moments) with the runtime's
    gradient clipping, under ByteCounter."""
    from runtime.optim import clip_grad_norm
    for _ in range(2):
        for p, g in zip(params, grads_from):
            p.grad = g.clone()
        counter = ByteCounter()
        with counter:
            clip_grad_norm(params, 1.0, None, torch.device("cpu"), reduce=False)
            opt.step()
    return counter.total


def test_eager_optimizer_step_traffic_is_what_torchs_fused_adamw_moves():
    """planner.precision.optimizer_step_bytes for the runtime (eager kernels, bf16 on float32
    weights): torch's fused AdamW step and the runtime's clipping, counted op by op, move what it
    prices; torch's foreach AdamW (the runtime's until session 50) moves 2.4x as much."""
    from planner.build import build_plan
    from planner.precision import optimizer_step_bytes
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4096, 70_000, 300_000)]
    grads = [torch.randn_like(p) * 100 for p in params]  # large enough to be clipped
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    moved = _traffic_of_step(opt, params, grads)
    foreach = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    assert _traffic_of_step(foreach, params, grads) == pytest.approx(96 / 40 * moved, rel=0.01)
    count = sum(p.numel() for p in params)
    kw = dict(cluster_name="x", device="x", nodes=1, devices_per_node=1, global_batch=8, micro_batch=1, seq_len=32,
              dtype="bf16")
    eager = build_plan(ZOO["tiny"], **kw).training
    assert optimizer_step_bytes(eager) * count == pytest.approx(moved, rel=0.01), (optimizer_step_bytes(eager), moved / count)
    fused = dataclasses.replace(eager, elementwise_kernels="fused")  # the master copy writes 16-bit parameters
    assert optimizer_step_bytes(fused) == optimizer_step_bytes(eager) + 6


class _NoWeightCasts(ByteCounter):
    """ByteCounter less the casts of the weights and of their gradients (priced apart:
    planner.precision.autocast_cast_bytes), whose outputs have a weight's shape; their bytes are
    kept in `weight_casts`."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.weight_casts = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.total
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.overloadpacket.__name__ == "_to_copy" and tuple(out.shape) in self.shapes:
            self.weight_casts += self.total - before
            self.total = before
        return out


def _traced_layers(cfg, b, s, counter, dtype, autocast):
    """[(layer index, forward counter, backward counter)] of the runtime's block and of its head with
    the loss, in `dtype` (under bf16 autocast with `autocast`), each traced by a `counter`
    (a _NoWeightCasts class) given the shapes of the module's weights."""
    cos, sin = rope_tables(cfg)
    targets = torch.randint(0, cfg.vocab, (b, s))
    out = []
    for index, module, fn in ((1, Block(cfg), lambda mod, t: mod(t, cos, sin)),
                              (cfg.num_layers_total - 1, Head(cfg), lambda mod, t: cross_entropy(mod(t), targets))):
        module = _gpu_norms(module.to(dtype), cfg, dtype)
        shapes = {tuple(p.shape) for p in module.parameters() if p.dim() == 2}
        x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
        fwd, bwd = counter(shapes), counter(shapes)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
            with fwd:
                y = fn(module, x)
        grad = torch.ones_like(y)
        with bwd:
            y.backward(grad)
        out.append((index, fwd, bwd))
    return out


def test_autocast_weight_casts_are_what_the_runtime_block_moves():
    """planner.precision.autocast_cast_bytes: without data parallelism the runtime's block, float32
    weights under bf16 autocast, casts each weight it multiplies by to bf16 in the forward and each
    such weight's gradient back to float32 in the backward (counted here as the casts whose output
    has a weight's shape)."""
    from planner.build import build_plan
    from planner.precision import autocast_cast_bytes
    cfg = _small("llama3-8b")
    block = Block(cfg)
    cos, sin = rope_tables(cfg)
    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    matmul_params = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    x = torch.randn(4, 32, cfg.hidden, requires_grad=True)
    casts_f, casts_b = _NoWeightCasts(shapes), _NoWeightCasts(shapes)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with casts_f:
            y = block(x, cos, sin)
    with casts_b:
        y.float().sum().backward()
    fwd, bwd = casts_f.weight_casts, casts_b.weight_casts
    kw = dict(cluster_name="x", device="x", nodes=1, devices_per_node=1, global_batch=8, micro_batch=1, seq_len=32,
              dtype="bf16")
    t = build_plan(ZOO["tiny"], **kw).training
    pf, pb = autocast_cast_bytes(t, dp=1)
    assert (pf * matmul_params, pb * matmul_params) == (fwd, bwd)
    assert autocast_cast_bytes(t, dp=2) == (0, 0)  # FSDP2 gathers bf16 weights
    assert autocast_cast_bytes(dataclasses.replace(t, dtype="fp32"), dp=1) == (0, 0)


@pytest.mark.parametrize("name", ["llama3-8b", "tiny-gpt", "qwen3-8b"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_what_a_block_under_autocast_keeps_is_what_the_planner_counts(name, recompute):
    """ModelConfig.activation_bytes plus planner.precision.autocast_held_bytes: what the runtime's
    block keeps for its backward (saved-tensor hooks, counted by storage; its parameters and the
    shared rotary tables left out) with float32 weights and a float32 residual stream under bf16
    autocast, as it trains without data parallelism."""
    from planner.build import build_plan
    from planner.precision import autocast_held_bytes
    cfg = _small(name)
    block = _gpu_norms(Block(cfg), cfg, torch.float32)
    block.full_recompute = recompute == "full"
    cos, sin = rope_tables(cfg)
    b, s = 4, 32
    x = torch.randn(b, s, cfg.hidden, requires_grad=True)
    measured = _kept_bytes(block, x, cos, sin, autocast=True)
    t = build_plan(ZOO["tiny"], cluster_name="x", device="x", nodes=1, devices_per_node=1, global_batch=8,
                   micro_batch=1, seq_len=32, dtype="bf16").training
    mats = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    counted = (cfg.activation_bytes(1, b, s, recompute=recompute, bytes_per_element=2, attention="flash")
               + autocast_held_bytes(cfg, t, 1, 1, recompute, b, s, 1, False, mats))
    assert counted == pytest.approx(measured, rel=0.01), (counted, measured)
    assert autocast_held_bytes(cfg, t, 2, 1, recompute, b, s, 1, False, mats) == 0  # FSDP2: bf16 weights


@pytest.mark.parametrize("name", ["llama3-8b", "tiny-gpt", "qwen3-8b"])
def test_eager_traffic_under_autocast_is_what_the_runtime_moves_without_data_parallelism(name):
    """planner.pointwise with autocast: the runtime's block, head and loss with float32 weights and a
    float32 residual stream under bf16 autocast (no data parallelism) move what it prices, about
    1.6x the bf16 count: float32 norms and residual adds, a cast of each norm's output per linear
    and their gradients cast back and added up in float32."""
    cfg = _small(name)
    b, s = 8, 32
    for index, fwd, bwd in _traced_layers(cfg, b, s, _NoWeightCasts, torch.float32, autocast=True):
        pf, pb = eager_bytes(cfg, index, b, s, 1, False, 2, False, "flash", autocast=True)
        assert pf == pytest.approx(fwd.total, rel=0.03) and pb == pytest.approx(bwd.total, rel=0.03), \
            (index, pf, fwd.total, pb, bwd.total)
        if index == 1:
            assert pf + pb > 1.4 * sum(eager_bytes(cfg, index, b, s, 1, False, 2, False, "flash"))


class _Conversions(_NoWeightCasts):
    """_NoWeightCasts that also sorts what it counts into the classes of dtype-converting kernels
    (planner.device, conversion_bandwidth_bytes_per_s): operands of mixed floating widths (complex64
    counts as float32's) with one broadcast against the output, or else writing float32 from a
    16-bit operand."""

    def __init__(self, shapes):
        super().__init__(shapes)
        self.upcast = self.broadcast = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.total
        out = super().__torch_dispatch__(func, types, args, kwargs)
        moved = self.total - before
        ins = [a for a in args if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())]
        res = out if isinstance(out, torch.Tensor) else (ins[0] if ins else None)
        if moved and res is not None and (res.is_floating_point() or res.is_complex()):
            def width(t):
                return t.element_size() // (2 if t.is_complex() else 1)
            if len({width(t) for t in ins + [res]}) > 1:
                if any(t.numel() < res.numel() for t in ins):
                    self.broadcast += moved
                elif width(res) == 4:
                    self.upcast += moved
        return out


@pytest.mark.parametrize("name", ["llama3-8b", "tiny-gpt", "qwen3-8b"])
@pytest.mark.parametrize("autocast", [True, False])
def test_the_conversions_priced_apart_are_the_runtimes_dtype_converting_kernels(name, autocast):
    """planner.pointwise.conversion_bytes: the bytes of the runtime's block, head and loss that move
    through kernels converting dtypes (upcasts to float32, mixed dtypes with a broadcast operand),
    which run below the copy bandwidth on a GPU; under bf16 autocast on float32 weights (no data
    parallelism) and in bf16 (FSDP2's working weights). None in float32."""
    from planner.pointwise import conversion_bytes
    cfg = _small(name)
    b, s = 8, 32
    dtype = torch.float32 if autocast else torch.bfloat16
    converted = 0
    for index, fwd, bwd in _traced_layers(cfg, b, s, _Conversions, dtype, autocast):
        (uf, bf), (ub, bb) = conversion_bytes(cfg, index, b, s, 1, False, 2, autocast)
        # within 3%, or 1% of the layer's traffic (the loss's per-row float32 scalars)
        slack = 0.01 * (fwd.total + bwd.total)
        for priced, traced in ((uf, fwd.upcast), (bf, fwd.broadcast), (ub, bwd.upcast), (bb, bwd.broadcast)):
            assert priced == pytest.approx(traced, rel=0.03, abs=slack), (index, uf, bf, ub, bb, fwd.upcast,
                                                                          fwd.broadcast, bwd.upcast, bwd.broadcast)
        converted += uf + bf + ub + bb
        assert conversion_bytes(cfg, index, b, s, 1, False, 4, autocast) == ((0, 0), (0, 0))
    assert converted > 0


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_the_q_and_k_norms_keep_on_cpu_what_the_planner_counts(dtype, autocast):
    """Qwen3's per-head q and k norms (qk_norm) as the runtime's block runs them on CPU (F.rms_norm
    decomposed, planner.precision.decomposed_norm_bytes): what they add to what the block keeps for
    its backward is what the planner adds, within 4 bytes a token (measured: 0 in float32 and
    bf16, 2 under bf16 autocast over float32 weights)."""
    from planner.build import build_plan
    from planner.precision import autocast_held_bytes, decomposed_norm_bytes
    b, s = 4, 32
    t = build_plan(ZOO["tiny"], cluster_name="x", device="x", nodes=1, devices_per_node=1, global_batch=8,
                   micro_batch=1, seq_len=s, dtype="fp32" if dtype == torch.float32 and not autocast else "bf16").training
    gaps = []
    for qk_norm in (False, True):
        cfg = _small("qwen3-8b", qk_norm=qk_norm)
        block = Block(cfg).to(dtype)
        cos, sin = rope_tables(cfg)
        x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
        mats = sum(p.numel() for p in block.parameters() if p.dim() == 2)
        counted = (cfg.activation_bytes(1, b, s, bytes_per_element=2 if autocast else x.element_size())
                   + decomposed_norm_bytes(cfg, t, 1, 1, "none", b, s, 1, False)
                   + (autocast_held_bytes(cfg, t, 1, 1, "none", b, s, 1, False, mats) if autocast else 0))
        gaps.append(_kept_bytes(block, x, cos, sin, autocast) - counted)
    assert abs(gaps[1] - gaps[0]) <= 4 * b * s, gaps
