"""One request's round loop on the replica that drives it.

The engine's loop (:func:`speclab.decoding.loop.rounds`) runs INSIDE a model replica:
in the draft replica for a drafting method (its proposals are local, the target is one
call per round and target key for all the replica's ready requests), in the target
replica for plain decoding (no hop at all). :func:`stream_rounds` runs it with an async
``step`` that answers the loop's Start / Propose / Verify messages; the replica's
:class:`~serve_apps.batcher.StepBatcher` turns the steps of concurrent requests into
batched forwards.

:class:`DecodeRequest` is what the ingress sends; the replica streams back
``{"tokens": [...], "progress": {...}}`` per round and ends with ``{"stats": {...}}``
(the loop's statistics plus where the time went, :class:`Timing`). ``progress`` carries
the statistics so far (the per-round lists as deltas), so a request the ingress ends
early (a stop string, a gone client), which never sees ``stats``, still reports its
rounds (:class:`LiveStats`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field, fields

from speclab.decoding.budget import AutoBudget
from speclab.decoding.loop import Committed, GenerationStats, Start, eos_set, rounds


@dataclass
class DecodeRequest:
    """A request as the ingress hands it to the replica that drives it."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: dict  # SamplingParams fields
    rule: dict  # RuleSpec.to_dict()
    seed: int
    eos: list[int]
    drafting: bool = True
    logprobs: int | None = None  # the target's log-probs of the tokens, this many alternatives
    echo: bool = False  # and of the prompt's tokens (with logprobs)
    budget: str = "fixed"  # "auto": each round's draft depth chosen (speclab.decoding.budget)
    # seconds the replica may hold committed rounds before sending them as one chunk
    # (stream_rounds); 0: a chunk per round (a streamed reply, stop strings)
    hold_s: float = 0.0

    def target_row(self, rid: str) -> dict:
        """The request as a row of the target's ``start_rows``."""
        return {"rid": rid, "prompt_ids": self.prompt_ids, "sampling": self.sampling,
                "rule": self.rule, "seed": self.seed, "logprobs": self.logprobs,
                "echo": self.echo}

    @classmethod
    def from_dict(cls, data: dict) -> DecodeRequest:
        return cls(**data)


@dataclass
class Timing:
    """Seconds of one request's rounds, as the driving replica saw them: waiting for a
    batch to close (``queue_s``), its share of draft model time (``draft_model_s``: the
    batch's propose time), the target call (``target_call_s``: hop + the target's batch),
    the target's forward inside it (``target_model_s``, the model alone) and the rest of
    the target's verify step (``target_rule_s``: trees from the wire, rules, pruning).
    Drafting ahead (:mod:`speclab.decoding.lookahead`): ``ahead_s`` the drafting done
    while the target verified (hidden behind ``target_call_s``, its batch's share),
    ``ahead_rounds`` the rounds that had a tree drafted ahead and ``ahead_hits`` those
    whose tree was ready (no draft time of their own)."""

    rounds: int = 0
    queue_s: float = 0.0
    draft_model_s: float = 0.0
    target_call_s: float = 0.0
    target_model_s: float = 0.0
    target_rule_s: float = 0.0
    ahead_s: float = 0.0
    ahead_rounds: int = 0
    ahead_hits: int = 0
    replica_s: float = 0.0  # the whole request on the driving replica
    batch_rows: list[int] = field(default_factory=list)  # rows verified with it, per round

    def add(self, step: dict) -> None:
        """Add one round's figures (a step result's ``timing``)."""
        self.rounds += 1
        for key in ("queue_s", "draft_model_s", "target_call_s", "target_model_s",
                    "target_rule_s", "ahead_s"):
            setattr(self, key, getattr(self, key) + float(step.get(key, 0.0)))
        if step.get("ahead_hit") is not None:
            self.ahead_rounds += 1
            self.ahead_hits += int(bool(step["ahead_hit"]))
        self.batch_rows.append(int(step.get("rows", 1)))

    def to_dict(self) -> dict:
        return asdict(self)


#: :class:`GenerationStats`' per-round lists: ``progress`` sends only their new entries
ROUND_LISTS = ("accepted_lengths", "round_accepted", "round_reach", "round_drafted")


