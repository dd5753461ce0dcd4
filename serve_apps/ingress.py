"""The HTTP ingress: runs the draft -> verify loop of each request between the draft
and target deployments, and speaks an OpenAI-compatible API.

Routes: ``POST /v1/completions`` (``stream: true`` sends server-sent events),
``GET /v1/models``, ``POST /generate`` (tokens, text and the SD stats: tau, target and
draft calls, accepted lengths), ``POST /recommend`` (AtSpeed beam SD), ``GET /health``
(live request states and memory of every target and draft replica).

A request runs the engine's ONE round loop (:func:`speclab.decoding.loop.rounds`) with
the deployments as its two sides: the draft deployment commits the last verdict and
proposes a tree (wire form: token ids, parent indices, draft probabilities); the target
deployment verifies it in ONE forward and returns the accepted path and new tokens.
Stats (tau, draft/verify seconds as seen from here) are the loop's own.
Every handle call is awaited, so a request waiting on a replica never blocks the
others. Bad input -> 4xx JSON ``{"error": {"message", "type", "param"}}`` naming the
field; a replica failure or a lost request state -> 503; the request's state on both
deployments is freed when it ends, fails or its client goes away.
"""


import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from serve_apps.beams import beams_from_wire, beams_to_wire
from serve_apps.protocol import CompletionRequest, GenerateRequest, RecommendRequest
from speclab.decoding.beam import BeamSDStats
from speclab.decoding.beam_loop import BeamPropose, beam_rounds
from speclab.decoding.loop import (
    Committed,
    GenerationStats,
    Proposal,
    Propose,
    Start,
    Verify,
    VerifyResult,
    eos_set,
    rounds,
)
from speclab.decoding.rules import RuleSpec, request_rule
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import pack_tensor

api = FastAPI(title="speclab")


class HTTPError(Exception):
    """An error answered as JSON with ``status``; ``param`` names the bad field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param}})


@api.exception_handler(RequestValidationError)
async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = f"{param}: {first['msg']}" if param else str(first["msg"])
    return HTTPError(400, msg, param).response()


@api.exception_handler(HTTPError)
async def _http_error(_request: Request, exc: HTTPError) -> JSONResponse:
    return exc.response()


@api.exception_handler(Exception)
async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", None,
                     "internal_error").response()


def _replica_error(exc: Exception, what: str) -> HTTPError:
    """A replica call failed: the caller's fault (ValueError: 400) or not (503)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    if isinstance(exc, ValueError):
        return HTTPError(400, text)
    return HTTPError(503, f"{what}: {text}", kind="service_unavailable")


