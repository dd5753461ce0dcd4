"""HTTP request bodies (pydantic): OpenAI-compatible completions, the native
``/generate`` and ``/recommend``. Unknown fields are errors, so a typo is reported
with its name instead of being ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _stops(value: str | list[str] | None) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ValueError("at most 4 non-empty stop strings")
    return stops


class CompletionRequest(_Body):
    """``POST /v1/completions`` (the fields of OpenAI's legacy completions API that a
    single-sequence decoder can honour)."""

    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1
    echo: Literal[False] = False
    logprobs: None = None
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("give one prompt (a string or a list of one string)")
            v = v[0]
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return _stops(v)


class GenerateRequest(_Body):
    """``POST /generate``: text or token ids in, tokens + text + SD stats out."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="top-k filter of the sampler (0: off)")
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int = 0
    verify: Literal["greedy", "sample", "typical"] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return _stops(v)

    @field_validator("prompt_ids")
    @classmethod
    def _ids(cls, v):
        if v is not None and not v:
            raise ValueError("must contain at least one token id")
        return v


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
