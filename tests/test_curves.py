"""The cluster profile's measured curves: collective bus bandwidth by message size, GEMM rate by
size, fused attention rate by sequence length; their validation; and what they do to a layer's cost."""

import pytest

from test_cost import A100, plan_for


def _a100_dict():
    import json
    from planner.cluster import PROFILE_DIR
    return json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())


def test_measured_busbw_curve_prices_each_size_at_its_own_bandwidth():
    """Every point of the shipped nccl-tests curve is reproduced exactly (t = 2(n-1)/n S / busbw),
    a size between two points lies between their bandwidths, and mid-size messages run well below
    the large-message line that one alpha-beta fit would give."""
    curve = _a100_dict()["collectives"]["all_reduce"]["intra_node"]["bus_bandwidth_by_size"]
    ranks = list(range(8))
    for size, busbw in curve:
        assert A100.collective_time("all_reduce", size, ranks) == pytest.approx(1.75 * size / busbw, rel=1e-9)
    (_, b1), (s2, b2) = curve[16], curve[17]  # 64 MiB and 128 MiB
    mid = 96 * 2**20
    bw = 1.75 * mid / A100.collective_time("all_reduce", mid, ranks)
    assert b1 < bw < b2
    line = A100.collectives["all_reduce"]["intra_node"]
    assert A100.collective_time("all_reduce", mid, ranks) > 1.15 * (line.alpha_s + 1.75 * mid / line.bus_bandwidth_bytes_per_s)
    # below the smallest measured size: the time of the smallest (latency-bound), never zero
    t_small = A100.collective_time("all_reduce", curve[0][0], ranks)
    assert A100.collective_time("all_reduce", 8, ranks) == pytest.approx(t_small)
    # other group sizes use the same busbw with their own ring factor
    assert A100.collective_time("all_reduce", s2, [0, 1]) == pytest.approx(1.0 * s2 / b2)
    # a ring across nodes runs at its slower tier's pace, and pays its latency once
    two = A100.with_nodes(2)
    inter = A100.collectives["all_reduce"]["inter_node"]
    f16 = 2 * 15 / 16
    for size in (8, s2):
        t_nic = inter.alpha_s + f16 * size / (8 * inter.bus_bandwidth_bytes_per_s)
        t_nvl = f16 * max(size, curve[0][0]) / (b2 if size == s2 else curve[0][1])
        assert two.collective_time("all_reduce", size, range(16)) == pytest.approx(max(t_nic, t_nvl))


def test_gemm_rate_follows_the_measured_curve_and_falls_back_to_the_scalar():
    from planner.layers import gemm_time
    dev = A100.device
    pts = _a100_dict()["device"]["matmul_flops_by_size"]["bf16"]
    for edge, rate in pts:
        assert dev.gemm_flops_per_s("bf16", edge, edge, edge) == pytest.approx(rate)
    # a product of the same arithmetic intensity as the 8192 cube runs at its rate, whatever its shape
    assert dev.gemm_flops_per_s("bf16", 16384, 16384, 4096) == pytest.approx(pts[3][1])
    # the non-square products of the curve's source table (Azure AI-benchmarking-guide, A100 FP16)
    for (M, N, K), measured in (((6144, 12288, 12288), 250.8e12), ((1024, 2145, 1024), 132.8e12),
                                ((802816, 192, 768), 157.8e12)):
        t = gemm_time(1, M, N, K, 2, lambda a, b, c: dev.gemm_flops_per_s("fp16", a, b, c), dev.memory_bytes_per_s)
        assert -0.25 < 2 * M * N * K / t / measured - 1 < 0.12, (M, N, K)
    # between two measured cubes: between their rates; outside the range: clamped
    assert pts[3][1] < dev.gemm_flops_per_s("bf16", 12000, 12000, 12000) < pts[4][1]
    assert dev.gemm_flops_per_s("bf16", 64, 64, 64) == pytest.approx(pts[0][1])
    assert dev.gemm_flops_per_s("bf16", 10**6, 10**6, 10**6) == pytest.approx(pts[-1][1])
    # dtypes without a curve: peak x matmul_efficiency
    assert dev.gemm_flops_per_s("fp32", 8192, 8192, 8192) == pytest.approx(dev.matmul_flops_per_s("fp32"))


