"""Typed errors raised to callers of the engine, and the one table mapping them to HTTP."""

from __future__ import annotations


class SpecOpsError(Exception):
    """Base of every error the engine reports to a caller."""

    code = "internal"


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


# The one place an error code becomes an HTTP status (used by the HTTP API).
HTTP_STATUS: dict[str, int] = {
    InvalidRequestError.code: 400,
    PromptTooLongError.code: 413,
    ModelConfigError.code: 500,
    TokenizerMismatchError.code: 500,
    SpecOpsError.code: 500,
}


def http_status(err: SpecOpsError) -> int:
    return HTTP_STATUS.get(err.code, 500)