def round_progress(stats: GenerationStats, sent: int) -> dict:
    """``stats``' counters so far and its per-round list entries after the first ``sent``
    rounds (what :class:`LiveStats` adds)."""
    out = {f.name: getattr(stats, f.name) for f in fields(stats)  # the rest are numbers
           if f.name not in ROUND_LISTS}
    out.update({k: getattr(stats, k)[sent:] for k in ROUND_LISTS})  # copies of the new
    return out


class LiveStats:
    """The ingress's copy of one request's statistics, rebuilt from its rounds'
    ``progress``: the figures of a request ended before its ``stats`` came."""

    def __init__(self) -> None:
        self.stats = GenerationStats()

    def add(self, progress: dict) -> None:
        """Take one round's :func:`round_progress`."""
        for key, value in progress.items():
            if key in ROUND_LISTS:
                getattr(self.stats, key).extend(value)
            elif hasattr(self.stats, key):
                setattr(self.stats, key, value)

    def to_dict(self) -> dict:
        """The statistics as the replica's ``stats`` gives them (derived rates too)."""
        return self.stats.to_dict()


Step = Callable[[object], Awaitable[object]]


async def stream_rounds(req: DecodeRequest, step: Step, timing: Timing,
                        policy: AutoBudget | None = None) -> AsyncIterator[dict]:
    """Run ``req`` through the loop; ``step(msg)`` answers each Start / Propose / Verify
    (its answer to Start: the target's start reply, whose ``prompt_logprobs`` are passed
    on). Yields ``{"prompt_logprobs"}`` first when the request echoes them, then
    ``{"tokens": [...], "progress": ...}`` per round (cut at EOS / ``max_tokens``; with
    ``"logprobs"``, one entry per token, when the request asked for them;
    :func:`round_progress`), then ``{"stats": ...}`` once the loop ended. ``policy``:
    the request's ``auto`` budget (the loop asks it for each round's levels).

    ``req.hold_s`` > 0: the rounds committed within ``hold_s`` seconds of the last chunk
    go out together, as ONE chunk (their tokens and logprobs in order, the progress of
    all of them), and whatever is held goes out before ``stats``. Each chunk is a message
    from the replica to the ingress, which wakes both and Ray's IO threads: on the
    2-core VM a chunk per round cost plain decoding through Serve a quarter to a third of its
    throughput (docs/serve.md)."""
    t0 = time.perf_counter()
    stats = GenerationStats()
    loop = rounds(req.prompt_ids, req.max_tokens, eos_set(req.eos), stats, req.drafting,
                  policy)
    reply: object = None
    sent = 0  # rounds whose list entries went out with a chunk's progress
    held: dict = {}  # committed rounds not sent yet: their tokens (and logprobs)
    last = t0  # when the last chunk went out

    def chunk() -> dict:
        nonlocal sent, held, last
        out = {**held, "progress": round_progress(stats, sent)}
        sent, held, last = len(stats.accepted_lengths), {}, time.perf_counter()
        return out

    try:
        while True:
            try:
                msg = loop.send(reply)
            except StopIteration:
                break
            reply = None
            if isinstance(msg, Committed):
                held.setdefault("tokens", []).extend(msg.tokens)
                if msg.logprobs is not None:
                    held.setdefault("logprobs", []).extend(msg.logprobs)
                if time.perf_counter() - last >= req.hold_s:
                    yield chunk()
                continue
            reply = await step(msg)
            if isinstance(msg, Start):
                echo = reply.get("prompt_logprobs") if isinstance(reply, dict) else None
                if echo is not None:
                    yield {"prompt_logprobs": echo}
                reply = None
        if held:
            yield chunk()
    finally:
        loop.close()
    timing.replica_s = time.perf_counter() - t0
    out = stats.to_dict()
    # the loop's own draft/verify timers see a batched round as one step: report the
    # model and call times instead
    out["draft_s"], out["verify_s"] = timing.draft_model_s, timing.target_call_s
    out["timing"] = timing.to_dict()
    yield {"stats": out}


async def collect(chunks: AsyncIterator[dict]) -> dict:
    """A streamed request as one reply: ``{"tokens": all tokens, "stats": ...}`` (with
    ``logprobs`` / ``prompt_logprobs`` when the chunks carried them)."""
    out: dict = {"tokens": [], "stats": {}}
    async for chunk in chunks:
        out["tokens"] += chunk.get("tokens", [])
        if "logprobs" in chunk:
            out.setdefault("logprobs", []).extend(chunk["logprobs"])
        for key in ("stats", "prompt_logprobs"):
            if key in chunk:
                out[key] = chunk[key]
    return out
