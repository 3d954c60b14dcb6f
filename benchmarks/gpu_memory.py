"""GPU memory: activation peak, one workspace for several models, weight offload under a budget.

    PYTHONPATH=src python3 benchmarks/gpu_memory.py --out gpu_memory.json [--minilm DIR]

1. BERT-base FP16, batch 64 x 512: peak activation memory of HF SDPA FP16 vs surge
   (measured with torch.cuda.max_memory_allocated, weights and inputs excluded).
2. Three encoders in one process: workspace bytes with one workspace each vs one shared.
3. BERT-large FP16 with a GPU weight budget of 1/4 of its weights, batch 32 x 128:
   latency vs max(copy time of all weights at the measured H2D bandwidth, resident compute time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from surge.engines.base import random_batch
from surge.engines.memory import Workspace
from surge.engines.torch_gpu import TorchEngine
from surge.types import Layout

MiB = 2 ** 20


def save(cfg) -> Path:
    from transformers import AutoModel

    d = Path(tempfile.mkdtemp())
    AutoModel.from_config(cfg).save_pretrained(d)
    return d


def wall_ms(fn, iters=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def activation_peak_hf(path: Path, batch: int, seq: int) -> float:
    from transformers import BertModel

    torch.cuda.empty_cache()
    m = BertModel.from_pretrained(path, dtype=torch.float16, attn_implementation="sdpa").cuda().eval()
    ids = torch.randint(1000, 30522, (batch, seq), device="cuda")
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        m(input_ids=ids, attention_mask=mask)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        m(input_ids=ids, attention_mask=mask)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del m, ids, mask
    torch.cuda.empty_cache()
    return peak


def activation_peak_surge(path: Path, batch: int, seq: int) -> tuple[float, int]:
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    e = TorchEngine(device="cuda", precision="fp16", max_batch=batch, max_tokens=batch * seq)
    e.load(path)
    b = random_batch(batch, seq, 30522, Layout.PACKED)
    e.run(b)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    e.run(b)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - e.weights.nbytes()
    plan = e.plan.nbytes
    e.close()
    return peak, plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_memory.json")
    args = ap.parse_args()
    from transformers import BertConfig, DistilBertConfig

    torch.manual_seed(0)
    res: dict = {}
    base_dir = save(BertConfig())
    # 1. activation peak
    hf = activation_peak_hf(base_dir, 64, 512)
    sg, plan = activation_peak_surge(base_dir, 64, 512)
    res["activation_peak"] = {"hf_sdpa_fp16_mib": hf / MiB, "surge_mib": sg / MiB, "surge_plan_mib": plan / MiB,
                              "ratio": sg / hf}
    print(json.dumps(res["activation_peak"]), flush=True)

    # 2. three encoders, one workspace
    dirs = [base_dir, save(DistilBertConfig()), save(BertConfig(hidden_size=384, num_hidden_layers=6,
                                                                num_attention_heads=12, intermediate_size=1536))]
    separate = [TorchEngine(device="cuda", precision="fp16", max_batch=32, gemm="cublas") for _ in dirs]
    shared_ws = Workspace("cuda")
    shared = [TorchEngine(device="cuda", precision="fp16", max_batch=32, workspace=shared_ws, gemm="cublas") for _ in dirs]
    same = True
    for e, d in zip(separate + shared, dirs + dirs):
        e.load(d)
    for a, s in zip(separate, shared):
        for n in (1, 17):
            b = random_batch(n, 77, 30522, Layout.PACKED)
            same &= bool(np.array_equal(a.run(b), s.run(b)))
    res["shared_workspace"] = {"separate_mib": sum(e.workspace.nbytes for e in separate) / MiB,
                               "shared_mib": shared_ws.nbytes / MiB, "outputs_identical": same}
    print(json.dumps(res["shared_workspace"]), flush=True)
    for e in separate + shared:
        e.close()
    del separate, shared, shared_ws
    torch.cuda.empty_cache()

    # 3. BERT-large under a weight budget of 1/4
    large = save(BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096))
    resident = TorchEngine(device="cuda", precision="fp16", max_batch=32)
    resident.load(large)
    total = resident.weights.nbytes()
    b = random_batch(32, 128, 30522, Layout.PACKED)
    compute_ms = wall_ms(lambda: resident.run(b))
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    copy_ms = wall_ms(lambda: dev.copy_(host, non_blocking=True), iters=10)
    del host, dev
    off = TorchEngine(device="cuda", precision="fp16", max_batch=32, weight_budget=total // 4)
    off.load(large)
    np_ok = float(np.abs(off.run(b).astype(np.float32) - resident.run(b).astype(np.float32)).max())
    off_ms = wall_ms(lambda: off.run(b))
    bound = max(copy_ms, compute_ms)
    res["offload"] = {"weights_mib": total / MiB, "budget_mib": total / 4 / MiB,
                      "gpu_weight_mib": (off.offload.gpu_bytes + sum(t.numel() * t.element_size() for t in off.weights.embedding_tensors())) / MiB,
                      "resident_layers": len(off.offload.resident), "streamed_layers": len(off.offload.host),
                      "h2d_gb_s": total / copy_ms / 1e6, "copy_all_ms": copy_ms, "resident_compute_ms": compute_ms,
                      "offload_ms": off_ms, "ratio_to_bound": off_ms / bound, "max_abs_diff_vs_resident": np_ok}
    print(json.dumps(res["offload"]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    a, s, o = res["activation_peak"], res["shared_workspace"], res["offload"]
    print("\n| measure | baseline | surge | ratio |\n|---|---|---|---|")
    print(f"| activation peak, BERT-base FP16 64x512 | HF SDPA {a['hf_sdpa_fp16_mib']:.0f} MiB | "
          f"{a['surge_mib']:.0f} MiB (plan {a['surge_plan_mib']:.0f}) | {a['ratio']:.2f} |")
    print(f"| workspace, 3 encoders | separate {s['separate_mib']:.0f} MiB | shared {s['shared_mib']:.0f} MiB | "
          f"{s['shared_mib'] / s['separate_mib']:.2f} |")
    print(f"| BERT-large 32x128, 1/4 weight budget | max(copy {o['copy_all_ms']:.2f}, compute "
          f"{o['resident_compute_ms']:.2f}) ms | {o['offload_ms']:.2f} ms | {o['ratio_to_bound']:.2f} |")


if __name__ == "__main__":
    main()
