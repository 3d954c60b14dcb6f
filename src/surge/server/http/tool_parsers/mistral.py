"""`mistral` (Mistral 7B Instruct v0.3, Mixtral 8x22B and later Mistral models, as vLLM's parser of that name):
calls follow the `[TOOL_CALLS]` token (a special token: while calls are read, the answer keeps special
tokens in its text, as vLLM's parser asks of a chat template's tokenizer). Two forms:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ..., "arguments": ...}]
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}     (tokenizer v11+; also name[ARGS]{...})
    [TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}  (tokenizer v13: the model names the call)

The first is what the v0.3 chat templates render (with an "id" in each object, which is ignored) and
what a forced tool choice's grammar writes. Text before the first `[TOOL_CALLS]` is content. Call ids are 9
letters and digits, as mistral-common requires of the ids that later turns send back; a call written with
`[CALL_ID]` keeps the id the model wrote (the id the template will render back with the tool's result).

What is not a call stays content, from the tag on where nothing after it was read (a `[TOOL_CALLS]` followed by
neither form, an element that is no call); where calls were read, the rest of the text after the last one.
Where vLLM turns an answer with a broken array into its text without the tag, or drops text around the calls,
surge keeps the text as written so that a streamed answer always equals the whole one. Several `name{...}`
after one tag are not read (content): each v11+ call has its own tag.

Streaming: content goes out as it comes, except a tail that may begin `[TOOL_CALLS]`; each call goes out
whole once its object closes.
"""

from __future__ import annotations

import re

from surge.server.http.tool_parsers.common import (CallStream, JsonEnd, alnum9_id, held_prefix, loads, name_and_args,
                                                   skip_space)

TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
ARGS_KEY = "arguments"
KEYS = ("arguments",)
NAME = re.compile(r"[A-Za-z0-9_.\-]+")
ID = re.compile(r"[A-Za-z0-9]+")
CONTENT, AFTER_TAG, ITEM, ITEM_OBJECT, AFTER_ITEM, NAMED, ARGS_OBJECT = (
    "content", "after_tag", "item", "item_object", "after_item", "named", "args_object")


class MistralStream(CallStream):
    new_id = staticmethod(alnum9_id)

    def __init__(self):
        super().__init__()
        self._state = CONTENT
        self._buf = ""  # held text: from the tag on, or since the last call (`_tagged` tells which)
        self._tagged = False
        self._at = 0  # where reading goes on in _buf
        self._name = ""
        self._call_id = None  # a [CALL_ID]'s id, for the call whose arguments follow
        self._scan = JsonEnd()

    def _fail(self, out: list) -> None:
        """What was held is content after all; reading goes on after it (a later tag may still start calls)."""
        rest = self._buf
        if self._tagged:
            out.append((TAG, None))
            rest = rest[len(TAG):]
        self._buf, self._state = rest, CONTENT
        if not self._tagged and rest:  # text after a call, read as content from its start
            i = rest.find(TAG)
            cut = len(rest) - held_prefix(rest, TAG) if i < 0 else i
            if cut:
                out.append((rest[:cut], None))
                self._buf = rest[cut:]

    def _object(self, keys) -> tuple[str, dict] | None | bool:
        """Scan the open object at `_at`; False while it is open, else its call (None: not one)."""
        end = self._scan.scan(self._buf[self._at:])
        if end is None:
            self._at = len(self._buf)
            return False
        end += self._at
        obj = loads(self._buf[self._obj:end])
        self._at = end
        return name_and_args(obj, keys) if keys else (self._name, obj if isinstance(obj, dict) else None)

    def _called(self, out: list, call) -> None:
        out.append(self._emit(*call, self._call_id))
        self._call_id = None
        self._buf, self._at, self._tagged = self._buf[self._at:], 0, False

    def _open_object(self, at: int, state: str) -> None:
        self._obj = self._at = at
        self._scan, self._state = JsonEnd(), state

    def feed(self, text: str) -> list[tuple[str | None, tuple[int, dict] | None]]:
        self._buf += text
        out: list = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list) -> bool:
        """One move of the reader; False when it needs more text."""
        buf, state = self._buf, self._state
        if state == CONTENT:
            i = buf.find(TAG)
            if i < 0:
                keep = held_prefix(buf, TAG)
                if len(buf) > keep:
                    out.append((buf[:len(buf) - keep], None))
                self._buf = buf[len(buf) - keep:]
                return False
            if i:
                out.append((buf[:i], None))
            self._buf, self._tagged, self._at, self._state = buf[i:], True, len(TAG), AFTER_TAG
            return True
        if state in (ITEM_OBJECT, ARGS_OBJECT):
            call = self._object(KEYS if state == ITEM_OBJECT else None)
            if call is False:
                return False
            if call is None or call[1] is None:
                self._fail(out)
                return True
            self._called(out, call)
            self._state = AFTER_ITEM if state == ITEM_OBJECT else CONTENT
            return True
        at = skip_space(buf, self._at) if state != NAMED else self._at
        if at == len(buf):
            return False
        ch = buf[at]
        if state == AFTER_TAG:
            if ch == "[":
                self._at, self._state = at + 1, ITEM
                return True
            m = NAME.match(buf, at)
            if m is None:
                self._fail(out)
                return True
            self._at, self._state, self._name, self._call_id = at, NAMED, "", None
            return True
        if state == ITEM:  # an array's element
            if ch != "{":
                self._fail(out)
                return True
            self._open_object(at, ITEM_OBJECT)
            return True
        if state == AFTER_ITEM:
            if ch == ",":
                self._at, self._state = at + 1, ITEM
            elif ch == "]":
                self._buf, self._at, self._state = buf[at + 1:], 0, CONTENT
            else:
                self._fail(out)
            return True
        # NAMED: the name, then [ARGS] or not, then the arguments' object
        m = NAME.match(buf, at)
        if m is not None:
            if m.end() == len(buf):  # the name may go on
                return False
            self._name += m.group()
            at = m.end()
        if not self._name:
            self._fail(out)
            return True
        rest = buf[at:]
        if ARGS.startswith(rest) or CALL_ID.startswith(rest):  # a part of a tag, or nothing yet
            self._at = at
            return False
        if rest.startswith(CALL_ID):  # [CALL_ID]<id>[ARGS]: read whole before anything is taken
            m = ID.match(buf, at + len(CALL_ID))
            after = m.end() if m else at + len(CALL_ID)
            if after == len(buf) or ARGS.startswith(buf[after:]) and not buf[after:].startswith(ARGS):
                self._at = at  # the id or the [ARGS] after it may go on
                return False
            if m is None or not buf.startswith(ARGS, after):
                self._fail(out)
                return True
            self._call_id, at, rest = m.group(), after, buf[after:]
        if rest.startswith(ARGS):
            at += len(ARGS)
            if at == len(buf):
                self._at = at
                return False
        if buf[at] != "{":
            self._fail(out)
            return True
        self._open_object(at, ARGS_OBJECT)
        return True

    def finish(self) -> str:
        """What is held at the end (a partial tag, calls not closed) is content."""
        rest, self._buf, self._state = self._buf, "", CONTENT
        return rest


def grammar(many: bool, literal) -> str:
    repeat = ' (", " body)*' if many else ""
    return f'start: {literal(TAG)} " "? "[" body{repeat} "]"\n'
