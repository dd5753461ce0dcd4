"""HTTP request bodies (pydantic): OpenAI-compatible completions and chat completions,
the native ``/generate`` and ``/recommend``, and the error body every route answers
with. Unknown fields are errors, so a typo is reported with its name instead of being
ignored; the constraints here (non-empty prompts, ranges) are the ones the server
enforces, and ``/openapi.json`` shows them.

Every decoding route takes ``verify`` and ``verify_params``: a rule of the rule registry
(:mod:`speclab.decoding.rules.registry`, rules registered by plugin modules included)
and its parameters. The name is checked here against the registry; the parameters by
the rule's own parameter model when the ingress resolves the rule with the sampling
settings (:meth:`serve_apps.ingress.Ingress._decoding`). ``/openapi.json`` lists the
registered names as an enum and each rule's parameters (:mod:`serve_apps.openapi`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from speclab.decoding.logprobs import MAX_TOP_LOGPROBS
from speclab.decoding.rules.registry import get_rule


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _stops(value: str | list[str] | None) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ValueError("at most 4 non-empty stop strings")
    return stops


NonEmpty = Annotated[str, Field(min_length=1)]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in value)


def _prompt_shape(value: Any) -> Any:
    """``prompt``'s shape checked before pydantic tries each member of its union (whose
    errors would all say "Input should be a valid string"): one sentence per cause."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of token ids, got "
                         f"{type(value).__name__}")
    if not value:
        raise ValueError("must not be empty")
    if _is_ids(value):
        bad = [(i, t) for i, t in enumerate(value) if t < 0]
        if bad:
            raise ValueError(f"token ids must be >= 0 (got {bad[0][1]} at index {bad[0][0]})")
        return value
    if all(isinstance(p, str) for p in value) or all(_is_ids(p) for p in value):
        if len(value) > 1:
            raise ValueError(f"one prompt per request (got a list of {len(value)}); send "
                             "each prompt as its own request")
        return _prompt_shape(value[0])
    raise ValueError("must be a string, a list of token ids, or a list of one of them")


def _text_parts(value: Any) -> Any:
    """A message's list content: every part must be a text part (this server decodes
    text models); a part of another type is refused by its index and type."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}: this model reads text "
                                 "only (parts of type 'text')")
    return value


def _registered_rule(name: str | None) -> str | None:
    """A name of the rule registry (checked when the request arrives, so a rule a plugin
    module registered is as good as a built-in one)."""
    if name is not None:
        try:
            get_rule(name)
        except ValueError as err:
            raise ValueError(str(err).removeprefix("verify: ")) from None
    return name


#: ``verify``: a registered rule (``/openapi.json`` lists them as an enum)
RuleName = Annotated[str | None, AfterValidator(_registered_rule), Field(
    description="the verification rule, a name of the rule registry (default: greedy at "
                "temperature 0, sample otherwise; a method whose drafts need their own "
                "rule, e.g. aasd, uses it)")]
#: ``verify_params``: checked by the rule's parameter model
RuleParams = Annotated[dict[str, Any] | None, Field(
    description="the parameters of the rule named in verify (its parameter model), e.g. "
                "typical: {epsilon, delta, bonus}")]


def _neutral(allowed: tuple, what: str) -> AfterValidator:
    """An OpenAI parameter this server does not implement: the values in ``allowed``
    change nothing and are accepted (clients such as LangChain, LiteLLM and
    lm-eval-harness send them on every request, and vLLM accepts them); any other value
    is refused naming the field: ``presence_penalty: not supported (only 0)``."""

    def check(value: Any) -> Any:
        if not any(value is a or (value == a and type(value) is not bool) for a in allowed):
            raise ValueError(f"not supported ({what})")
        return value

    return AfterValidator(check)


class _OpenAIBody(_Body):
    """The neutral-valued OpenAI parameters both OpenAI routes accept."""

    presence_penalty: Annotated[float | None, _neutral((0, None), "only 0")] = None
    frequency_penalty: Annotated[float | None, _neutral((0, None), "only 0")] = None
    logit_bias: Annotated[dict[str, float] | None, _neutral(({}, None), "only {}")] = None
    stream_options: dict[str, bool] | None = Field(
        None, description="include_usage: the last chunk carries usage (it always does)")
    metadata: dict[str, str] | None = None


#: seconds a request may decode (``timeout``)
Timeout = Annotated[float | None, Field(
    gt=0.0, description="seconds this request may decode, at most "
                              "serve.request_timeout_s; past it the reply holds the tokens "
                              "decoded by then, finish_reason length and "
                              "deadline_exceeded: true")]

#: alternatives per token a request may ask for (``logprobs`` / ``top_logprobs``)
TopLogprobs = Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, "
                                  "not_found_error, service_unavailable or internal_error")
    param: str | None = Field(None, description="the request field at fault")
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class CompletionRequest(_OpenAIBody):
    """``POST /v1/completions`` (the fields of OpenAI's legacy completions API that a
    single-sequence decoder can honour)."""

    model: str | None = None
    prompt: (NonEmpty | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                         Field(min_length=1, max_length=1)]) = Field(
        description="one prompt: a non-empty string or token id list, or a list of one")
    max_tokens: int = Field(16, ge=1, description="at most serve.max_tokens")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = None
    verify: RuleName = None
    verify_params: RuleParams = None
    timeout: Timeout = None
    stream: bool = False
    n: Literal[1] = 1
    best_of: Annotated[int | None, _neutral((1, None), "only 1")] = None
    suffix: Annotated[str | None, _neutral((None, ""), "only null")] = None
    echo: bool | None = Field(False, description="the prompt before the completion (with "
                                                  "logprobs: the prompt tokens' log-probs)")
    logprobs: TopLogprobs = Field(None, description="the target's log-probs of the tokens, "
                                                    "with this many alternatives each")
    user: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        return _prompt_shape(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return _stops(v)


class TextPart(_Body):
    """A text part of a message's content (the only kind a text model reads)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """A message; ``developer`` is OpenAI's newer name for ``system`` (sent to the chat
    template as ``system``); list content is its text parts joined."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text(cls, v: Any) -> Any:
        return _text_parts(v)

    def for_template(self) -> dict:
        """``{"role", "content"}`` for the tokenizer's chat template."""
        content = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content}


