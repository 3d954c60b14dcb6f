"""Prepare what a GPU machine without the bundled-model package needs.

Writes OUT/minilm/ (the bundled model, weights in fp16 so that it fits the
transfer limit; config and tokenizer unchanged) and OUT/ref_fp32.npy: the FP32
PyTorch reference embeddings (tests/reference.py, the ORIGINAL fp32 weights) of
every sentence of surge.data.load_sentences(); and OUT/hidden_fp32.npz: the
last hidden states of tests/reference.hidden_state_texts (TEI's /embed_all). The
GPU tests compare against those, so the fp16 storage of the copy counts against
the engine.

    PYTHONPATH=src python3 benchmarks/gpu_prepare.py OUT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

from surge.data import load_sentences
from surge.models import bundled_model_dir, load_model_spec


def main(out: Path) -> None:
    src = bundled_model_dir()
    dst = out / "minilm"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "*.md", ".gitattributes",
                                                            "data_config.json"))
    sd = load_file(str(src / "model.safetensors"))
    save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in sd.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.reference import TorchReference, hidden_state_texts

    reference = TorchReference(load_model_spec(src))
    ref = reference(load_sentences())
    np.save(out / "ref_fp32.npy", ref.astype(np.float32))
    hidden = reference.last_hidden_states(hidden_state_texts(load_sentences()))
    np.savez(out / "hidden_fp32.npz", *hidden)
    print(f"wrote {dst}, {out / 'ref_fp32.npy'} {ref.shape} and {out / 'hidden_fp32.npz'} ({len(hidden)} texts)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
