"""One response's output items as the Responses API streams them (server/http/responses_api.py).

The answer's blocks (server/http/answer_blocks.py) are its items: the thinking a `reasoning` item of
`reasoning_text`, a text run a `message` item of `output_text` (with the `logprobs` of the tokens that
wrote it), each tool call a `function_call` item. Every item is announced
(`response.output_item.added`), filled by deltas and closed (`response.output_item.done`), and every
event is numbered (`sequence_number`). A whole answer is built by the same class (fed its text at once,
the events thrown away), so a stream's final response and the non-streamed one have the same items.
"""

from __future__ import annotations

import time

import orjson

from surge.server.http.answer_blocks import AnswerBlocks
from surge.server.http.reasoning import REASONING
from surge.server.http.responses_items import call_item, logprob_list, message_item, new_id


def usage(prompt: int, completion: int, reasoning: int = 0, cached: int = 0) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


def outcome(finish: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def finished(p, output: list[dict], finish, prompt_tokens: int, completion_tokens: int, reasoning: int = 0,
             cached: int = 0) -> dict:
    """The final response object of prepared request `p` (responses_api._Prepared)."""
    status, incomplete = outcome(finish)
    return {**p.base, "status": status, "incomplete_details": incomplete, "output": output,
            "usage": usage(prompt_tokens, completion_tokens, reasoning, cached), "completed_at": int(time.time())}


class ResponseEvents:
    """The typed events of one response, numbered; after `finish`, `response` is the final object.
    `p`: responses_api._Prepared (base, want_lps, parse_calls, forced, reasoning, count)."""

    def __init__(self, p):
        self.p = p
        self.seq = 0
        self.output: list[dict] = []
        self.blocks = AnswerBlocks(p.reasoning, p.parse_calls, p.forced)
        self.open: dict | None = None  # the item being written (a message or a reasoning item)
        self.text: list[str] = []
        self.lps: list[dict] = []
        self.response: dict | None = None

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.p.base),
                self._event("response.in_progress", response=self.p.base)]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def _render(self, ops: list[tuple]) -> list[bytes]:
        out: list[bytes] = []
        for op in ops:
            if op[0] == "open":
                out += self._add(op[1])
            elif op[0] == "piece":
                out += self._piece(op[1], op[2])
            elif op[0] == "close":
                out += self._close()
            else:
                out += self._call(op[1])
        return out

    def _add(self, kind: str) -> list[bytes]:
        if kind == REASONING:
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {**message_item("", None, "in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": [],
                    **({"logprobs": []} if self.p.want_lps else {})}
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.output), item=item),
                self._event("response.content_part.added", **self._where(), part=part)]

    def _piece(self, text: str, logprobs) -> list[bytes]:
        self.text.append(text)
        if self.open["type"] == "reasoning":
            return [self._event("response.reasoning_text.delta", **self._where(), delta=text)]
        lps = logprob_list(logprobs) if self.p.want_lps else None
        self.lps.extend(lps or ())
        return [self._event("response.output_text.delta", **self._where(), delta=text, logprobs=lps or [])]

    def _close(self) -> list[bytes]:
        text, where = "".join(self.text), self._where()
        if self.open["type"] == "message":
            item = message_item(text, self.lps if self.p.want_lps else None, self.status, self.open["id"])
            part = item["content"][0]
            done = self._event("response.output_text.done", **where, text=text, logprobs=self.lps)
        else:
            part = {"type": "reasoning_text", "text": text}
            item = {**self.open, "content": [part], "status": self.status}
            done = self._event("response.reasoning_text.done", **where, text=text)
        out = [done, self._event("response.content_part.done", **where, part=part),
               self._event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.open, self.text, self.lps = None, [], []
        return out

    def _call(self, call: dict) -> list[bytes]:
        item = call_item(call)
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    # an item closed while the answer goes on is complete; the last one has the answer's status
    status = "completed"

    def delta(self, d) -> list[bytes]:
        """`d`: a Delta of the stream (or a whole GenerationResult): its text and log-probabilities."""
        return self._render(self.blocks.feed(d.text, d.logprobs))

    def finish(self, d) -> list[bytes]:
        """`d`: the last Delta (or the GenerationResult): its finish reason and token counts."""
        self.status, _ = outcome(d.finish_reason)
        out = self._render(self.blocks.finish())
        thought = self.blocks.thought
        reasoning = len(self.p.count(thought)) if thought else 0
        self.response = finished(self.p, self.output, d.finish_reason, d.prompt_tokens, d.completion_tokens,
                                 reasoning, d.cached_tokens)
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.response)]

    def cut(self) -> list[dict]:
        """The output so far of an answer stopped before its end (cancelled), its open item incomplete."""
        self.status = "incomplete"
        self._render(self.blocks.finish())
        return self.output

    def failed(self, exc) -> list[bytes]:
        """`exc`: the SurgeError that ended the stream. The response carries the output written before it
        (the item being written, incomplete), as the events streamed it."""
        self.response = {**self.p.base, "status": "failed", "error": {"code": exc.code, "message": exc.message},
                         "output": self.cut()}
        return [self._event("error", code=exc.code, message=exc.message, param=exc.param),
                self._event("response.failed", response=self.response)]
