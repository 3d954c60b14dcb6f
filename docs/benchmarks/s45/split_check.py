"""GPU equivalence probe for the split: the torch engine and the decoder engine through their CUDA paths
(graphs captured per bucket, launch/collect, pooling and heads in the graph, pipelined slots; decode graphs,
overlapped multi-step launches, n-gram speculation, row graphs), outputs saved for comparison between trees."""
import json, sys, pathlib, tempfile
import numpy as np
import torch

dev = sys.argv[1]
out_path = sys.argv[2]
work = pathlib.Path(sys.argv[3])
res = {}

# ---------------------------------------------------------------- encoder
from transformers import BertConfig, BertModel
enc_dir = work / "bert"
if not (enc_dir / "config.json").exists():
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=256, max_position_embeddings=128)).save_pretrained(enc_dir)
from surge.engines.base import random_batch
from surge.engines.heads import Head, HeadSet
from surge.engines.torch_gpu import TorchEngine
from surge.types import Layout
batches = [random_batch(b, s, 1000, Layout.PACKED) for b, s in ((1, 7), (3, 20), (8, 64), (5, 33))]
prec = "fp16" if dev == "cuda" else "fp32"

def eng(**kw):
    e = TorchEngine(device=dev, precision=prec, max_batch=8, **kw)
    e.load(enc_dir)
    return e

e = eng()
e.warmup([(2, 16)])
res["enc_run"] = [e.run(b).astype(np.float64).round(6).tolist() for b in batches]
res["enc_builds_after_ready"] = e.builds_after_ready
e.close()
if dev == "cuda":
    e = eng(pipeline_depth=2)
    assert e.attach_pooling("mean")
    e.warmup([(2, 16)])
    jobs = [e.launch(b) for b in batches[:2]]
    res["enc_pooled_launch"] = [e.collect(j).astype(np.float64).round(6).tolist() for j in jobs]
    res["enc_pooled_run"] = [e.run(b).astype(np.float64).round(6).tolist() for b in batches]
    e.close()
    g = np.random.default_rng(1)
    f = lambda *s: g.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
    hs = HeadSet([Head("c", "classify", ("a", "b", "c"), pre=[(f(128, 128), f(128), "tanh")], weight=f(3, 128),
                       bias=f(3), width=3),
                  Head("t", "token-classify", tuple("vwxyz"), weight=f(5, 128), bias=f(5), width=5)])
    for inv in (True, False):
        e = eng(batch_invariant=inv, gemm="auto" if inv else "cublas")
        assert e.attach_heads(hs)
        e.warmup([(2, 16)])
        rows = [e.run_heads(b) for b in batches]
        res[f"enc_heads_{inv}"] = [[np.asarray(r, dtype=np.float64).round(5).tolist() for r in rr] for rr in rows]
        e.close()
    e = eng(batch_invariant=False)  # gemm=auto: every mode captured and timed
    e.warmup([(2, 16)])
    ref = res["enc_run"]
    got = [e.run(b) for b in batches]
    res["enc_auto_close"] = all(np.allclose(np.asarray(a), b, atol=5e-2) for a, b in zip(ref, got))
    res["enc_auto_modes"] = sorted({m for t in e.choices.values() for m in t})
    e.close()

# ---------------------------------------------------------------- decoder
sys.path.insert(0, ".")
from tests.decoder_models import build_model
dec_dir = work / "qwen2"
if not (dec_dir / "config.json").exists():
    build_model("qwen2", dec_dir, seed=3)
from surge.engines.decoder import DecoderEngine
from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
from surge.runtime.scheduler.ngram import NgramProposer
from surge.runtime.scheduler.overlap import StepLoop

g = torch.Generator().manual_seed(5)
prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(4, 60, (6,), generator=g)]
prompts[0] = (prompts[0][:5] * 6)  # repeats: the n-gram speculator finds drafts
dt = "bf16" if dev == "cuda" else "fp32"

def loop(engine, steps=1, speculator=None, overlapped=True):
    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=8,
                                      max_num_batched_tokens=512, max_model_len=512), ())
    seqs = [Sequence(i, p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    if not overlapped:
        while sched.has_work:
            sc = sched.schedule()
            o = engine.step(sc)
            sched.update(sc, {k: v.token for k, v in o.items()})
        return [s.output_ids for s in seqs], None
    lp = StepLoop(sched, engine, steps=steps, speculator=speculator)
    while lp.busy:
        lp.step()
    return [s.output_ids for s in seqs], lp

for name, kw, lk in [("plain", {}, {"overlapped": False}),
                     ("overlap2", {"decode_steps": 2}, {"steps": 2}),
                     ("spec", {"decode_steps": 2, "speculative_tokens": 3}, {"steps": 2, "speculator": "ngram"})]:
    engine = DecoderEngine(dec_dir, device=dev, dtype=dt, num_blocks=256, max_num_seqs=8, max_model_len=512, **kw)
    engine.warmup()
    if lk.get("speculator"):
        lk = dict(lk, speculator=NgramProposer(3))
    outs, lp = loop(engine, **lk)
    res[f"dec_{name}"] = outs
    if lp is not None:
        res[f"dec_{name}_overlapped"] = lp.overlapped
        res[f"dec_{name}_stats"] = {k: v for k, v in vars(lp).items() if isinstance(v, int) and not isinstance(v, bool)}
json.dump(res, open(out_path, "w"))
print("ok", out_path, {k: (v if not isinstance(v, list) else len(v)) for k, v in res.items()})
