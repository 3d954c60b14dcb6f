"""Session 36: torch.profiler over 20 consecutive engine steps inside the engine thread (GPT-2 small, 8 streams, FP32,
2 threads). PYTHONPATH=src:. python3 docs/benchmarks/s36/cpu_step_profile.py"""
import sys, asyncio, argparse, tempfile, time, torch
from pathlib import Path
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "src")
import generate as G
from torch.profiler import profile, ProfilerActivity
ap = argparse.ArgumentParser(); G.add_engine_args(ap)
args = ap.parse_args(["--device","cpu","--streams","8","--prompt","64","--output","32","--threads","2"] + sys.argv[1:])
args.dtype = args.dtype or "fp32"
torch.set_num_threads(2)
with tempfile.TemporaryDirectory() as tmp:
    path = G.build("gpt2-small", Path(tmp)/"m", "cpu")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, 50257, (8, 64), generator=g).tolist()
    engine, service, _ = G.make_service(path, args, 8)
    st = {"n": 0, "p": None, "t": []}
    orig = engine.step
    def step(sch):
        st["n"] += 1
        dec = all(s.num_new == 1 for s in sch) if hasattr(sch[0], "num_new") else None
        if st["n"] == 45: st["p"] = profile(activities=[ProfilerActivity.CPU]); st["p"].__enter__()
        t = time.perf_counter(); out = orig(sch); st["t"].append((len(sch), time.perf_counter() - t))
        if st["n"] == 65: st["p"].__exit__(None, None, None)
        return out
    engine.step = step
    async def main():
        for _ in range(3):
            r = await G._surge_round(service, prompts, 32)
            print("round", r["tok_s"], r["itl_p50_ms"])
        await service.close()
    asyncio.run(main())
    print("step times ms", [round(1e3*t, 1) for _, t in st["t"][-40:]])
    print(st["p"].key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
