"""Distillation by width: the narrowed student keeps exactly the chosen FFN neurons of the teacher.

References are the teacher (the bundled all-MiniLM-L6-v2) in transformers FP32 on real sentences.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from surge.cli.main import app
from surge.data import calibration_queries, heldout_queries
from surge.models import bundled_model_dir, load_model_spec
from surge.optimize import distill as D


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(bundled_model_dir())


@pytest.fixture(scope="module")
def teacher(spec):
    torch.set_num_threads(2)
    return D._load(spec)


def _batch(spec, texts):
    from surge.optimize.validate import encode_texts
    from surge.types import TokenBatch

    b = TokenBatch.pad(encode_texts(spec, texts))
    return torch.from_numpy(b.input_ids), torch.from_numpy(b.attention_mask)


def _hidden(model, ids, mask):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def _pooled(model, ids, mask):
    return torch.nn.functional.normalize(D._pool(_hidden(model, ids, mask), mask, "mean"), dim=-1)


SENTENCES = heldout_queries()[:48]


def test_nothing_pruned_is_the_teacher_exactly(spec, teacher):
    ids, mask = _batch(spec, SENTENCES)
    student = D.make_student(teacher, list(range(spec.num_layers)))
    size = teacher.config.intermediate_size
    # every neuron kept, given in a scrambled order: the slice is the identity
    D.narrow_ffn(student, [list(np.random.default_rng(i).permutation(size)) for i in range(spec.num_layers)])
    assert student.config.intermediate_size == size
    assert torch.equal(_hidden(student, ids, mask), _hidden(teacher, ids, mask))


def test_narrowing_keeps_exactly_the_chosen_neurons(spec, teacher):
    ids, mask = _batch(spec, SENTENCES)
    student = D.make_student(teacher, list(range(spec.num_layers)))
    keep, info = D.choose_ffn(student, 768, *_batch(spec, calibration_queries()[:64]))
    assert [len(k) for k in keep] == [768] * spec.num_layers and all(k == sorted(set(k)) for k in keep)
    assert len(info["importance_kept_share"]) == spec.num_layers
    D.narrow_ffn(student, keep)
    assert student.config.intermediate_size == 768
    base = student.base_model
    assert all(l.intermediate.dense.out_features == 768 and l.output.dense.in_features == 768 for l in base.encoder.layer)

    def silenced(kept_sets):  # the teacher with every other FFN neuron's activation set to 0
        handles = []
        for layer, k in zip(teacher.encoder.layer, kept_sets):
            off = torch.ones(teacher.config.intermediate_size, dtype=torch.bool)
            off[torch.as_tensor(k)] = False
            handles.append(layer.intermediate.register_forward_hook(lambda m, a, o, off=off: o.masked_fill(off, 0.0)))
        try:
            return _hidden(teacher, ids, mask)
        finally:
            for h in handles:
                h.remove()

    got = _hidden(student, ids, mask)
    assert torch.allclose(got, silenced(keep), atol=1e-5, rtol=0)
    # ... and not a teacher silenced elsewhere (the check tells neuron sets apart)
    shifted = [sorted((np.asarray(k) + 1) % teacher.config.intermediate_size) for k in keep]
    assert not torch.allclose(got, silenced(shifted), atol=1e-3, rtol=0)


def test_measured_neurons_beat_random_ones(spec, teacher):
    ids, mask = _batch(spec, SENTENCES)
    want = _pooled(teacher, ids, mask)
    calib = _batch(spec, calibration_queries()[:64])
    chosen = D.make_student(teacher, list(range(spec.num_layers)))
    D.narrow_ffn(chosen, D.choose_ffn(chosen, 768, *calib)[0])
    rng = np.random.default_rng(0)
    rand = D.make_student(teacher, list(range(spec.num_layers)))
    D.narrow_ffn(rand, [sorted(rng.permutation(1536)[:768]) for _ in range(spec.num_layers)])
    measured = float((_pooled(chosen, ids, mask) * want).sum(-1).mean())
    random = float((_pooled(rand, ids, mask) * want).sum(-1).mean())
    assert measured > random + 0.03, (measured, random)  # held-out, all 2,715: 0.752 against 0.681


def test_refit_folds_the_dropped_neurons_into_the_kept_ones(spec, teacher):
    ids, mask = _batch(spec, SENTENCES)  # held out: the refit sees calibration text only
    want = _pooled(teacher, ids, mask)
    calib = [_batch(spec, calibration_queries()[i : i + 64]) for i in range(0, 512, 64)]
    everything = D.make_student(teacher, list(range(spec.num_layers)))
    D.refit_ffn(everything, [list(range(1536))] * spec.num_layers, calib)  # nothing dropped: the teacher again,
    assert float((_pooled(everything, ids, mask) * want).sum(-1).min()) > 0.999  # up to the ridge's shrinkage
    keep = D.choose_ffn(D.make_student(teacher, list(range(spec.num_layers))), 768, *calib[0])[0]
    plain = D.make_student(teacher, list(range(spec.num_layers)))
    D.narrow_ffn(plain, keep)
    refit = D.make_student(teacher, list(range(spec.num_layers)))
    residual = D.refit_ffn(refit, keep, calib)
    assert len(residual) == spec.num_layers and all(0 < r < 1 for r in residual)
    for layer, ours, k in zip(teacher.encoder.layer, refit.base_model.encoder.layer, keep):
        # only the output projection is refitted: the kept neurons are the teacher's own
        assert torch.equal(ours.intermediate.dense.weight, layer.intermediate.dense.weight[k])
        assert ours.output.dense.weight.shape == (384, 768)
    cos_plain = float((_pooled(plain, ids, mask) * want).sum(-1).mean())
    cos_refit = float((_pooled(refit, ids, mask) * want).sum(-1).mean())
    assert cos_refit > cos_plain + 0.05, (cos_plain, cos_refit)  # all 2,715 held-out: 0.752 -> 0.912


def test_a_short_distill_run_brings_the_narrow_student_closer_to_the_teacher(spec, teacher, tmp_path):
    from transformers import AutoModel

    ids, mask = _batch(spec, heldout_queries()[:256])
    want = _pooled(teacher, ids, mask)
    texts = calibration_queries()[:640]
    cosines = {}
    for steps in (1, STEPS):  # 1 step at a vanishing rate: the student distill starts from
        options = D.DistillOptions(layers=6, ffn_size=384, steps=steps, time_budget=0, texts=texts, threads=2,
                                   lr=5e-4 if steps > 1 else 1e-12)
        result = D.distill(spec, tmp_path / str(steps), options)
        assert result.kept_layers == list(range(6)) and result.info["student_ffn_size"] == 384
        student = AutoModel.from_pretrained(str(tmp_path / str(steps)), local_files_only=True).eval()
        assert student.config.intermediate_size == 384 and student.config.num_hidden_layers == 6
        cosines[steps] = float((_pooled(student, ids, mask) * want).sum(-1).mean())
    assert load_model_spec(tmp_path / str(STEPS)).num_layers == 6
    # FFN 1536 -> 384: the refitted student starts at 0.841 and 60 steps on 640 texts bring it to 0.849 (measured;
    # at 768 it starts at 0.912, closer than so short a run on so little text gets it)
    assert cosines[STEPS] > cosines[1] + 0.003, cosines


STEPS = 60


@pytest.mark.parametrize("args, message", [
    (["--ffn-size", "2000"], "--ffn-size must be >= 1 and at most the teacher's 1536"),
    (["--ffn-size", "-3"], "--ffn-size must be >= 1"),
    (["--layers", "6"], "the student must be smaller than the teacher: --layers below 6 or --ffn-size below the teacher's FFN size (1536)"),
    (["--layers", "6", "--ffn-size", "1536"], "the student must be smaller than the teacher"),
    (["--layers", "7", "--ffn-size", "768"], "--layers must be between 1 and 6"),
    (["--precision", "fp16"], "--precision must be 'fp32' or 'bf16'"),
])
def test_bad_width_options_are_clear_errors(tmp_path, args, message):
    r = CliRunner().invoke(app, ["distill", "-o", str(tmp_path / "s"), *args])
    assert r.exit_code == 1 and message in " ".join(r.output.split()), r.output
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.staging").exists()
