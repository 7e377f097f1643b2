"""Bad cluster profiles, model JSON and Hugging Face config.json files give a one-line ConfigError
naming the field (found by fuzzing the loaders), never a traceback or a silent wrong plan."""
import copy
import json
import re
import subprocess
import sys

import pytest

from planner.cluster import PROFILE_DIR, cluster_from_dict, load_cluster
from planner.hf_config import from_hf_config
from planner.model import ConfigError, ModelConfig
from planner.model_files import load_model
from planner.rope import RopeScaling
from planner.zoo import ZOO

NAN, INF = float("nan"), float("inf")
A100 = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
HF = {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 128,
      "intermediate_size": 384, "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 64}
DEL = object()


def _set(d, path, value):
    for k in path[:-1]:
        d = d[k]
    if value is DEL:
        del d[path[-1]]
    else:
        d[path[-1]] = value


def _every_tier(key, value):
    def mutate(d):
        for op in d["collectives"].values():
            for tier in op.values():
                tier[key] = value
    return mutate


def _segments(*ups):
    return {"2": {"alpha_s": 1e-5, "bus_bandwidth_bytes_per_s": 1e11,
                  "segments": [{"up_to_bytes": u, "alpha_s": 1e-5, "bus_bandwidth_bytes_per_s": 1e11} for u in ups]}}


def _no_bf16(d):
    dev = d["device"]
    for k in ("attention_flops", "matmul_flops_by_size", "attention_flops_by_seq"):
        dev.pop(k)
    dev["peak_flops"].pop("bf16")
    dev["matmul_efficiency"].pop("bf16")


AR = ("collectives", "all_reduce", "intra_node")
PROFILE_CASES = [
    # (path or mutation, value, words the message must contain)
    (("device", "memory_bytes"), NAN, r"device\.memory_bytes: nan is not a finite number"),
    (("device", "memory_bytes"), INF, r"device\.memory_bytes: inf is not a finite number"),
    (_every_tier("bus_bandwidth_bytes_per_s", NAN), None, r"bus_bandwidth_bytes_per_s: nan is not a finite"),
    (("sources", "device.memory_bytes"), INF, r"sources\.device\.memory_bytes: inf"),
    (("overlap_slowdown",), "x", r"overlap_slowdown 'x' must be a number from 1 to 100"),
    (("overlap_slowdown",), [1], r"overlap_slowdown \[1\] must be a number from 1 to 100"),
    (("overlap_slowdown",), -1, r"overlap_slowdown -1 must be a number from 1 to 100"),
    (("overlap_slowdown",), 1e30, r"overlap_slowdown 1e\+30 must be a number from 1 to 100"),
    (("compute_slots",), 1e-300, r"compute_slots 1e-300 must be a number from 0.01"),
    (("nodes",), 10**18, r"nodes 1000000000000000000 must be a positive integer, at most 1048576"),
    (("tiers", "inter_node", "zz"), 1, r"tiers\.inter_node\.zz: unknown field"),
    (("collectives", "all_reduce", "intra_node", "by_group_size"), 0, r"by_group_size: expected an object"),
    (("collectives", "all_reduce", "inter_node", "by_group_size"), {"4": {"alpha_s": 1e-5,
     "bus_bandwidth_bytes_per_s": 1e10, "members_per_node": 0}}, r"by_group_size\.4\.members_per_node: 0 must be"),
    (("overlap_slowdown",), True, r"overlap_slowdown True must be a number"),
    (("overlap_slowdown",), INF, r"overlap_slowdown: inf is not a finite number"),
    (AR + ("by_group_size",), [1, 2], r"all_reduce\.intra_node\.by_group_size: expected an object"),
    (AR + ("by_group_size",), {"0": {"alpha_s": 0, "bus_bandwidth_bytes_per_s": 1}}, r"by_group_size\.0: expected"),
    (AR + ("by_group_size",), _segments(1000, 5000), r"segments\[1\]\.up_to_bytes: 5000 on the last segment"),
    (AR + ("by_group_size",), _segments(None, None), r"segments\[0\]\.up_to_bytes: null before the last"),
    (AR + ("by_group_size",), _segments(5000, 1000, None), r"segments\[1\]\.up_to_bytes: 1000 does not rise"),
    (("device", "memory_bandwidth_efficiency"), 5, r"device\.memory_bandwidth_efficiency: 5 is above 1"),
    (("device", "allocator_overhead_fraction"), 5, r"device\.allocator_overhead_fraction: 5 must be below 1"),
    (("device", "allocator_overhead_fraction"), 1, r"device\.allocator_overhead_fraction: 1 must be below 1"),
    (("device", "reserved_bytes"), -1, r"device\.reserved_bytes: -1 must be a finite non-negative number"),
    (("topology",), {"node_of_rank": [-1, -1, 5, 5]}, r"topology\.node_of_rank\[0\]: -1 is not a node index"),
    (("topology",), {"node_of_rank": [0, 0, 5, 5]}, r"topology\.node_of_rank\[2\]: 5 is not a node index"),
    (("topology",), {"node_of_rank": [0] * 9}, r"topology\.node_of_rank: node 0 has 9 ranks but devices_per_node"),
    (("topology",), {"node_of_rank": [True, False]}, r"topology\.node_of_rank: must be a list of node indices"),
    (("topology",), [0, 1], r"topology\.node_of_rank: must be a list"),
    (("colectives",), {}, r"colectives: unknown field; known fields are backend, collectives, compute_slots"),
    (("device", "memroy_bytes"), 1, r"device\.memroy_bytes: unknown field; known fields are allocator_overhead"),
    (("devices_per_node",), True, r"devices_per_node True must be a positive integer"),
    (("nodes",), True, r"nodes True must be a positive integer"),
    (("format_version",), True, r"format_version True is not supported"),
    (("name",), 5, r"name 5 must be a string"),
    (("device", "name"), ["a"], r"device\.name: \['a'\] must be a string"),
    (("tiers",), [1], r"tiers must be an object"),
    (("tiers", "inter_node"), -1, r"tiers\.inter_node: a tier is intra_node or inter_node, an object with a 'link'"),
    (("tiers", "inter_node", "bandwidth_bytes_per_s"), 0, r"tiers\.inter_node: .* positive 'bandwidth_bytes_per_s'"),
    (("tiers", "nvlink"), {"link": "NVLink"}, r"tiers\.nvlink: a tier is intra_node or inter_node"),
    (("device", "matmul_flops_by_size", "bf16"), [[1024, 1e12], [2048, INF]], r"matmul_flops_by_size\.bf16"),
    (("device", "memory_bytes"), 10**400, r"device\.memory_bytes: an integer of 401 digits is out of range"),
    (("devices_per_node",), 2**64, r"devices_per_node: an integer of 20 digits is out of range"),
    (("device", "name"), "\udc80", r"device\.name: '\\udc80' is not Unicode text"),
    (("name",), " ", r"name must be a non-empty printable string"),
    (("devices_per_node",), 2048, r"devices_per_node 2048 is more than 1024"),
    (("collectives", "broadcast"), {}, r"collectives\.broadcast: unknown field"),
    (("collectives", "all_reduce", "pcie"), {}, r"collectives\.all_reduce\.pcie: unknown field"),
    (AR + ("junk",), 1, r"all_reduce\.intra_node\.junk: unknown field"),
    (AR + ("by_group_size",), {"2": {"alpha_s": 0, "bus_bandwidth_bytes_per_s": 1, "x": 1}},
     r"by_group_size\.2\.x: unknown field"),
    (AR + ("by_group_size",), {"\u00b2": {"alpha_s": 0, "bus_bandwidth_bytes_per_s": 1}},
     r"by_group_size\.\u00b2: expected"),
    (("device", "attention_flops_by_seq"), {"bogus": {"64": [[1024, 1e12]]}},
     r"attention_flops_by_seq\.bogus: unknown kernel"),
    (("device", "attention_flops_by_seq"), {"flash": {"\u00b2": [[1024, 1e12]]}}, r"flash\.\u00b2: the key must be"),
]


@pytest.mark.parametrize("path, value, words", PROFILE_CASES)
def test_a_bad_cluster_profile_is_a_config_error_naming_the_field(path, value, words):
    d = copy.deepcopy(A100)
    path(d) if callable(path) else _set(d, path, value)
    with pytest.raises(ConfigError, match=words) as exc:
        cluster_from_dict(d, "p.json")
    assert "\n" not in str(exc.value)


def test_a_dtype_the_profile_lacks_is_a_config_error_where_a_plan_uses_it():
    d = copy.deepcopy(A100)
    _no_bf16(d)
    dev = cluster_from_dict(d, "p.json").device  # loads: a profile may give only some dtypes
    assert dev.matmul_flops_per_s("fp16") > 0
    for use in (lambda: dev.matmul_flops_per_s("bf16"), lambda: dev.gemm_flops_per_s("bf16", 64, 64, 64),
                lambda: dev.attention_flops_per_s("bf16", 2048, 128), lambda: dev.peak_flops["bf16"]):
        with pytest.raises(ConfigError, match=r"device\.peak_flops: no entry for bf16 .*--dtype fp16"):
            use()


@pytest.mark.parametrize("content, words", [
    (b'{"a": "\xff\xfe"}', r"--cluster: .*x\.json is not UTF-8 text"),
    (None, r"--cluster: cannot read .*x\.json \(Is a directory\)"),
    (b'{"a": ' * 100000, r"--cluster: .*x\.json is not valid JSON"),
])
def test_an_unreadable_profile_file_is_a_config_error_naming_the_path(tmp_path, content, words):
    f = tmp_path / "x.json"
    f.mkdir() if content is None else f.write_bytes(content)
    with pytest.raises(ConfigError, match=words):
        load_cluster(str(f))


TINY = ZOO["tiny"].to_dict()
MODEL_CASES = [
    # Hugging Face config.json (from_hf_config)
    ("hf", {"num_attention_heads": 0}, r"num_attention_heads: is 0; it must be a positive integer"),
    ("hf", {"num_attention_heads": None}, r"num_attention_heads: is null"),
    ("hf", {"hidden_size": "128"}, r"hidden_size: is '128'"),
    ("hf", {"num_hidden_layers": 4.0}, r"num_hidden_layers: is 4\.0"),
    ("hf", {"rms_norm_eps": "abc"}, r"rms_norm_eps: is 'abc'"),
    ("hf", {"rms_norm_eps": [1]}, r"rms_norm_eps: is \[1\]"),
    ("hf", {"rope_theta": -1}, r"rope_theta: is -1"),
    ("hf", {"head_dim": "16"}, r"head_dim: is '16'"),
    ("hf", {"num_key_value_heads": 0}, r"num_key_value_heads: is 0"),
    ("hf", {"tie_word_embeddings": "false"}, r"tie_word_embeddings: is 'false'; it must be true or false"),
    ("hf", {"num_key_value_heads": 3}, r"model\.kv_heads: 3 does not divide heads=8"),
    ("hf", {"model_type": "qwen2", "attention_bias": "yes"}, r"attention_bias: is 'yes'; it must be true or false"),
    ("hf", {"num_hidden_layers": 10**9}, r"model\.layers: is 1000000000; at most 10000"),
    ("hf", {"model_type": "gpt2"}, r"missing 'n_embd', which a gpt2 config must have"),
    ("hf", {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "n_inner": 0},
     r"n_inner: is 0"),
    ("hf", {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "activation_function": "relu"},
     r"activation_function: 'relu' is not a GELU"),
    ("hf", {"rope_scaling": "abc"}, r"rope_scaling: 'abc' must be an object \(or null: none\)"),
    ("hf", {"rope_scaling": {"rope_type": True, "factor": 8.0}}, r"rope_scaling\.rope_type: True must be a name"),
    # ModelConfig fields (model JSON, and a plan's `model` object: ModelConfig.from_dict)
    ("model", {"head_dim": "16"}, r"model\.head_dim: is '16'; it must be a positive integer"),
    ("model", {"head_dim": 7}, r"model\.head_dim: a head of 7 dimensions is odd: rotary embeddings rotate pairs"),
    ("model", {"head_dim": -16}, r"model\.head_dim: is -16"),
    ("model", {"head_dim": 0}, r"model\.head_dim: is 0"),
    ("model", {"norm_eps": "x"}, r"model\.norm_eps: is 'x'"),
    ("model", {"norm_eps": -1}, r"model\.norm_eps: is -1"),
    ("model", {"norm_eps": NAN}, r"model\.norm_eps: is nan"),
    ("model", {"rope_theta": -1}, r"model\.rope_theta: is -1; it must be a positive number"),
    ("model", {"rope_theta": INF}, r"model\.rope_theta: is inf"),
    ("model", {"tie_embeddings": "no"}, r"model\.tie_embeddings: is 'no'; it must be true or false"),
    ("model", {"tie_embeddings": "false"}, r"model\.tie_embeddings: is 'false'"),
    ("model", {"qkv_bias": 1}, r"model\.qkv_bias: is 1"),
    ("model", {"name": 5}, r"model\.name: is 5; it must be a non-empty printable string"),
    ("model", {"hidden": 128.0}, r"model\.hidden: is 128\.0; it must be a positive integer"),
    ("model", {"layers": True}, r"model\.layers: is True"),
    ("model", {"heads": "8"}, r"model\.heads: is '8'"),
    ("model", {"vocab": None}, r"model\.vocab: is None"),
    ("model", {"layers": 1000000000}, r"model\.layers: is 1000000000; at most 10000, far above any real model"),
    ("model", {"seq_len": 10**12}, r"model\.seq_len: is 1000000000000; at most 100000000"),
    ("model", {"rope_scaling": 8}, r"model\.rope_scaling: is 8; expected null or an object with type and factor"),
    ("model", {"rope_scaling": {"type": "yarn", "factor": 4}}, r"model\.rope_scaling\.type: is 'yarn'; use one of linear"),
    ("model", {"rope_scaling": {"type": "linear"}}, r"model\.rope_scaling\.factor: missing"),
    ("model", {"rope_scaling": {"type": "linear", "factor": -2}}, r"model\.rope_scaling\.factor: is -2"),
    ("model", {"rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}},
     r"model\.rope_scaling\.high_freq_factor: is 1; it must be above low_freq_factor \(4\)"),
    ("model", {"rope_scaling": {"type": "llama3", "factor": 8, "original_max_position_embeddings": 8192.5}},
     r"model\.rope_scaling\.original_max_position_embeddings: is 8192\.5"),
    ("model", {"rope_scaling": {"type": "linear", "factor": 2, "alpha": 1}}, r"model\.rope_scaling\.alpha: unknown field"),
    ("hf", {"rope_scaling": {"rope_type": "llama3", "factor": "8"}}, r"rope_scaling\.factor: is '8'"),
    ("model", {"gelu_approximate": "fast"}, r"model\.gelu_approximate: is 'fast'; use one of none, tanh"),
    ("model", {"gelu_approximate": "tanh"}, r"model\.gelu_approximate: llama blocks use SwiGLU, no GELU"),
]


@pytest.mark.parametrize("kind, change, words", MODEL_CASES)
def test_a_bad_model_or_hf_config_is_a_config_error_naming_the_field(kind, change, words):
    with pytest.raises(ConfigError, match=words) as exc:
        if kind == "hf":
            from_hf_config(dict(HF, **change))
        else:
            ModelConfig.from_dict(dict(TINY, **change))
    assert "\n" not in str(exc.value)


def test_model_files_good_and_bad(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    assert load_model(str(tmp_path / "config.json")).name == tmp_path.name
    assert from_hf_config(dict(HF, num_key_value_heads=None)).kv_heads == 8  # null: absent, as Hugging Face reads it
    assert from_hf_config(dict(HF, head_dim=16)).head_dim is None  # hidden / heads: the default
    (tmp_path / "bad.json").write_bytes(b'{"a": "\xff\xfe"}')
    with pytest.raises(ConfigError, match=r"--model: .*bad\.json is not UTF-8 text"):
        load_model(str(tmp_path / "bad.json"))
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ConfigError, match=r"--model: cannot read .*dir\.json \(Is a directory\)"):
        load_model(str(tmp_path / "dir.json"))
    # Llama 3.1's rope scaling, as its config.json (transformers 4) and transformers 5 write it
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    want = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert from_hf_config(dict(HF, rope_scaling=llama31)).rope_scaling == want
    assert from_hf_config(dict(HF, rope_parameters={**llama31, "rope_theta": 5e5})).rope_scaling == want
    assert from_hf_config(dict(HF, rope_scaling={"type": "dynamic", "factor": 2.0})).rope_scaling is None  # priced alike
    assert "rope_scaling" not in ZOO["tiny"].to_dict()  # plans written before the field read the same
    for name, m in ZOO.items():  # the zoo still builds, and round-trips through a model JSON
        assert ModelConfig.from_dict(json.loads(json.dumps(m.to_dict()))) == m, name


def test_the_shipped_profiles_load():
    for f in PROFILE_DIR.glob("*.json"):
        assert load_cluster(str(f)).device.memory_bytes > 0


def test_the_cli_answers_a_nan_profile_in_one_line(tmp_path):
    d = copy.deepcopy(A100)
    _every_tier("bus_bandwidth_bytes_per_s", NAN)(d)
    f = tmp_path / "nan.json"
    f.write_text(json.dumps(d))
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "plan", "--model", "tiny", "--cluster", str(f),
                           "--gpus", "4", "--global-batch", "16", "--micro-batch", "2", "--tp", "2", "--pp", "2"],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"bus_bandwidth_bytes_per_s: nan is not a finite number", lines[0])


