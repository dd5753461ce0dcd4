"""The HTTP ingress: an OpenAI-compatible API in front of the draft and target
deployments.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``
sends server-sent events; ``usage`` on every response; the request's SD statistics in
the ``speclab`` extension field), ``GET /v1/models``, ``POST /generate`` (tokens, text
and the SD stats: tau, target and draft calls, accepted lengths, where the time went),
``POST /recommend`` (AtSpeed beam SD), ``GET /health`` (live request states and memory
of every target and draft replica), ``GET /openapi.json`` (every route's body
constraints and error responses, the registered verification rules and their
parameters: :mod:`serve_apps.openapi`). Every decoding route takes ``verify`` and
``verify_params`` (a rule of the rule registry and its parameters).

A decoding request is ONE handle call from here: to the draft deployment, which drives
the request's rounds next to its drafter and verifies on the target in batched calls
(:mod:`serve_apps.draft`), or, for plain decoding, to the target deployment, which
drives it alone (:mod:`serve_apps.target`); ``/recommend`` too goes to the draft
deployment, which runs its beam SD rounds (:mod:`serve_apps.beams`). Every request is
a streamed call, whether or not its client streams: a streamed request or one with stop
strings gets each round's tokens as they come, cut at a stop string by
:mod:`serve_apps.stops`; any other gets them in chunks of up to :data:`HOLD_S` seconds
of rounds. A stop string, a client that goes away or the request's deadline
(``timeout``, ``serve.request_timeout_s``) ends its rounds at once. This module keeps
the routes and the mapping of errors to HTTP statuses.

Every error answers OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``:
400 naming the field, 401 without the API key (``serve.api_key``), 404 for an unknown
route or model, 503 when a replica failed or lost the request's state; the request's
state on both deployments is freed when it ends, fails or its client goes away.
"""


import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_apps.chat import chat_prompt
from serve_apps.decode import DecodeRequest, LiveStats
from serve_apps.errors import as_failure, downstream_cancel
from serve_apps.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    join_completion_logprobs,
)
from serve_apps.metrics import RequestMetrics, count_error, count_errors_in, count_refusal
from serve_apps.openapi import server_schema
from serve_apps.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    RecommendRequest,
)
from serve_apps.router import target_key
from serve_apps.spec_metrics import spec_decode_metrics
from serve_apps.stops import StopText
from speclab.config.base import ConfigError
from speclab.decoding.loop import eos_set
from speclab.decoding.rules import RuleSpec, request_rule
from speclab.decoding.sampling import SamplingParams
from speclab.models.loading import load_tokenizer

#: seconds a replica may hold the rounds of a request whose reply waits for the end (not
#: streamed, no stop strings) before sending them to the ingress as one chunk; a chunk
#: per round cost plain decoding through Serve a quarter to a third of its throughput
#: on the 2-core VM (docs/serve.md); a chunk per 0.1 s costs about 1 ms in 100
HOLD_S = 0.1

api = FastAPI(title="speclab", description=__doc__)


def _errors(*codes: int) -> dict:
    """OpenAPI ``responses`` for the error statuses a route can answer."""
    what = {400: "invalid request: the message names the field (param)",
            401: "missing or wrong API key (only when serve.api_key is set)",
            404: "unknown model, or no recommender served",
            503: "a replica failed or lost the request's state; retry"}
    return {c: {"model": ErrorResponse, "description": what[c]} for c in codes}


class HTTPError(Exception):
    """An error answered as JSON with ``status``; ``param`` names the bad field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON answer; a 4xx counts as a refusal by its code, else its type."""
        if self.status < 500:
            count_refusal(self.code or self.kind)
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(status_code=self.status, content=self.body(), headers=headers)


