"""Fixtures shared by test modules: a measured cluster profile and a model profile of the tiny
model on 2 gloo ranks, measured once per session (about 35 s on 2 cores)."""
import pytest

from tests.torchrun_helpers import profile_ranks


@pytest.fixture(scope="session")
def cluster_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "cpu-gloo-2.json"
    proc = profile_ranks(2, "cluster", "--quick", "-o", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def model_profile(cluster_profile):
    out = cluster_profile.parent / "tiny.json"
    proc = profile_ranks(2, "model", "--model", "tiny", "--cluster-profile", cluster_profile, "--seq-len", 32,
                            "--micro-batches", "1,2", "--tp", "1,2", "--cp", "1,2", "--repeats", 3, "-o", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
