"""Typed errors raised to callers of the engine, the one table mapping them to HTTP, and how
a message quotes a client's value (:func:`echo`: clipped, so an error is never as large as its input)."""

from __future__ import annotations


class SpecOpsError(Exception):
    """Base of every error the engine reports to a caller."""

    code = "internal"

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The request field to fix, when there is one (the API returns it as ``error.param``)."""


class InvalidRequestError(SpecOpsError, ValueError):
    """The request itself is malformed (empty prompt, bad k, bad sampling params)."""

    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit in the model's context window."""

    code = "prompt_too_long"


class ModelConfigError(SpecOpsError, ValueError):
    """Models cannot work together (different tokenizers, vocabularies) or cannot load."""

    code = "model_config"


class TokenizerMismatchError(ModelConfigError):
    """The draft and the target do not share one tokenizer."""

    code = "tokenizer_mismatch"


class UnsupportedParameterError(InvalidRequestError):
    """The request uses an OpenAI parameter this server does not implement (n > 1, logprobs, ...)."""

    code = "unsupported_parameter"


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts."""

    code = "request_too_large"


class AuthenticationError(SpecOpsError):
    """No API key, or not a bearer key."""

    code = "missing_api_key"


class PermissionDeniedError(SpecOpsError):
    """An API key that this server does not accept."""

    code = "invalid_api_key"


class ForbiddenError(SpecOpsError):
    """A valid API key whose tenant may not do this (send ``cluster``, read ``/v1/policy``)."""

    code = "forbidden"


class ModelNotFoundError(SpecOpsError):
    """The request names a model this server does not serve."""

    code = "model_not_found"


class OverloadedError(SpecOpsError):
    """Every worker is busy and the admission queue is full: retry later."""

    code = "overloaded"


class QueueTimeoutError(SpecOpsError):
    """The request waited in the admission queue longer than the server allows."""

    code = "queue_timeout"


class NotReadyError(SpecOpsError):
    """The server is still loading its models (or failed to)."""

    code = "not_ready"


class ArtifactUnavailableError(SpecOpsError):
    """A named artifact the request asks for (``retrieval.kb``, ``knnlm.datastore``) exists but no
    verified version of it is loaded here: its champion was refused (corrupt, foreign) or the
    registry is unreachable. Retry later; the server retries the fetch with backoff."""

    code = "artifact_unavailable"


class UnavailableError(SpecOpsError):
    """A part of the server cannot answer now (its state is busy past a short wait): retry later."""

    code = "unavailable"


class RequestTimeoutError(SpecOpsError):
    """The request decoded for longer than the server allows."""

    code = "request_timeout"


class ReadTimeoutError(SpecOpsError):
    """The client took longer than the server allows to send its request (headers or body)."""

    code = "read_timeout"


class RouterError(SpecOpsError, ValueError):
    """A router artifact is malformed or does not fit this server (dimension, embedder)."""

    code = "router"


class DatastoreError(SpecOpsError, ValueError):
    """A retrieval datastore is malformed, corrupt, or does not fit this target (hidden size,
    vocabulary, tokenizer)."""

    code = "datastore"


class KBError(SpecOpsError, ValueError):
    """A knowledge base is malformed, corrupt or foreign, was built with another embedder, or
    lacks the retriever asked for."""

    code = "kb"


# The one place an error code becomes an HTTP status (used by the HTTP API).
HTTP_STATUS: dict[str, int] = {
    InvalidRequestError.code: 400,
    UnsupportedParameterError.code: 400,
    PromptTooLongError.code: 413,
    RequestTooLargeError.code: 413,
    ReadTimeoutError.code: 408,
    AuthenticationError.code: 401,
    PermissionDeniedError.code: 403,
    ForbiddenError.code: 403,
    ModelNotFoundError.code: 404,
    OverloadedError.code: 429,
    NotReadyError.code: 503,
    QueueTimeoutError.code: 503,
    UnavailableError.code: 503,
    ArtifactUnavailableError.code: 503,
    RequestTimeoutError.code: 504,
    ModelConfigError.code: 500,
    TokenizerMismatchError.code: 500,
    RouterError.code: 500,
    DatastoreError.code: 500,
    KBError.code: 500,
    SpecOpsError.code: 500,
}


def http_status(err: SpecOpsError) -> int:
    return HTTP_STATUS.get(err.code, 500)


ECHO_CHARS = 100
"""The most characters of a client's value an error message quotes."""


def clip(text: str, limit: int = ECHO_CHARS, *, size: int | None = None) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis and the original size when it was longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) if size is None else size} characters)"


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, clipped: a 500 KB invalid value is quoted by its first characters."""
    return clip(repr(value), limit, size=len(value) if isinstance(value, str) else None)
