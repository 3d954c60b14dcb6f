"""A tiny Qwen2-shaped model trained here (seconds on the CPU) to answer a weather question with a Hermes
tool call; its chat template is Qwen2.5's way with tools (tests/decoder_models.QWEN_TOOLS), so later turns
render the call and the tool's answer."""

from __future__ import annotations

from pathlib import Path

from tests.decoder_models import QWEN_TOOLS, save_tokenizer, train_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def train_tool_model(out: Path) -> Path:
    """Trained until its greedy answer to ASK with the tool is ANSWER."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True)
    tok = train_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>", "{", "}", "_", "\n", "?"])  # characters the corpus lacks
    save_tokenizer(tok, out, QWEN_TOOLS)
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=True,
                                         bos_token_id=bos, eos_token_id=eos, pad_token_id=bos))
    hf = AutoTokenizer.from_pretrained(out)
    prompt = hf.apply_chat_template(ASK, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    p_ids = hf(prompt, add_special_tokens=False)["input_ids"]
    a_ids = hf(ANSWER, add_special_tokens=False)["input_ids"] + [eos]
    assert hf.decode(a_ids, skip_special_tokens=True) == ANSWER
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
    assert hf.decode(got, skip_special_tokens=True) == ANSWER, "the model did not learn its answer"
    model.save_pretrained(out, safe_serialization=True)
    return out
