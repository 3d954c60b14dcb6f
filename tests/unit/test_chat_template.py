"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import pytest

from surge.errors import InvalidInput
from surge.models.chat_template import ChatTemplate
from tests.decoder_models import CHATML, LLAMA2, save_tokenizer, train_tokenizer

# A template using tojson, namespace, loop controls and strftime_now-free features most real ones use.
TOOLS = (
    "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.role == 'system' %}{%- continue %}{%- endif %}"
    "{%- set ns.n = ns.n + 1 %}<{{ m.role }}:{{ ns.n }}>{{ m.content | tojson }}{%- if m.name is defined %}"
    "({{ m.name }}){%- endif %}\n{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2+2? "},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And <b>3+3</b> \"quoted\" é?"}],
    [{"role": "user", "content": "a", "name": "bob"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "  spaced  \n"}],
]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    tok = train_tokenizer()
    dirs = {}
    for name, template in (("chatml", CHATML), ("llama2", LLAMA2), ("tools", TOOLS)):
        d = tmp_path_factory.mktemp(name)
        save_tokenizer(tok, d, template)
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("name", ["chatml", "llama2", "tools"])
@pytest.mark.parametrize("gen", [True, False])
def test_rendering_equals_transformers(name, gen, tokenizer_dirs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dirs[name])
    ours = ChatTemplate.from_dir(tokenizer_dirs[name])
    for conv in CONVERSATIONS:
        if name == "llama2" and conv[0]["role"] == "system":
            continue
        try:
            expected = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        except Exception as exc:  # the template refuses this conversation: so must ours
            with pytest.raises(InvalidInput, match="alternate"):
                ours.render(conv, add_generation_prompt=gen)
            assert "alternate" in str(exc)
            continue
        assert ours.render(conv, add_generation_prompt=gen) == expected
        ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        assert hf(expected, add_special_tokens=False)["input_ids"] == list(ids)


TOOL_LIST = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> \"here\" é",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


def test_tools_render_as_transformers_renders_them(tokenizer_dirs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dirs["chatml"])
    ours = ChatTemplate.from_dir(tokenizer_dirs["chatml"])
    for conv in CONVERSATIONS:
        expected = hf.apply_chat_template(conv, tools=TOOL_LIST, tokenize=False, add_generation_prompt=True)
        assert "get_weather" in expected
        assert ours.render(conv, tools=TOOL_LIST) == expected
        assert ours.render(conv) == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_llama2_template_rejects_bad_roles(tokenizer_dirs):
    ours = ChatTemplate.from_dir(tokenizer_dirs["llama2"])
    with pytest.raises(InvalidInput, match="alternate"):
        ours.render([{"role": "assistant", "content": "x"}])


THINKING = (  # a Qwen3-style switch, one of vLLM's chat_template_kwargs
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


def test_continue_final_message_and_template_variables_render_as_transformers(tokenizer_dirs, tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer()
    save_tokenizer(tok, tmp_path, THINKING)
    dirs = {**tokenizer_dirs, "thinking": tmp_path}
    prefill = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "  The color is "}]
    for name in ("chatml", "tools", "thinking"):
        hf = AutoTokenizer.from_pretrained(dirs[name])
        ours = ChatTemplate.from_dir(dirs[name])
        want = hf.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
        assert ours.render(prefill, add_generation_prompt=False, continue_final_message=True) == want
        assert ours.render(prefill, add_generation_prompt=False) != want  # it is cut, not the whole turn
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ours = ChatTemplate.from_dir(tmp_path)
    conv = CONVERSATIONS[0]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert ours.render(conv, variables=kwargs) == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                                                     **kwargs)
    assert "<think>" in ours.render(conv, variables={"enable_thinking": False})
    for bad, param in (({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                       ({"variables": {"messages": []}}, "chat_template_kwargs")):
        with pytest.raises(InvalidInput) as err:
            ours.render(prefill, **bad)
        assert err.value.param == param


def test_a_developer_message_is_a_system_one_unless_the_template_knows_the_role():
    """OpenAI's `developer` role (Codex CLI and the Responses API send it): a template that never names it
    renders it as transformers renders the same message with role system; one that does gets it as is."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.decoder_models import QWEN_TOOLS

    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want, _ = render_jinja_template([[{**chat[0], "role": "system"}, chat[1]]], chat_template=QWEN_TOOLS,
                                    add_generation_prompt=True)
    plain = ChatTemplate(QWEN_TOOLS, {})
    assert not plain.knows_developer and plain.render(chat) == want[0]
    knowing = ChatTemplate("{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }}|"
                           "{% endfor %}", {})
    assert knowing.knows_developer and knowing.render(chat) == "D:Be brief.|Hi|"