@api.middleware("http")
async def _count_errors(request: Request, call_next):
    """Every answer with an error status counts in ``speclab_request_errors`` (400s and
    404s of the validation and routing handlers included), by status."""
    response = await call_next(request)
    if response.status_code >= 400:
        count_error(response.status_code)
    return response


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # loc: the character offset, not a field
        why = (first.get("ctx") or {}).get("error", "")
        return HTTPError(400, f"invalid JSON body{': ' + why if why else ''}").response()
    if tuple(first.get("loc", ())) == ("body",):  # no body, or not a JSON object
        return _bad_body(request, first).response()
    param = request_param(first.get("loc", ()))
    text = str(first["msg"]).removeprefix("Value error, ")
    msg = f"{param}: {text}" if param else text
    return HTTPError(400, msg, param).response()


def _bad_body(request: Request, error: dict) -> HTTPError:
    """A body that is missing or not a JSON object: the route's first required field is
    the one at fault (``param``), named with what was sent."""
    route = request.scope.get("route")
    model = getattr(getattr(getattr(route, "body_field", None), "field_info", None),
                    "annotation", None)
    fields = getattr(model, "model_fields", {})
    required = [n for n, f in fields.items() if f.is_required()] or list(fields)[:1]
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number",
             bool: "a boolean"}
    got = "no body" if error.get("type") == "missing" else \
        kinds.get(type(error.get("input")), "null")
    need = f" with {', '.join(required)}" if required else ""
    return HTTPError(400, f"{required[0] if required else 'body'}: the request body must be "
                          f"a JSON object{need} (got {got})",
                     required[0] if required else "body")


def request_param(loc: tuple) -> str | None:
    """The request field a validation error's ``loc`` names (``messages.0.content``),
    without the body marker and pydantic's union-member tags (``constrained-str``,
    ``list[constrained-str]``, ``function-after[...]``, ``str``)."""
    tags = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance"}
    parts = [str(p) for p in loc[1:] if p is not None] if loc[:1] == ("body",) else \
        [str(p) for p in loc]
    kept = [p for p in parts if p.isdigit() or (p.isidentifier() and p not in tags)]
    return ".".join(kept) or None


@api.exception_handler(HTTPError)
async def _http_error(_request: Request, exc: HTTPError) -> JSONResponse:
    return exc.response()


@api.exception_handler(StarletteHTTPException)
async def _routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404) and wrong methods (405) in the same shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     None, kind).response()


@api.exception_handler(Exception)
async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", None,
                     "internal_error").response()


def _replica_error(exc: BaseException, what: str) -> HTTPError:
    """A replica call failed: the caller's fault (ValueError: 400) or not (503; a
    replica's cancelled task included, :func:`serve_apps.errors.as_failure`)."""
    if isinstance(exc, HTTPError):
        return exc
    exc = as_failure(exc, "replica call")
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    if isinstance(exc, ValueError):
        return HTTPError(400, text)
    return HTTPError(503, f"{what}: {text}", kind="service_unavailable")


class _DeadlinePassed(Exception):
    """A request's deadline passed while it waited for its next round."""


class _OwnTimeout(Exception):
    """Carries a TimeoutError the awaited step raised itself (``__cause__``)."""


async def _before(step, deadline: float | None):
    """``await step``, or :class:`_DeadlinePassed` once ``time.perf_counter()`` passes
    ``deadline`` (None: no deadline); a TimeoutError of the step itself (a replica's)
    passes through as the error it is."""
    if deadline is None:
        return await step

    async def own() -> object:
        try:
            return await step
        except TimeoutError as exc:
            raise _OwnTimeout from exc

    try:
        return await asyncio.wait_for(own(), max(deadline - time.perf_counter(), 0.0))
    except _OwnTimeout as wrapped:
        raise wrapped.__cause__ from None
    except TimeoutError:
        raise _DeadlinePassed from None


