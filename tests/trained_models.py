"""Tiny Qwen2-shaped models trained here (seconds on the CPU) to give one answer to one question, greedily:

- `train_tool_model`: a weather question answered with text and a Hermes tool call, under Qwen2.5's way with
  tools (tests/decoder_models.QWEN_TOOLS), so later turns render the call and the tool's answer;
- `train_thinking_model`: a question answered `<think>...</think>` then the answer, as DeepSeek-R1's
  distills do (the tags one token each, as R1's tokenizer has them).
"""

from __future__ import annotations

from pathlib import Path

from tests.decoder_models import CHATML, QWEN_TOOLS, save_tokenizer, train_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

THINK_ASK = [{"role": "user", "content": "What is the capital of France?"}]
THINKING = "\nThe user asks for the capital of France. It is Paris.\n"
THINK_ANSWER = f"<think>{THINKING}</think>\n\nParis."


def train_to_answer(out: Path, added: list[str], template: str, ask: list[dict], answer: str,
                    tools: list | None = None) -> Path:
    """A model (and tokenizer, with `added` tokens) trained until its greedy answer to `ask` is `answer`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True)
    tok = train_tokenizer()
    tok.add_tokens(added)
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
    assert hf.decode(a_ids, skip_special_tokens=True) == answer
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
    assert hf.decode(got, skip_special_tokens=True) == answer, "the model did not learn its answer"
    model.save_pretrained(out, safe_serialization=True)
    return out


def train_tool_model(out: Path) -> Path:
    # characters the corpus lacks, and the tags as one token each
    return train_to_answer(out, ["<tool_call>", "</tool_call>", "{", "}", "_", "\n", "?"], QWEN_TOOLS, ASK, ANSWER,
                           [TOOL])


def train_thinking_model(out: Path) -> Path:
    return train_to_answer(out, ["<think>", "</think>", "\n", "?"], CHATML, THINK_ASK, THINK_ANSWER)
