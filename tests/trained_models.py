"""Tiny Qwen2-shaped models trained here (seconds on the CPU) to give one answer to one question, greedily:

- `train_tool_model`: a weather question answered with a tool call in one of the tool-call parsers' formats
  (TOOL_FORMATS): a Hermes call after text under Qwen2.5's way with tools (tests/decoder_models.QWEN_TOOLS,
  so later turns render the call and the tool's answer), a Llama 3.1 JSON call after `<|python_tag|>` (a special
  token, so not in the answer's text) under LLAMA3_TOOLS, or text and a Mistral `[TOOL_CALLS]` array (a special
  token too, as are Mistral's [INST] and the like) under MISTRAL_TOOLS;
- `train_thinking_model`: a question answered `<think>...</think>` then the answer, as DeepSeek-R1's
  distills do (the tags one token each, as R1's tokenizer has them).
"""

from __future__ import annotations

from pathlib import Path

from tests.decoder_models import CHATML, LLAMA3_TOOLS, MISTRAL_TOOLS, QWEN_TOOLS, save_tokenizer, train_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# parser -> (chat template, answer as the model writes it, added tokens, added special tokens); the corpus lacks
# some characters ({, }, _, ...): they are added as tokens of their own, and so are the tags
TOOL_FORMATS = {
    "hermes": (QWEN_TOOLS, ANSWER, ["<tool_call>", "</tool_call>", "{", "}", "_", "\n", "?"], []),
    "llama3_json": (LLAMA3_TOOLS, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    ["{", "}", "_", "\n", "?"], ["<|python_tag|>"]),
    "mistral": (MISTRAL_TOOLS, 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                ["{", "}", "[", "]", "_", "\n", "?"],
                ["[TOOL_CALLS]", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]"]),
}

THINK_ASK = [{"role": "user", "content": "What is the capital of France?"}]
THINKING = "\nThe user asks for the capital of France. It is Paris.\n"
THINK_ANSWER = f"<think>{THINKING}</think>\n\nParis."


def train_to_answer(out: Path, added: list[str], template: str, ask: list[dict], answer: str,
                    tools: list | None = None, special: list[str] = ()) -> Path:
    """A model (and tokenizer, with `added` tokens and `special` ones) trained until its greedy answer to `ask`
    is `answer`, token for token (the special tokens written out in `answer`), written to `out`.

    Trained once per set of arguments and copied from the test cache after that (several test files serve the
    same model: the Hermes tool model three, the thinking model three; 3-8 s of CPU a training): keyed by the
    arguments, this module's and decoder_models.py's source, the corpus and the libraries' versions."""
    import hashlib
    import json
    import os
    import shutil
    import tempfile

    import tokenizers
    import torch
    import transformers

    from surge.data import load_sentences
    from tests.conftest import CACHE_DIR

    here = Path(__file__).resolve().parent
    key = hashlib.sha256(json.dumps([added, template, ask, answer, tools, list(special), torch.__version__,
                                     transformers.__version__, tokenizers.__version__, load_sentences(),
                                     (here / "trained_models.py").read_text(),
                                     (here / "decoder_models.py").read_text()]).encode()).hexdigest()[:20]
    cached = CACHE_DIR / "trained" / key
    if not cached.is_dir():
        cached.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".building-"))
        try:
            _train_to_answer(building / "model", added, template, ask, answer, tools, special)
            try:
                os.rename(building / "model", cached)  # whole or not at all
            except OSError:  # another test process wrote it first: a model that learned the same answer
                pass
        finally:
            shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(cached, out)  # a copy: a test may write into its model directory
    return out


def _train_to_answer(out: Path, added: list[str], template: str, ask: list[dict], answer: str,
                     tools: list | None, special: list[str]) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True)
    tok = train_tokenizer()
    tok.add_tokens(added)
    tok.add_special_tokens(list(special))
    save_tokenizer(tok, out, template)
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=True,
                                         bos_token_id=bos, eos_token_id=eos, pad_token_id=bos))
    hf = AutoTokenizer.from_pretrained(out)
    prompt = hf.apply_chat_template(ask, tools=tools, tokenize=False, add_generation_prompt=True)
    p_ids = hf(prompt, add_special_tokens=False)["input_ids"]
    a_ids = hf(answer, add_special_tokens=False)["input_ids"] + [eos]
    assert hf.decode(a_ids[:-1]) == answer
    ids = torch.tensor([p_ids + a_ids])
    labels = ids.clone()
    labels[0, : len(p_ids)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(400):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    got = model.generate(torch.tensor([p_ids]), max_new_tokens=len(a_ids) + 4, do_sample=False)[0, len(p_ids):]
    assert got.tolist() == a_ids, "the model did not learn its answer"
    model.save_pretrained(out, safe_serialization=True)
    return out


def train_tool_model(out: Path, parser: str = "hermes") -> Path:
    template, answer, added, special = TOOL_FORMATS[parser]
    return train_to_answer(out, added, template, ASK, answer, [TOOL], special)


def train_thinking_model(out: Path) -> Path:
    return train_to_answer(out, ["<think>", "</think>", "\n", "?"], CHATML, THINK_ASK, THINK_ANSWER)
