"""Tiny random-weight decoder models for the generation tests, built like a user would have them:
transformers configs + save_pretrained, a byte-level BPE tokenizer trained on the shipped sentences
(tokenizers), and a chat template in tokenizer_config.json."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

# A Qwen2/ChatML-style template (the shape most chat models ship), with a tools section in the style of
# Qwen2.5's (the tools as JSON lines in the system turn).
CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5's way with tools: tool calls of assistant turns written as hermes blocks (`arguments | tojson`, so
# arguments are objects), tool answers as a user turn of <tool_response> blocks.
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3.1's way with JSON tool calls (its template's tools prompt and call rendering, with ChatML's turn markers):
# the tools as JSON in the system turn, an assistant turn's calls as {"name": ..., "parameters": ...} objects
# (`arguments | tojson`; joined by "; " where there are several, which the real template refuses and vLLM's
# llama3_json parser reads), the tools' answers as "ipython" turns.
LLAMA3_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\nEnvironment: ipython\\n\\nGiven the following functions, please "
    "respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. "
    "Do not use variables.\\n\\n' }}{%- for tool in tools %}{{- tool | tojson }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>ipython\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Mistral 7B Instruct v0.3's template (the tools before the last user turn, an assistant turn's calls as
# `[TOOL_CALLS] [` + each `function | tojson` with its 9-character id + `]`, tool answers as [TOOL_RESULTS]).
MISTRAL_TOOLS = (
    "{{- bos_token }}{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}{{- '[AVAILABLE_TOOLS] [' }}{%- for tool in tools %}"
    "{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '][/AVAILABLE_TOOLS]' }}"
    "{%- endif %}{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function | tojson %}{{- out[:-1] }}"
    "{%- if tool_call.id is not defined or tool_call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id + '\"}' }}{%- if not loop.last %}{{- ', ' }}{%- else %}"
    "{{- ']' + eos_token }}{%- endif %}{%- endfor %}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content | trim + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content | string + ', \"call_id\": \"' + message.tool_call_id "
    "+ '\"}[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}"
)
# A Llama-2-style one: bos_token, raise_exception, loop variables.
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@lru_cache(maxsize=4)
def _trained(vocab_size: int, all_bytes: bool) -> str:
    return _train(vocab_size, all_bytes).to_str()


def train_tokenizer(vocab_size: int = 384, all_bytes: bool = False):
    """Trained once per process (a second each). `all_bytes`: every byte is a token (any text can be
    written, e.g. the braces of JSON), at the price of stray bytes in a random model's output."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained(vocab_size, all_bytes))


def _train(vocab_size: int, all_bytes: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from surge.data import load_sentences

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Only the characters of the text as the alphabet: a random model's output then decodes to
    # readable text (no stray bytes of split characters).
    alphabet = pre_tokenizers.ByteLevel.alphabet() if all_bytes else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(load_sentences(), trainer)
    return tok


def save_tokenizer(tok, out: Path, template: str = CHATML) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 512, "chat_template": template,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }))


def build_model(kind: str, out: Path, *, seed: int = 0, vocab: int = 384, template: str = CHATML,
                all_bytes: bool = False, **overrides) -> Path:
    """kind: gpt2 | llama | qwen2 | qwen3 | mistral | granite. Weights: seeded random, larger than the default init so that greedy
    choices are not near-ties (FP32 rounding then never flips a token). `all_bytes`: train_tokenizer's."""
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab, all_bytes)
    eos = tok.token_to_id("<|im_end|>")
    bos = tok.token_to_id("<|endoftext|>")
    common = dict(vocab_size=tok.get_vocab_size(), bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    if kind == "gpt2":
        cfg = GPT2Config(**{**dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.08),
                            **common, **overrides})
        cls = GPT2LMHeadModel
    elif kind == "llama":
        cfg = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    initializer_range=0.08, tie_word_embeddings=False), **common, **overrides})
        cls = LlamaForCausalLM
    elif kind == "qwen2":
        cfg = Qwen2Config(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                    initializer_range=0.08, tie_word_embeddings=True), **common, **overrides})
        cls = Qwen2ForCausalLM
    elif kind == "qwen3":  # a head size of its own (not hidden / heads), q/k norms, no biases
        cfg = Qwen3Config(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=256, initializer_range=0.08, tie_word_embeddings=True),
                             **common, **overrides})
        cls = Qwen3ForCausalLM
    elif kind == "granite":  # Llama with multipliers, and biases on attention and MLP
        cfg = GraniteConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.08, tie_word_embeddings=True, embedding_multiplier=6.0,
                                      residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=3.0,
                                      attention_bias=True, mlp_bias=True), **common, **overrides})
        cls = GraniteForCausalLM
    elif kind == "mistral":
        cfg = MistralConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.08, sliding_window=None), **common, **overrides})
        cls = MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if kind == "qwen2":  # biases start at zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    if kind == "granite":  # biases start at zero: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.1)
    if kind == "qwen3":  # the q/k norms start at ones: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.3)
                layer.self_attn.k_norm.weight.normal_(1, 0.3)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out, template)
    return out


