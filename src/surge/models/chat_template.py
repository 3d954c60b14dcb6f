"""Chat templates: the jinja2 template a model ships, rendered as transformers'
`apply_chat_template` renders it (same sandboxed environment, filters and globals,
the tokenizer's special tokens as variables), without importing transformers.

Tested for equality against transformers (tests/unit/test_chat_template.py).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from surge import json_depth
from surge.errors import ConfigError, InvalidInput

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized
        return value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where the last message's text ends


def _arguments_as_objects(message: dict) -> dict:
    """An assistant turn's tool calls with their JSON `arguments` as objects, which chat templates expect
    (Qwen2.5's writes `arguments | tojson`: the string OpenAI clients send would come out quoted), as vLLM
    passes them; what is not a JSON object stays."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    fixed = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json_depth.loads(fn["arguments"])  # bounded: the template's tojson recurses
            except ValueError:
                args = None
            if isinstance(args, dict):
                c = {**c, "function": {**fn, "arguments": args}}
        fixed.append(c)
    return {**message, "tool_calls": fixed}


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]):
        self.template = template
        self.special_tokens = special_tokens
        _compile(template)  # a syntax error is a startup error
        # a template that never names the developer role gets developer messages as system ones (as vLLM
        # does: most raise on a role they do not know, or drop it)
        self.knows_developer = "developer" in template

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTemplate | None":
        path = Path(path)
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"  # where transformers >= 4.50 saves it
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if not template:
            return None
        special = {k: s for k in _SPECIAL if (s := _token_str(cfg.get(k))) is not None}
        try:
            return cls(template, special)
        except Exception as exc:
            raise ConfigError(f"{path}: invalid chat template ({exc})") from exc

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None, documents=None,
               continue_final_message: bool = False, variables: dict | None = None) -> str:
        """As transformers' apply_chat_template(tokenize=False): `continue_final_message` ends the text
        inside the last message (a prefill the model continues, no end-of-turn after it); `variables` are
        the template's own (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
        kwargs = dict(variables or {})
        import jinja2

        if continue_final_message and add_generation_prompt:
            raise InvalidInput("continue_final_message and add_generation_prompt cannot both be set",
                               param="continue_final_message")
        taken = sorted(set(kwargs) & {"messages", "tools", "documents", "add_generation_prompt"})
        if taken:
            raise InvalidInput(f"chat_template_kwargs cannot set {', '.join(taken)}", param="chat_template_kwargs")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if not self.knows_developer:  # OpenAI's newer name of the system role (Codex CLI sends it)
            chat = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in chat]
        chat = [_arguments_as_objects(m) for m in chat]
        if continue_final_message:  # transformers' way: a tag after the content, the text cut before it
            if not isinstance(chat[-1].get("content"), str):
                raise InvalidInput("continue_final_message: the last message has no text to continue",
                                   param="continue_final_message")
            chat[-1] = {**chat[-1], "content": chat[-1]["content"] + _CONTINUE_TAG}
        try:
            text = _compile(self.template).render(messages=chat, tools=tools, documents=documents,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **{**self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidInput(f"chat template: {exc}", param="messages") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # The template runs on the client's messages, whose extra fields pass through as vLLM passes them
            # (tool_calls, reasoning_content, ...): one of the wrong type fails inside the template's own
            # expressions, which is the request's fault (vLLM answers 400 too).
            raise InvalidInput(f"chat template: {type(exc).__name__}: {exc}", param="messages") from None
        if not continue_final_message:
            return text
        if _CONTINUE_TAG.strip() not in text:
            raise InvalidInput("continue_final_message: the chat template does not write the last message",
                               param="continue_final_message")
        at = text.rindex(_CONTINUE_TAG.strip())
        # a template that trims the content's trailing whitespace trimmed the tag's space too
        return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()