@dataclass
class Decoding:
    """One request's decoding parameters, as the loop needs them."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: dict
    rule: RuleSpec
    seed: int
    stops: list[str]
    stats: GenerationStats = field(default_factory=GenerationStats)
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str = "length"


@serve.ingress(api)
class Ingress:
    """Holds handles to the target and draft deployments; see the module docstring."""

    def __init__(self, target, draft, settings: dict) -> None:
        from speclab.models.loading import load_tokenizer

        self.target, self.draft = target, draft
        self.s = settings
        self.tokenizer = load_tokenizer(settings["target_path"], field="models.target")
        self._info: dict | None = None

    async def _infos(self) -> dict:
        if self._info is None:
            t = await self.target.info.remote()
            d = await self.draft.info.remote()
            self._info = {**t, "drafting": d["drafting"], "prefill_top_k": d["prefill_top_k"],
                          "features": d["features"], "rule": d["rule"]}
        return self._info

    # ------------------------------------------------------------------ the SD loop
    async def _decode(self, rid: str, dec: Decoding) -> AsyncIterator[list[int]]:
        """Run request ``rid`` through the engine's round loop, awaiting the deployments
        as its sides; yields the tokens committed by each round (cut at EOS or
        ``max_tokens``); fills ``dec.stats``. Both states are freed at the end."""
        info = await self._infos()
        eos = eos_set(info["eos"])
        drafting = info["drafting"]
        loop = rounds(dec.prompt_ids, dec.max_tokens, eos, dec.stats, drafting)
        reply = None
        try:
            while True:
                try:
                    msg = loop.send(reply)
                except StopIteration:
                    return
                reply = None
                if isinstance(msg, Committed):
                    dec.tokens += msg.tokens
                    if msg.done and dec.tokens and dec.tokens[-1] in eos:
                        dec.finish_reason = "stop"
                    yield msg.tokens
                    continue
                try:
                    reply = await self._side_call(rid, dec, msg, drafting, info)
                except Exception as exc:
                    where = ("start" if isinstance(msg, Start) else
                             f"round {len(dec.stats.accepted_lengths) + 1}")
                    raise _replica_error(exc, f"request {rid}: {where}") from None
        finally:
            loop.close()
            await self._end(rid, drafting)

    async def _side_call(self, rid: str, dec: Decoding, msg, drafting: bool, info: dict):
        """One request of the loop to a side (a deployment handle call)."""
        if isinstance(msg, Start):
            pre = await self.target.start.remote(rid, dec.prompt_ids, dec.sampling,
                                                 dec.rule.to_dict(), dec.seed,
                                                 info["prefill_top_k"] if drafting else 0,
                                                 drafting and info["features"])
            if drafting:
                await self.draft.start.remote(rid, dec.prompt_ids, pre["top"], dec.sampling,
                                              dec.seed, pre["features"])
            return None
        if isinstance(msg, Propose):
            r = await self.draft.propose.remote(rid, msg.path, msg.new, msg.budget,
                                                pack_tensor(msg.features))
            return Proposal(r["tree"], r["draft_calls"])
        if isinstance(msg, Verify):
            return VerifyResult.from_dict(await self.target.verify.remote(rid, msg.tree))
        raise TypeError(f"unknown loop message {msg!r}")

    async def _end(self, rid: str, uses_draft: bool) -> None:
        for handle in ([self.target, self.draft] if uses_draft else [self.target]):
            try:
                await handle.end.remote(rid)
            except Exception:  # a dead replica took the state with it
                pass

    # ------------------------------------------------------------------ helpers
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise HTTPError(400, "prompt: the target has no tokenizer; send prompt_ids to "
                                 "/generate", "prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise HTTPError(400, "prompt: encodes to no tokens", "prompt")
        return ids

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _decoding(self, ids: list[int], max_tokens: int, temperature: float,
                        top_p: float, top_k: int, seed: int, stops: list[str],
                        rule: str | None) -> Decoding:
        if max_tokens > self.s["max_tokens"]:
            raise HTTPError(400, f"max_tokens: must be <= {self.s['max_tokens']} on this "
                                 f"server, got {max_tokens}", "max_tokens")
        try:
            sampling = SamplingParams(temperature, top_k, top_p)
        except ValueError as exc:
            raise HTTPError(400, str(exc), str(exc).split(":")[0]) from None
        info = await self._infos()
        needed = RuleSpec.from_dict(info["rule"]) if info["rule"] else None
        try:
            spec = request_rule(rule, None, sampling, needed)
        except ValueError as exc:
            raise HTTPError(400, str(exc), "verify") from None
        return Decoding(ids, max_tokens, {"temperature": temperature, "top_k": top_k,
                                          "top_p": top_p}, spec, seed, stops)

    async def _run_text(self, rid: str, dec: Decoding) -> AsyncIterator[str]:
        """Text deltas per round; stops at a stop string (not included). Text that may
        still become a stop string or an incomplete character is held back."""
        out, sent = [], 0
        hold = max((len(s) for s in dec.stops), default=1) - 1
        rounds = self._decode(rid, dec)
        try:
            async for new in rounds:
                out += new
                text = self._text(out)
                cut = min((i for i in (text.find(s) for s in dec.stops) if i >= 0),
                          default=-1)
                if cut >= 0:
                    dec.finish_reason = "stop"
                    if cut > sent:
                        yield text[sent:cut]
                    return
                safe = len(text) - hold
                while safe > sent and text[safe - 1] == "\ufffd":
                    safe -= 1
                if safe > sent:
                    yield text[sent:safe]
                    sent = safe
        finally:  # a stop string or a gone client ends the loop early: free the states now
            await rounds.aclose()
        text = self._text(out)
        if len(text) > sent:
            yield text[sent:]

    # ------------------------------------------------------------------ routes
    async def _replicas(self, handle, count: int) -> list[dict]:
        """Stats of every replica of a deployment: probes with 8 ids per replica are
        spread by the affinity router's hash (all replicas reached w.p. ~1 - n 2^-8n)."""
        seen = {}
        for i in range(8 * count):
            st = await handle.stats.remote(f"probe-{i}")
            seen[st["pid"]] = st
        return list(seen.values())

    @api.get("/health")
    async def health(self) -> dict:
        """Liveness plus every target and draft replica's live request states."""
        try:
            t = await self._replicas(self.target, self.s["replicas"]["target"])
            d = await self._replicas(self.draft, self.s["replicas"]["draft"])
        except Exception as exc:
            raise _replica_error(exc, "health") from None
        return {"status": "ok", "method": self.s["method"], "target": t, "draft": d}

    @api.get("/v1/models")
    async def models(self) -> dict:
        """The one model this app serves (its name is ``serve.model_name``)."""
        return {"object": "list", "data": [{
            "id": self.s["model_name"], "object": "model", "created": self.s["created"],
            "owned_by": "speclab", "method": self.s["method"]}]}

    @api.post("/generate")
    async def generate(self, body: GenerateRequest) -> dict:
        """Native decoding: text or token ids in; tokens, text and SD stats out."""
        if (body.prompt is None) == (body.prompt_ids is None):
            raise HTTPError(400, "prompt: give exactly one of prompt or prompt_ids", "prompt")
        ids = self._encode(body.prompt) if body.prompt is not None else body.prompt_ids
        dec = await self._decoding(ids, body.max_tokens, body.temperature, body.top_p, body.top_k,
                             body.seed, body.stop, body.verify)
        rid = uuid.uuid4().hex
        text = "".join([d async for d in self._run_text(rid, dec)])
        return {"id": rid, "text": text, "token_ids": dec.tokens,
                "finish_reason": dec.finish_reason, "method": self.s["method"],
                "stats": dec.stats.to_dict()}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        """OpenAI-compatible completion (``stream``: server-sent events per round)."""
        if body.model is not None and body.model != self.s["model_name"]:
            raise HTTPError(404, f"model: {body.model!r} is not served here (serving "
                                 f"{self.s['model_name']!r}, see /v1/models)", "model",
                            "not_found_error")
        dec = await self._decoding(self._encode(body.prompt), body.max_tokens, body.temperature,
                             body.top_p, 0, body.seed if body.seed is not None else 0,
                             body.stop, None)
        rid = uuid.uuid4().hex
        head = {"id": f"cmpl-{rid}", "object": "text_completion",
                "created": int(time.time()), "model": self.s["model_name"]}
        if not body.stream:
            text = "".join([d async for d in self._run_text(rid, dec)])
            n_prompt = len(dec.prompt_ids)
            return {**head, "choices": [{"text": text, "index": 0, "logprobs": None,
                                         "finish_reason": dec.finish_reason}],
                    "usage": {"prompt_tokens": n_prompt,
                              "completion_tokens": dec.stats.new_tokens,
                              "total_tokens": n_prompt + dec.stats.new_tokens}}

        async def events() -> AsyncIterator[str]:
            try:
                async for delta in self._run_text(rid, dec):
                    yield "data: " + json.dumps({**head, "choices": [{
                        "text": delta, "index": 0, "logprobs": None,
                        "finish_reason": None}]}) + "\n\n"
                yield "data: " + json.dumps({**head, "choices": [{
                    "text": "", "index": 0, "logprobs": None,
                    "finish_reason": dec.finish_reason}]}) + "\n\n"
            except HTTPError as exc:  # headers are sent: report in the stream
                yield "data: " + json.dumps({"error": {"message": exc.message,
                                                       "type": exc.kind}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/recommend")
    async def recommend(self, body: RecommendRequest) -> dict:
        """AtSpeed beam SD between the deployments (the engine's beam loop): the target's
        top-``k`` items (``verify: strict``) or ``k`` items by relaxed sampling."""
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
        stats = BeamSDStats()
        loop = beam_rounds(info["rec_levels"], gamma, stats)
        res: dict = {}
        try:
            try:
                prompt = await self.target.rec_start.remote(rid, body.history, body.k,
                                                            body.verify, body.seed)
                await self.draft.rec_start.remote(rid, prompt, body.verify, n, body.seed)
                reply = None
                while True:
                    try:
                        msg = loop.send(reply)
                    except StopIteration:
                        break
                    committed = beams_to_wire(msg.committed)
                    if isinstance(msg, BeamPropose):
                        reply = await self.draft.rec_draft.remote(rid, committed, msg.g)
                    else:
                        res = await self.target.rec_verify.remote(rid, msg.proposal, committed)
                        reply = (beams_from_wire(res["committed"]), res["accepted"])
            except Exception as exc:
                raise _replica_error(exc, f"request {rid}: recommend") from None
        finally:
            loop.close()
            await self._end(rid, True)
        return {"id": rid, "items": res["items"], "scores": res["scores"],
                "stats": {"target_calls": stats.target_calls,
                          "accepted_steps": stats.accepted_steps, "n": n, "gamma": gamma,
                          "verify": body.verify, "wall_s": time.perf_counter() - t0}}
