"""What the search writes, the runtime runs: every plan `trident search` lists passes the runtime's
checks (runtime.run_checks) and builds its stages. GPT-2 (a Hugging Face config: tied embeddings,
a vocabulary of 50,257) on one A100 node: before session 45 seven of its eight best plans were
refused, the pipelined ones for the tied embedding and the TP ones for the odd vocabulary."""
from __future__ import annotations

import torch

from planner.cluster import load_cluster
from planner.hf_config import from_hf_config
from planner.search import search
from runtime.model import Transformer
from runtime.run_checks import check_plan
from runtime.train import parse_args

GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}


def test_the_runtime_accepts_every_plan_the_search_lists(tmp_path):
    model = from_hf_config(GPT2)
    assert model.tie_embeddings and model.vocab % 2
    plans = [f.plan for f in search(model, load_cluster("dgx-a100-80gb", nodes=1), global_batch=32, seq_len=1024,
                                    top=8).results]
    assert len(plans) == 8
    assert any(p.mesh.pp > 1 for p in plans) and any(p.mesh.tp > 1 for p in plans)  # the cases once refused
    for i, plan in enumerate(plans):
        path = tmp_path / f"plan{i}.json"
        plan.write(path)
        check_plan(str(path), parse_args(["--plan", str(path)]), plan.mesh.world_size)
        for st in plan.pipeline.stages:
            with torch.device("meta"):
                Transformer(plan.model, st.start, st.end)