def test_measured_curves_are_validated_with_one_line_errors():
    from planner.cluster import cluster_from_dict
    from planner.model import ConfigError
    cases = [
        (("collectives", "all_reduce", "intra_node", "bus_bandwidth_by_size"), [[1024, 1e9]],
         "collectives.all_reduce.intra_node.bus_bandwidth_by_size"),
        (("collectives", "all_reduce", "intra_node", "bus_bandwidth_by_size"), [[2048, 1e9], [1024, 2e9]],
         "rise strictly"),
        (("device", "matmul_flops_by_size", "bf16"), [[1024, 1e12], [2048, "fast"]], "matmul_flops_by_size.bf16"),
        (("device", "matmul_flops_by_size", "bf16"), [[1024, 1e12], [2048, 9e14]], "above peak_flops.bf16"),
        (("device", "matmul_flops_by_size", "int4"), [[1024, 1e12], [2048, 2e12]], "matmul_flops_by_size.int4"),
        (("device", "attention_flops", "bf16"), 4e14, "attention_flops.bf16: above peak_flops.bf16"),
        (("device", "attention_flops", "bf16"), "fast", "attention_flops"),
        (("device", "attention_flops"), [1e14], "attention_flops"),
        (("device", "attention_flops_by_seq"), {"flash": []}, "attention_flops_by_seq: expected an object of kernel"),
        (("device", "attention_flops_by_seq"), {"flash": {"d64": [[512, 1e14], [1024, 1e14]]}},
         "attention_flops_by_seq.flash.d64: the key must be a head dimension"),
        (("device", "attention_flops_by_seq"), {"flash": {"64": [[512, 1e14], [1024, 9e14]]}},
         "attention_flops_by_seq.flash.64: a rate above the 16-bit peak_flops"),
        (("device", "attention_flops_by_seq"), {"flash": {"64": [[1024, 1e14], [512, 1e14]]}}, "rise strictly"),
        (("device", "conversion_bandwidth_bytes_per_s"), 1e12, "conversion_bandwidth_bytes_per_s: expected an object"),
        (("device", "conversion_bandwidth_bytes_per_s"), {"downcast": 1e12},
         "conversion_bandwidth_bytes_per_s.downcast: unknown class; use upcast or broadcast"),
        (("device", "conversion_bandwidth_bytes_per_s"), {"upcast": -1}, "conversion_bandwidth_bytes_per_s.upcast"),
    ]
    for path, value, words in cases:
        d = _a100_dict()
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(ConfigError) as exc:
            cluster_from_dict(d, "p.json")
        assert "\n" not in str(exc.value) and words in str(exc.value), str(exc.value)


def test_fused_attention_runs_at_the_profiles_measured_rate():
    """FlashAttention is not a library GEMM: where the profile measured it, the fused attention
    core runs at that rate, forward and backward: the causal curve by sequence length and head
    dimension (device.attention_flops_by_seq, FlashAttention-2 paper Fig. 4 for A100), else the
    one figure (device.attention_flops), else the MAMF rate."""
    import dataclasses
    from planner.cluster import cluster_from_dict
    from planner.layers import attention_core_hw_flops, layer_cost
    from planner.model import ConfigError
    d = _a100_dict()
    curve = cluster_from_dict(d, "a100").device
    del d["device"]["attention_flops_by_seq"]
    figure = cluster_from_dict(d, "a100").device
    del d["device"]["attention_flops"]
    none = cluster_from_dict(d, "a100").device
    # the curve's own points (Dao 2023, Fig. 4c/4d), between them in log(seq) and head dimension,
    # held outside; the Triton kernel has its own
    assert curve.attention_flops_per_s("bf16", 4096, 128) == pytest.approx(173e12)
    assert curve.attention_flops_per_s("fp16", 512, 64) == pytest.approx(88e12)
    assert curve.attention_flops_per_s("bf16", 2048, 96) == pytest.approx((140e12 + 155e12) / 2)
    assert curve.attention_flops_per_s("bf16", 2048 * 2 ** 0.5, 128) == pytest.approx((155e12 + 173e12) / 2)
    assert curve.attention_flops_per_s("bf16", 65536, 128) == pytest.approx(189e12)
    assert curve.attention_flops_per_s("bf16", 128, 256) == pytest.approx(99e12)
    assert curve.attention_flops_per_s("bf16", 2048, 128, "flash-triton") == pytest.approx(69e12)
    assert curve.attention_flops_per_s("fp32", 2048, 128) == pytest.approx(curve.matmul_flops_per_s("fp32"))
    assert figure.attention_flops_per_s("bf16", 2048, 128) == pytest.approx(179.5e12)
    assert none.attention_flops_per_s("bf16", 2048, 128) == pytest.approx(none.matmul_flops_per_s("bf16"))
    with pytest.raises(ConfigError, match="no attention_flops_by_seq.flash-triton"):
        figure.attention_flops_per_s("bf16", 2048, 128, "flash-triton")
    plan = plan_for(model="llama2-7b", tp=2, seq_len=4096, micro_batch=1)
    m, tp = plan.model, 2
    f_core, b_core = attention_core_hw_flops(m, 1, 4096, "flash")
    slow = 1 / none.matmul_flops_per_s("bf16")
    ref = layer_cost(plan, dataclasses.replace(A100, device=none), 1, plan.pipeline.stages[0], [0, 1])
    for dev, rate in ((curve, 173e12), (figure, 179.5e12)):
        a = layer_cost(plan, dataclasses.replace(A100, device=dev), 1, plan.pipeline.stages[0], [0, 1])
        assert a.fwd_compute_s - ref.fwd_compute_s == pytest.approx(f_core / tp * (1 / rate - slow), rel=1e-6)
        assert a.bwd_compute_s - ref.bwd_compute_s == pytest.approx(b_core / tp * (1 / rate - slow), rel=1e-6)
    # the Triton kernel: the same FLOPs and memory, at its own (lower) rate
    triton = plan_for(model="llama2-7b", tp=2, seq_len=4096, micro_batch=1, attention="flash-triton")
    t = layer_cost(triton, A100, 1, triton.pipeline.stages[0], [0, 1])
    a = layer_cost(plan, A100, 1, plan.pipeline.stages[0], [0, 1])
    assert t.fwd_compute_s - a.fwd_compute_s == pytest.approx(f_core / tp * (1 / 76e12 - 1 / 173e12), rel=1e-6)
    assert t.activation_bytes == a.activation_bytes


