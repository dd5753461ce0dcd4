"""``DraftDeployment``: the draft side of any registered method, and the replica that
DRIVES each drafting request's rounds.

A request reaches this replica once (``generate``: streamed rounds), routed by its id
(:mod:`serve_apps.router`). Its round loop (:func:`serve_apps.decode.stream_rounds`) runs
here: the proposal is local, and the
target is ONE call per round and target routing key for every request of this replica
that is ready (its :class:`~serve_apps.batcher.StepBatcher` collects them): one batched draft pass
(:class:`~speclab.decoding.row_pool.DraftPool`: batched chain / EAGLE-2 / optimal / SALF
drafting, else one drafter per row), then ``verify_rows`` on the target with every tree.
Requests go to target replicas in ``buckets`` routing keys (:func:`serve_apps.router.
target_key`). The draft model and the method's resources (an acceptance head, a
datastore) are loaded once per replica. ``POST /recommend`` is driven here too
(``rec_run``): AtSpeed beam SD rounds next to the drafter recommender, one target call
per round (:mod:`serve_apps.beams`).
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from serve_apps.batcher import StepBatcher
from serve_apps.channel import ChannelClient, ChannelError
from serve_apps.decode import DecodeRequest, Timing, stream_rounds
from serve_apps.errors import request_error
from serve_apps.metrics import ServeMetrics
from serve_apps.router import target_key
from serve_apps.sessions import PoolRow, RequestStates, SessionGone
from speclab.config.method import parse_method
from speclab.decoding.budget import AutoBudget, RoundCosts
from speclab.decoding.drafting import BatchDrafter
from speclab.decoding.lookahead import AheadTrial
from speclab.decoding.loop import Propose, Start, Verify
from speclab.decoding.row_pool import (
    DraftPool,
    NewRow,
    generator_state,
    seeded,
    set_generator_state,
)
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import DraftSide, Proposal, VerifyResult
from speclab.decoding.wire import unpack_tensor
from speclab.drafters.registry import BuildContext, build_drafter, make_batch_drafter
from speclab.families.registry import families
from speclab.families.spec import load
from speclab.models.loading import DTYPES, load_model, resolve_device


@dataclass
class _Join:
    rid: str
    key: str
    req: DecodeRequest


@dataclass
class _Round:
    rid: str
    key: str
    path: list[int] | None
    new: list[int]
    budget: int
    features: torch.Tensor | None
    skip: bool = False  # a round without a draft: the target verifies the root alone


def features_wire(traits) -> bool | list | str:
    """The features a method's drafter asks the target for, as they travel in
    ``start_rows``: False (none), True (the last layer's) or an EAGLE-3 drafter's layers
    (a list of hidden-state indices, or ``"eagle3"``: the paper's default)."""
    if not traits.needs_features:
        return False
    spec = traits.feature_layers
    return True if spec is None else spec if isinstance(spec, str) else list(spec)


def check_feature_drafters(resources: dict, target_vocab: int,
                           target_source: str | None = None) -> None:
    """At load, refuse a trained family's artifact (loaded into ``resources``: an EAGLE
    drafter, Medusa heads, a plugin's) that was not trained for the target, with the
    check its family declares (``check_artifact``; a ValueError naming the method field,
    e.g. ``eagle_model``): with the target's folder ``target_source``, against its HF
    config (and what else the family reads there: Medusa's LM-head fingerprint);
    without it, the vocabulary (``target_vocab``) alone."""
    checks = [f for f in families().values() if f.is_artifact and f.check_artifact]
    found = [(m, f) for m in resources.values() for f in checks if load(f.is_artifact)(m)]
    if not found:
        return
    config = None
    if target_source is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(target_source, trust_remote_code=False)
    for model, fam in found:
        fam.call("check_artifact", model, config, fam.artifact_field, target_source,
                 target_vocab)


class DraftDeployment(RequestStates):
    """Holds the draft side of one method (``method``: a method config dump; ``plugins``:
    modules to import first, for methods registered outside speclab) and a handle to the
    target deployment. ``target_source``: the target's local folder, which a feature
    drafter (EAGLE, Medusa, a family's) is checked against at load
    (:func:`check_feature_drafters`)."""

    def __init__(self, target, draft: str | None, method: dict, target_vocab: int,
                 dtype: str = "float32", device: str = "cpu", max_sessions: int = 64,
                 max_cached_tokens: int = 65536, idle_timeout_s: float = 60.0,
                 rec_draft: str | None = None, plugins: list[str] | None = None,
                 max_batch: int = 64, batch_wait_ms: float = 5.0, torch_threads: int = 1,
                 buckets: int = 1, direct_rounds: bool = True,
                 attn_implementation: str = "auto", target_source: str | None = None,
                 draft_ahead: bool = True, ahead_warmup: int = 8,
                 ahead_min_hit_rate: float = 0.2) -> None:
        torch.set_num_threads(torch_threads)
        self.max_batch = max_batch
        self._budget: AutoBudget | None = None  # the auto requests' (on the first one)
        self._budget_lock = asyncio.Lock()  # concurrent first requests build it once
        self._auto: set[str] = set()  # requests decoding with an auto budget
        for module in plugins or []:
            importlib.import_module(module)
        self.target = target
        self.buckets = buckets
        self.source = uuid.uuid4().hex  # who this replica is to the target's batcher
        self.cfg = parse_method(method)
        self.method = self.cfg.name
        self.model = None
        self.device, self.dtype = resolve_device(device), dtype  # feature drafters' too
        if self.cfg.needs_draft_model:
            if draft is None:
                raise ValueError(f"models.draft: method {self.method!r} needs a draft model")
            self.model = load_model(draft, dtype, device, "models.draft", attn_implementation)
            vocab = int(self.model.config.vocab_size)
            if vocab != target_vocab:
                raise ValueError(f"models.draft: vocab_size {vocab} != target's {target_vocab}")
        self.resources: dict = {}  # the method's head / datastore, loaded once here
        traits = self.cfg.traits()  # declared by the method's config
        self.drafting = traits.drafting  # False: plain decoding (the empty drafter)
        self.prefill_top_k = traits.prefill_top_k
        # what the target returns with each verdict: False, True (the last layer's
        # features) or the layers an EAGLE-3 drafter fuses (a list, or "eagle3")
        self.features = features_wire(traits)
        self.rule = traits.rule.to_dict() if traits.rule else None
        super().__init__(max_sessions, max_cached_tokens, idle_timeout_s)
        self.pool = DraftPool(self._make, ahead_warmup, ahead_min_hit_rate)
        # draft each request's next round while the target verifies this one
        # (speclab.decoding.lookahead), for greedy requests of a rewindable drafter
        self.draft_ahead = draft_ahead
        self.trial = AheadTrial()  # with or without, measured in turns on this replica
        self._draft_row_s = 0.0
        if self.drafting:  # a drafter it cannot build (heads, datastore) fails the deploy
            DraftSide(build_drafter(self.cfg, self._context(SamplingParams(), None))).release()
            # one trained for another target is refused before serving, as offline
            check_feature_drafters(self.resources, target_vocab, target_source)
        self.active = 0  # requests decoding here
        self.metrics = ServeMetrics()
        self.batcher = StepBatcher(self._run, lambda: self.active, max_batch,
                                   batch_wait_ms / 1e3, self.metrics.batch)
        self._ending: set[asyncio.Task] = set()
        self.direct_rounds = direct_rounds
        self._channels: dict[str, ChannelClient | None] = {}  # target key -> its channel
        self.rec = None
        if rec_draft:
            from serve_apps.beams import RecDraftSide

            self.rec = RecDraftSide(rec_draft, dtype, device)

    def _context(self, sampling: SamplingParams, generator) -> BuildContext:
        runner = ModelRunner(self.model) if self.model is not None else None
        return BuildContext(runner, sampling, generator, self.resources,
                            device=self.device, dtype=DTYPES[self.dtype])

    def _make(self, sampling: SamplingParams) -> BatchDrafter:
        ctx = self._context(sampling, None)
        drafter = make_batch_drafter(
            self.cfg, ctx, lambda g: build_drafter(self.cfg, self._context(sampling, g)))
        if drafter is None:
            raise ValueError(f"method: {self.method!r} does not draft")
        return drafter

    async def info(self) -> dict:
        """The method, whether it drafts at all, how many prefill top tokens its drafter
        reads (AASD), whether it reads the target's features (EAGLE) and the verification
        rule its drafts need (None: the request's)."""
        return {"method": self.method, "drafting": self.drafting,
                "prefill_top_k": self.prefill_top_k, "features": self.features,
                "rule": self.rule}

    # ------------------------------------------------------------------ one batch
    async def _run(self, steps: list) -> list:
        """Propose for every ready request (one batched pass), then per target key ONE
        call that starts the joining requests and ONE that verifies every tree."""
        out: list = [None] * len(steps)
        rounds = [(i, s) for i, s in enumerate(steps) if isinstance(s, _Round)]
        joins = [(i, s) for i, s in enumerate(steps) if isinstance(s, _Join)]
        # 1. draft: every ready request's tree in shared draft forwards
        t0 = time.perf_counter()
        ready = []
        for i, s in rounds:
            try:
                self.sessions.get(s.rid)
                ready.append((i, s))
            except SessionGone as exc:
                out[i] = exc
        # a round without a draft leaves the drafter alone: the next proposal brings the
        # tokens since (the loop's contract), so the pool's state does not move
        drafted = [(i, s) for i, s in ready if not s.skip]
        proposed = dict(zip([i for i, _ in drafted], self.pool.propose(
            [(s.rid, s.path, s.new, s.budget, s.features) for _, s in drafted])
            if drafted else [], strict=True))
        proposals = [proposed.get(i, Proposal(None)) for i, _ in ready]
        kept = []
        for (i, s), p in zip(ready, proposals, strict=True):
            if isinstance(p, Exception):  # its drafter failed: this request only
                out[i] = p
            else:
                kept.append(((i, s), p))
        ready, proposals = [r for r, _ in kept], [p for _, p in kept]
        draft_s = time.perf_counter() - t0
        # 2. the target: starts and verifies of each key, all keys at once
        if joins and self._budget is not None:  # their prefills are in this step's time
            self._budget.changed()
        calls, parts = [], []
        for key in sorted({s.key for _, s in joins}):
            mine = [(i, s) for i, s in joins if s.key == key]
            rows = [s.req.target_row(s.rid) for _, s in mine]
            calls.append(self._call(key, "start_rows", self.source, rows, self.prefill_top_k,
                                    self.features))
            parts.append(("start", mine))
        for key in sorted({s.key for _, s in ready}):
            mine = [(i, s, p) for (i, s), p in zip(ready, proposals, strict=True)
                    if s.key == key]
            # a sampled request's one rng travels with its round: the target's rule
            # continues it and sends it back (so a seed reproduces the offline sample)
            items = [(s.rid, p.tree.to_wire() if p.tree is not None else None,
                      self._rng_state(s.rid)) for _, s, p in mine]
            calls.append(self._call(key, "verify_rows", self.source, items))
            parts.append(("verify", mine))
        t1 = time.perf_counter()
        pending = [asyncio.ensure_future(c) for c in calls]
        # 3. while the target verifies: draft the next round of the requests just sent
        ahead_s, ahead = 0.0, []
        mode = self.draft_ahead and self.trial.on()  # measured: does it pay here?
        if mode and ready:
            await asyncio.sleep(0)  # every call is on its way before this replica drafts
            t2 = time.perf_counter()
            ahead = self.pool.draft_ahead([s.rid for _, s in ready
                                           if s.rid not in self._auto])
            ahead_s = time.perf_counter() - t2
        t3 = time.perf_counter()
        replies = await asyncio.gather(*pending, return_exceptions=True)
        call_s = time.perf_counter() - t1
        # drafting ahead held the batch up by how much it outlasted the target's work
        verdicts = [r for reply in replies if isinstance(reply, list) for r in reply
                    if isinstance(r, dict) and "verdict" in r]
        busy = [r["target_model_s"] + r.get("target_rule_s", 0.0) for r in verdicts]
        late_s = max(t3 - t1 - max(busy, default=0.0), 0.0) if ahead else 0.0
        self._charge(ready, proposals, ahead, draft_s, late_s)
        if self.draft_ahead and ready:
            committed = sum(len(r["verdict"]["new"]) for r in verdicts)
            self.trial.record(mode, committed, draft_s + call_s)
        # 4. hand each request its answer
        joined = []
        for (kind, mine), reply in zip(parts, replies, strict=True):
            for j, entry in enumerate(mine):
                i, s = entry[0], entry[1]
                res = reply if isinstance(reply, BaseException) else reply[j]
                if isinstance(res, BaseException) or "error" in res:
                    out[i] = res if isinstance(res, BaseException) else request_error(
                        s.rid, res["error"])
                elif kind == "start":
                    joined.append((i, s, res))
                else:
                    if res.get("rng") is not None and s.rid in self.pool:
                        set_generator_state(self.pool.generator(s.rid), res["rng"])
                    out[i] = (entry[2], VerifyResult.from_dict(res["verdict"]), {
                        "draft_model_s": draft_s, "target_call_s": call_s,
                        "target_model_s": res["target_model_s"],
                        "target_rule_s": res.get("target_rule_s", 0.0), "rows": res["rows"],
                        "ahead_s": ahead_s, "ahead_hit": entry[2].ahead})
        if joined:
            self.pool.join([NewRow(s.rid, s.req.prompt_ids, SamplingParams(**s.req.sampling),
                                   None, seeded(s.req.seed), res["top"],
                                   unpack_tensor(res["features"])) for _, s, res in joined])
            for i, s, res in joined:
                self.sessions.put(s.rid, PoolRow(self.pool, s.rid), release_old=False)
                out[i] = res  # the target's start reply (prompt_logprobs for echo)
        if self._budget is not None and ready:  # the next rounds share a new decision
            self._budget.next_step()
        return out

    def _charge(self, ready: list, proposals: list, ahead: list[str], draft_s: float,
                late_s: float) -> None:
        """Book drafting ahead's gains and costs per request (they decide whether it goes
        on, :meth:`DraftPool.can_draft_ahead`): a hit saved its share of what drafting
        this batch's other trees cost (``draft_s`` over the rows drafted), and every
        request drafted ahead pays its share of ``late_s``, the time drafting ahead held
        up the batch after the target had replied."""
        hits = [s.rid for (_, s), p in zip(ready, proposals, strict=True) if p.ahead]
        drafted = len(ready) - len(hits)
        per_row = draft_s / drafted if drafted else self._draft_row_s
        if drafted:
            self._draft_row_s = per_row  # the last measured cost of drafting one row
        for rid in hits:
            if rid in self.pool:
                self.pool.ahead_stats(rid).charge(saved_s=per_row)
                self.metrics.ahead(True, per_row)
        for p in proposals:
            if p.ahead is False:
                self.metrics.ahead(False, 0.0)
        for rid in ahead:
            if rid in self.pool:
                self.pool.ahead_stats(rid).charge(lost_s=late_s / len(ahead))

    def _rng_state(self, rid: str) -> bytes | None:
        """Request ``rid``'s rng state when it samples (None at temperature 0: no draws)."""
        if rid not in self.pool or self.pool.sampling(rid).greedy:
            return None
        return generator_state(self.pool.generator(rid))

    # ------------------------------------------------------------------ a request
    async def generate(self, rid: str, request: dict) -> AsyncIterator[dict]:
        """Decode one request (a :class:`DecodeRequest` dict), streamed:
        ``{"tokens"}`` per round, then ``{"stats"}``."""
        if not self.drafting:
            raise ValueError(f"method: {self.method!r} does not draft")
        req = DecodeRequest.from_dict(request)
        key = target_key(rid, self.buckets)
        timing = Timing()
        verdict: list[VerifyResult] = []

        policy = (await self._auto_budget(key)).row() if req.budget == "auto" else None

        async def round_step(path, new, budget, features) -> Proposal:
            t0 = time.perf_counter()
            proposal, result, times = await self.batcher.submit(
                _Round(rid, key, path, new, budget, features,
                       skip=policy is not None and budget == 0), rid)
            wait = time.perf_counter() - t0 - times["draft_model_s"] - times["target_call_s"]
            timing.add({**times, "queue_s": max(wait, 0.0)})
            verdict.append(result)
            return proposal

        async def step(msg):
            if isinstance(msg, Start):
                return await self.batcher.submit(_Join(rid, key, req), rid)
            if isinstance(msg, Propose):
                return await round_step(msg.path, msg.new, msg.budget, msg.features)
            assert isinstance(msg, Verify)
            if not verdict:  # a round without a draft (the last token): verify the root
                await round_step(None, [], 0, None)
            return verdict.pop()

        self.active += 1
        if policy is not None:
            self._auto.add(rid)
        try:
            async for chunk in stream_rounds(req, step, timing, policy):
                yield chunk
        finally:
            self.active -= 1
            if policy is not None:
                self._auto.discard(rid)
                policy.close()  # (the loop closes it too; not if it never started)
                for levels in policy.chosen:
                    self.metrics.budget(levels)
            self.sessions.end(rid)
            task = asyncio.create_task(self._end_target(key, rid))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    async def stats(self, probe: str = "") -> dict:
        """The sessions' stats (:meth:`RequestStates.stats`) plus ``budget``: what this
        replica's ``auto`` budget learned (:meth:`AutoBudget.state`) and ``steps``, its
        recent steps (the last 2,048 to 4,096) per depth, ``{depth: steps}``; None before
        an auto request. ``/health`` shows it for every draft replica."""
        out = await super().stats(probe)
        b = self._budget
        out["budget"] = None if b is None else {
            **b.state(), "steps": {str(d): n for d, n in sorted(Counter(b.decisions).items())}}
        return out

    async def _auto_budget(self, key: str) -> AutoBudget:
        """This replica's ``auto`` budget (:mod:`speclab.decoding.budget`), shared by its
        auto requests (each takes a row; one decision per batch step): the target's cost
        curves from its replica (calibrated there once, stored) and the draft model's from
        this one, up to this replica's batch (at most 16 rows); the requests that ended
        are the prior of those to come."""
        depth = self.cfg.draft_length()
        if not depth:
            raise ValueError(f"budget: auto needs a method with a known draft length; "
                             f"{self.method!r} does not say its own")
        async with self._budget_lock:
            if self._budget is None:
                await self._new_budget(key, depth)
        return self._budget

    async def _new_budget(self, key: str, depth: int) -> None:
        """Build this replica's auto budget (see :meth:`_auto_budget`)."""
        from speclab.calibration import Calibration, model_calibration

        rows = min(self.max_batch, 16)
        target = Calibration.from_dict(await self.target.calibration.remote(key, rows))
        draft = model_calibration(self.model, rows) if self.model is not None else None
        costs = RoundCosts(target.round_costs(batched=True).target,
                           draft.round_costs(batched=True).target if draft else None)
        self._budget = AutoBudget(costs, depth, driven=True)

    async def _call(self, key: str, op: str, *args) -> object:
        """``op(key, *args)`` on the target replica of ``key``: over its same-node channel
        when it runs on this node (and ``direct_rounds``), else a Serve handle call."""
        if self.direct_rounds and key not in self._channels:
            import ray

            where = await self.target.channel.remote(key)
            here = where["node"] == ray.get_runtime_context().get_node_id()
            self._channels[key] = ChannelClient(where["path"], where["secret"]) if here \
                else None
        client = self._channels.get(key)
        if client is None:
            return await getattr(self.target, op).remote(key, *args)
        try:
            return await client.call(op, key, *args)
        except ChannelError:
            if self._channels.get(key) is client:  # ask Serve for a live replica next time
                self._channels.pop(key).close()
            raise

    async def _end_target(self, key: str, rid: str) -> None:
        try:
            await self._call(key, "end", rid)
        except Exception:  # a dead target replica took the row with it
            pass

    # ------------------------------------------------------------------ recommend
    async def rec_run(self, rid: str, history: list[int], k: int, mode: str = "strict",
                      n: int = 10, gamma: int = 2, seed: int = 0) -> dict:
        """``POST /recommend``, driven here like every decoding request (one call from the
        ingress): the target prefills the history's prompt (``rec_start``), the drafter
        recommender prefills it too, then the beam SD rounds run next to the drafter with
        ONE ``rec_verify`` call on the target per round
        (:meth:`serve_apps.beams.RecDraftSide.recommend`; strict: beam search with beam
        ``n``; relaxed: ``n`` samples per level). Both sides' states are freed when it
        ends or fails. Returns ``items``, ``scores``, ``target_calls``, ``accepted_steps``."""
        if self.rec is None:
            raise ValueError("recommend: this app serves no recommender (serve.rec_draft)")
        done = False
        try:
            start = await self.target.rec_start.remote(rid, history, k, mode, seed)
            self.sessions.put(rid, self.rec.start(start["prompt"], mode, n, seed))
            verdict, stats = await self.rec.recommend(
                lambda: self.sessions.get(rid),
                lambda proposal, committed: self.target.rec_verify.remote(rid, proposal,
                                                                          committed),
                start["levels"], gamma)
            done = True
        finally:
            self.sessions.end(rid)
            if not done:  # the target frees a finished request's state itself
                try:
                    await self.target.end.remote(rid, rid)  # routed by the request id
                except Exception:  # a dead target replica took the state with it
                    pass
        return {"items": verdict["items"], "scores": verdict["scores"],
                "target_calls": stats.target_calls, "accepted_steps": stats.accepted_steps}

