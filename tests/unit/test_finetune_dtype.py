"""surge.models.finetune trains its heads in FP32 whatever dtype the backbone's checkpoint stores."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_heads_train_on_a_backbone_stored_in_fp16(tmp_path):
    """transformers 5 loads a checkpoint in the dtype it stores: an FP16 copy of the bundled MiniLM (as the GPU
    machine holds it) once gave Half features to the FP32 heads and failed; the heads now train and classify
    the held-out commands as well as on the FP32 backbone."""
    import shutil

    from surge.models import bundled_model_dir
    from surge.models.finetune import train_heads

    src = bundled_model_dir()
    half = tmp_path / "fp16"
    model = transformers.AutoModel.from_pretrained(str(src), local_files_only=True, dtype=torch.float16)
    model.save_pretrained(str(half))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (src / f).is_file():
            shutil.copy(src / f, half / f)
    assert transformers.AutoModel.from_pretrained(str(half)).dtype == torch.float16  # the case under test
    report = train_heads(half, tmp_path / "heads", n_train=120, n_test=60)
    ref = train_heads(src, tmp_path / "heads32", n_train=120, n_test=60)  # the same data on the FP32 backbone
    for k in ("intent_accuracy", "slot_token_accuracy"):
        assert report[k] > 0.8 and abs(report[k] - ref[k]) <= 0.05, (report, ref)
    assert json.loads((tmp_path / "heads" / "TRAINING.json").read_text())["train"] == 120
    assert (tmp_path / "heads" / "intent" / "config.json").is_file() and (tmp_path / "heads" / "slots").is_dir()
