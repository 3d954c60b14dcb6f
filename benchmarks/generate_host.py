"""The host's share of a decode step: GenerateService with the GPU taken out.

A tiny Qwen2-shaped model on the CPU, the CUDA-graph decode path's host logic (graphs.run: staging
buffers, block tables) with a replay that does nothing, and the overlapped step loop: each decode step
costs only what the host does for it (schedule, launch, read back, resolve, the hand-off to the event
loop and the streams' coroutines, the benchmark's own consumer). That is the floor under the wall time of
a step on the GPU, whatever the kernels take: the two threads share the GIL.

    PYTHONPATH=src python3 benchmarks/generate_host.py --streams 64 --prompt 128 --output 128 --rounds 5

Prints the decode steps' host time per step (median over rounds; the prefill step is left out).
`--text`: the streams are detokenized with the model's byte-level BPE tokenizer, as the server does
(the default leaves text out, as benchmarks/generate.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))


class _NoReplay:
    def __init__(self, graphs, b):
        self.graphs, self.b = graphs, b

    def replay(self):
        pass


def build_engine(path: Path, streams: int, max_len: int):
    from surge.engines.decoder import DecoderEngine
    from surge.engines.decoder.graphs import DecodeGraphs

    engine = DecoderEngine(path, device="cpu", max_num_seqs=streams, max_model_len=max_len,
                           kv_cache_tokens=(streams + 8) * max_len)
    g = DecodeGraphs(engine, streams)
    g.graphs = {b: _NoReplay(g, b) for b in g.buckets}
    g.outputs = {b: (torch.zeros(b, engine.cfg.vocab_size), torch.full((b,), 7, dtype=torch.long)) for b in g.buckets}
    engine.graphs = g
    # the prefill step: no model either (its time is not the host's share of a decode step)
    engine.step = lambda scheduled: _prefill_stub(scheduled)
    return engine


def _prefill_stub(scheduled):
    from surge.engines.decoder.sampler import SampleOut

    return {s.seq.seq_id: SampleOut(7) for s in scheduled if s.sample}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gc", choices=["none", "settle", "settle-t"], default="none",
                    help="settle: gc_settle.settle() after the warm-up, as the server does; settle-t: also a "
                         "higher generation-0 threshold")
    ap.add_argument("--stagger", action="store_true",
                    help="prompt lengths prompt - i %% 16: streams cross KV block boundaries at different steps "
                         "(as in real traffic) instead of all at once")
    ap.add_argument("--text", action="store_true",
                    help="detokenize with the model's tokenizer (the server's path) instead of token ids only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.generate import _NoText, _surge_round
    from surge.runtime.generate_service import GenerateService, GenerationConfig
    from tests.decoder_models import build_model

    max_len = args.prompt + args.output + 16
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model("qwen2", Path(tmp) / "q", max_position_embeddings=max(512, max_len))
        engine = build_engine(path, args.streams, max_len)
        gen = GenerationConfig(max_num_seqs=args.streams, max_num_batched_tokens=args.streams * args.prompt,
                               max_model_len=max_len, cache_entries=0, prefix_caching=False, overlap_steps=True)
        if args.text:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            tokenizer = _NoText()
        service = GenerateService("host", "1", path, engine, tokenizer, None, gen, request_timeout_s=600)
        service.loop.overlap = True  # the GPU's loop (the service turns it off for a CPU engine)
        service.mark_ready()
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, engine.cfg.vocab_size, (args.streams, args.prompt), generator=g).tolist()
        if args.stagger:
            prompts = [p[:len(p) - i % 16] for i, p in enumerate(prompts)]

        import psutil

        proc = psutil.Process()

        def cpu():  # per-thread CPU seconds: {native id: user + system}
            return {t.id: t.user_time + t.system_time for t in proc.threads()}

        async def run():
            await _surge_round(service, prompts[:8], 4)
            if args.gc != "none":
                import gc

                from surge.runtime.gc_settle import settle

                settle()
                if args.gc == "settle-t":
                    gc.set_threshold(20000, 10, 10)
            out = []
            c0 = cpu()
            for _ in range(args.rounds):
                s0 = service.steps
                r = await _surge_round(service, prompts, args.output)
                r["steps"] = service.steps - s0
                out.append(r)
            c1 = cpu()
            steps = sum(r["steps"] for r in out)
            eng = service._thread.native_id
            import threading

            main_id = threading.main_thread().native_id
            print(f"CPU ms per step: engine thread {1e3 * (c1[eng] - c0.get(eng, 0)) / steps:.3f}, "
                  f"event loop {1e3 * (c1[main_id] - c0[main_id]) / steps:.3f}")
            await service.close()
            return out

        rounds = asyncio.run(run())
    per_step = [1e3 * (r["wall_s"] - r["ttft_p50_ms"] / 1e3) / max(1, args.output - 1) for r in rounds]
    print("rounds: wall ms", [round(1e3 * r["wall_s"], 1) for r in rounds], "steps", [r["steps"] for r in rounds])
    print("decode host ms/step (wall - ttft) / (output - 1):", [round(x, 3) for x in per_step])
    print("ITL p50 ms:", [round(r["itl_p50_ms"], 3) for r in rounds])
    print(f"median host ms per decode step: {statistics.median(per_step):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
