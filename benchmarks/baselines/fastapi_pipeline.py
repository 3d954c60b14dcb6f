"""The classifier server people write by hand: FastAPI + transformers' text-classification pipeline.

The baseline of benchmarks/tasks.py (2-core row): load `pipeline("text-classification")`,
one call per request under a lock (the pipeline is not safe to share between the
threadpool's threads), JSON out in the TEI / HF Inference shape that surge's
POST /predict answers, so one load generator drives both.

    python benchmarks/baselines/fastapi_pipeline.py --port 9000 --model-dir DIR [--threads N]
"""

from __future__ import annotations

import argparse
import threading
from typing import Union

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from transformers import pipeline


class PredictRequest(BaseModel):
    inputs: Union[str, list[str]]


def build_app(model_dir: str) -> FastAPI:
    pipe = pipeline("text-classification", model=model_dir, device="cpu", top_k=None)
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/ready")
    def ready():
        return {"status": "ready"}

    @app.post("/predict")
    def predict(req: PredictRequest):
        with lock:
            out = pipe(req.inputs)
        return out if isinstance(req.inputs, list) else out[0] if out and isinstance(out[0], list) else out

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    uvicorn.run(build_app(args.model_dir), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
