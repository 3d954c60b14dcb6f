"""OpenAI-compatible generation's requests: the bodies of /v1/chat/completions and /v1/completions
(OpenAI's fields and vLLM's extensions), and what is read off them before generating: the chat
messages the template takes, the prompts' token ids, the tool-call parser, and the 400s for fields
surge cannot honour.

Apart from server/http/openai_chat.py (the answers, streamed or not) because vLLM's /tokenize and
the Anthropic and Responses routes read requests the same way and answer differently.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from surge.errors import InvalidInput, PayloadTooLarge, Unprocessable, shown
from surge.server.http import fail_fast
from surge.server.http.gil_points import each
from surge.server.http.guided_fields import tool_choice_guide
from surge.server.http.tool_calls import PARSERS


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk carries "
                                         "the usage so far (its choice's tokens).")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # A union's errors name each alternative ("'stop.str': Input should be a valid string"): one sentence.
    union_hints: ClassVar[dict] = {"stop": "expected a string or a list of strings"}

    model: StrictStr | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128, description="Choices a prompt (each a sequence of its own; a seeded "
                   "request's choice j samples with seed + j).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: StrictStr | None = None
    logit_bias: dict[StrictStr, float] | None = Field(
        None, description="Token id (a string) -> a bias in [-100, 100] added to its logit before sampling.")
    # extensions (vLLM's names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: int | None = Field(None, ge=0, description="No EOS, stop token or stop string ends the answer "
                                   "before this many tokens.")
    allowed_token_ids: list[StrictInt] | None = Field(None, description="Only these tokens may be sampled.")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="Keep only the prompt's last N tokens.")
    bad_words: list[StrictStr] | None = Field(None, description="Words the answer never writes (as vLLM: the "
                                              "token that would complete one is not drawn).")
    priority: StrictInt = Field(0, description="vLLM's: lower runs first where the model's scheduling_policy is "
                                "'priority' (elsewhere only 0 is accepted).")
    prompt_logprobs: StrictInt | None = Field(None, description="vLLM's: the prompt's tokens' log-probabilities "
                                              "(None for the first), each with this many top ones (0-20); not with "
                                              "stream.")
    # structured outputs (server/http/guided_fields.py): OpenAI's, and vLLM's names
    response_format: dict | None = Field(None, description="{'type': 'text' | 'json_object' | 'json_schema', "
                                         "'json_schema': {'schema': ...}}: the answer follows the JSON schema.")
    guided_json: Union[dict, StrictStr, None] = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict | None = Field(None, description="vLLM's: one of json, regex, choice, grammar "
                                            "(Lark or GBNF), json_object.")


class TextPart(BaseModel):
    """A content part. Parts of other types (image_url, input_audio, file) are read so that chat_messages can
    refuse them by name with a 400, rather than a 422 about strings."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[each(ChatMessage)] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = Field(None, description="Rendered into the prompt by the chat template; with "
                                     "tool_choice 'auto' the answer's calls are parsed (the model's "
                                     "tool_call_parser setting; without one: 400), with 'required' or a named "
                                     "function the answer is held to calls of them.")
    tool_choice: Union[StrictStr, dict, None] = None
    parallel_tool_calls: bool | None = Field(None, description="false: tool_choice 'required' makes one call.")
    # vLLM's chat template controls
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="The answer continues the last (assistant) "
                                         "message's text, no end of turn after it.")
    chat_template_kwargs: dict | None = Field(None, description="The template's own variables (e.g. "
                                              "enable_thinking).")
    chat_template: StrictStr | None = Field(None, description="vLLM's: refused (400), as vLLM refuses it "
                                            "without --trust-request-chat-template; the model's template renders.")
    # OpenAI fields a text model cannot honour: refused when set (chat_answer), never dropped
    modalities: list[StrictStr] | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: Union[StrictStr, dict, None] = None
    include_reasoning: bool = Field(True, description="vLLM's: false leaves the thinking that the model's "
                                    "reasoning_parser separates out of the answer.")
    reasoning_effort: StrictStr | None = Field(None, description="For a model with a reasoning_parser: the "
                                               "template's reasoning_effort; none / minimal turn Qwen3's thinking "
                                               "off.")


TokenIds = fail_fast.items(StrictInt)


