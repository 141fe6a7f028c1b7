"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Only what the server implements is accepted. An OpenAI parameter we do not implement
(``suffix``, tools and
functions) and any field OpenAI does not define either
gets a 400 naming the parameter, rather than being silently ignored. The exceptions are
:data:`IGNORED_FIELDS`: what clients commonly send that cannot change the output (storage,
billing and tracing hints); they are accepted, and the API names the ones a request sent in
its ``X-Specops-Ignored-Fields`` header and a log line. vLLM's ``top_k`` and ``min_p`` are
honoured (``specops.serving.engine.sampling``). Our extension fields are ``speculation``, ``cluster``,
``retrieval``, ``knnlm``, ``references`` and vLLM's ``return_token_ids``, ``logprobs_mode``,
``repetition_penalty``, ``min_tokens`` and ``ignore_eos``.
Types are strict (:data:`STRICT`), as OpenAI's are. Server-side bounds (prompt length,
``max_tokens``, ``k``) are checked by the API against :class:`~specops.serving.http.config.ServeConfig`,
since they are settings.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from specops.core.errors import UnsupportedParameterError, echo
from specops.serving.engine.grammar import GrammarSpec
from specops.serving.http import tools as tools_fmt
from specops.serving.http.speculation import FieldValueError, Speculation

MAX_N = 16
"""Most choices one request may ask for (``n``, ``best_of``)."""

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""Every model: unknown fields refused, and no coercion: ``"5"`` and ``true`` are not integers, ``"0.5"`` is not
a number, ``1`` is not a boolean (an integer is still a valid float: ``"temperature": 1``); no NaN or infinity."""

ClusterName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
"""Cluster ids become registry model names (``draft-<cluster>``): letters, digits, ``_.-``, at most 64."""


KBName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class Retrieval(BaseModel):
    """Extension: iterative retrieval-augmented generation over a knowledge base (``docs/retrieval.md``)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    kb: KBName
    """Knowledge base name (``kb-<name>`` in the registry, or a --kb-dir the server loaded)."""
    mode: Literal["ralmspec", "ralmseq", "oneshot"] = "ralmspec"
    """ralmspec: speculative retrieval from a local cache, verified in batches (same output); ralmseq: the baseline;
    oneshot: retrieve the top ``passages`` once, put them before the prompt and decode (with ``llma``, they are
    references too)."""
    passages: int = Field(5, ge=1, le=20)
    """oneshot: passages retrieved for the prompt."""
    retriever: Literal["exact", "hnsw", "scann", "bm25"] = "exact"
    stride: int = Field(4, ge=1, le=64)
    """Tokens generated per retrieval."""
    query_tokens: int = Field(32, ge=1, le=512)
    """The query is the last this-many tokens of prompt + output."""
    speculation_stride: int = Field(0, ge=0, le=32)
    """RaLMSpec: speculations per verification; 0 = OS³ chooses it live."""
    prefetch: int = Field(20, ge=1, le=256)
    """RaLMSpec: KB results per query added to the local cache at each verification."""
    asynchronous: bool | None = Field(None, alias="async")
    """RaLMSpec: verify while the next speculation step runs (true) or not (false); null (default): asynchronous
    while the request decodes alone, synchronous while others decode beside it, always synchronous over a KB in
    embedded Milvus Lite (its search holds the interpreter lock)."""
    speculation_off: bool = True
    """RaLMSpec: OS³ may skip speculating when RaLMSeq is faster with the measured costs (false: the paper's OS³)."""
    reverify: bool = True
    """RaLMSpec: a mismatch verifies its withdrawn tokens again under the true passage (false: regenerate them)."""


class Knnlm(BaseModel):
    """Extension: kNN-LM decoding over a datastore of the target's hidden states (``docs/retrieval.md``)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    datastore: KBName
    """kNN-LM datastore name (``knnlm-<name>`` in the registry, or a --knnlm-dirs directory by its folder name)."""
    lam: float = Field(0.25, ge=0.0, le=1.0, alias="lambda")
    """Weight of the neighbours' distribution: p = λ·p_kNN + (1-λ)·p_LM."""
    k: int = Field(32, ge=1, le=1024)
    """Neighbours per search."""
    speculative: bool = True
    """True: RaLMSpec's speculative kNN-LM (same output); false: a datastore search per token."""
    speculation_stride: int = Field(0, ge=0, le=32)
    """Speculative: tokens per batched verification; 0 = OS³ chooses it live."""