def load_hf(model_dir: Path):
    """(transformers FP32 model, its tokenizer) of a built model, on one thread: the end-to-end tests'
    reference beside a server that has the other core."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(model_dir)


def build_lora(base_dir: Path, out: Path, *, seed: int = 0, r: int = 8, alpha: float = 16.0,
               targets: list[str] | None = None, scale: float = 3.0, **extra) -> Path:
    """A PEFT LoRA adapter of a built model, saved as peft saves it. Both matrices random (PEFT starts B
    at zero) and B scaled up so that the adapter changes greedy answers. `extra`: more LoraConfig fields
    (use_rslora, alpha_pattern, rank_pattern, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if targets is None:
        targets = ["c_attn", "c_proj", "c_fc"] if base.config.model_type == "gpt2" else \
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                     fan_in_fan_out=base.config.model_type == "gpt2", **extra)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out, safe_serialization=True)
    return out


def load_peft(base_dir: Path, adapter_dir: Path):
    """transformers FP32 + peft: the reference of an adapter's answers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def build_quantized_checkpoint(model_dir: Path, out: Path, scheme: str = "FP8_DYNAMIC") -> Path:
    """A quantized checkpoint of a built model as its writers make it, for the loader's tests.

    scheme "FP8_DYNAMIC" (weights by channel, dynamic per-token activations), "FP8" (weights by tensor, a static
    activation scale), "W4A16" (4-bit integers in groups of 128, packed), "W8A8" (8-bit integers by channel):
    compressed-tensors' own presets, applied, each weight's scale computed by its
    calculate_qparams from the weight's range (what llm-compressor's observers hand it), compressed by its
    ModelCompressor and saved with its config, as llm-compressor's oneshot saves. "block": the "fp8" method in
    128 x 128 blocks, each weight quantized by transformers' own FP8 conversion (Fp8Quantize) and the config
    transformers' FineGrainedFP8Config writes."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if scheme == "block":
        from transformers import FineGrainedFP8Config
        from transformers.integrations.finegrained_fp8 import Fp8Quantize

        qc = FineGrainedFP8Config(weight_block_size=(128, 128))
        op = Fp8Quantize(type("Quantizer", (), {"quantization_config": qc})())
        state = {}
        for name, t in model.state_dict().items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # the embedding's, saved once (as save_pretrained does)
            linear = name.startswith("model.layers.") and name.endswith("_proj.weight")
            state.update(op.convert({name: t}) if linear else {name: t})
        model.config.quantization_config = qc.to_dict()
        model.config.save_pretrained(out)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                     preset_name_to_scheme)
        from compressed_tensors.quantization.utils import calculate_qparams

        cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"])
        apply_quantization_config(model, cfg)
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None or not hasattr(module, "weight_scale"):
                continue
            w = module.weight.detach()
            args = module.quantization_scheme.weights
            if args.strategy == "group":  # [N, K / group] ranges
                w = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = w.amin(-1), w.amax(-1)
            elif args.strategy == "channel":
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            else:
                lo, hi = w.amin(), w.amax()
            scale, zp = calculate_qparams(lo, hi, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # a static activation scale (unused by surge's W8A16 kernels)
                module.input_scale.data.fill_(0.05)
            module.quantization_status = QuantizationStatus.CALIBRATION
        compressor = ModelCompressor.from_pretrained_model(model)  # the format compressed-tensors infers
        compressor.compress_model(model)
        model.save_pretrained(out)
        compressor.update_config(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (model_dir / f).exists():
            shutil.copy(model_dir / f, out / f)
    json.loads((out / "config.json").read_text())["quantization_config"]  # written, or KeyError
    return out


def load_quantized_reference(fp8_dir: Path):
    """transformers FP32 on an FP8 checkpoint's weights, dequantized by the format's own library
    (compressed-tensors decompressing; transformers' FP8 dequantization on the CPU), activations in full
    precision: what surge's W8A16 engine computes."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    method = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["quant_method"]
    if method == "compressed-tensors":
        from compressed_tensors.quantization import disable_quantization
        from transformers.utils.quantization_config import CompressedTensorsConfig

        model = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
        model.apply(disable_quantization)  # the dense weights only: no fake-quantized activations
    else:
        from transformers import FineGrainedFP8Config

        model = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32,
                                                     quantization_config=FineGrainedFP8Config(dequantize=True))
    return model.eval()


QWEN3_EMBEDDING_PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
                                    "query\nQuery:", "document": ""}


def build_embedding_model(kind: str, out: Path, *, seed: int = 0, pooling: str = "lasttoken",
                          max_seq_length: int = 48, prompts: dict | None = None, default_prompt_name: str | None = None,
                          **overrides) -> Path:
    """A decoder embedding model as Qwen3-Embedding / e5-mistral ship on the hub: a causal-LM
    checkpoint (config.json names `*ForCausalLM`, the weights keep their `model.` prefix and LM head) with
    sentence-transformers 2-4's files beside it (modules.json, 1_Pooling, 2_Normalize), and a tokenizer that
    appends <|endoftext|> to every text (Qwen3-Embedding's post-processor), without a chat template; `prompts`:
    its config_sentence_transformers.json's named prompts."""
    from tokenizers.processors import TemplateProcessing

    d = build_model(kind, out, seed=seed, **overrides)
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)  # sentence-transformers 5+ would wrap texts in it
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(d / "tokenizer.json"))
    eos = t.token_to_id("<|endoftext|>")
    t.post_processor = TemplateProcessing(single="$A <|endoftext|>", pair="$A $B <|endoftext|>",
                                          special_tokens=[("<|endoftext|>", eos)])
    t.save(str(d / "tokenizer.json"))
    hidden = json.loads((d / "config.json").read_text())["hidden_size"]
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (d / "1_Pooling").mkdir()
    (d / "2_Normalize").mkdir()
    modes = {m: m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                                      "weightedmean_tokens", "lasttoken")}
    (d / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, **{f"pooling_mode_{m}": v for m, v in modes.items()},
        "include_prompt": True}))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                             "do_lower_case": False}))
    if prompts is not None:  # Qwen3-Embedding's config_sentence_transformers.json carries its instruction
        (d / "config_sentence_transformers.json").write_text(json.dumps({
            "prompts": prompts, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}))
    return d


def build_decoder_classifier(kind: str, out: Path, labels: list[str], *, seed: int = 0, **overrides) -> Path:
    """A decoder `*ForSequenceClassification` checkpoint (one label: a reranker, as Qwen3-Reranker's seq-cls
    form) with a random score head, and build_embedding_model's tokenizer (<|endoftext|> appended to every text
    and also the padding token: transformers pools the token before it, the last one that is not padding)."""
    import torch
    from transformers import (AutoConfig, LlamaForSequenceClassification, Qwen2ForSequenceClassification,
                              Qwen3ForSequenceClassification)

    tmp = out.parent / (out.name + "-base")
    build_embedding_model(kind, tmp, seed=seed, **overrides)
    cfg = AutoConfig.from_pretrained(tmp)
    cfg.num_labels = len(labels)
    cfg.id2label = dict(enumerate(labels))
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    cls = {"qwen3": Qwen3ForSequenceClassification, "qwen2": Qwen2ForSequenceClassification,
           "llama": LlamaForSequenceClassification}[kind]
    cfg.architectures = [cls.__name__]
    torch.manual_seed(seed + 1)
    model = cls.from_pretrained(tmp, config=cfg, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tmp / name).read_bytes())
    return out
