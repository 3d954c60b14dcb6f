"""Session 36: 12 layers of GPT-2 small's four linear shapes (distinct weights: more than the caches hold), median of 5,
ms a pass: f32 / bf = F.linear on [out, in]; f32t / bft = x @ W on [in, out]; i8 = torch._weight_int8pack_mm (BF16
activations, INT8 weights, a BF16 scale a row). python3 docs/benchmarks/s36/cpu_linear_cold.py"""
import torch, time, statistics
torch.set_num_threads(2)
L=12
def bench(f, n=5):
    f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e3
shapes=[(768,2304),(768,768),(768,3072),(3072,768)]
W={}
for K,N in shapes:
    ws=[torch.randn(N,K) for _ in range(L)]
    W[(K,N)]=dict(f32=ws, bf=[w.bfloat16() for w in ws], bft=[w.bfloat16().t().contiguous() for w in ws], f32t=[w.t().contiguous() for w in ws],
                  q=[(torch.round(w/(w.abs().amax(1)/127)[:,None]).clamp(-127,127).to(torch.int8), (w.abs().amax(1)/127).bfloat16()) for w in ws])
for M in (1,4,8,16,32):
    x={K:torch.randn(M,K) for K in (768,3072)}
    xb={K:v.bfloat16() for K,v in x.items()}
    def run(kind):
        def f():
            for l in range(L):
                for (K,N) in shapes:
                    d=W[(K,N)]
                    if kind=='f32': torch.nn.functional.linear(x[K], d['f32'][l])
                    elif kind=='bf': torch.nn.functional.linear(xb[K], d['bf'][l])
                    elif kind=='bft': xb[K] @ d['bft'][l]
                    elif kind=='f32t': x[K] @ d['f32t'][l]
                    else: torch._weight_int8pack_mm(xb[K], *d['q'][l])
        return f
    print(M, {k: round(bench(run(k)),2) for k in ('f32','f32t','bf','bft','i8')})
