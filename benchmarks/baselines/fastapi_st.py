"""The GPU embedding server people write by hand: FastAPI + sentence-transformers, FP16 on CUDA.

The GPU baseline of benchmarks/gpu_serving.py. Written the usual way: one
SentenceTransformer in half precision on the GPU, `model.encode` per request
under a lock (a sync route, so FastAPI runs it in its thread pool), vectors
out as JSON lists. Speaks OpenAI's POST /v1/embeddings (and /embed).

    python benchmarks/baselines/fastapi_st.py --port 9000 --model-dir DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import threading
from typing import Union

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class OpenAIRequest(BaseModel):
    input: Union[str, list[str]]
    model: str | None = None


class EmbedRequest(BaseModel):
    inputs: Union[str, list[str]]


def build_app(model_dir: str, device: str) -> FastAPI:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device=device)
    if device.startswith("cuda"):
        model = model.half()
    lock = threading.Lock()
    app = FastAPI()

    def embed(texts: list[str]) -> list[list[float]]:
        with lock:
            return model.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True).tolist()

    @app.get("/ready")
    def ready():
        return {"status": "ready"}

    @app.post("/v1/embeddings")
    def openai(req: OpenAIRequest):
        texts = [req.input] if isinstance(req.input, str) else req.input
        return {"object": "list", "model": req.model or "model",
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(embed(texts))]}

    @app.post("/embed")
    def native(req: EmbedRequest):
        texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        return {"embeddings": embed(texts)}

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    uvicorn.run(build_app(a.model_dir, a.device), host="127.0.0.1", port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
