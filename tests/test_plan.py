"""The plan file: validation messages name the field, round trips are byte-identical."""
import json

import pytest

from planner.model import ConfigError
from planner.plan import FORMAT_VERSION, Plan
from planner.build import build_plan, even_stages
from planner.zoo import ZOO


def make(**kw):
    args = dict(cluster_name="dgx-a100-80gb", device="A100", nodes=1, devices_per_node=8, global_batch=16,
                micro_batch=1, tp=2, pp=2)
    args.update(kw)
    return build_plan(kw.pop("model", ZOO["tiny"]), **{k: v for k, v in args.items() if k != "model"})


def test_round_trip_is_byte_identical(tmp_path):
    plan = make(schedule="interleaved-1f1b", virtual_stages=2, recompute="selective", sequence_parallel=True, zero=3)
    plan.prediction = {"step_time_s": 0.1234567890123, "breakdown": {"time": {"compute_s": 1e-9}}}
    first = plan.to_json()
    path = tmp_path / "plan.json"
    path.write_text(first)
    again = Plan.read(path).to_json()
    assert again == first
    assert Plan.from_json(again).content_hash() == plan.content_hash()


def edit(plan, path, value):
    d = json.loads(plan.to_json())
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return json.dumps(d)


@pytest.mark.parametrize("path,value,field", [
    ("mesh.dp", 4, "mesh"),  # degrees do not multiply to the GPU count
    ("mesh.tp", 3, "mesh"),
    ("cluster.devices_per_node", 2, "mesh"),
    ("model.ffn_hidden", 385, "mesh.tp"),  # TP does not divide ffn_hidden
    ("training.global_batch", 15, "training.global_batch"),
    ("pipeline.stages.1.layers", [2, 6], "pipeline.stages[1].layers"),  # layers not covered exactly once
    ("pipeline.stages.0.layers", [0, 2], "pipeline.stages[0]"),
    ("pipeline.stages.1.recompute", ["full"], "pipeline.stages[1].recompute"),
    ("pipeline.stages.0.zero", 4, "pipeline.stages[0].zero"),
    ("pipeline.schedule", "zigzag", "pipeline.schedule"),
    ("pipeline.micro_batches", 3, "pipeline.micro_batches"),
    ("training.dtype", "int8", "training.dtype"),
    ("training.seq_len", 65, "training.seq_len"),
    ("format_version", FORMAT_VERSION + 1, "format_version"),
    ("mesh.order", ["pp", "tp"], "mesh.order"),
    ("training.learning_rate", 1.0, "training.learning_rate"),  # unknown field
    ("pipeline.stages.0.recompte", [], "pipeline.stages[0].recompte"),
    ("model.arch", "bert", "model.arch"),
    ("training.micro_batch", KeyError, "training.micro_batch"),
    ("training.overlap_grad_reduce", "no", "training.overlap_grad_reduce"),
    ("training.overlap_param_gather", 0, "training.overlap_param_gather"),
    ("pipeline.lockstep", 1, "pipeline.lockstep"),
    ("pipeline.recv_buffers", "reused", "pipeline.recv_buffers"),
    ("pipeline.sent_outputs", "dropped", "pipeline.sent_outputs"),
    ("pipeline.p2p", "split", "pipeline.p2p"),
    ("training.async_tp_allreduce", "yes", "training.async_tp_allreduce"),
    ("training.grad_accumulation", "fp8", "training.grad_accumulation"),
    ("training.elementwise_kernels", "triton", "training.elementwise_kernels"),
    ("training.fsdp_copies", "no", "training.fsdp_copies"),
    ("training.sp_saved_inputs", "sharded", "training.sp_saved_inputs"),
    ("training.selective_recompute", "layer", "training.selective_recompute"),
    ("training.attention", "xformers", "training.attention"),
    ("training.fp8", "e5m2", "training.fp8"),
    ("training.fp8_param_gather", "yes", "training.fp8_param_gather"),
    ("training.tp_comm_overlap", 1, "training.tp_comm_overlap"),
    ("training.adam_moments", "bf16", "training.adam_moments"),
])
def test_validation_names_the_field(path, value, field):
    text = edit(make(), path, value)
    with pytest.raises(ConfigError) as info:
        Plan.from_json(text)
    msg = str(info.value)
    assert msg.startswith(field), msg
    assert "\n" not in msg


def test_tp_must_divide_heads_and_kv_heads():
    with pytest.raises(ConfigError, match="mesh.tp: 8 does not divide model.kv_heads=4"):
        make(tp=8, pp=1)


def test_tp_larger_than_a_node_is_refused():
    with pytest.raises(ConfigError, match="mesh.tp: 8 is larger than a node"):
        make(devices_per_node=4, nodes=2, tp=8, pp=1)


def test_not_json_is_a_clear_error():
    with pytest.raises(ConfigError, match="not valid JSON"):
        Plan.from_json("{not json")


