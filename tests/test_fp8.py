"""FP8 linears (planner.fp8): the blocks' products at the FP8 rate, their casts by recipe, the
weight copies a recipe keeps, and what is refused."""
import json
import math

import pytest

from planner.build import build_plan
from planner.cli import main as cli_main
from planner.cluster import load_cluster
from planner.cost import estimate
from planner.fp8 import CAST_BYTES, cast_bytes, fp8_rate
from planner.layers import layer_cost
from planner.model import ConfigError
from planner.plan import Plan
from planner.zoo import ZOO

H100 = load_cluster("dgx-h100-80gb")


def plan_for(model="llama3-8b", cluster=H100, **kw):
    args = dict(cluster_name=cluster.name, device=cluster.device.name, nodes=1, devices_per_node=8, dp=8,
                global_batch=32, micro_batch=1, seq_len=4096, zero=1)
    args.update(kw)
    return build_plan(ZOO[model] if isinstance(model, str) else model, **args)


def block(plan, cluster=H100):
    stage = plan.pipeline.stages[0]
    return layer_cost(plan, cluster, 1, stage, plan.mesh.group("tp", pp=0, dp=0))


# Azure's sustained cuBLASLt FP8 sweep on an ND H100 v5 (m = n = k, TFLOPS; profiles/hardware/
# dgx-h100-80gb.json, device.matmul_flops_by_size.fp8)
AZURE_H100_FP8 = [(1024, 274.1), (2048, 1011.3), (4096, 1216.9), (8192, 1290.1), (16384, 1377.3), (32768, 1382.2)]


def azure_h100_fp8(M, N, K):
    """FLOP/s of an M x K by K x N FP8 product on the H100 curve: the cube of equal arithmetic
    intensity (edge 3MNK / (MK + KN + MN)), linear in log(edge) between the table's sizes."""
    edge = 3 * M * N * K / (M * K + K * N + M * N)
    for (e1, r1), (e2, r2) in zip(AZURE_H100_FP8, AZURE_H100_FP8[1:]):
        if e1 <= edge <= e2:
            return 1e12 * (r1 + (r2 - r1) * math.log(edge / e1) / math.log(e2 / e1))
    raise AssertionError(edge)


