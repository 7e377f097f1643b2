"""The prepared check for a session that is lent one GPU: profile it, predict, train, compare.

    python3 benchmarks/gpu_check.py [--out DIR] [--steps 8]        # DIR defaults to $OUT, else out/gpu_check

Nothing of trident needs installing: the repository on PYTHONPATH and a python3 with torch, numpy,
networkx and pandas (the lent H200 machine's own). On one GPU, in one command of a few minutes:
1. the device, as `trident profile cluster` measures it on GPUs (runtime.profile_gpu: GEMM rate
   by size per dtype, causal attention rate by sequence length and head dimension, memory
   bandwidth), against the shipped profile of the same device where there is one;
2. `trident profile model` of a 1.2B Llama-shaped model (Llama 3.2 1B's shape) at sequence 2048,
   in bf16 on the GPU, micro-batches 1, 2, 4;
3. six single-GPU plans (recompute none, selective, full; micro-batch 1 to 4; one with dropout 0.1,
   one with a document mask: runtime.documents, documents of 257 tokens of the synthetic data), each predicted
   three ways: the shipped profile alone, the measured device alone, the measured device and model
   profile; then trained by runtime.train (bf16 autocast over float32 weights, AdamW), and
   compared: step time, optimizer step and peak memory (torch.cuda.max_memory_allocated); the last
   step of each is traced (runtime.train --trace: DIR/traces), and the table gives the share of it
   the GPU spent in kernels ("busy") and the operators the host dispatched;
4. the first plan trained 4 steps validating every 2 and checkpointing asynchronously, resumed
   from its step 2: its validation losses and the resumed steps' distance from the straight run's.
Without a GPU it runs the same loop as a smoke test on the CPU with the tiny model (step 1 left
out: runtime.profile_gpu measures GPUs only). Everything it writes lands in DIR; the table and
results.json say what was measured.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from planner.device import CONVERSIONS  # noqa: E402

# Llama 3.2 1B's shape (its config.json: hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192,
# vocabulary 128256, tied embeddings), trained at sequence 2048
LLAMA_1B = dict(name="llama-1.2b", arch="llama", layers=16, hidden=2048, ffn_hidden=8192, heads=32, kv_heads=8,
                vocab=128256, seq_len=2048, tie_embeddings=True)
# name: (micro_batch, global_batch, recompute, dropout, document mask): one with hidden and attention
# dropout (runtime.dropout), one with a document mask (runtime.documents); the model profile
# measures without either (planner.model_profile.unmeasured_delta)
PLANS = {"mb1-none": (1, 8, "none", 0.0, False), "mb2-selective": (2, 8, "selective", 0.0, False),
         "mb4-full": (4, 16, "full", 0.0, False), "mb4-none": (4, 16, "none", 0.0, False),
         "mb2-dropout": (2, 8, "none", 0.1, False), "mb2-documents": (2, 8, "none", 0.0, True)}


def env() -> dict:
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return e


def torchrun(*args, nproc: int = 1) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           *map(str, args)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    took = time.perf_counter() - t0
    print(f"  {' '.join(map(str, args[:3]))}: {took:.0f} s", flush=True)
    return took


def device_worker(path: str) -> int:
    """Under torchrun: runtime.profile_gpu's device measurements on this rank's GPU, to `path`."""
    from datetime import timedelta

    import torch.distributed as dist

    from runtime.device import init
    from runtime import profile_gpu
    backend, _ = init(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    device, sources, slow, slots = profile_gpu.measure_device(quick=False)
    device["reserved_bytes"] = profile_gpu.reserved_outside_allocator()
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps({"device": device, "sources": sources, "overlap_slowdown": slow,
                                          "compute_slots": slots, "host_dispatch_s": host_dispatch(),
                                          "eager_bandwidth": eager_bandwidth()}, indent=1) + "\n")
    dist.barrier()  # rank 0 has written before any rank destroys the group (tests/sp_probe.py says why)
    dist.destroy_process_group()
    return 0


def host_dispatch() -> dict:
    """Host seconds per eager operator, for operators whose GPU work takes a few microseconds:
    back to back, the host's dispatch sets the pace (the best of 5 runs of 2000 calls each)."""
    import torch
    import torch.nn.functional as F

    from runtime.device import current, timed
    dev = current()
    x = torch.zeros(16, device=dev)
    xg = torch.zeros(16, 16, device=dev, requires_grad=True)
    w = torch.zeros(16, 16, device=dev, requires_grad=True)

    def per_call(fn, n=2000):
        fn()
        return min(timed(lambda: [fn() for _ in range(n)]) for _ in range(5)) / n

    def linear_amp():
        with torch.autocast(dev.type, dtype=torch.bfloat16, cache_enabled=False):
            return F.linear(xg, w)
    return {"add_": per_call(lambda: x.add_(1)), "mul_autograd": per_call(lambda: xg * 2),
            "linear_autocast_autograd": per_call(linear_amp),
            "linear_autocast_fwd_bwd": per_call(lambda: linear_amp().sum().backward(), 500)}