def test_even_stages_megatron_and_llama3_splits():
    gpt = ZOO["mt-nlg-530b"]  # 105 blocks on 35 stages: 3 blocks each, embedding and head extra
    st = even_stages(gpt, 35)
    assert [s.num_layers for s in st] == [4] + [3] * 33 + [4]
    llama = ZOO["llama3-405b"]  # 126 blocks + 2 on 16 stages: first and last hold one block fewer
    st = even_stages(llama, 16)
    assert [s.num_layers for s in st] == [8] * 16
    assert st[0].layers == [0, 8] and st[-1].layers == [120, 128]


def test_mesh_groups_keep_tp_inside_a_node():
    plan = make(nodes=2, devices_per_node=4, tp=4, pp=2)
    assert plan.mesh.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r in range(8):
        assert plan.mesh.rank(**plan.mesh.coords(r)) == r


def test_1f1b_needs_a_micro_batch_per_stage():
    with pytest.raises(ConfigError, match="pipeline.micro_batches: 1 is fewer than pp=2"):
        make(global_batch=4, micro_batch=1, tp=1, pp=2, dp=4)
    make(global_batch=4, micro_batch=1, tp=1, pp=2, dp=4, schedule="gpipe")  # GPipe has no such need


def test_sequence_parallel_is_the_same_on_every_stage():
    text = edit(make(sequence_parallel=True), "pipeline.stages.1.sequence_parallel", False)
    with pytest.raises(ConfigError, match="sequence_parallel differs between stages"):
        Plan.from_json(text)


def test_execution_options_round_trip_and_are_omitted_at_their_defaults(tmp_path):
    default = make()
    d = json.loads(default.to_json())
    assert "overlap_grad_reduce" not in d["training"] and "lockstep" not in d["pipeline"]
    assert "recv_buffers" not in d["pipeline"] and "p2p" not in d["pipeline"]
    assert "async_tp_allreduce" not in d["training"] and "grad_accumulation" not in d["training"]
    assert "elementwise_kernels" not in d["training"] and "fsdp_copies" not in d["training"]
    assert "sent_outputs" not in d["pipeline"] and "adam_moments" not in d["training"]
    plan = make(overlap_grad_reduce=False, lockstep=True, recv_buffers="preallocated", p2p="scatter-gather",
                sent_outputs="freed", adam_moments="param_dtype",
                async_tp_allreduce=True, grad_accumulation="fused", elementwise_kernels="fused", fsdp_copies=False,
                fp8="current", fp8_param_gather=True, tp_comm_overlap=True)
    assert "fp8" not in d["training"] and "tp_comm_overlap" not in d["training"]
    first = plan.to_json()
    back = Plan.from_json(first)
    assert back.training.overlap_grad_reduce is False and back.pipeline.lockstep is True
    assert back.pipeline.recv_buffers == "preallocated" and back.pipeline.p2p == "scatter-gather"
    assert back.pipeline.sent_outputs == "freed" and back.training.adam_moments == "param_dtype"
    assert back.training.async_tp_allreduce is True and back.training.grad_accumulation == "fused"
    assert back.training.elementwise_kernels == "fused" and back.training.fsdp_copies is False
    assert (back.training.fp8, back.training.fp8_param_gather, back.training.tp_comm_overlap) == ("current", True, True)
    assert back.to_json() == first
    assert back.content_hash() != default.content_hash()


def test_lockstep_needs_plain_1f1b():
    with pytest.raises(ConfigError, match="^pipeline.lockstep"):
        make(schedule="interleaved-1f1b", virtual_stages=2, lockstep=True)


def test_mesh_groups_and_their_node_shapes_match_rank_by_rank():
    """Mesh.group (a range) lists rank(**coords, dim=i) for each i, in every order; the cluster
    prices a large group (numpy, run lengths for a rising range) as it prices its list, with the
    shipped node map and with a measured one (topology.node_of_rank)."""
    import itertools
    import random
    from planner.cluster import load_cluster
    from planner.plan import Mesh
    plain = load_cluster("dgx-a100-80gb").with_nodes(64)
    mapped = load_cluster("dgx-a100-80gb").with_nodes(64)
    mapped.node_of_rank = random.Random(0).sample([r // 8 for r in range(512)], 512)

    def shape(cluster, ranks):
        per_node = {}
        for r in ranks:
            per_node[cluster.node_of(r)] = per_node.get(cluster.node_of(r), 0) + 1
        return len(ranks), len(per_node), max(per_node.values())
    for order, (pp, dp, tp) in itertools.product(itertools.permutations(("pp", "dp", "tp")),
                                                 ((2, 128, 2), (4, 16, 8), (1, 512, 1), (8, 64, 1))):
        mesh = Mesh(pp=pp, dp=dp, tp=tp, order=list(order))
        for dim in ("pp", "dp", "tp"):
            others = {d: mesh.size(d) - 1 for d in ("pp", "dp", "tp") if d != dim}
            group = mesh.group(dim, **others)
            assert list(group) == [mesh.rank(**others, **{dim: i}) for i in range(mesh.size(dim))]
            for cluster in (plain, mapped):
                assert cluster.group_shape(group) == cluster.group_shape(list(group)) == shape(cluster, group)
