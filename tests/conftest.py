"""Fixtures shared by test modules: a measured cluster profile and a model profile of the tiny
model on 2 gloo ranks, measured once per session (about 35 s on 2 cores). And two marks:
`in_process`, the modules below that start no processes of their own beyond a CLI call and time
nothing, which `make test` runs beside each other (pytest-xdist, a worker per core) first; and
`side_by_side`, modules that start ranks but check nothing their speed or the host's load moves
(losses, gradients, memory, one-line errors, predictions; their tests that read the session's
measured profiles excepted), which it runs two tests at a time:
their launches leave about half of 2 cores idle (process starts, gloo's waits; 52% busy for
test_bad_input and test_runtime_cli one at a time, 90% two at a time). The rest (timings, the
host's share, the shaped two-node link, the session's measured profiles) runs one test at a
time, each having the cores to itself."""
from pathlib import Path

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


IN_PROCESS = {  # a new module is left out (run one test at a time) until it is known to belong here
    "test_backward_flow", "test_bounds", "test_cli", "test_cluster_cli", "test_compare", "test_cost", "test_curves",
    "test_dp_overlap", "test_expert_parallel", "test_fp8", "test_fused_kernels", "test_input_checks",
    "test_launch_checks", "test_memory_parts", "test_metrics", "test_model", "test_plan", "test_pointwise",
    "test_published", "test_recompute", "test_runnable", "test_sac", "test_schedule", "test_search", "test_search_cli",
    "test_sends", "test_sizing", "test_tp_overlap",
}


SIDE_BY_SIDE = {  # start ranks; check nothing their speed or load moves (a new module stays out until checked)
    "test_bad_input", "test_blend", "test_checkpoint", "test_context_parallel", "test_defer_grad_sync",
    "test_documents", "test_dropout", "test_evaluate", "test_first_backward", "test_fp16", "test_fsdp_groups",
    "test_heap_trace", "test_hf_weights",
    "test_hsdp", "test_loss", "test_lr_schedule", "test_moe", "test_pipeline_buffers", "test_runtime",
    "test_runtime_cli", "test_sac_runtime", "test_sequence_parallel", "test_tied", "test_tokens", "test_vocab",
}


def pytest_collection_modifyitems(items):
    for item in items:
        stem, profiled = Path(item.path).stem, {"cluster_profile", "model_profile"} & set(
            getattr(item, "fixturenames", ()))
        if stem in IN_PROCESS:
            if profiled:
                raise pytest.UsageError(f"{item.nodeid} measures the session's profiles on 2 ranks: take its module "
                                        "out of IN_PROCESS in tests/conftest.py")
            item.add_marker(pytest.mark.in_process)
        elif stem in SIDE_BY_SIDE and not profiled:  # the profiles are measured with the cores to themselves
            item.add_marker(pytest.mark.side_by_side)
