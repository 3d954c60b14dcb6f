"""One exception hierarchy for surge, and its one mapping to HTTP and gRPC.

Protocol layers catch SurgeError and render it in their own error body; they
never invent status codes of their own.
"""

from __future__ import annotations

import grpc


class SurgeError(Exception):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    code: str = "internal_error"

    @property
    def openai_type(self) -> str:
        """OpenAI's error `type` of this error: its status's (a class declares its status only)."""
        return openai_type(self.http_status)

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class InvalidInput(SurgeError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    code = "invalid_input"


class EmptyInput(InvalidInput):
    """No inputs, or an empty text: a class of its own because text-embeddings-inference answers it
    apart from other validation errors (its `Empty` error type, 400; server/tei_errors.py). Its code stays
    invalid_input: OpenAI's body and the failure metrics' labels do not change."""


class WrongTask(InvalidInput):
    """A route of one task called on a model of another (the message names the model's task)."""

    code = "wrong_task"


class Unauthorized(SurgeError):
    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    code = "invalid_api_key"


class NotFound(SurgeError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    code = "model_not_found"


class PayloadTooLarge(SurgeError):
    http_status = 413
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    code = "payload_too_large"


class BodyTooLarge(PayloadTooLarge):
    """The request body's bytes past the limit (not too many or too long inputs): TEI answers this one
    413 too, the others 422 (server/tei_errors.py)."""


class ResultTooLarge(PayloadTooLarge):
    """The answer's bytes would pass a limit (POST /embed_all's per-token rows): refused before any compute,
    413 on every protocol (TEI's routes too: it is not a too-long or too-many-inputs validation)."""


class Unprocessable(SurgeError):
    http_status = 422
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    code = "unprocessable"


class Overloaded(SurgeError):
    """The queue is full: the client should back off and retry."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    code = "overloaded"


class NotReady(SurgeError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    code = "not_ready"


class DeadlineExceeded(SurgeError):
    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    code = "timeout"


class Cancelled(SurgeError):
    http_status = 499
    grpc_code = grpc.StatusCode.CANCELLED
    code = "cancelled"


class Unsupported(SurgeError):
    """A feature of a protocol that surge does not implement (Triton: UNSUPPORTED)."""

    http_status = 501
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    code = "unsupported"


class EngineError(SurgeError):
    """The engine failed on a batch (out of memory, a bad shape...)."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    code = "engine_error"


class ConfigError(SurgeError):
    """A configuration file is invalid; the message names the file and field."""

    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    code = "invalid_config"


# OpenAI's error type by HTTP status where it is not the class's default: any other 4xx is
# invalid_request_error (OpenAI's own type for a bad request, a bad API key and an unknown model), any other
# 5xx server_error.
_OPENAI_TYPES = {429: "rate_limit_error", 501: "invalid_request_error", 504: "timeout"}


def openai_type(status: int) -> str:
    """The `type` of OpenAI's error body for an HTTP status: a 4xx is the client's error, never server_error."""
    return _OPENAI_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


# -- what error messages may echo -------------------------------------------------------
ECHO_CHARS = 64


def shown(value, limit: int = ECHO_CHARS) -> str:
    """A client-given name as an error message repeats it: at most `limit` characters.

    A 100 KB model name must not come back as a 100 KB error body (nor fill logs).
    """
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "\u2026"


def relative_paths(message: str, root) -> str:
    """A message with the absolute `root` prefix taken off its paths: clients see
    `enc/1/model.yaml`, not where the repository lies on the server's disk."""
    import re

    root = re.escape(str(root).rstrip("/"))
    message = re.sub(root + "/", "", message)
    return re.sub(root + r"(?![\w.-])", ".", message)  # the root itself, not a sibling named like it