class CompletionRequest(_Sampling):
    # A union's errors name each alternative ("'prompt.str': Input should be a valid string"): one sentence.
    union_hints: ClassVar[dict] = {**_Sampling.union_hints, "prompt": "expected a string, a list of strings, a "
                                   "list of token ids, or a list of token-id lists"}
    prompt: Union[StrictStr, fail_fast.items(StrictStr), TokenIds, fail_fast.items(TokenIds)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: StrictStr | None = None
    best_of: int | None = Field(None, ge=1, description="Only equal to n (no server-side ranking of choices).")


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Validated chat messages as the template takes them (the chat route's and vLLM's /tokenize's)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):  # text parts joined, as most templates expect a string
            for j, p in enumerate(m.content):
                if p.type != "text":
                    raise InvalidInput(f"messages[{i}].content[{j}] is of type '{shown(p.type)}': only text "
                                       "parts are served (no images, audio or files)", param="messages")
                if p.text is None:
                    raise Unprocessable(f"messages[{i}].content[{j}]: a text part needs 'text'", param="messages")
            d["content"] = "".join(p.text for p in m.content)
        out.append(d)
    return out


def _refuse_stream_options(req: _Sampling) -> None:
    """As OpenAI and vLLM: stream_options asks for chunks a request that does not stream never gets."""
    if req.stream_options is not None and not req.stream:
        raise InvalidInput("stream_options can only be set when stream is true", param="stream_options")


def refuse_request_template(req) -> None:
    """A request's own jinja template is code the server would run: refused as vLLM refuses it (without
    --trust-request-chat-template), never silently replaced by the model's."""
    if req.chat_template is not None:
        raise InvalidInput("a request's own chat_template is not accepted: the model's chat template renders the "
                           "messages (its variables go in chat_template_kwargs)", param="chat_template")


def _refuse_chat_fields(req: ChatCompletionRequest) -> None:
    """What a text model cannot honour is a 400 naming it (the request models ignore unknown fields)."""
    _refuse_stream_options(req)
    refuse_request_template(req)
    if req.modalities and set(req.modalities) != {"text"}:
        raise InvalidInput("only the text modality is served", param="modalities")
    if req.audio is not None:
        raise InvalidInput("audio output is not supported", param="audio")
    if req.web_search_options is not None:
        raise InvalidInput("web search is not supported", param="web_search_options")
    if req.top_logprobs and not req.logprobs:  # as OpenAI and vLLM: never an answer without what was asked
        raise InvalidInput("top_logprobs needs logprobs set to true", param="top_logprobs")
    for field in ("functions", "function_call"):
        if getattr(req, field) is not None:
            raise InvalidInput(f"'{field}' (deprecated by OpenAI) is not supported; send tools and tool_choice",
                               param=field)


def prompt_logprobs_wanted(req: _Sampling) -> int | None:
    """vLLM's `prompt_logprobs`: the number of top tokens a prompt position lists, or None; what surge cannot
    answer (a stream, as vLLM; more than 20, or vLLM's -1 for the whole vocabulary) is a 400, never ignored."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if req.stream:
        raise InvalidInput("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
    if not 0 <= k <= 20:
        raise InvalidInput(f"prompt_logprobs must be between 0 and 20 (got {k})", param="prompt_logprobs")
    return k


def _vllm_extras(req, keep_special: bool = False) -> dict:
    """`keep_special`: the tool-call parser reads a special token (mistral's [TOOL_CALLS]), so the text keeps
    them, as vLLM's parser sets skip_special_tokens false."""
    return {"min_tokens": req.min_tokens, "allowed_token_ids": req.allowed_token_ids,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens and not keep_special, "bad_words": req.bad_words,
            "priority": req.priority}


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens."""
    return ids[-keep:] if keep and keep < len(ids) else ids


def tool_calls_wanted(req: ChatCompletionRequest, service) -> tuple[str | None, tuple[str, str] | None]:
    """(the tool-call parser the answer's calls are read with, None when they are not read; the guide a
    required or named tool choice asks for, in that parser's format); what surge cannot honour is refused,
    never ignored."""
    choice = req.tool_choice
    if choice not in (None, "none", "auto") and not req.tools:
        raise InvalidInput("tool_choice needs tools", param="tool_choice")
    if not req.tools or choice == "none":
        return None, None
    if isinstance(choice, str) and choice not in ("auto", "required"):
        raise InvalidInput(f"tool_choice '{choice}' is not one of none, auto, required or a named function",
                           param="tool_choice")
    parser = getattr(service.config, "tool_call_parser", "none")
    if parser == "none":
        raise InvalidInput(f"model '{service.name}' has no tool-call parser (generation setting tool_call_parser: "
                           f"{', '.join(PARSERS[1:])}); with tool_choice 'none' the tools are rendered into the "
                           "prompt by the chat template", param="tool_choice")
    if choice in (None, "auto"):
        return parser, None
    return parser, tool_choice_guide(req.tools, choice, service.guide_literal, req.parallel_tool_calls is not False,
                                     parser)


def _prompts(raw, service, max_inputs: int, echo: bool, truncate: int | None = None) -> list[tuple[list[int], str]]:
    """(token ids, the prompt's text when echoed, else "") of each prompt (its last `truncate` tokens)."""
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise InvalidInput("'prompt' must not be empty", param="prompt")
    if len(items) > max_inputs:
        raise PayloadTooLarge(f"'prompt' has {len(items)} items; at most {max_inputs} are allowed", param="prompt")
    out = []
    for p in items:
        whole = service.encode(p) if isinstance(p, str) else list(p)
        ids = _truncated(whole, truncate)
        service.check_prompt(ids)
        text = (p if isinstance(p, str) and ids is whole else service.decode(ids)) if echo else ""
        out.append((ids, text))
    return out