IGNORED_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "stream_options.continuous_usage_stats",
    "stream_options.include_obfuscation",
)
"""Fields accepted and ignored, because they cannot change the output: ``user`` (an end-user id for
OpenAI's abuse monitoring), ``store`` and ``metadata`` (OpenAI's stored completions), ``service_tier``
(OpenAI's billing tier), ``parallel_tool_calls`` (chat, when it sends no ``tools``; with them it is honoured),
``stream_options.continuous_usage_stats`` (vLLM: usage in every chunk; usage comes in the last
chunk with ``include_usage``) and ``stream_options.include_obfuscation`` (OpenAI's padding of
stream events). Everything else unknown is a 400 naming it, so a typo is never ignored."""

IGNORED_HEADER = "X-Specops-Ignored-Fields"
"""The response header naming the :data:`IGNORED_FIELDS` a request sent, comma-separated."""


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool | None = None
    """Ignored (:data:`IGNORED_FIELDS`)."""
    include_obfuscation: bool | None = None
    """Ignored (:data:`IGNORED_FIELDS`)."""


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's structured-output schema."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema the output follows (absent: any JSON value of an object)."""
    strict: bool | None = None
    """Accepted: the schema is always followed exactly here."""


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldValueError("json_schema", "give json_schema exactly when type is 'json_schema'")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of a JSON schema, a regular expression, a list of choices,
    a Lark grammar, or any JSON object."""

    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = STRICT

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    """vLLM's: keep the ``top_k`` most probable tokens; -1 or 0 (vLLM's "off") or absent: all."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """vLLM's: keep tokens at least ``min_p`` times as probable as the most probable one; 0 or absent: all."""
    n: int = Field(1, ge=1, le=MAX_N)
    """Choices to return: independent samples of the same prompt (choice ``i`` seeded ``seed + i``)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI's: subtracted from the logit of every token the output already holds."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI's: times a token's count in the output, subtracted from its logit."""
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=300)
    """OpenAI's: token id (as a string) -> bias added to its logit, at most 300 entries."""
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    """vLLM's: a logit of a token in the prompt or the output divided by it (positive) or multiplied; 1 = off."""
    min_tokens: int | None = Field(None, ge=0)
    """vLLM's: the end-of-sequence tokens cannot come before this many output tokens."""
    ignore_eos: bool = False
    """vLLM's: an end-of-sequence token does not end the output; it runs to ``max_tokens``."""
    # accepted and ignored (IGNORED_FIELDS; ``user`` above)
    store: bool | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    service_tier: ServiceTier | None = None
    # extensions
    speculation: Speculation | None = None
    cluster: ClusterName | None = None
    retrieval: Retrieval | None = None
    knnlm: Knnlm | None = None
    return_token_ids: bool = False
    """vLLM's extension: the response's choice also carries ``prompt_token_ids`` and ``token_ids``
    (the output's ids as decoded), so a client can compare outputs by ids rather than by text."""
    references: list[str] | None = None
    """Texts LLMA copies from (``speculation.method = "llma"``); bounded by the server's
    max_references and max_reference_tokens (413 beyond)."""
    response_format: ResponseFormat | None = None
    """OpenAI's (chat; vLLM takes it on completions too): ``json_object`` or ``json_schema`` output."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's: the output follows a JSON schema, a regex, a choice or a grammar (``specops.serving.engine.grammar``)."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older name of ``structured_outputs.json`` (as are ``guided_regex``, ``guided_choice``, ``guided_grammar``)."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None
    """vLLM's ``logprobs_mode`` (a server option there, per request here): ``raw_logprobs``
    (default) the target's log-softmax; ``processed_logprobs`` the distribution sampled from
    (temperature, min-p, top-k, top-p applied). Only with log-probabilities asked for."""

    def logprobs_n(self) -> int | None:
        """Alternatives per token the request asks for (0 = the chosen token's alone), or None: none asked."""
        return None

    def grammar(self, tokenizer=None) -> GrammarSpec | None:
        """The output constraint the request asks for (one at most), or None: free text. ``tokenizer``
        (the target's) names the tool format a forced tool call is written in (chat only)."""
        found: list[GrammarSpec] = []
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type == "json_object":
            found.append(GrammarSpec("json_object", "", "response_format"))
        elif rf is not None and rf.json_schema is not None:
            schema = rf.json_schema.schema_
            field = "response_format.json_schema.schema"
            found.append(
                GrammarSpec("json_schema", json.dumps(schema), field)
                if schema
                else GrammarSpec("json_object", "", field)
            )
        for prefix, (js, regex, choice, grammar, obj) in (
            ("structured_outputs.", (so.json_, so.regex, so.choice, so.grammar, so.json_object) if so else (None,) * 5),
            ("guided_", (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar, None)),
        ):
            if js is not None:
                found.append(GrammarSpec("json_schema", js if isinstance(js, str) else json.dumps(js), prefix + "json"))
            if regex is not None:
                found.append(GrammarSpec("regex", regex, prefix + "regex"))
            if choice is not None:
                found.append(GrammarSpec.choice(choice, prefix + "choice"))
            if grammar is not None:
                found.append(GrammarSpec("grammar", grammar, prefix + "grammar"))
            if obj:
                found.append(GrammarSpec("json_object", "", prefix + "json_object"))
        if len(found) > 1:
            raise UnsupportedParameterError(
                f"{found[1].field}: one output constraint per request; {found[0].field} is one already", found[1].field
            )
        return found[0] if found else None

    def _check_logprobs_mode(self) -> None:
        if self.logprobs_mode is not None and self.logprobs_n() is None:
            raise UnsupportedParameterError(
                "logprobs_mode applies only when log-probabilities are asked for; send logprobs too", "logprobs_mode"
            )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s or len(s) > 64 for s in stops):
            raise ValueError("each stop sequence must be 1 to 64 characters")
        return stops

    def ignored(self) -> tuple[str, ...]:
        """The :data:`IGNORED_FIELDS` this request sent (dotted), in that order."""
        sent = set(self.model_fields_set)
        if self.stream_options is not None:
            sent |= {f"stream_options.{name}" for name in self.stream_options.model_fields_set}
        return tuple(name for name in IGNORED_FIELDS if name in sent)

    def ignored_header(self) -> dict[str, str]:
        """``{IGNORED_HEADER: "store,metadata"}`` naming :meth:`ignored`; empty when it sent none."""
        names = self.ignored()
        return {IGNORED_HEADER: ",".join(names)} if names else {}

    def unsupported(self) -> None:
        """Raise for OpenAI parameters that are valid but not implemented here."""
        if self.n > 1 and getattr(self, "echo", False) and self.max_tokens == 0:
            raise UnsupportedParameterError("n: scoring a prompt (echo with max_tokens 0) has one answer", "n")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameterError("stream_options is only allowed with stream=true", "stream_options")
        self._check_logprobs_mode()


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    """Text or token ids (strict: JSON booleans are not token ids); one prompt per request."""
    max_tokens: int | None = Field(None, ge=0)
    """0 only with ``echo``: score the prompt (its log-probabilities with ``logprobs``), generate nothing."""
    echo: bool = False
    """The response's text starts with the prompt; with ``logprobs``, so do its log-probabilities
    (the first prompt token's are null: nothing before it predicts it)."""
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """Choices to decode, of which the ``n`` with the highest cumulative log-probability are returned."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """The target's log-probability of each output token and of the ``logprobs`` most probable
    tokens at its position (0: the chosen token's alone)."""
    suffix: str | None = None

    def logprobs_n(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("prompt is empty")
        if isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(v)}; send them as separate requests")
            return v[0]
        return v

    def unsupported(self) -> None:
        super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedParameterError(
                "max_tokens: 0 generates nothing; it is only for scoring a prompt with echo (and logprobs)",
                "max_tokens",
            )
        if self.best_of is not None and self.best_of < self.n:
            raise UnsupportedParameterError(
                f"best_of ({echo(self.best_of)}) must be at least n ({echo(self.n)})", "best_of"
            )
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise UnsupportedParameterError(
                "best_of with stream: the best choices are known only once all are done (OpenAI's rule)", "best_of"
            )
        if self.suffix:
            raise UnsupportedParameterError("suffix is not supported", "suffix")


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=64)
    arguments: str = ""
    """The arguments as JSON text, as the model wrote them."""


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (``messages[i].tool_calls``)."""

    model_config = STRICT

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionDef(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (absent: any JSON object)."""
    strict: bool | None = None
    """Accepted: a forced call's arguments always follow the schema exactly here."""


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: that function must be called."""

    model_config = STRICT

    type: Literal["function"]
    function: ChosenFunction


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    """An assistant turn's calls (its ``content`` may then be null)."""

    def as_dict(self) -> dict:
        """The message as the chat template and ``specops.serving.http.tools`` take it."""
        out: dict = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    """The target's log-probability of each output token (``top_logprobs``: and of its most probable alternatives)."""
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    """Functions the model may call (``specops.serving.http.tools``)."""
    tool_choice: Any = None
    """``auto`` (the default with tools): the model decides; ``none``: no call (the tools are not
    rendered); ``required``: at least one call; a named function: that call. The last two are
    grammars: the arguments follow the function's schema."""
    parallel_tool_calls: bool | None = None
    """With ``tools``: whether a response may hold several calls (default true). Without: ignored."""
    functions: list[dict] | None = None
    function_call: Any = None

    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> str | NamedToolChoice | None:
        if v is None or (isinstance(v, str) and v in ("none", "auto", "required")):
            return v
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as e:
                raise ValueError(
                    f"a named function is {{'type': 'function', 'function': {{'name': ...}}}}: {e.errors()[0]['msg']}"
                ) from None
        raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")

    def calls_tools(self) -> bool:
        """The output may hold tool calls (``tools`` sent, ``tool_choice`` not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict]:
        """The tools as OpenAI JSON (what the prompt shows), none with ``tool_choice: none``."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()] if self.calls_tools() else []

    def grammar(self, tokenizer=None) -> GrammarSpec | None:
        if self.calls_tools():
            choice = (
                self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
            )
            parallel = self.parallel_tool_calls is not False
            spec = tools_fmt.grammar(tokenizer, self.tool_dicts(), choice, parallel=parallel)
            if spec is not None:
                return spec
        return super().grammar()

    def ignored(self) -> tuple[str, ...]:
        out = super().ignored()
        return tuple(n for n in out if n != "parallel_tool_calls") if self.tools else out

    @model_validator(mode="after")
    def _tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise FieldValueError(
                    "max_completion_tokens",
                    f"{echo(self.max_completion_tokens)} disagrees with max_tokens "
                    f"({echo(self.max_tokens)}); send one of them (max_tokens is its deprecated name)",
                )
            self.max_tokens = self.max_completion_tokens
        return self

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameterError(
                "top_logprobs needs logprobs: true (OpenAI's rule); send both", "top_logprobs"
            )
        if self.tool_choice not in (None, "none") and not self.tools:
            raise UnsupportedParameterError("tool_choice needs tools (OpenAI's rule); send both", "tool_choice")
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) < len(names):
                raise UnsupportedParameterError("tools: two functions have the same name", "tools")
            choice = self.tool_choice
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise UnsupportedParameterError(
                    f"tool_choice.function.name: {choice.function.name!r} is not one of the tools",
                    "tool_choice.function.name",
                )
            if self.calls_tools() and super().grammar() is not None:
                raise UnsupportedParameterError(
                    f"{super().grammar().field} with tools: a tool call and a response format are two grammars for "
                    "one output; send tool_choice 'none', or leave the response format out",
                    super().grammar().field,
                )
        if self.functions or self.function_call not in (None, "none"):
            field = "functions" if self.functions else "function_call"
            raise UnsupportedParameterError("functions / function_call are not supported", field)
