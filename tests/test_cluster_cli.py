"""`trident cluster derive|show`: a what-if profile scales every inter-node bus bandwidth by each
device's new share of its node's NICs and nothing else, reads back, prices plans accordingly,
and bad requests are refused in one line."""
import json

import pytest

from planner.cli import main
from planner.cluster import COLLECTIVES, PROFILE_DIR, TIERS, load_cluster

H100 = str(PROFILE_DIR / "dgx-h100-80gb.json")
GiB = 2**30


def _measured_style_base(tmp_path):
    """The H100 profile with the forms a measured profile adds: per group size, segments, a curve."""
    d = json.loads(open(H100).read())
    ab = d["collectives"]["all_gather"]["inter_node"]
    ab["by_group_size"] = {"16": {"alpha_s": 5e-5, "bus_bandwidth_bytes_per_s": 4.0e10,
                                  "segments": [{"up_to_bytes": 2**20, "alpha_s": 3e-5, "bus_bandwidth_bytes_per_s": 1e10},
                                               {"up_to_bytes": None, "alpha_s": 5e-5, "bus_bandwidth_bytes_per_s": 4e10}]}}
    d["collectives"]["reduce_scatter"]["inter_node"]["bus_bandwidth_by_size"] = [[2**20, 1e10], [2**30, 4.6e10]]
    p = tmp_path / "base.json"
    p.write_text(json.dumps(d))
    return p


def test_derive_scales_each_inter_node_bandwidth_and_nothing_else(tmp_path, capsys):
    base_path = _measured_style_base(tmp_path)
    out = tmp_path / "h100-200g.json"
    assert main(["cluster", "derive", str(base_path), "--nic-gbps", "200", "-o", str(out)]) == 0
    assert "x 0.5" in capsys.readouterr().out
    base, new = load_cluster(str(base_path)), load_cluster(str(out))
    assert new.kind == "derived" and new.name == "h100-200g" and new.devices_per_node == 8
    assert new.tiers["inter_node"]["bandwidth_bytes_per_s"] == 25e9
    assert new.device == base.device
    for op in COLLECTIVES:
        assert new.collectives[op]["intra_node"] == base.collectives[op]["intra_node"]
        for n in (2, 16, 64):
            for size in (1e3, 3e5, 2**20, 5e7, 2**31):
                a0, bw0 = base.collectives[op]["inter_node"].at(n, size)
                a1, bw1 = new.collectives[op]["inter_node"].at(n, size)
                assert a1 == a0 and bw1 == pytest.approx(bw0 / 2, rel=1e-12), (op, n, size)
    # a bandwidth-bound collective across nodes takes twice as long; one inside a node no longer
    for op in ("all_reduce", "all_gather", "send_recv"):
        across = (2, 2, 1) if op == "send_recv" else (8, 8, 1)  # one device a node: NIC-bound
        t0, t1 = (c.shaped_collective_time(op, 8 * GiB, across) for c in (base, new))
        assert t1 / t0 == pytest.approx(2, rel=1e-3)
        inside = (2, 1, 2) if op == "send_recv" else (8, 1, 8)
        assert new.shaped_collective_time(op, GiB, inside) == base.shaped_collective_time(op, GiB, inside)
    raw = json.loads(out.read_text())
    assert raw["sources"]["derived"].startswith("`trident cluster derive` from base (sha256:")
    assert "base: source: NVIDIA/nccl-tests" in raw["sources"]["collectives.all_reduce.inter_node.bus_bandwidth_bytes_per_s"]