class ChatCompletionRequest(_OpenAIBody):
    """``POST /v1/chat/completions``: the messages go through the target tokenizer's chat
    template (or, for a tokenizer without one, :data:`serve_apps.chat.PLAIN_CHAT_TEMPLATE`)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="at most serve.max_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = None
    verify: RuleName = None
    verify_params: RuleParams = None
    timeout: Timeout = None
    stream: bool = False
    n: Literal[1] = 1
    logprobs: bool | None = Field(None, description="the target's log-probs of the tokens")
    top_logprobs: TopLogprobs = Field(None, description="alternatives per token (with logprobs)")
    response_format: Annotated[dict[str, Any] | None, _neutral(
        ({"type": "text"}, None), 'only {"type": "text"}: this server does not constrain '
                                  'the output to JSON or a schema')] = None
    tools: Annotated[list[dict] | None, _neutral(([], None), "only []: this server calls no "
                                                             "tools")] = None
    tool_choice: Annotated[str | None, _neutral(("none", None), 'only "none": this server '
                                                                'calls no tools')] = None
    parallel_tool_calls: bool | None = None  # no tools: it changes nothing
    store: Annotated[bool | None, _neutral((False, None), "only false")] = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return _stops(v)

    @property
    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16


class GenerateRequest(_Body):
    """``POST /generate``: text or token ids in, tokens + text + SD stats out."""

    prompt: NonEmpty | None = Field(None, description="give prompt or prompt_ids")
    prompt_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="token ids below the vocabulary size")
    max_tokens: int = Field(64, ge=1, description="at most serve.max_tokens")
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="top-k filter of the sampler (0: off)")
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int = 0
    verify: RuleName = None
    verify_params: RuleParams = None
    timeout: Timeout = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return _stops(v)


class RecommendRequest(_Body):
    """``POST /recommend``: dataset item ids (most recent last) -> top-``k`` items by
    AtSpeed beam SD with strict top-K verification (the target's beam-search result) or
    relaxed sampling verification."""

    history: list[int] = Field(min_length=1)
    k: int = Field(10, ge=1)
    n: int | None = Field(None, ge=1, description="draft beam size (default serve.rec_n)")
    gamma: int | None = Field(None, ge=1, description="draft steps per round")
    verify: Literal["strict", "relaxed"] = Field(
        "strict", description="strict top-K (lossless: the target's beam search) or "
                              "relaxed sampling verification (AtSpeed Algorithm 2)")
    seed: int = Field(0, description="seed of relaxed sampling")
