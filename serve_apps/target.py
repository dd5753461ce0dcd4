"""``TargetDeployment``: the target model over ONE batched cache holding every live
request of the replica (:class:`~speclab.decoding.row_pool.TargetPool`), and the
verification rules.

Calls (first argument: the routing key, see :func:`serve_apps.router.target_key`):

* ``start_rows`` / ``verify_rows``: a draft replica's half of a round for several of its
  requests at once (prefill; one forward over every tree). Calls from several draft
  replicas that arrive together are merged into one batch by the replica's
  :class:`~serve_apps.batcher.StepBatcher`. A draft replica on the same node makes these
  calls (and ``end``) over a Unix socket (``channel``, :mod:`serve_apps.channel`).
* ``generate``: plain decoding (no draft), streamed and driven here: the rounds of all
  concurrent requests share one forward.
* ``end``, ``stats``, ``info``; ``rec_start`` / ``rec_verify`` are the target's half of
  AtSpeed beam SD for ``POST /recommend``, called by the draft replica that drives the
  request (:mod:`serve_apps.beams`).

Results are per request: a request the replica no longer holds (ended, expired,
evicted) gets an error entry, the others their verdicts. State is bounded by
:class:`serve_apps.sessions.SessionStore`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from serve_apps.batcher import AGAIN, StepBatcher
from serve_apps.beams import RecTargetSide
from serve_apps.channel import ChannelServer
from serve_apps.decode import DecodeRequest, Timing, stream_rounds
from serve_apps.errors import request_error
from serve_apps.metrics import ServeMetrics
from serve_apps.sessions import PoolRow, RequestStates, SessionGone
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.loop import Start, Verify
from speclab.decoding.row_pool import (
    NewRow,
    TargetPool,
    generator_state,
    seeded,
    set_generator_state,
)
from speclab.decoding.rules import RuleSpec
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import VerifyResult, check_prompt
from speclab.decoding.wire import pack_tensor
from speclab.models.loading import context_length, load_model
from speclab.timing import now, split_forward_time

_KEYS = itertools.count()


@dataclass(eq=False)
class _Starts:
    source: str
    rows: list[dict]
    prefill_top_k: int
    features: bool | list | str  # serve_apps.draft.features_wire
    key: int = field(default_factory=lambda: next(_KEYS))  # its replies while prefilling


@dataclass
class _Verifies:
    source: str
    items: list[tuple]  # (rid, wire tree or None[, rng state bytes or None])


def row_error(exc: Exception) -> dict:
    """A per-request error entry: ``gone`` (no state here), ``invalid`` (bad input) or
    ``failed`` (this request's step raised)."""
    kind = ("gone" if isinstance(exc, SessionGone | KeyError) else
            "invalid" if isinstance(exc, ValueError) else "failed")
    return {"error": {"kind": kind, "message": str(exc)}}


class TargetDeployment(RequestStates):
    """Holds the target; see the module docstring."""

    def __init__(self, target: str, dtype: str = "float32", device: str = "cpu",
                 max_sessions: int = 64, max_cached_tokens: int = 65536,
                 idle_timeout_s: float = 60.0, rec_target: str | None = None,
                 max_batch: int = 64, batch_wait_ms: float = 5.0,
                 torch_threads: int = 1, attn_implementation: str = "auto",
                 prefill_chunk: int | None = None) -> None:
        torch.set_num_threads(torch_threads)
        #: prompt tokens a batch step prefills (chunked prefill; None: whole prompts)
        self.prefill_chunk = prefill_chunk
        self._waiting: dict[int, list] = {}  # a start step's replies, while it prefills
        self._pending: dict[str, tuple[_Starts, int]] = {}  # prefilling rid -> step, row
        self.model = load_model(target, dtype, device, "models.target", attn_implementation)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen is not None else None
        self.eos = eos if eos is not None else self.model.config.eos_token_id
        self.vocab = int(self.model.config.vocab_size)
        self.context = context_length(self.model.config)  # None: no position limit
        super().__init__(max_sessions, max_cached_tokens, idle_timeout_s)
        self.pool = TargetPool(BatchRunner(self.model))
        self.sources: dict[str, str] = {}  # request id -> who drives it
        self.metrics = ServeMetrics()
        self.batcher = StepBatcher(self._run, self._expected, max_batch, batch_wait_ms / 1e3,
                                   self.metrics.batch, dropped=self._dropped)
        self.channel_server = ChannelServer(self._channel_op)
        self.rec = None
        if rec_target:
            self.rec = RecTargetSide(rec_target, dtype, device)

    async def info(self) -> dict:
        """Vocabulary size, EOS id(s), context length (positions; None: unlimited), the
        recommender's items and id length (if any)."""
        return {"vocab_size": self.vocab, "eos": self.eos, "context": self.context,
                "rec_items": len(self.rec.meta.items) if self.rec else 0,
                "rec_levels": self.rec.trie.length if self.rec else 0}

    # ------------------------------------------------------------------ batched work
    def _expected(self) -> int:
        return len(set(self.sources.values()))

    async def _run(self, steps: list) -> list:
        """One batch: the joining rows of each start call, then every tree of every verify
        call in ONE forward. A joining prompt no longer than that forward's widest tree
        rides in it as one more row; the others are prefilled in one forward before it
        (all of them, when the batch verifies nothing). With ``prefill_chunk``, a prompt
        enters the cache at most that many tokens per batch (its first chunk when it
        joins, then one forward per batch feeds the prefilling rows ``prefill_chunk``
        tokens in all), so a long prompt never holds the other requests' rounds for more
        than a chunk; its start call answers (:data:`AGAIN` until then) once its rows are
        in."""
        out: list = [None] * len(steps)
        starts = [i for i, s in enumerate(steps) if isinstance(s, _Starts)]
        verifies = [i for i, s in enumerate(steps) if isinstance(s, _Verifies)]
        for i in starts:
            if steps[i].key not in self._waiting:
                self._waiting[steps[i].key] = self._start(steps[i], ride=bool(verifies))
        if self.pool.prefilling:
            for rid, p in self.pool.prefill_step(self.prefill_chunk or 1).items():
                self._answer(rid, p)
        if verifies:
            t0 = now(self.pool.runner.device)
            flat: list[tuple[int, int, str, dict | None, bytes | None]] = []
            for i in verifies:
                out[i] = [None] * len(steps[i].items)
                for j, (rid, tree, rng, *_) in enumerate(
                        (*item, None) for item in steps[i].items):
                    try:
                        self.sessions.get(rid)  # marks it used; SessionGone if not here
                        # a sampled request's rng arrives from the replica driving it
                        set_generator_state(self.pool.generator(rid), rng)
                        flat.append((i, j, rid, tree, rng))
                    except (SessionGone, KeyError) as exc:
                        out[i][j] = row_error(exc)
            results, model_s, _ = split_forward_time(
                self.pool.runner,
                lambda: self.pool.verify([(rid, tree) for _, _, rid, tree, _ in flat])
                if flat else [])
            # the forward alone vs. the rest of the batch's step (session look-ups, trees
            # from the wire, masks, each row's rule and pruning)
            rule_s = max(now(self.pool.runner.device) - t0 - model_s, 0.0)
            for (i, j, rid, _tree, rng), res in zip(flat, results, strict=True):
                if isinstance(res, Exception):  # this request's failure, not the batch's
                    out[i][j] = row_error(res)
                    continue
                out[i][j] = {"verdict": res.to_dict(), "target_model_s": model_s,
                             "target_rule_s": rule_s, "rows": len(flat),
                             "rng": None if rng is None else
                             generator_state(self.pool.generator(rid))}
        self.pool.settle()  # the joining rows no verify forward took
        for rid, p in self.pool.take_ridden().items():
            self._answer(rid, p)
        for i in starts:
            replies = self._waiting[steps[i].key]
            out[i] = AGAIN if any(r is None for r in replies) else \
                self._waiting.pop(steps[i].key)
        return out

    def _answer(self, rid: str, p) -> None:
        """Row ``rid``'s prompt is in: its place in its start call's replies."""
        step, j = self._pending.pop(rid)
        if step.key in self._waiting:
            self._waiting[step.key][j] = self._started(step, rid, p)

    def _start(self, step: _Starts, ride: bool = False) -> list[dict]:
        """A start call's rows join (``ride``: their prefill waits for this batch's verify
        forward, :meth:`TargetPool.start`); their replies, None where still to come."""
        rows, replies = [], [None] * len(step.rows)
        for j, r in enumerate(step.rows):
            try:
                check_prompt(r["prompt_ids"], self.vocab)
                rows.append((j, NewRow(r["rid"], list(r["prompt_ids"]),
                                       SamplingParams(**r["sampling"]),
                                       RuleSpec.from_dict(r["rule"]), seeded(r["seed"]),
                                       logprobs=r.get("logprobs"),
                                       echo=bool(r.get("echo")))))
            except (ValueError, TypeError, KeyError) as exc:
                replies[j] = row_error(ValueError(str(exc)))
        spec = None if step.features is True else step.features  # True: the last layer's
        if step.features:
            try:  # hooks for layers not tracked yet (an EAGLE-3 drafter's)
                self.pool.track_features(spec)
            except (ValueError, TypeError) as exc:
                return [row_error(ValueError(f"features: {exc}")) for _ in step.rows]
        started = (self.pool.start([r for _, r in rows], step.prefill_top_k,
                                   spec if step.features else True, self.prefill_chunk,
                                   ride=ride)
                   if rows else [])
        for (j, row), p in zip(rows, started, strict=True):
            if p is None:  # still prefilling: answered by a later batch
                self._pending[row.rid] = (step, j)
            else:
                replies[j] = self._started(step, row.rid, p)
        return replies

    def _started(self, step: _Starts, rid: str, p) -> dict:
        """A row whose prompt is in: it becomes a session; its start reply."""
        self.sources[rid] = step.source
        self.sessions.put(rid, PoolRow(self.pool, rid), release_old=False)
        return {"top": p.top, "prompt_logprobs": p.prompt_logprobs,
                "features": pack_tensor(p.features) if step.features else None}

    def _dropped(self, step) -> None:
        """A start call whose caller went away while its rows prefilled: they leave."""
        if isinstance(step, _Starts) and self._waiting.pop(step.key, None) is not None:
            for rid in [r for r, (s, _) in self._pending.items() if s is step]:
                self._pending.pop(rid)
                self.pool.end(rid)

    def _forget(self, rid: str) -> bool:
        self.sources.pop(rid, None)
        pending = self._pending.pop(rid, None)
        if pending is not None:  # ended while prefilling: its start reply says so
            step, j = pending
            self.pool.end(rid)
            if step.key in self._waiting:
                self._waiting[step.key][j] = row_error(SessionGone(f"request {rid} ended"))
            return True
        return self.sessions.end(rid)

    # ------------------------------------------------------------------ a draft replica's calls
    async def start_rows(self, key: str, source: str, rows: list[dict], prefill_top_k: int = 0,
                         features: bool | list | str = False) -> list[dict]:
        """Prefill new requests (``rows``: ``rid``, ``prompt_ids``, ``sampling``, ``rule``,
        ``seed``) of ``source`` (the calling draft replica). Per row ``top``: the
        ``prefill_top_k`` best tokens per prompt position (AASD) and ``features``: the
        prefill's packed ``[P-1, F]`` features (feature drafters: ``features`` True for the
        last layer's, a list of layers or ``"eagle3"`` for EAGLE-3's fused ones, returned
        with every verdict too), or an ``error`` entry."""
        return await self.batcher.submit(_Starts(source, rows, prefill_top_k, features), source)

    async def verify_rows(self, key: str, source: str, items: list) -> list[dict]:
        """One round of several requests: per ``(rid, tree)`` (wire form; None: the root
        alone) ``{"verdict"}`` (a :class:`VerifyResult` dict) with ``target_model_s`` (the
        batch's target forward alone, the runner's own synchronised clock),
        ``target_rule_s`` (the rest of the batch's verify step here: session look-ups,
        trees from the wire, masks, every row's rule and pruning) and ``rows`` (the
        requests in it), or an ``error`` entry."""
        return await self.batcher.submit(_Verifies(source, [tuple(i) for i in items]), source)

    async def end(self, key: str, rid: str) -> bool:
        """Free request ``rid``'s row (False if it was already gone)."""
        return self._forget(rid)

    async def calibration(self, key: str, rows: int) -> dict:
        """The target's forward cost curves up to ``rows`` rows
        (:func:`speclab.calibration.model_calibration`: stored, else measured now while
        this replica waits, and stored), for a draft replica's ``auto`` budget."""
        from speclab.calibration import model_calibration

        return model_calibration(self.model, max(int(rows), 1)).to_dict()

    async def channel(self, key: str) -> dict:
        """Where this replica answers the three calls above directly
        (:mod:`serve_apps.channel`): a Unix socket ``path``, ``secret`` and ``node``."""
        import ray

        return {**await self.channel_server.address(),
                "node": ray.get_runtime_context().get_node_id()}

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        if getattr(self, "channel_server", None) is not None:
            self.channel_server.remove()

    async def _channel_op(self, op: str, args: tuple) -> object:
        if op not in ("start_rows", "verify_rows", "end"):
            raise ValueError(f"channel: unknown call {op!r}")
        return await getattr(self, op)(*args)

    # ------------------------------------------------------------------ plain decoding
    async def generate(self, key: str, rid: str, request: dict) -> AsyncIterator[dict]:
        """Plain decoding driven here, streamed: ``{"tokens"}`` per round, then
        ``{"stats"}``."""
        req = DecodeRequest.from_dict(request)
        timing = Timing()

        async def step(msg):
            if isinstance(msg, Start):
                row = req.target_row(rid)
                reply = (await self.batcher.submit(_Starts(rid, [row], 0, False), rid))[0]
            else:
                assert isinstance(msg, Verify)
                t0 = time.perf_counter()
                reply = (await self.batcher.submit(_Verifies(rid, [(rid, None)]), rid))[0]
                step_s = time.perf_counter() - t0
                if "error" not in reply:  # no hop here: the call is the batch's step
                    model_s, rule_s = reply["target_model_s"], reply["target_rule_s"]
                    timing.add({"queue_s": max(step_s - model_s - rule_s, 0.0),
                                "target_call_s": model_s + rule_s, "target_model_s": model_s,
                                "target_rule_s": rule_s, "rows": reply["rows"]})
            if "error" in reply:
                raise request_error(rid, reply["error"])
            return VerifyResult.from_dict(reply["verdict"]) if isinstance(msg, Verify) else reply

        try:
            async for chunk in stream_rounds(req, step, timing):
                yield chunk
        finally:
            self._forget(rid)

    # ------------------------------------------------------------------ recommend
    async def rec_start(self, rid: str, history: list[int], k: int, mode: str = "strict",
                        seed: int = 0) -> dict:
        """``POST /recommend`` (called by the draft replica that drives it): prefill the
        history's prompt; returns its tokens (``prompt``) and the item ids' length
        (``levels``: the rounds end once the beams are that long)."""
        if self.rec is None:
            raise ValueError("recommend: this app serves no recommender (serve.rec_target)")
        side, prompt = self.rec.start(history, k, mode, seed)
        self.sessions.put(rid, side)
        return {"prompt": prompt, "levels": self.rec.trie.length}

    async def rec_verify(self, rid: str, proposal: dict, committed: list) -> dict:
        """Verification (strict top-K or relaxed sampling) of one round of drafted levels;
        the request's state is freed with its last round (``done``)."""
        out = self.rec.verify(self.sessions.get(rid), proposal, committed)
        if out["done"]:
            self.sessions.end(rid)
        return out
