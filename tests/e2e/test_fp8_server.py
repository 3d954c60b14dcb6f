"""FP8 end to end on the CPU: a real `surge serve` of an FP8 checkpoint written by compressed-tensors (RedHatAI's
"-FP8-dynamic" kind) answers the openai client's chat and streamed completions with transformers' greedy text on
the same checkpoint; `--generation quantization=fp8`, which needs an FP8-capable GPU, stops the server at startup
naming the setting and what it needs."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("compressed_tensors")

from tests.decoder_models import build_quantized_checkpoint, build_model, load_quantized_reference  # noqa: E402
from tests.server_process import ROOT, ServerProcess, free_port  # noqa: E402

NAME = "fp8-qwen"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8srv")
    base = build_model("qwen2", root / "base", seed=9, hidden_size=128, intermediate_size=256)
    return build_quantized_checkpoint(base, root / NAME, "FP8_DYNAMIC")


def test_an_fp8_checkpoint_is_served_as_transformers_answers(fp8_dir):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    model, tok = load_quantized_reference(fp8_dir), AutoTokenizer.from_pretrained(fp8_dir)
    question = "Define assignment."
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    chat_ref = tok.decode(model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                         pad_token_id=0)[0, len(ids):], skip_special_tokens=True)
    prompt = "The assignment of"
    pids = tok(prompt)["input_ids"]
    comp_ref = tok.decode(model.generate(torch.tensor([pids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, len(pids):], skip_special_tokens=True)
    with ServerProcess(str(fp8_dir), "--threads", "1", "--generation", "cache_entries=0") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                              max_tokens=16, temperature=0)
        assert chat.choices[0].message.content == chat_ref
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == comp_ref


def test_quantization_fp8_on_the_cpu_is_a_clear_startup_error(fp8_dir):
    p = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", str(fp8_dir), "--port", str(free_port()),
                        "--grpc-port", "0", "--generation", "quantization=fp8"], capture_output=True, text=True,
                       timeout=180, cwd=ROOT)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "quantization=fp8 needs a CUDA GPU of compute capability 8.9" in out, out[-2000:]