def test_a_rate_too_small_to_price_is_one_line_without_warnings(tmp_path):
    """An attention rate of 1e-300 FLOP/s overflows the search's bounds: one line naming the rates
    to check, no numpy warnings before it."""
    d = copy.deepcopy(A100)
    d["device"]["attention_flops_by_seq"]["flash"]["64"][0][1] = 1e-300
    f = tmp_path / "slow.json"
    f.write_text(json.dumps(d))
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "search", "--model", "tiny", "--cluster", str(f),
                           "--gpus", "8", "--global-batch", "16"], capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "attention_flops_by_seq" in lines[0], proc.stderr


def test_a_key_given_twice_is_refused_not_overwritten(tmp_path):
    """Python's json keeps the last of two values of one key; a model file, cluster profile or plan
    that names a key twice is refused in one line naming it, whichever value comes first."""
    from planner.plan import Plan
    text = json.dumps(ZOO["tiny"].to_dict())
    for first, second in (('"layers": 0', '"layers": 4'), ('"layers": 4', '"layers": 0')):
        f = tmp_path / "m.json"
        f.write_text(text.replace('"layers": 4', f"{first}, {second}", 1))
        with pytest.raises(ConfigError, match="--model: .*the key 'layers' appears twice in one object"):
            load_model(str(f))
    f = tmp_path / "c.json"
    f.write_text(json.dumps(A100).replace('"devices_per_node": 8', '"devices_per_node": 8, "devices_per_node": 4', 1))
    with pytest.raises(ConfigError, match="the key 'devices_per_node' appears twice"):
        load_cluster(str(f))
    with pytest.raises(ConfigError, match="plan: not valid JSON .the key 'format_version' appears twice"):
        Plan.from_json('{"format_version": 1, "format_version": 1}')