def test_dtype_converting_kernels_run_at_the_profiles_measured_bandwidth():
    """device.conversion_bandwidth_bytes_per_s: an eager bf16 layer's upcasts and broadcast
    conversions (planner.pointwise.conversion_bytes) run at their measured bandwidths, the rest of
    its memory-bound bytes at the copy bandwidth; without the field, all at the copy bandwidth.
    The fused kernels of Megatron-style plans convert nothing and are not slowed."""
    import dataclasses
    from planner.cluster import cluster_from_dict
    from planner.layers import layer_cost, layer_params_on_device, replicated_params
    from planner.pointwise import conversion_bytes
    d = _a100_dict()
    plain = cluster_from_dict(d, "a100")
    d["device"]["conversion_bandwidth_bytes_per_s"] = {"upcast": 5e11, "broadcast": 2.5e11}
    slow = cluster_from_dict(d, "a100")
    bw = plain.device.memory_bytes_per_s
    for nodes in (2, 1):  # dp 2 (FSDP2's bf16 weights); dp 1 (float32 weights under autocast)
        plan = plan_for("llama3-8b", nodes=nodes, tp=8, pp=1, global_batch=8, micro_batch=1, dtype="bf16")
        eager = dataclasses.replace(plan, training=dataclasses.replace(plan.training, elementwise_kernels="eager"))
        stage, m, autocast = eager.pipeline.stages[0], eager.model, nodes == 1
        for index in (1, m.num_layers_total - 1):  # a block (rotary upcasts), the head (the loss's broadcasts)
            a, b = (layer_cost(eager, c, index, stage, list(range(8))) for c in (plain, slow))
            (up_f, bc_f), (up_b, bc_b) = conversion_bytes(m, index, 1, eager.training.seq_len, 8, False, 2, autocast)
            if autocast:  # each weight's gradient cast back to float32 (planner.precision)
                kind = m.layer_kind(index)
                up_b += 6 * (layer_params_on_device(m, index, 8) - replicated_params(m, kind))
            for t_plain, t_slow, up, bc in ((a.fwd_compute_s, b.fwd_compute_s, up_f, bc_f),
                                            (a.bwd_compute_s, b.bwd_compute_s, up_b, bc_b)):
                extra = up * (1 / 5e11 - 1 / bw) + bc * (1 / 2.5e11 - 1 / bw)
                assert t_slow - t_plain == pytest.approx(extra, rel=1e-6) and extra > 0
        plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, elementwise_kernels="fused"))
        fused = [layer_cost(plan, c, 1, plan.pipeline.stages[0], list(range(8))) for c in (plain, slow)]
        assert fused[0].fwd_compute_s == fused[1].fwd_compute_s and fused[0].bwd_compute_s == fused[1].bwd_compute_s