def test_smaller_nodes_fewer_nics_and_memory(tmp_path, capsys):
    out = tmp_path / "a4.json"
    assert main(["cluster", "derive", "dgx-a100-80gb", "--devices-per-node", "4", "--nics-per-node", "1",
                 "--memory-gib", "40", "-o", str(out), "--name", "four"]) == 0
    base, new = load_cluster("dgx-a100-80gb"), load_cluster(str(out))
    assert (new.name, new.devices_per_node, new.device.memory_bytes) == ("four", 4, 40 * GiB)
    assert "40 GiB" in new.device.name
    # one 200 Gb/s NIC shared by 4 devices: a quarter of the base's per-device share
    ratio = new.collectives["all_reduce"]["inter_node"].at(8)[1] / base.collectives["all_reduce"]["inter_node"].at(8)[1]
    assert ratio == pytest.approx(0.25)
    capsys.readouterr()
    # 8 GPUs are 2 nodes of 4 now: TP 8 would leave the node, and a 4-way TP plan's memory limit is 40 GiB
    plan = ["plan", "--model", "llama2-7b", "--cluster", str(out), "--gpus", "8", "--global-batch", "16",
            "--micro-batch", "1", "--seq-len", "4096"]
    assert main([*plan, "--tp", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tp" in err and "node" in err
    assert main([*plan, "--tp", "4"]) != 0  # 42.5 GiB: fits on the base's 80, not on 40
    err = capsys.readouterr().err
    assert "device has 40.0" in err
    assert main([*plan, "--tp", "4", "--zero", "1", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert main([*plan[:4], "dgx-a100-80gb", *plan[5:], "--tp", "4", "--zero", "1", "--json"]) == 0
    est80 = json.loads(capsys.readouterr().out)
    assert est["fits"] and est["memory_limit_bytes"] < est80["memory_limit_bytes"]
    # its DP all-reduce now crosses a 50 Gb/s share: never faster than on one 8-GPU node
    assert est["step_time_s"] > est80["step_time_s"]

def test_a_pairwise_nvlink_mesh_gives_a_group_its_share_of_the_links(tmp_path, capsys):
    """--nvlink-mesh: a group of k of a node's 4 devices drives k - 1 of each device's 3 link bundles,
    a send one; the NVLink SHARP curve is capped at the ring's figure; a measured figure per group
    size scales by the same share; the network is the base's; the shipped 4-GPU H200 profile is what
    the command writes; TP 2 costs more on it than on the NVSwitch node; one device a node is refused."""
    base_path = _measured_style_base(tmp_path)
    d = json.loads(base_path.read_text())
    d["collectives"]["all_gather"]["intra_node"]["by_group_size"] = {
        "2": {"alpha_s": 2e-5, "bus_bandwidth_bytes_per_s": 3e11},
        "8": {"alpha_s": 4e-5, "bus_bandwidth_bytes_per_s": 3.6e11}}
    base_path.write_text(json.dumps(d))
    out = tmp_path / "h100x4.json"
    assert main(["cluster", "derive", str(base_path), "--devices-per-node", "4", "--nvlink-mesh", "-o", str(out)]) == 0
    base, new = load_cluster(str(base_path)), load_cluster(str(out))
    assert new.devices_per_node == 4 and "no switch" in new.tiers["intra_node"]["link"]
    for op in ("all_reduce", "reduce_scatter", "all_to_all", "all_gather"):
        b, m = base.collectives[op]["intra_node"], new.collectives[op]["intra_node"]
        two = (2e-5, 1e11) if op == "all_gather" else (b.alpha_s, b.bus_bandwidth_bytes_per_s / 3)
        assert m.at(2, 2**30) == pytest.approx(two) and m.at(2, 2**10) == pytest.approx(two), op
        assert m.at(3, 2**30) == pytest.approx((b.alpha_s, b.bus_bandwidth_bytes_per_s * 2 / 3)), op
        assert m.at(4, 2**30)[1] == pytest.approx(min(b.at(4, 2**30)[1], b.bus_bandwidth_bytes_per_s)), op
        assert new.collectives[op]["inter_node"] == base.collectives[op]["inter_node"]
    assert base.collectives["all_reduce"]["intra_node"].at(4, 2**32)[1] > 4.7e11  # NVLS on the switch
    assert new.collectives["all_reduce"]["intra_node"].at(4, 2**32)[1] == pytest.approx(3.7e11)  # the ring's
    pair = (2, 1, 2)
    send = [c.shaped_collective_time("send_recv", GiB, pair) for c in (base, new)]
    assert send[1] > 2.9 * send[0]
    raw = json.loads(out.read_text())
    assert "(k - 1)/3" in raw["sources"]["collectives.all_gather.intra_node.by_group_size"]
    capsys.readouterr()
    # the shipped profiles: the command's output but for their description and the topology's evidence
    for base, name in (("hgx-h200-141gb", "hgx-h200-4gpu-141gb"), ("dgx-h100-80gb", "hgx-h100-4gpu-80gb")):
        assert main(["cluster", "derive", base, "--devices-per-node", "4", "--nvlink-mesh",
                     "--name", name, "-o", str(tmp_path / f"{name}.json")]) == 0
        written, shipped = (json.loads(p.read_text())
                            for p in (tmp_path / f"{name}.json", PROFILE_DIR / f"{name}.json"))
        assert "NV6" in shipped["sources"].pop("nvlink_mesh")
        assert {**written, "description": ""} == {**shipped, "description": ""}
    capsys.readouterr()
    plan = ["plan", "--model", "llama3-8b", "--gpus", "2", "--global-batch", "8", "--micro-batch", "4", "--tp", "2",
            "--sequence-parallel", "--recompute", "full", "--json", "--cluster"]
    steps = {}
    for name in ("hgx-h200-141gb", "hgx-h200-4gpu-141gb"):
        assert main([*plan, name]) == 0
        est = json.loads(capsys.readouterr().out)
        steps[name] = (est["step_time_s"], est["breakdown"]["time"]["tp_comm_s"])
    assert steps["hgx-h200-4gpu-141gb"][1] > 2.5 * steps["hgx-h200-141gb"][1]
    assert steps["hgx-h200-4gpu-141gb"][0] > steps["hgx-h200-141gb"][0]


def test_show_lists_the_device_the_links_and_every_collective(capsys):
    assert main(["cluster", "show", "dgx-h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100-SXM5-80GB" in out and "80.00 GiB" in out
    for tier in TIERS:
        assert f"{tier}:" in out
    for op in COLLECTIVES:
        assert op in out


SHIPPED = sorted(PROFILE_DIR.glob("*.json"))


def _numbers(d, path=()):
    """The dotted paths of a profile's figures (every number, a curve as one)."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _numbers(v, path + (k,))
        elif not isinstance(v, str):
            yield ".".join(path + (k,))


@pytest.mark.parametrize("profile", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_figure_has_its_source_and_prices_a_plan(profile, capsys):
    """Each number of a shipped hardware profile is named in its `sources` (its own path, a path
    above it, or a pattern with *), the profile loads, and a plan is priced on it."""
    from fnmatch import fnmatch
    d = json.loads(profile.read_text())
    keys = list(d["sources"])
    figures = list(_numbers({k: v for k, v in d.items() if k not in ("sources", "format_version")}))
    assert len(figures) > 30  # the device, the tiers, two tiers of five collectives
    unsourced = [f for f in figures if not any(f == k or f.startswith(k + ".") or fnmatch(f, k) or fnmatch(f, k + ".*")
                                               for k in keys)]
    assert not unsourced, unsourced
    assert all(len(d["sources"][k]) > 40 for k in keys)
    cluster = load_cluster(profile.stem, nodes=2)
    assert cluster.device.memory_bytes > 40 * GiB and d["name"] == profile.stem
    assert main(["plan", "--model", "llama3-8b", "--cluster", profile.stem, "--nodes", "2", "--global-batch", "288",
                 "--micro-batch", "1", "--tp", "2", "--pp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]


@pytest.mark.parametrize("argv, field", [
    (["cluster", "derive", "dgx-h100-80gb", "-o", "{tmp}/x.json"], "nothing to change"),
    (["cluster", "derive", "dgx-h100-80gb", "--devices-per-node", "16", "-o", "{tmp}/x.json"], "--devices-per-node"),
    (["cluster", "derive", "dgx-h100-80gb", "--nic-gbps", "0", "-o", "{tmp}/x.json"], "--nic-gbps"),
    (["cluster", "derive", "no-such-cluster", "--nic-gbps", "100", "-o", "{tmp}/x.json"], "no-such-cluster"),
    (["cluster", "derive", "dgx-h100-80gb", "--nic-gbps", "100", "-o", "{tmp}/no/dir/x.json"], "-o"),
    (["cluster", "derive", "{tmp}/notiers.json", "--nic-gbps", "100", "-o", "{tmp}/x.json"],
     "tiers.inter_node.bandwidth_bytes_per_s"),
    (["cluster", "show", "{tmp}/bad.json"], "format_version"),
    (["cluster", "derive", "{tmp}/derived.json", "--nics-per-node", "4", "-o", "{tmp}/x.json"], "--nic-gbps"),
    (["cluster", "derive", "dgx-h100-80gb", "--nics-per-node", "1000", "-o", "{tmp}/x.json"], "--nics-per-node"),
    (["cluster", "derive", "dgx-h100-80gb", "--devices-per-node", "1", "--nvlink-mesh", "-o", "{tmp}/x.json"],
     "--nvlink-mesh"),
    (["cluster", "derive", "hgx-h200-4gpu-141gb", "--nvlink-mesh", "-o", "{tmp}/x.json"], "linked pairwise already"),
    (["cluster", "derive", "hgx-h200-4gpu-141gb", "--devices-per-node", "2", "-o", "{tmp}/x.json"],
     "--devices-per-node"),
    (["cluster"], "action"),
])
def test_bad_requests_get_one_line(tmp_path, capsys, argv, field):
    d = json.loads(open(H100).read())
    del d["tiers"]
    (tmp_path / "notiers.json").write_text(json.dumps(d))
    (tmp_path / "bad.json").write_text(json.dumps({**d, "format_version": 7}))
    assert main(["cluster", "derive", "dgx-h100-80gb", "--nic-gbps", "200", "-o", str(tmp_path / "derived.json")]) == 0
    capsys.readouterr()
    try:
        rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
    assert not (tmp_path / "x.json").exists()