def test_the_block_linears_run_at_the_fp8_rate_with_their_casts():
    """Closed form for a Llama block (tp 1, tokens T = 4096): each linear's FLOPs move from the
    BF16 rate to the FP8 one of its shape (QKV T x h x (q + 2kv), the output projection T x q x h,
    gate and up as one 2T x h x f product, down T x f x h), and the casts add their bytes."""
    m, T = ZOO["llama3-8b"], 4096
    h, f, q, kv = m.hidden, m.ffn_hidden, m.q_dim, m.kv_dim
    products = [(T, q + 2 * kv, h), (T, h, q), (2 * T, f, h), (T, h, f)]  # (M, N, K)
    flops = sum(2 * M * N * K for M, N, K in products)
    assert flops == 2 * T * (h * (q + 2 * kv) + h * q + 3 * h * f)
    weights = h * (q + 2 * kv) + q * h + 3 * h * f
    inputs = T * (h + q + h + f)  # QKV's, the output projection's, gate and up's (one), down's
    grads = T * ((q + 2 * kv) + h + 2 * f + h)
    bf16 = H100.device.matmul_flops_per_s("bf16")
    gain = sum(2 * M * N * K * (1 / bf16 - 1 / azure_h100_fp8(M, N, K)) for M, N, K in products)  # compute-bound
    bw = H100.device.memory_bytes_per_s
    base = block(plan_for())
    for recipe, cached in (("tensorwise", False), ("current", True), ("delayed", True), ("mxfp8", True)):
        c = block(plan_for(fp8=recipe))
        mbs = 32 // 8  # micro-batches of one sequence a step on each of 8 data-parallel ranks
        cast_f = CAST_BYTES[recipe] * (inputs + weights / (mbs if cached else 1)) / bw
        cast_b = CAST_BYTES[recipe] * grads / bw
        assert base.fwd_compute_s - c.fwd_compute_s == pytest.approx(gain - cast_f, rel=1e-6)
        assert base.bwd_compute_s - c.bwd_compute_s == pytest.approx(2 * gain - cast_b, rel=1e-6)
        assert base.bwd_weight_s - c.bwd_weight_s == pytest.approx(gain, rel=1e-6)
        # TransformerEngine's recipes keep the four linears' inputs in 8 bits: a byte an element less
        less = 0 if recipe == "tensorwise" else T * (2 * h + q + f)
        assert (base.activation_bytes - c.activation_bytes, c.params) == (less, base.params)
    assert CAST_BYTES["tensorwise"] == CAST_BYTES["current"] == 6 and CAST_BYTES["delayed"] == 4
    # fused elementwise kernels compute the amax in the kernel that writes the tensor: its read goes
    assert [cast_bytes(r, "fused") for r in ("tensorwise", "current", "delayed")] == [4, 4, 4]
    fused = block(plan_for(fp8="current", elementwise_kernels="fused")), block(plan_for(elementwise_kernels="fused"))
    cached = 4 * (inputs + weights / (32 // 8)) / bw  # the fused forward's casts, at 4 bytes
    assert fused[1].fwd_compute_s - fused[0].fwd_compute_s == pytest.approx(gain - cached)


def test_fp8_speeds_a_step_and_keeps_weight_copies_where_the_recipe_caches_them():
    base = estimate(plan_for(), H100)
    tensorwise = estimate(plan_for(fp8="tensorwise"), H100)
    current = estimate(plan_for(fp8="current"), H100)
    assert current.step_time_s < tensorwise.step_time_s < base.step_time_s
    parts = lambda e: e.breakdown["memory"]["other_parts"]  # noqa: E731
    assert parts(base)["fp8_weight_copies"] == parts(tensorwise)["fp8_weight_copies"] == 0
    blocks = ZOO["llama3-8b"].block_params() * ZOO["llama3-8b"].layers
    assert parts(current)["fp8_weight_copies"] == pytest.approx(2 * blocks)
    m, T = ZOO["llama3-8b"], 4096  # one micro-batch's activations at a time (no pipeline)
    kept_less = m.layers * T * (2 * m.hidden + m.q_dim + m.ffn_hidden)
    assert current.peak_memory_bytes == pytest.approx(base.peak_memory_bytes + 2 * blocks - kept_less)


def test_an_moe_router_stays_in_16_bits():
    from planner.fp8 import is_fp8_product
    m = ZOO["mixtral-8x7b"]
    gemms = m.block_gemms(1, 1024)[:-2]
    kept = [g for g in gemms if not is_fp8_product(m, g)]
    assert kept == [(1, 1024, m.moe.experts, m.hidden)] and len(gemms) > 1  # the router alone


def test_the_plan_file_keeps_the_recipe(tmp_path):
    plan = plan_for(fp8="delayed")
    path = tmp_path / "p.json"
    plan.write(path)
    assert json.loads(path.read_text())["training"]["fp8"] == "delayed"
    assert Plan.read(str(path)).training.fp8 == "delayed"
    plan_for().write(path)
    assert "fp8" not in json.loads(path.read_text())["training"]  # an option added later: written when set


@pytest.mark.parametrize("change, words", [
    (dict(fp8="e4m3"), "use one of tensorwise, current, delayed, mxfp8"),
    (dict(fp8="tensorwise", dtype="fp32", master_weights=False), "16-bit mixed precision"),
])
def test_a_bad_recipe_is_refused_naming_the_field(change, words):
    with pytest.raises(ConfigError, match="training.fp8") as err:
        plan_for(**change)
    assert words in str(err.value)


def test_a_device_without_fp8_is_refused_in_one_line(capsys):
    a100 = load_cluster("dgx-a100-80gb")
    with pytest.raises(ConfigError, match=r"training.fp8: .*A100.* no FP8 rate"):
        estimate(plan_for(cluster=a100, fp8="tensorwise"), a100)
    code = cli_main(["plan", "--model", "llama3-8b", "--cluster", "dgx-a100-80gb", "--nodes", "1", "--dp", "8",
                     "--global-batch", "32", "--micro-batch", "1", "--fp8", "tensorwise"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "training.fp8" in err[0]


def test_every_shipped_fp8_rate_is_below_its_peak_and_twice_bf16s():
    """Peaks from the datasheets, burst rates (MAMF) within 60-80% of them, and the sustained
    curves (H100, H200, GB200) below the burst rate at every size; B200 and B300, with no curve,
    run every shape at the burst rate."""
    from pathlib import Path
    curves = set()
    for path in sorted(Path(__file__).resolve().parent.parent.glob("profiles/hardware/*.json")):
        dev = load_cluster(str(path)).device
        if "fp8" not in dev.peak_flops:
            continue
        assert dev.peak_flops["fp8"] == 2 * dev.peak_flops["bf16"]  # every datasheet here: FP8 doubles BF16
        assert 0.6 < dev.matmul_efficiency["fp8"] < 0.8
        burst = dev.matmul_flops_per_s("fp8")
        if dev.matmul_by_size.get("fp8"):
            curves.add(path.stem)
            assert all(r < burst for _, r in dev.matmul_by_size["fp8"])
        else:
            assert fp8_rate(dev)(8192, 8192, 8192) == fp8_rate(dev)(1024, 2048, 512) == burst
    assert curves == {"dgx-h100-80gb", "hgx-h100-4gpu-80gb", "hgx-h200-141gb", "hgx-h200-4gpu-141gb",
                      "gb200-nvl72-186gb"}
    assert fp8_rate(H100.device)(8192, 8192, 8192) == pytest.approx(1290.1e12)
    assert fp8_rate(H100.device)(6144, 12288, 12288) == pytest.approx(azure_h100_fp8(6144, 12288, 12288))


def test_fp8_parameters_are_gathered_in_a_byte_and_held_once():
    """ZeRO 1 over 16 ranks on two nodes: the all-gather after the optimizer step moves one byte for
    each FP8 linear's weight (the blocks' parameters but their two norms) and two for the rest;
    the weights' 8-bit copies are the parameters, no copy beside them. (The gather after the step,
    not beside the next forward, which could hide either.)"""
    kw = dict(nodes=2, dp=16, fp8="current", overlap_param_gather=False)
    plain, fp8_params = (estimate(plan_for(**kw, fp8_param_gather=g), H100) for g in (False, True))
    m = ZOO["llama3-8b"]
    P, F = m.num_parameters(), m.layers * (m.block_params() - 2 * m.hidden)
    ranks = plan_for(**kw).mesh.shard_group(pp=0, tp=0)
    gather = lambda n: H100.shaped_as(2, 8).collective_time("all_gather", n, ranks)  # noqa: E731
    saved = gather(2 * P) - gather(2 * (P - F) + F)
    assert saved > 0
    exposed = lambda e: e.breakdown["time"]["dp_comm_exposed_s"]  # noqa: E731
    assert exposed(plain) - exposed(fp8_params) == pytest.approx(saved, rel=1e-6)
    parts = lambda e: e.breakdown["memory"]["other_parts"]["fp8_weight_copies"]  # noqa: E731
    assert parts(fp8_params) == 0 and parts(plain) == pytest.approx(2 * m.layers * m.block_params())


def test_gradients_fused_into_16_bit_buffers_take_two_bytes():
    """Megatron-Bridge's configs: gradient accumulation fusion into bf16 buffers (grad_reduce_in_fp32
    false): half the float32 buffers' bytes, no accumulation pass."""
    fused, fused16 = (estimate(plan_for(grad_accumulation=g), H100) for g in ("fused", "fused-16bit"))
    grads = lambda e: e.breakdown["memory"]["gradients_bytes"]  # noqa: E731
    assert grads(fused16) == pytest.approx(grads(fused) / 2)
    assert fused16.breakdown["time"]["compute_s"] == pytest.approx(fused.breakdown["time"]["compute_s"])


def test_fp8_parameters_need_fp8():
    with pytest.raises(ConfigError, match="training.fp8_param_gather: true gathers FP8 weights, which need FP8 linears: set training.fp8"):
        plan_for(fp8_param_gather=True)


def test_sequence_parallel_gathers_move_a_byte_an_element():
    """TransformerEngine quantizes a column-parallel linear's input, and the output gradient of a
    row-parallel one, before it all-gathers them; the reduce-scatters stay 16-bit. Llama 3 8B on
    one node, TP 8 with sequence parallelism, shards kept: forward two 8-bit all-gathers and two
    reduce-scatters; backward two 8-bit gathers of output gradients, two regathers, two scatters."""
    kw = dict(tp=8, dp=1, global_batch=8, sequence_parallel=True)
    plain, current, mx = (block(plan_for(fp8=r, **kw)) for r in (None, "current", "mxfp8"))
    act, ranks = 2 * 4096 * ZOO["llama3-8b"].hidden, list(range(8))
    ag, rs = (H100.collective_time(op, act, ranks) for op in ("all_gather", "reduce_scatter"))
    ag8, agmx = (H100.collective_time("all_gather", act / 2 * x, ranks) for x in (1, 1 + 1 / 32))
    assert plain.fwd_tp_s == pytest.approx(2 * (ag + rs)) and plain.bwd_tp_s == pytest.approx(4 * ag + 2 * rs)
    assert current.fwd_tp_s == pytest.approx(2 * (ag8 + rs)) and current.bwd_tp_s == pytest.approx(4 * ag8 + 2 * rs)
    assert mx.fwd_tp_s == pytest.approx(2 * (agmx + rs)) and ag8 < agmx < ag
