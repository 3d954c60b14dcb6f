"""The embedding server people write by hand: FastAPI + the transformers model, one request at a time.

This is the baseline surge is compared with (benchmarks/serving_vs_baseline.py).
It is written the way such servers usually are: load AutoModel/AutoTokenizer,
mean-pool and normalize in torch, one forward pass per request, a lock so
that requests do not trample each other's threads, JSON lists out. It speaks
the same two APIs as surge (POST /embed and POST /v1/embeddings), so one
benchmark command drives both.

    python benchmarks/baselines/fastapi_transformers.py --port 9000 [--model-dir DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import threading
from typing import Union

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from transformers import AutoModel, AutoTokenizer


class EmbedRequest(BaseModel):
    inputs: Union[str, list[str]]


class OpenAIRequest(BaseModel):
    input: Union[str, list[str]]
    model: str | None = None


def build_app(model_dir: str) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    lock = threading.Lock()
    app = FastAPI()

    def embed(texts: list[str]) -> list[list[float]]:
        with lock, torch.inference_mode():
            enc = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1).tolist()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/ready")
    def ready():
        return {"status": "ready"}

    @app.post("/embed")
    def embed_route(req: EmbedRequest):
        texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        return {"embeddings": embed(texts)}

    @app.post("/v1/embeddings")
    def openai_route(req: OpenAIRequest):
        texts = [req.input] if isinstance(req.input, str) else req.input
        vectors = embed(texts)
        return {"object": "list", "model": req.model or "baseline",
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model-dir", default=None, help="default: surge's bundled all-MiniLM-L6-v2")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from surge.models import bundled_model_dir

        model_dir = str(bundled_model_dir())
    uvicorn.run(build_app(model_dir), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
