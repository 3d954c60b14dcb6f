"""`surge bench`: load generation, workloads and reports for embedding servers.

- workloads.py: assistant-style queries from templates, Zipf popularity, query logs
- targets.py: how one request is sent (native HTTP, OpenAI, KServe v2 HTTP/gRPC, in-process)
- loadgen.py: closed-loop and open-loop (Poisson) load, sweeps, warm-up, bounds
- metrics.py: reading cache and batch statistics from a server's /metrics
- report.py: percentiles, summaries, JSON, tables and PNG plots
"""