def _layer(kind: str) -> dict:
    """One measured layer of a model profile, as `trident profile model` writes it (1 and 2 sequences)."""
    return {"layer": kind, "tp": 1, "sequence_parallel": False, "recompute": "none", "forward_s": [0.0, 1e-4],
            "backward_s": [0.0, 2e-4], "activation_bytes": [0.0, 1e6], "optimizer_s": 1e-5, "param_bytes": 1000,
            "grad_bytes": 1000, "points": [[1, 1e-4, 2e-4, 1e6], [2, 2e-4, 4e-4, 2e6]]}


MODEL_PROFILE = {"format_version": 1, "name": "tiny@dgx", "model": ZOO["tiny"].to_dict(), "seq_len": 32,
                 "dtype": "bf16", "processes": 1, "cluster_profile": {"name": "dgx-a100-80gb", "hash": ""},
                 "micro_batches": [1, 2], "entries": [_layer(k) for k in ("embedding", "block", "head")],
                 "pipeline": {"1f1b": {"step_s": 0.01, "overhead_per_op_s": 1e-4}}, "sources": {}}


@pytest.mark.parametrize("path, value, words", [
    ("entries.1.param_bytes", 0, "entries[1].param_bytes: 0 must be a positive number"),  # a division by it
    ("entries.1.forward_s", [-1, 1e-4], "entries[1].forward_s: [-1, 0.0001] is negative at the micro-batches"),
    ("entries.2.backward_s", [0.0, -1e-4], "entries[2].backward_s: [0.0, -0.0001] is negative"),
    ("entries.0.backward", [0.0, 1.0], "entries[0].backward: unknown field"),
    ("entries.0.points", "1,2", "entries[0].points: must be a list of [micro_batch"),
    ("entries.0.points", [[1, 1e-4, -2e-4, 1e6]], "entries[0].points: must be a list"),
    ("sequence_length", 32, "sequence_length: unknown field; a model profile has"),
    ("cluster_profile.nodes", 2, "cluster_profile.nodes: unknown field"),
    ("pipeline.1f1b.step", 1.0, "pipeline.1f1b.step: unknown field"),
    ("pipeline.1f1b.step_s", -1.0, "pipeline.1f1b.step_s: -1.0 must be a non-negative number"),
    ("pipeline.zero-bubble", {}, "pipeline.zero-bubble: unknown field"),
])
def test_a_bad_model_profile_is_a_config_error_naming_the_field(path, value, words):
    """A model profile whose figures cannot be measurements (a layer without weights, a time negative
    where it was measured) or with a field `trident profile model` does not write is refused
    in one line naming it; the profile as written loads."""
    from planner.model_profile import model_profile_from_dict
    assert model_profile_from_dict(copy.deepcopy(MODEL_PROFILE)).micro_batches == [1, 2]
    d = copy.deepcopy(MODEL_PROFILE)
    *parents, leaf = path.split(".")
    node = d
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[leaf] = value
    with pytest.raises(ConfigError) as err:
        model_profile_from_dict(d, "p.json")
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
