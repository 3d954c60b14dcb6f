"""The PyTorch FP32 reference that surge's outputs are checked against.

It deliberately shares no code with surge's own path: the transformers model,
its own tokenizer class, and pooling written out here with torch ops.
"""

from __future__ import annotations

import numpy as np


class TorchReference:
    def __init__(self, spec):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.spec = spec
        self.tok = AutoTokenizer.from_pretrained(str(spec.path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(spec.path), dtype=torch.float32, local_files_only=True).eval()

    def __call__(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        import torch

        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                enc = self.tok(texts[i : i + batch_size], padding=True, truncation=True,
                               max_length=self.spec.max_length, return_tensors="pt")
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                if self.spec.pooling == "cls":
                    pooled = hidden[:, 0]
                else:
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                if self.spec.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out.append(pooled.numpy())
        return np.concatenate(out)

    def last_hidden_states(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's last_hidden_state [tokens, hidden] float32, one text at a time (no padding), truncated to
        the model's length: what TEI's /embed_all answers."""
        import torch

        out = []
        with torch.inference_mode():
            for text in texts:
                enc = self.tok([text], truncation=True, max_length=self.spec.max_length, return_tensors="pt")
                out.append(self.model(**enc).last_hidden_state[0].numpy().astype(np.float32))
        return out


def hidden_state_texts(sentences: list[str]) -> list[str]:
    """The texts whose hidden states the GPU tests check (benchmarks/gpu_prepare.py stores their reference):
    six sentences and one past the model's length."""
    return sentences[:6] + ["the quick brown fox jumps over the lazy dog " * 80]
