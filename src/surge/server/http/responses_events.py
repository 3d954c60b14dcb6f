"""One response's output items as the Responses API streams them (server/http/responses_api.py).

The generated text is read in order by the model's reasoning parser (server/http/reasoning.py: the
thinking becomes a `reasoning` item of `reasoning_text`), then by its tool-call parser (a text run
becomes a `message` item of `output_text`, each hermes call a `function_call` item). Every item is
announced (`response.output_item.added`), filled by deltas and closed (`response.output_item.done`), and
every event is numbered (`sequence_number`). A whole answer is built by the same class (fed its text at
once, the events thrown away), so a stream's final response and the non-streamed one have the same items.

Blank text next to calls is no message (a newline between two calls, say); an answer of blank text only
is a message of it. A message's `logprobs` are those of the tokens that wrote it (thinking tokens have
none, as OpenAI's reasoning has none).
"""

from __future__ import annotations

import time

import orjson

from surge.server.http.reasoning import REASONING, ReasoningStream
from surge.server.http.responses_items import call_item, logprob_list, message_item, new_id
from surge.server.http.tool_calls import ToolCallStream


def usage(prompt: int, completion: int, reasoning: int = 0) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


def outcome(finish: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def finished(p, output: list[dict], finish, prompt_tokens: int, completion_tokens: int, reasoning: int = 0) -> dict:
    """The final response object of prepared request `p` (responses_api._Prepared)."""
    status, incomplete = outcome(finish)
    return {**p.base, "status": status, "incomplete_details": incomplete, "output": output,
            "usage": usage(prompt_tokens, completion_tokens, reasoning), "completed_at": int(time.time())}


class ResponseEvents:
    """The typed events of one response, numbered; after `finish`, `response` is the final object.
    `p`: responses_api._Prepared (base, want_lps, parse_calls, reasoning, count)."""

    def __init__(self, p):
        self.p = p
        self.seq = 0
        self.output: list[dict] = []
        self.thinking = ReasoningStream(p.reasoning) if p.reasoning != "none" else None
        self.calls = ToolCallStream() if p.parse_calls else None
        self.open: dict | None = None  # the item being written (a message or a reasoning item)
        self.text: list[str] = []
        self.lps: list[dict] = []
        self.held = ""  # blank text after a call or at the start, written only if text follows
        self.thought = ""  # the reasoning text, counted at the end
        self.response: dict | None = None

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.p.base),
                self._event("response.in_progress", response=self.p.base)]

    # --- items --------------------------------------------------------------------------------------
    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def _add(self, item: dict, part: dict) -> list[bytes]:
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.output), item=item),
                self._event("response.content_part.added", **self._where(), part=part)]

    def _write(self, kind: str, piece: str, logprobs=None) -> list[bytes]:
        """`piece` of a message (kind "message") or of the reasoning ("reasoning")."""
        out = [] if self.open is not None and self.open["type"] == kind else self._close("completed")
        if self.open is None:
            if kind == "message":
                out += self._add({**message_item("", None, "in_progress"), "content": []},
                                 {"type": "output_text", "text": "", "annotations": [],
                                  **({"logprobs": []} if self.p.want_lps else {})})
            else:
                out += self._add({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                                  "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        if not piece and not logprobs:
            return out
        self.text.append(piece)
        if kind == "reasoning":
            self.thought += piece
            return out + [self._event("response.reasoning_text.delta", **self._where(), delta=piece)]
        lps = logprob_list(logprobs) if self.p.want_lps else None
        self.lps.extend(lps or ())
        return out + [self._event("response.output_text.delta", **self._where(), delta=piece, logprobs=lps or [])]

    def _close(self, status: str) -> list[bytes]:
        if self.open is None:
            return []
        text, where = "".join(self.text), self._where()
        if self.open["type"] == "message":
            item = message_item(text, self.lps if self.p.want_lps else None, status, self.open["id"])
            part = item["content"][0]
            done = self._event("response.output_text.done", **where, text=text, logprobs=self.lps)
        else:
            part = {"type": "reasoning_text", "text": text}
            item = {**self.open, "content": [part], "status": status}
            done = self._event("response.reasoning_text.done", **where, text=text)
        out = [done, self._event("response.content_part.done", **where, part=part),
               self._event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.open, self.text, self.lps = None, [], []
        return out

    def _call(self, call: dict) -> list[bytes]:
        out = self._close("completed")
        item = call_item(call)
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        out += [self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        return out

    # --- text in --------------------------------------------------------------------------------------
    def _content(self, text: str, logprobs) -> list[bytes]:
        """Answer text (after any thinking): a message, or with the tool-call parser messages and calls."""
        if self.calls is None:
            return self._write("message", text, logprobs) if text or logprobs else []
        out: list[bytes] = []
        pieces = self.calls.feed(text)
        if logprobs and not any(t for t, _ in pieces):  # a token's scores go out with text, or alone
            pieces.insert(0, ("", None))
        for k, (piece, call) in enumerate(pieces):
            writing = self.open is not None and self.open["type"] == "message"
            if call is not None:
                self.held = ""  # blank text between calls is no message
                out += self._call(call[1])
            elif not writing and not (self.held + piece).strip() and not (k == 0 and logprobs):
                self.held += piece  # blank so far: a message only if text follows
            elif piece or (k == 0 and logprobs):
                piece, self.held = self.held + piece, ""
                out += self._write("message", piece, logprobs if k == 0 else None)
        return out

    def delta(self, text: str, logprobs) -> list[bytes]:
        if self.thinking is None:
            return self._content(text, logprobs)
        out: list[bytes] = []
        for field, piece in self.thinking.feed(text):
            if field == REASONING:
                out += self._write("reasoning", piece)
            else:
                out += self._content(piece, logprobs)
                logprobs = None
        if logprobs and self.thinking.answering:  # held text of the answer: its scores go out now
            out += self._content("", logprobs)
        return out

    def finish(self, finish, prompt_tokens: int, completion_tokens: int) -> list[bytes]:
        status, _ = outcome(finish)
        out = []
        if self.thinking is not None:
            for _, piece in self.thinking.finish():
                out += self._write("reasoning", piece)
        if self.calls is not None:
            tail, self.held = self.held + self.calls.finish(), ""
            answered = any(item["type"] != "reasoning" for item in self.output)
            if tail and ((self.open is not None and self.open["type"] == "message") or tail.strip()
                         or not answered):
                out += self._write("message", tail)
        if self.open is None and not self.output:
            out += self._write("message", "")  # an empty answer is still a message
        out += self._close(status)
        reasoning = len(self.p.count(self.thought)) if self.thought else 0
        self.response = finished(self.p, self.output, finish, prompt_tokens, completion_tokens, reasoning)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.response)]

    def failed(self, code: str, message: str, param: str | None) -> list[bytes]:
        self.response = {**self.p.base, "status": "failed", "error": {"code": code, "message": message},
                         "output": self.output}
        return [self._event("error", code=code, message=message, param=param),
                self._event("response.failed", response=self.response)]