@dataclass
class Decoding:
    """One request's decoding parameters and, once decoded, its tokens and stats."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: dict
    rule: RuleSpec
    seed: int
    stops: list[str]
    logprobs: int | None = None  # the target's log-probs, with this many alternatives
    echo: bool = False  # and the prompt tokens' (with logprobs)
    stats: dict = field(default_factory=dict)
    live: LiveStats = field(default_factory=LiveStats)  # stats so far, from each round
    tokens: list[int] = field(default_factory=list)  # generated so far
    token_logprobs: list = field(default_factory=list)  # an entry per token (logprobs)
    prompt_logprobs: list | None = None  # an entry per prompt token (echo)
    finish_reason: str = "length"
    deadline: float | None = None  # time.perf_counter() at which decoding stops
    deadline_exceeded: bool = False  # it did: the reply holds the rounds decoded by then
    # seconds the driving replica may hold rounds before sending them (DecodeRequest)
    hold_s: float = 0.0

    def kept_logprobs(self) -> list:
        """The entries of the tokens kept (a stop string may have cut the last round)."""
        return self.token_logprobs[:len(self.tokens)]


@serve.ingress(api)
class Ingress:
    """Holds handles to the target and draft deployments; see the module docstring."""

    def __init__(self, target, draft, settings: dict) -> None:
        self.target, self.draft = target, draft
        self.s = settings
        # serve.topology colocated: ONE deployment holds both sides (its target's calls
        # are named target_<call>, and a request's target row is routed by its id)
        self.colocated = settings.get("topology") == "colocated"
        self.tokenizer = load_tokenizer(settings["target_path"], field="models.target")
        self._info: dict | None = None
        self._ending: set[asyncio.Task] = set()  # states being freed (early ends)
        self.metrics = RequestMetrics(settings["model_name"])
        count_errors_in(self.metrics)  # the middleware's (Serve runs a copy of `api`)
        api.openapi_schema = None
        api.openapi = self._openapi
        self._openapi()  # now: the rules registered when the app is built (plugins too)

    def _openapi(self) -> dict:
        """FastAPI's schema plus this server's own limits (``max_tokens``) and the
        registered verification rules (:func:`serve_apps.openapi.server_schema`)."""
        from fastapi.openapi.utils import get_openapi

        if api.openapi_schema is None:
            schema = get_openapi(title=api.title, version="1", description=api.description,
                                 routes=api.routes)
            api.openapi_schema = server_schema(schema, self.s["max_tokens"])
        return api.openapi_schema

    def _auth(self, request: Request) -> None:
        """401 unless the request carries the API key as a Bearer token (when set)."""
        key = self.s.get("api_key")
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
            raise HTTPError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                 "<key>'", None, "authentication_error", "invalid_api_key")

    def _target(self, call: str, stream: bool = False):
        """The handle method of a call to the target side: ``call`` on the target
        deployment, or ``target_<call>`` on the colocated one."""
        handle = self.target.options(stream=True) if stream else self.target
        return getattr(handle, f"target_{call}" if self.colocated else call)

    async def _infos(self) -> dict:
        if self._info is None:
            t = await self._target("info").remote()
            d = await self.draft.info.remote()
            self._info = {**t, "drafting": d["drafting"], "prefill_top_k": d["prefill_top_k"],
                          "features": d["features"], "rule": d["rule"]}
        return self._info

    # ------------------------------------------------------------------ decoding
    async def _decode(self, rid: str, dec: Decoding) -> AsyncIterator[list[int]]:
        """Request ``rid`` on the deployment that drives it, streamed from there: yields
        the tokens of each round; fills ``dec.stats``. On failure, an early close (a stop
        string, a gone client: Serve cancels this task) or the request's deadline both
        deployments free its state at once, and the stats are those of the rounds run."""
        info = await self._infos()
        drafting = info["drafting"]
        key = rid if self.colocated else target_key(rid, self.s["target_buckets"])
        req = DecodeRequest(dec.prompt_ids, dec.max_tokens, dec.sampling, dec.rule.to_dict(),
                            dec.seed, sorted(eos_set(info["eos"])), drafting, dec.logprobs,
                            dec.echo, self.s.get("budget", "fixed"), dec.hold_s).__dict__
        t0 = time.perf_counter()
        finished = False
        if drafting:
            response = self.draft.options(stream=True).generate.remote(rid, req)
        else:
            response = self._target("generate", stream=True).remote(key, rid, req)
        try:
            chunks = aiter(response)
            while True:
                try:
                    chunk = await _before(anext(chunks), dec.deadline)
                except StopAsyncIteration:
                    break
                except _DeadlinePassed:
                    dec.deadline_exceeded = True
                    break
                if "progress" in chunk:
                    dec.live.add(chunk["progress"])
                if "stats" in chunk:  # the last chunk: the request is done
                    dec.stats = chunk["stats"]
                    break
                if "prompt_logprobs" in chunk:
                    dec.prompt_logprobs = chunk["prompt_logprobs"]
                elif chunk["tokens"]:
                    dec.tokens += chunk["tokens"]
                    dec.token_logprobs += chunk.get("logprobs", [])
                    yield chunk["tokens"]
            finished = not dec.deadline_exceeded
        except (Exception, asyncio.CancelledError) as exc:
            if not isinstance(exc, Exception) and not downstream_cancel(exc):
                raise  # this request was cancelled (client gone), not a replica's task
            raise _replica_error(exc, f"request {rid}") from None
        finally:
            if not finished:
                response.cancel()
                if not dec.stats:  # ended early: the rounds that ran
                    dec.stats = dec.live.to_dict()
                    dec.stats["timing"] = {"ingress_s": time.perf_counter() - t0}
                    dec.stats["wall_s"] = dec.stats["timing"]["ingress_s"]
                # freed in the background: the reply (a deadline's) does not wait for
                # replicas that may be busy
                task = asyncio.ensure_future(self._end(rid, key, drafting))
                self._ending.add(task)
                task.add_done_callback(self._ending.discard)
        if dec.tokens and dec.tokens[-1] in eos_set(info["eos"]):
            dec.finish_reason = "stop"
        dec.stats.setdefault("timing", {})["ingress_s"] = time.perf_counter() - t0

    async def _end(self, rid: str, key: str, uses_draft: bool) -> None:
        calls = [(self._target("end"), (key, rid))] + (
            [(self.draft.end, (rid,))] if uses_draft else [])
        for end, args in calls:
            try:
                await end.remote(*args)
            except Exception:  # a dead replica took the state with it
                pass

    # ------------------------------------------------------------------ helpers
    def _encode(self, text: str, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise HTTPError(400, f"{param}: the target has no tokenizer; send prompt_ids to "
                                 "/generate", param)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise HTTPError(400, f"{param}: encodes to no tokens", param)
        return ids

    def _detok(self, token: int) -> str:
        """One token's own text (logprobs' ``tokens``): its decoded text, or, for a piece of
        a UTF-8 character (which decodes to U+FFFD alone), the tokenizer's token string,
        so different tokens keep different names; ``token_id:N`` without a tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        text = self.tokenizer.decode([token])
        return self.tokenizer.convert_ids_to_tokens(token) if "\ufffd" in text else text

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _decoding(self, ids: list[int], max_tokens: int, temperature: float,
                        top_p: float, top_k: int, seed: int, stops: list[str],
                        rule: str | None, rule_params: dict | None,
                        max_param: str = "max_tokens", logprobs: int | None = None,
                        echo: bool = False, prompt_param: str = "prompt",
                        timeout: float | None = None) -> Decoding:
        """A request's decoding parameters, checked against this server's bounds, the
        vocabulary and the rule registry (``rule`` / ``rule_params``: the request's
        ``verify`` / ``verify_params``; ``logprobs``: alternatives per token of the
        target's log-probs to report, None: none; ``echo``: the prompt's too); HTTPError
        400 names the field (``prompt_param``: the request's prompt field, for a request
        beyond the model's context length). ``timeout``: the seconds the request may
        decode from now, at most ``serve.request_timeout_s``; None: that bound alone."""
        if max_tokens > self.s["max_tokens"]:
            raise HTTPError(400, f"{max_param}: must be <= {self.s['max_tokens']} on this "
                                 f"server, got {max_tokens}", max_param)
        info = await self._infos()
        limit = min((x for x in (info.get("context"), self.s.get("max_model_len")) if x),
                    default=None)  # None: neither the model nor the server sets one
        if limit is not None and len(ids) + max_tokens > limit:
            raise HTTPError(400, f"{prompt_param}: this model's maximum context length is "
                                 f"{limit} tokens; the prompt has {len(ids)} tokens and "
                                 f"{max_param} asks for {max_tokens} more ({len(ids) + max_tokens}"
                                 " in all): shorten the prompt or lower "
                                 f"{max_param}", prompt_param, code="context_length_exceeded")
        if len(ids) + max_tokens > self.s["max_cached_tokens"]:
            raise HTTPError(400, f"{max_param}: the prompt's {len(ids)} tokens plus "
                                 f"{max_param}={max_tokens} exceed the "
                                 f"{self.s['max_cached_tokens']} positions a replica holds "
                                 f"(serve.max_cached_tokens)", max_param)
        bad = [t for t in ids if t >= info["vocab_size"]]
        if bad:
            raise HTTPError(400, f"prompt_ids: token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {info['vocab_size']})", "prompt_ids")
        try:
            sampling = SamplingParams(temperature, top_k, top_p)
        except ValueError as exc:
            raise HTTPError(400, str(exc), str(exc).split(":")[0]) from None
        needed = RuleSpec.from_dict(info["rule"]) if info["rule"] else None
        if needed is not None and rule_params:
            raise HTTPError(400, f"verify_params: this method's drafts are verified with the "
                                 f"{needed.name!r} rule and the method's own parameters; "
                                 "leave verify_params unset", "verify_params")
        try:
            spec = request_rule(rule, rule_params, sampling, needed)
        except ConfigError as exc:  # the rule's parameter model refused verify_params
            raise HTTPError(400, str(exc), "verify_params") from None
        except ValueError as exc:
            raise HTTPError(400, str(exc), "verify") from None
        limit_s = min((x for x in (timeout, self.s.get("request_timeout_s")) if x), default=None)
        return Decoding(ids, max_tokens, {"temperature": temperature, "top_k": top_k,
                                          "top_p": top_p}, spec, seed, stops, logprobs, echo,
                        deadline=None if limit_s is None else time.perf_counter() + limit_s)

    async def _run_text(self, rid: str, dec: Decoding, stream: bool) -> AsyncIterator[str]:
        """Text deltas per round (``stream``), cut at a stop string (not included; see
        :class:`serve_apps.stops.StopText`); a stop string or a gone client ends the
        request's rounds early and frees its states at once. A request neither streamed
        nor with stop strings gets its text decoded once, at the end, and its replica
        sends its rounds in chunks of up to :data:`HOLD_S` seconds (at a deadline, the
        reply holds the rounds that reached the ingress by then)."""
        if not stream and not dec.stops:
            dec.hold_s = HOLD_S
            async for _ in self._decode(rid, dec):
                pass
            yield self._text(dec.tokens)
            return
        text = StopText(self._text, dec.stops)
        async for delta in text.deltas(self._decode(rid, dec)):
            yield delta
        if text.stopped:
            dec.finish_reason, dec.tokens = "stop", list(text.tokens)

    async def _complete_text(self, route: str, rid: str, dec: Decoding) -> str:
        """The whole text of a non-streamed request (metrics recorded)."""
        t0 = time.perf_counter()
        text = "".join([d async for d in self._run_text(rid, dec, False)])
        self.metrics.request(route, time.perf_counter() - t0, dec.stats)
        return text

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.s["model_name"]:
            raise HTTPError(404, f"model: {model!r} is not served here (serving "
                                 f"{self.s['model_name']!r}, see /v1/models)", "model",
                            "not_found_error", "model_not_found")

    def _usage(self, dec: Decoding) -> dict:
        n_prompt, n_new = len(dec.prompt_ids), len(dec.tokens)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new,
                "total_tokens": n_prompt + n_new}

    def _sd(self, dec: Decoding) -> dict:
        """The ``speclab`` extension field: the request's SD statistics (with the rounds
        drafted ahead and their hits, :mod:`speclab.decoding.lookahead`)."""
        st = dec.stats
        timing = st.get("timing", {})
        return {"method": self.s["method"], "tau": st.get("tau", 0.0),
                "target_calls": st.get("target_calls", 0),
                "draft_calls": st.get("draft_calls", 0),
                "accepted_lengths": st.get("accepted_lengths", []),
                "acceptance_rate": st.get("acceptance_rate", 0.0),
                "ahead_rounds": timing.get("ahead_rounds", 0),
                "ahead_hits": timing.get("ahead_hits", 0),
                # each round's draft budget in levels (0: a plain round; serve.budget)
                "round_budgets": st.get("round_reach", []),
                "deadline_exceeded": dec.deadline_exceeded}

    def _metrics(self, dec: Decoding) -> dict:
        """``{"metrics": {"speculative_decoding": ...}}`` in vLLM's per-request schema
        (:mod:`serve_apps.spec_metrics`, ``serve.spec_decode_metrics``), or ``{}`` when
        that is ``none``."""
        level = self.s["spec_decode_metrics"]
        if level == "none":
            return {}
        return {"metrics": {"speculative_decoding": spec_decode_metrics(
            dec.stats, self.s["draft_length"], level, self.s["drafting"])}}

    def _events(self, route: str, rid: str, dec: Decoding, head: dict,
                choice: callable) -> StreamingResponse:
        """Server-sent events: ``choice(delta, finish_reason)`` per round, a chunk with
        the finish reason, then (as OpenAI and vLLM end a stream with usage) a chunk with
        ``"choices": []``, ``usage`` and the SD stats, then ``[DONE]``."""

        async def events() -> AsyncIterator[str]:
            t0 = time.perf_counter()
            try:
                async for delta in self._run_text(rid, dec, True):
                    yield "data: " + json.dumps({**head, "choices": [choice(delta, None)]}) + \
                        "\n\n"
                yield "data: " + json.dumps({**head, "choices": [choice("", dec.finish_reason)]}
                                            ) + "\n\n"
                yield "data: " + json.dumps({**head, "choices": [], "usage": self._usage(dec),
                                             **self._metrics(dec), "speclab": self._sd(dec)}
                                            ) + "\n\n"
                self.metrics.request(route, time.perf_counter() - t0, dec.stats)
            except HTTPError as exc:  # headers are sent: report in the stream (counted
                self.metrics.error(exc.status)  # here: the response's status is 200)
                yield "data: " + json.dumps(exc.body()) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ routes
    async def _replicas(self, stats, count: int) -> list[dict]:
        """Stats of every replica of a deployment (``stats``: its handle method): probes
        with 8 ids per replica are spread by the affinity router's hash (all replicas
        reached w.p. ~1 - n 2^-8n)."""
        seen = {}
        for i in range(8 * count):
            st = await stats.remote(f"probe-{i}")
            seen[st["pid"]] = st
        return list(seen.values())

    @api.get("/health", responses=_errors(503))
    async def health(self) -> dict:
        """Liveness plus every target and draft replica's live request states."""
        try:
            t = await self._replicas(self._target("stats"), self.s["replicas"]["target"])
            d = await self._replicas(self.draft.stats, self.s["replicas"]["draft"])
        except Exception as exc:
            raise _replica_error(exc, "health") from None
        return {"status": "ok", "method": self.s["method"], "target": t, "draft": d}

    @api.get("/metrics", response_class=PlainTextResponse)
    async def metrics_text(self) -> PlainTextResponse:
        """Prometheus text: this ingress replica's decoding counters under a standalone
        vLLM server's exact names (``vllm:spec_decode_num_drafts_total``, ...,
        ``vllm:e2e_request_latency_seconds``), so vLLM's Grafana dashboard reads them
        unchanged (open, like /health)."""
        return PlainTextResponse(self.metrics.vllm_text(),
                                 media_type="text/plain; version=0.0.4")

    @api.get("/v1/models", responses=_errors(401))
    async def models(self, request: Request) -> dict:
        """The one model this app serves (its name is ``serve.model_name``)."""
        self._auth(request)
        return {"object": "list", "data": [{
            "id": self.s["model_name"], "object": "model", "created": self.s["created"],
            "owned_by": "speclab", "method": self.s["method"]}]}

    @api.post("/generate", responses=_errors(400, 401, 503))
    async def generate(self, body: GenerateRequest, request: Request) -> dict:
        """Native decoding: text or token ids in; tokens, text and SD stats out."""
        self._auth(request)
        if (body.prompt is None) == (body.prompt_ids is None):
            raise HTTPError(400, "prompt: give exactly one of prompt or prompt_ids", "prompt")
        ids = self._encode(body.prompt) if body.prompt is not None else body.prompt_ids
        dec = await self._decoding(ids, body.max_tokens, body.temperature, body.top_p,
                                   body.top_k, body.seed, body.stop, body.verify,
                                   body.verify_params, prompt_param="prompt" if
                                   body.prompt is not None else "prompt_ids",
                                   timeout=body.timeout)
        rid = uuid.uuid4().hex
        text = await self._complete_text("generate", rid, dec)
        return {"id": rid, "text": text, "token_ids": dec.tokens,
                "finish_reason": dec.finish_reason, "method": self.s["method"],
                "deadline_exceeded": dec.deadline_exceeded, "stats": dec.stats}

    @api.post("/v1/completions", responses=_errors(400, 401, 404, 503))
    async def completions(self, body: CompletionRequest, request: Request):
        """OpenAI-compatible completion (``stream``: server-sent events per round)."""
        self._auth(request)
        self._check_model(body.model)
        ids = self._encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        dec = await self._decoding(ids, body.max_tokens, body.temperature, body.top_p, 0,
                                   body.seed if body.seed is not None else 0, body.stop,
                                   body.verify, body.verify_params, logprobs=body.logprobs,
                                   echo=bool(body.echo), timeout=body.timeout)
        rid = uuid.uuid4().hex
        head = {"id": f"cmpl-{rid}", "object": "text_completion",
                "created": int(time.time()), "model": self.s["model_name"]}
        echo = (body.prompt if isinstance(body.prompt, str) else self._text(ids)) \
            if body.echo else ""
        sent = {"first": True, "tokens": 0, "offset": 0}  # what earlier chunks carried

        def choice(text: str, finish: str | None) -> dict:
            """The prompt first (echo), then the text; with logprobs, those of the tokens
            received since the last chunk (the kept ones at the end)."""
            first, sent["first"] = sent["first"], False
            lps = None
            if dec.logprobs is not None:
                entries = dec.token_logprobs if finish is None else dec.kept_logprobs()
                new = entries[sent["tokens"]:]
                sent["tokens"] += len(new)
                if first and dec.echo:
                    sent["offset"] = len(echo)
                lps = completion_logprobs(new, self._detok, sent["offset"])
                if lps["tokens"]:
                    sent["offset"] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                if first and dec.echo:
                    lps = join_completion_logprobs(echoed_prompt_logprobs(
                        ids, dec.prompt_logprobs or [None], self._detok), lps)
            return {"text": echo + text if first else text, "index": 0, "logprobs": lps,
                    "finish_reason": finish}

        if body.stream:
            return self._events("completions", rid, dec, head, choice)
        text = await self._complete_text("completions", rid, dec)
        return {**head, "choices": [choice(text, dec.finish_reason)],
                "usage": self._usage(dec), **self._metrics(dec), "speclab": self._sd(dec)}

    @api.post("/v1/chat/completions", responses=_errors(400, 401, 404, 503))
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        """OpenAI-compatible chat completion: the messages through the target tokenizer's
        chat template (see :mod:`serve_apps.chat`); ``stream``: server-sent events."""
        self._auth(request)
        self._check_model(body.model)
        if self.tokenizer is None:
            raise HTTPError(400, "messages: the target has no tokenizer", "messages")
        try:
            prompt = chat_prompt(self.tokenizer, [m.for_template() for m in body.messages])
        except Exception as exc:  # the template refused the messages (e.g. role order)
            raise HTTPError(400, f"messages: the chat template refused them: {exc}",
                            "messages") from None
        if body.top_logprobs and not body.logprobs:
            raise HTTPError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        dec = await self._decoding(self._encode(prompt, "messages"), body.limit,
                                   body.temperature, body.top_p, 0,
                                   body.seed if body.seed is not None else 0, body.stop,
                                   body.verify, body.verify_params, param,
                                   logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                   prompt_param="messages", timeout=body.timeout)
        rid = uuid.uuid4().hex
        head = {"id": f"chatcmpl-{rid}", "created": int(time.time()),
                "model": self.s["model_name"]}
        sent = [0]  # tokens whose logprobs earlier chunks carried

        def logprobs(finish: str | None) -> dict | None:
            if dec.logprobs is None:
                return None
            entries = dec.token_logprobs if finish is None else dec.kept_logprobs()
            new, sent[0] = entries[sent[0]:], max(sent[0], len(entries))
            return chat_logprobs(new, self._detok)

        if body.stream:
            first = [True]

            def delta(text: str, finish: str | None) -> dict:
                d = {"content": text} if finish is None else {}
                if first[0]:
                    d, first[0] = {"role": "assistant", **d}, False
                return {"index": 0, "delta": d, "logprobs": logprobs(finish),
                        "finish_reason": finish}

            return self._events("chat", rid, dec, {**head, "object": "chat.completion.chunk"},
                                delta)
        text = await self._complete_text("chat", rid, dec)
        return {**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs(dec.finish_reason), "finish_reason": dec.finish_reason}],
            "usage": self._usage(dec), **self._metrics(dec), "speclab": self._sd(dec)}

    @api.post("/recommend", responses=_errors(400, 401, 404, 503))
    async def recommend(self, body: RecommendRequest, request: Request) -> dict:
        """AtSpeed beam SD, driven by the draft replica (one call from here, one target
        call per round there): the target's top-``k`` items (``verify: strict``) or
        ``k`` items by relaxed sampling."""
        self._auth(request)
        info = await self._infos()
        if not info["rec_items"]:
            raise HTTPError(404, "recommend: this app serves no recommender (set "
                                 "serve.rec_target and serve.rec_draft)", None,
                            "not_found_error")
        n = body.n or self.s["rec_n"]
        gamma = body.gamma or self.s["rec_gamma"]
        if body.k > n:
            raise HTTPError(400, f"k: must not exceed the draft beam size n={n}", "k")
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        try:
            res = await self.draft.rec_run.remote(rid, body.history, body.k, body.verify, n,
                                                  gamma, body.seed)
        except (Exception, asyncio.CancelledError) as exc:
            if not isinstance(exc, Exception) and not downstream_cancel(exc):
                raise  # this request was cancelled (client gone), not a replica's task
            err = _replica_error(exc, f"request {rid}: recommend")
            await self._end(rid, rid, True)  # a replica died mid-request: free the other
            raise err from None
        self.metrics.request("recommend", time.perf_counter() - t0, None)
        return {"id": rid, "items": res["items"], "scores": res["scores"],
                "stats": {"target_calls": res["target_calls"],
                          "accepted_steps": res["accepted_steps"], "n": n, "gamma": gamma,
                          "verify": body.verify, "wall_s": time.perf_counter() - t0}}
