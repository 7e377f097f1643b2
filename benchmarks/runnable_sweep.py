"""Does the runtime accept what the search writes? Random searches (`planner.search.search`, the
`top` best plans of each, expert parallelism searched for mixture-of-experts models) over models
with and without tied embeddings, odd vocabularies and experts, node kinds and sizes; each plan
listed is checked as `runtime.train` checks a plan before it starts
(runtime.run_checks.check_plan) and its stages are built on the meta device. Prints every refusal
and the count.

    python benchmarks/runnable_sweep.py [--seed 1] [--problems 30] [--top 5]   (about 1 s a problem)
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.cluster import load_cluster  # noqa: E402
from planner.hf_config import from_hf_config  # noqa: E402
from planner.model import ConfigError  # noqa: E402
from planner.search import search  # noqa: E402
from planner.zoo import ZOO  # noqa: E402
from runtime.model import Transformer  # noqa: E402
from runtime.run_checks import check_plan  # noqa: E402
from runtime.train import parse_args  # noqa: E402

# GPT-2 (tied, a vocabulary of 50,257) and Qwen2 0.5B (tied, 14 heads) from their Hugging Face configs
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
         "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 4096,
         "tie_word_embeddings": True}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--problems", type=int, default=30)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    models = [from_hf_config(GPT2), from_hf_config(QWEN2)] + [ZOO[n] for n in (
        "gpt-1.7b", "llama2-7b", "llama3-8b", "gpt3-175b", "llama2-13b", "mixtral-8x7b", "qwen3-30b-a3b")]
    total = refused = moe = spread = 0
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.problems):
            model, name = rng.choice(models), rng.choice(["dgx-a100-80gb", "dgx-h100-80gb", "hgx-h200-141gb"])
            nodes, gb = rng.choice([1, 2, 4, 8, 16]), rng.choice([32, 64, 128, 256, 512])
            seq = min(model.seq_len, rng.choice([1024, 2048, 4096]))
            try:
                cluster = load_cluster(name, nodes=nodes)
                found = search(model, cluster, global_batch=gb, seq_len=seq, top=args.top)
            except ConfigError as exc:
                print(f"{model.name} {name} x{nodes}: no search ({exc})")
                continue
            for j, f in enumerate(found.results):
                total += 1
                moe, spread = moe + (f.plan.model.moe is not None), spread + (f.plan.mesh.ep > 1)
                path = Path(d) / f"{i}-{j}.json"
                f.plan.write(path)
                m = f.plan.mesh
                try:
                    check_plan(str(path), parse_args(["--plan", str(path)]), m.world_size)
                    for st in f.plan.pipeline.stages:
                        with torch.device("meta"):
                            Transformer(f.plan.model, st.start, st.end)
                except ConfigError as exc:
                    refused += 1
                    print(f"refused: {model.name} on {nodes} {name}, global batch {gb} at {seq}: tp {m.tp} pp {m.pp} "
                          f"dp {m.dp} ep {m.ep} {f.plan.pipeline.schedule}: {exc}")
    print(f"plans {total} ({moe} of MoE models, {spread} with expert parallelism), refused {refused}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