def eager_bandwidth() -> dict:
    """Bytes per second (reads and writes counted) of eager kernels the runtime runs, on 2^28
    elements: a float32 copy, a cast to bf16, a contiguous bf16 product, float32 accumulation, a
    complex product (rotary embeddings); the profile measures the conversions the planner prices
    apart (runtime.profile_gpu.conversion_bandwidth)."""
    import torch

    from runtime.device import current, timed
    dev, n = current(), 2**28
    a16, b16 = (torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    a32, b32 = torch.randn(n, device=dev), torch.randn(n, device=dev)
    c = torch.randn(n // 2, device=dev, dtype=torch.complex64)
    f = torch.randn(n // 2, device=dev, dtype=torch.complex64)
    cases = {"copy_fp32": (lambda: b32.copy_(a32), 8), "cast_fp32_to_bf16": (lambda: a32.to(torch.bfloat16), 6),
             "mul_bf16": (lambda: a16 * b16, 6), "add__fp32": (lambda: b32.add_(a32), 12),
             "complex_mul": (lambda: c * f, 12)}
    out = {}
    for name, (fn, per) in cases.items():
        fn()
        out[name] = per * n / min(timed(fn) for _ in range(10))
    return out


# GPU name -> shipped profile, tried in this order ("GB200" names contain "B200")
SHIPPED = {"GB200": "gb200-nvl72-186gb", "B300": "dgx-b300-288gb", "B200": "dgx-b200-180gb", "H200": "hgx-h200-141gb",
           "H100": "dgx-h100-80gb", "A100": "dgx-a100-80gb"}


def shipped_for(name: str):
    """The shipped hardware profile whose device is `name`'s GPU (SHIPPED's first key in the name), else H200's."""
    return next((v for k, v in SHIPPED.items() if k in name.upper()), SHIPPED["H200"])


def measured_cluster(shipped: dict, measured: dict) -> dict:
    """The shipped profile with its device replaced by the measured one (its collectives are not
    used on one GPU)."""
    out = json.loads(json.dumps(shipped))
    out["name"] = shipped["name"] + "-measured-device"
    out["kind"] = "measured"
    out["description"] = "device measured by benchmarks/gpu_check.py; collectives as shipped (unused on one GPU)"
    out["device"] = measured["device"]
    out["sources"] = {k: v for k, v in shipped.get("sources", {}).items() if not k.startswith("device")}
    out["sources"].update(measured["sources"])
    out["overlap_slowdown"], out["compute_slots"] = measured["overlap_slowdown"], measured["compute_slots"]
    return out


def compare_curves(shipped, measured) -> list[str]:
    """Lines comparing the measured bf16 GEMM and causal attention rates with the shipped ones."""
    lines = []
    for edge in (2048, 4096, 8192):
        a = shipped.device.gemm_flops_per_s("bf16", edge, edge, edge)
        b = measured.device.gemm_flops_per_s("bf16", edge, edge, edge)
        lines.append(f"  bf16 GEMM {edge}^3: shipped {a / 1e12:6.0f}  measured {b / 1e12:6.0f} TFLOP/s ({b / a - 1:+.0%})")
    for seq in (2048, 8192):
        a = shipped.device.attention_flops_per_s("bf16", seq, 64)
        b = measured.device.attention_flops_per_s("bf16", seq, 64)
        lines.append(f"  causal attention s={seq} d=64: shipped {a / 1e12:5.0f}  measured {b / 1e12:5.0f} TFLOP/s "
                     f"({b / a - 1:+.0%})")
    if "masked" in measured.device.attention_by_seq:  # runtime.documents' dense mask, all scores counted
        b = measured.device.attention_flops_per_s("bf16", 2048, 64, "masked")
        lines.append(f"  masked attention s=2048 d=64: measured {b / 1e12:5.0f} TFLOP/s (causal flash: "
                     f"{b / measured.device.attention_flops_per_s('bf16', 2048, 64) - 1:+.0%})")
    a, b = shipped.device.memory_bytes_per_s, measured.device.memory_bytes_per_s
    lines.append(f"  memory bandwidth: shipped {a / 1e12:.2f}  measured {b / 1e12:.2f} TB/s ({b / a - 1:+.0%})")
    for k in CONVERSIONS:  # planner.device: dtype-converting kernels
        a, b = (c.device.conversion_bandwidth.get(k, c.device.memory_bytes_per_s) for c in (shipped, measured))
        lines.append(f"  {k} conversions: shipped {a / 1e12:.2f}  measured {b / 1e12:.2f} TB/s ({b / a - 1:+.0%})")
    return lines


def foreach_ratio(t) -> float:
    """How much more torch's foreach AdamW step (the runtime's until session 50: eight passes, 4 p +
    3 g + 56 bytes a parameter, clipping's 3 g besides) moves than the fused one priced now
    (planner.precision.optimizer_step_bytes), less one."""
    from planner.precision import optimizer_step_bytes
    p = g = 4  # float32 master weights and gradients: the runtime's under bf16 and fp32 alike
    return (4 * p + 3 * g + 56 + 3 * g) / optimizer_step_bytes(t) - 1


def replay(d: Path) -> int:
    """Predict a recorded run (benchmarks/gpu_runs/*: its device.json, plans/ and runs/) again with
    this planner, from the shipped profile and from the device the run measured, against the
    measured step times (planner.compare's) and the traced step's time in GPU kernels."""
    from planner.cluster import cluster_from_dict, load_cluster
    from planner.compare import compare
    from planner.cost import estimate
    from planner.plan import Plan
    dev = json.loads((d / "device.json").read_text())
    eager = dev.get("eager_bandwidth", {})
    if "conversion_bandwidth_bytes_per_s" not in dev["device"] and "cast_bf16_to_fp32" in eager:
        # recorded before runtime.profile_gpu measured conversions: the same kernels, in its diagnostics
        dev["device"]["conversion_bandwidth_bytes_per_s"] = {"upcast": eager["cast_bf16_to_fp32"],
                                                             "broadcast": eager["sub_broadcast_bf16_to_fp32"]}
    name = shipped_for(dev["device"]["name"])
    shipped_dict = json.loads((REPO / "profiles" / "hardware" / f"{name}.json").read_text())
    shipped = load_cluster(name).shaped_as(1, 1)
    measured = cluster_from_dict(measured_cluster(shipped_dict, dev), "measured").shaped_as(1, 1)
    print(f"{d.name}: predicted / measured - 1 (kernels: the traced step's time in GPU kernels; memory: "
          f"the peak, torch.cuda.max_memory_allocated)")
    print(f"{'plan':14s} {'measured s':>10s} {'kernels s':>9s} {'shipped':>8s} {'device':>8s} {'device/kernels':>14s} "
          f"{'peak GiB':>8s} {'memory':>7s}")
    for path in sorted((d / "plans").glob("*.json")):
        plan = Plan.read(str(path))
        run = json.loads((d / "runs" / path.name).read_text())
        step = compare(plan, run, plan.prediction)["measured_step_time_s"]
        kernels = run["trace"][0]["device_kernel_s"] if run.get("trace") else float("nan")
        est_a, est_b = (estimate(plan, c) for c in (shipped, measured))
        a, b, peak = est_a.step_time_s, est_b.step_time_s, run["peak_memory_bytes"]
        if "optimizer" not in run:  # recorded before session 50: the runtime stepped torch's foreach AdamW
            a, b = (e.step_time_s + e.breakdown["time"]["optimizer_s"] * foreach_ratio(plan.training) for e in (est_a, est_b))
        print(f"{path.stem:14s} {step:10.4f} {kernels:9.4f} {a / step - 1:+8.1%} {b / step - 1:+8.1%} "
              f"{b / kernels - 1:+14.1%} {peak / 2**30:8.2f} {est_b.peak_memory_bytes / peak - 1:+7.1%}")
    return 0


def resume_check(out: Path, plan: Path) -> dict:
    """A plan trained 4 steps validating every 2 and checkpointing asynchronously (runtime.evaluate,
    runtime.checkpoint.Saver), then resumed from its step 2: the validation losses, and how far the
    resumed steps' losses are from the straight run's."""
    import shutil
    ckpt = out / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    torchrun("-m", "runtime.train", "--plan", plan, "--steps", 4, "--checkpoint-dir", ckpt, "--checkpoint-every", 2,
             "--async-checkpoint", "--eval-every", 2, "--out", out / "straight.json")
    shutil.rmtree(ckpt / "step-4")
    torchrun("-m", "runtime.train", "--plan", plan, "--steps", 4, "--checkpoint-dir", ckpt, "--resume",
             "--out", out / "resumed.json")
    straight, again = (json.loads((out / f"{n}.json").read_text()) for n in ("straight", "resumed"))
    diff = max(abs(a - b) / abs(b) for a, b in zip(again["losses"], straight["losses"][2:]))
    return {"validation": [round(v["loss"], 6) for v in straight["validation"]], "max_rel_diff": diff}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--replay", default=None, metavar="DIR",
                    help="predict a recorded run (benchmarks/gpu_runs/*) again; needs no GPU")
    ap.add_argument("--device-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device_worker:
        return device_worker(args.device_worker)
    if args.replay:
        return replay(Path(args.replay))

    import torch

    from planner.build import build_plan
    from planner.cluster import load_cluster
    from planner.compare import compare
    from planner.cost import estimate
    from planner.model import ModelConfig
    from planner.model_profile import load_model_profile
    from planner.zoo import ZOO

    out = Path(args.out or os.environ.get("OUT") or REPO / "out" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    t_start = time.perf_counter()
    if gpu:
        name = torch.cuda.get_device_name(0)
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}, "
              f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB", flush=True)
        model, seq, dtype = ModelConfig(**LLAMA_1B), 2048, "bf16"
    else:
        name = "cpu"
        print(f"torch {torch.__version__}: no GPU, so a smoke test of the loop on the CPU with the tiny model",
              flush=True)
        model, seq, dtype = ZOO["tiny"], 32, "fp32"
    (out / "model.json").write_text(json.dumps(model.to_dict(), indent=1) + "\n")
    shipped_name = shipped_for(name)
    shipped_path = REPO / "profiles" / "hardware" / f"{shipped_name}.json"
    shipped = load_cluster(str(shipped_path)).shaped_as(1, 1)

    print("1. the device", flush=True)
    if gpu:
        torchrun("benchmarks/gpu_check.py", "--device-worker", out / "device.json")
        dev = json.loads((out / "device.json").read_text())
        mpath = out / "measured-cluster.json"
        mpath.write_text(json.dumps(measured_cluster(json.loads(shipped_path.read_text()), dev), indent=1) + "\n")
        measured = load_cluster(str(mpath)).shaped_as(1, 1)
        lines = compare_curves(shipped, measured)
        lines += [f"  host dispatch {k}: {v * 1e6:.1f} us" for k, v in dev.get("host_dispatch_s", {}).items()]
        lines += [f"  eager kernel {k}: {v / 1e12:.2f} TB/s" for k, v in dev.get("eager_bandwidth", {}).items()]
        print("\n".join(lines), flush=True)
    else:
        mpath, measured, lines = shipped_path, shipped, []

    print("2. the model profile", flush=True)
    ppath = out / "model-profile.json"
    torchrun("-m", "runtime.profile", "model", "--model", out / "model.json", "--cluster-profile", mpath,
             "--seq-len", seq, "--micro-batches", "1,2,4", "--tp", "1", "--repeats", 5, "--dtype", dtype, "-o", ppath)
    mprof = load_model_profile(str(ppath))

    print("3. plans: predict, train, compare", flush=True)
    (out / "plans").mkdir(exist_ok=True)
    plans, preds = {}, {}
    for pname, (mb, gb, rec, drop, masked) in PLANS.items():
        plan = build_plan(model, cluster_name=measured.name, device=measured.device.name, nodes=1, devices_per_node=1,
                          global_batch=gb, micro_batch=mb, seq_len=seq, recompute=rec, dtype=dtype,
                          profile_hash=measured.profile_hash, dropout=drop, document_mask=masked)
        preds[pname] = {"shipped": estimate(plan, shipped), "device": estimate(plan, measured),
                        "device+model": estimate(plan, measured, model_profile=mprof)}
        plan.prediction = preds[pname]["device+model"].to_dict()
        plan.prediction.pop("stages", None)
        plan.write(out / "plans" / f"{pname}.json")
        plans[pname] = plan
    from runtime.data import SyntheticData
    eos = int(SyntheticData(model.vocab, seq, 0).cycle[0])  # once in each 257 tokens of the synthetic rows
    for masked in (False, True):  # --eos-id is for masked plans alone
        names = [n for n in plans if plans[n].training.document_mask == masked]
        runs = out / "runs" if len(names) > 1 else out / "runs" / f"{names[0]}.json"  # one plan: its file
        torchrun("-m", "runtime.train", "--plan", *[out / "plans" / f"{n}.json" for n in names], "--steps", args.steps,
                 "--out", runs, "--trace", out / "traces", *(["--eos-id", eos] if masked else []))
    rows = []
    for pname, plan in plans.items():
        run = json.loads((out / "runs" / f"{pname}.json").read_text())
        c = compare(plan, run, plan.prediction)
        p = preds[pname]
        rows.append({"plan": pname, "measured_step_s": c["measured_step_time_s"],
                     **{f"predicted_step_s[{k}]": e.step_time_s for k, e in p.items()},
                     **{f"step_error[{k}]": e.step_time_s / c["measured_step_time_s"] - 1 for k, e in p.items()},
                     "measured_peak_bytes": c["measured_peak_memory_bytes"],
                     "predicted_peak_bytes[analytic]": p["device"].peak_memory_bytes,
                     "memory_error[analytic]": p["device"].peak_memory_bytes / c["measured_peak_memory_bytes"] - 1,
                     "memory_error[device+model]": c["memory_error"],
                     "measured_optimizer_s": c["measured_optimizer_s"], "predicted_optimizer_s": c["predicted_optimizer_s"],
                     "measured_tflops_per_gpu": p["device"].model_tflops_per_gpu * p["device"].step_time_s
                     / c["measured_step_time_s"],
                     # the traced step (runtime.trace): the share of it the GPU spent in kernels
                     "device_busy": (run["trace"][0]["device_kernel_s"] or 0.0) / run["trace"][0]["step_s"],
                     "device_kernel_s": run["trace"][0]["device_kernel_s"],
                     # kernels, and the GPU's idle gaps between them: short launch gaps, long waits on the host
                     "kernel_timeline": run["trace"][0].get("kernel_timeline"),
                     "aten_calls": run["trace"][0]["aten_calls"]})
    print(f"\n{'plan':14s} {'measured s':>10s} {'shipped':>8s} {'device':>8s} {'dev+model':>9s}   "
          f"{'peak GiB':>8s} {'analytic':>8s} {'dev+model':>9s}  TFLOP/s  busy  aten ops")
    for r in rows:
        e = [r[f"step_error[{k}]"] for k in ("shipped", "device", "device+model")]
        print(f"{r['plan']:14s} {r['measured_step_s']:10.4f} {e[0]:+8.1%} {e[1]:+8.1%} {e[2]:+9.1%}   "
              f"{r['measured_peak_bytes'] / 2**30:8.2f} {r['memory_error[analytic]']:+8.1%} "
              f"{r['memory_error[device+model]']:+9.1%}  {r['measured_tflops_per_gpu']:7.1f} {r['device_busy']:5.0%} "
              f"{r['aten_calls']:9,d}")
    for r in rows:  # the traced step's kernels and the GPU's idle time between them (runtime.trace)
        t = r["kernel_timeline"]
        if t:
            print(f"{r['plan']:14s} {t['kernels']:,d} kernels; idle between them: {t['short_gaps_s'] * 1e3:.1f} ms in "
                  f"launch gaps, {t['long_gaps_s'] * 1e3:.1f} ms waiting on the host (traced step)")
    print("4. validation and an asynchronous checkpoint, resumed", flush=True)
    resumed = resume_check(out, out / "plans" / f"{next(iter(plans))}.json")
    print(f"  validation losses {resumed['validation']}; resumed steps 3-4 differ from the straight run's by "
          f"{resumed['max_rel_diff']:.2e} (relative)", flush=True)
    print(f"(step-time and memory errors are predicted / measured - 1; {time.perf_counter() - t_start:.0f} s in all)")
    (out / "results.json").write_text(json.dumps({"device": name, "gpu": gpu, "device_lines": lines, "rows": rows,
                                                  "resume": resumed}, indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
