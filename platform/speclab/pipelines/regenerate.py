"""Stage: the target answers the user turns of conversations itself (what EAGLE, Medusa,
HASS and SpecForge call regeneration or self-distillation), so a drafter learns the
distribution it will have to predict.

Conversations of one split are read as a stream (:func:`read_conversations`), cut into
shards of ``regenerate.shard_size``, and decoded on Ray actors that each hold the
target (and drafter) in speclab's own batched engine (:class:`~speclab.api.Decoder`):
turn by turn, every conversation of the shard that has a ``t``-th user turn is
answered together, its prompt being the conversation so far (the target's own earlier
answers included) through the chat template. A conversation ends after its last
answered turn; a system message is kept. With a drafting method (``regenerate.method``)
the job is speculative decoding: at temperature 0 its answers equal plain decoding's.

Output: ``shard-NNNNN.jsonl`` (OpenAI-messages records ``{"id", "messages",
"regenerated": {...}}``, each written to a temporary name and renamed, so a shard is
whole or absent) and ``manifest.json`` (settings, shards done, totals). A rerun with the
same settings keeps the finished shards; one with other settings is refused. The
folder is a ``corpus.path`` for ``corpus.source: conversations`` once complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speclab.data.conversations import (
    Conversation,
    read_conversations,
    split_of,
    template_ids,
)
from speclab.models.loading import context_length

MANIFEST = "manifest.json"


def user_turns(conv: Conversation, turns: int) -> list[list[dict]]:
    """The prompts of ``conv``'s first ``turns`` user turns: for turn ``t``, the messages
    before its ``t``-th user message plus that message (system messages kept, assistant
    messages to be replaced by the target's answers)."""
    out, so_far = [], []
    for m in conv.messages:
        if m["role"] == "assistant":
            continue
        so_far.append(m)
        if m["role"] == "user":
            out.append(list(so_far))
            if len(out) == turns:
                break
    return out


def settings_of(cfg: Any, target: str) -> dict:
    """What determines the job's output (a rerun with other settings is refused; the
    method and drafter are not among them: they change the speed, not the answers)."""
    r, c = cfg.regenerate, cfg.corpus
    return {"target": target, "source": str(c.path),
            "format": c.format, "chat_template": c.chat_template, "split": r.split,
            "conversations": c.max_conversations, "turns": r.turns,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
            "top_p": r.top_p, "seed": r.seed, "shard_size": r.shard_size,
            "order": r.order, "dtype": cfg.models.dtype}


def first_turn_size(record: dict) -> int:
    """Characters of a record's first prompt (its system and first user messages, as
    JSON): the key ``regenerate.order: length`` sorts conversations by."""
    first = user_turns(Conversation(record["id"], record["messages"]), 1)[0]
    return len(json.dumps(first, ensure_ascii=False))


def plan(cfg: Any) -> tuple[list[list[dict]], dict]:
    """The conversations to answer, cut into shards (records ``{"id", "messages"}``), and
    the read's statistics. Streams the source and stops at ``corpus.max_conversations``;
    with ``regenerate.order: length`` the conversations picked are sorted (stably) by
    the characters of their first user turn before they are cut, so each shard's batch
    holds prompts of like length (ShareGPT's first turns run from a few tokens to
    20,000: in a batch of 16 a single long one made every row decode over its padded
    cache)."""
    from speclab.data.conversations import ReadStats

    c, r = cfg.corpus, cfg.regenerate
    stats = ReadStats()
    picked: list[dict] = []
    for conv in read_conversations(c.path, c.format, c.strict, stats):
        if split_of(conv.id, c.validation, c.test) != r.split:
            continue
        if not any(m["role"] == "user" for m in conv.messages):
            continue
        picked.append({"id": conv.id, "messages": conv.messages})
        if c.max_conversations is not None and len(picked) >= c.max_conversations:
            break
    if not picked:
        raise ValueError(f"corpus.path: {c.path!r} holds no {r.split} conversation with a "
                         f"user turn ({stats.summary()})")
    if r.order == "length":
        picked.sort(key=first_turn_size)
    shards = [picked[i: i + r.shard_size] for i in range(0, len(picked), r.shard_size)]
    return shards, {"read": stats.summary(), "conversations": len(picked),
                    "malformed": stats.malformed, "truncated": stats.truncated}


@dataclass
class ShardResult:
    """What one shard took: answers, new tokens, target calls, capped answers, turns too
    long for the target's context, seconds."""

    index: int
    answers: int
    new_tokens: int
    target_calls: int
    capped: int
    too_long: int
    seconds: float


def answer_shard(dec: Any, records: list[dict], cfg: Any, template: str | None,
                 first_seed: int) -> tuple[list[dict], dict]:
    """The target's answers to ``records`` (turn by turn, batched): the regenerated
    records and the totals. ``dec``: a :class:`~speclab.api.Decoder`. A turn whose
    prompt plus ``regenerate.max_new_tokens`` exceeds the target's context is not
    answered (counted as ``too_long``): its conversation ends before it, and one with
    no answered turn is left out."""
    r = cfg.regenerate
    tok = dec.tokenizer
    limit = context_length(dec.target.model.config)
    eos = dec.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list | tuple) else {eos}
    prompts = [user_turns(Conversation(x["id"], x["messages"]), r.turns) for x in records]
    answers: list[list[str]] = [[] for _ in records]
    lengths: list[list[int]] = [[] for _ in records]
    cut = [False] * len(records)
    totals = {"answers": 0, "new_tokens": 0, "target_calls": 0, "capped": 0, "too_long": 0}
    for t in range(max(map(len, prompts))):
        live, ids = [], []
        for i, p in enumerate(prompts):
            if len(p) <= t or cut[i]:
                continue
            x = template_ids(tok, _with_answers(p[t], answers[i]), template)
            if limit and len(x) + r.max_new_tokens > limit:
                cut[i] = True  # the conversation ends before this turn
                totals["too_long"] += 1
                continue
            live.append(i)
            ids.append(x)
        if not ids:
            continue
        results = dec.generate(prompts=ids, batch_size=r.batch_size, method=r.method,
                               max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                               top_p=r.top_p, seed=first_seed + 7919 * t)
        for i, res in zip(live, results, strict=True):
            toks = [x for x in res.token_ids if x not in eos_ids]
            answers[i].append(tok.decode(toks, skip_special_tokens=True).strip())
            lengths[i].append(len(res.token_ids))
            totals["answers"] += 1
            totals["new_tokens"] += len(res.token_ids)
            totals["target_calls"] += int(res.stats.target_calls)
            totals["capped"] += int(len(res.token_ids) >= r.max_new_tokens
                                    and not eos_ids & set(res.token_ids))
    out = []
    for x, p, a, n in zip(records, prompts, answers, lengths, strict=True):
        if a:  # the conversation up to its last answered turn
            out.append({"id": x["id"], "messages": _with_answers(p[len(a) - 1], a) + [
                {"role": "assistant", "content": a[-1]}],
                "regenerated": {"turns": len(a), "new_tokens": n}})
    return out, totals


def _with_answers(prompt: list[dict], answers: list[str]) -> list[dict]:
    """``prompt`` (system and user messages) with the target's answers after each user
    message that has one."""
    out, k = [], 0
    for m in prompt:
        out.append(m)
        if m["role"] == "user" and k < len(answers) and m is not prompt[-1]:
            out.append({"role": "assistant", "content": answers[k]})
            k += 1
    return out


def check_output(out: Path, settings: dict) -> None:
    """ValueError when ``out`` holds a regeneration with other settings (or something
    that is not a regeneration)."""
    path = out / MANIFEST
    if path.exists():
        old = json.loads(path.read_text()).get("settings", {})
        if old != settings:
            diff = sorted(k for k in settings if old.get(k) != settings[k])
            raise ValueError(f"regenerate.output: {out} holds a regeneration with other "
                             f"settings ({', '.join(diff)}); choose another output folder")
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"regenerate.output: {out} is not empty and holds no {MANIFEST}")


SHARD_FIELDS = ("answers", "new_tokens", "target_calls", "capped", "too_long", "seconds")


def open_output(out: Path, settings: dict, shards: int) -> tuple[set[int], dict[int, dict]]:
    """Create or resume ``out`` (:func:`check_output` first): the indices of the shards
    already finished, and what each of them took (``{index: {answers, new_tokens,
    target_calls, capped, too_long, seconds}}``, from the manifest; absent for shards an
    older version wrote)."""
    check_output(out, settings)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):
        stale.unlink()
    done = {i for i in (int(p.stem.split("-")[1]) for p in out.glob("shard-*.jsonl"))
            if i < shards}
    path = out / MANIFEST
    old = json.loads(path.read_text()).get("shard_results", {}) if path.exists() else {}
    results = {int(k): v for k, v in old.items() if int(k) in done}
    write_manifest(out, settings, shards, done, {}, results)
    return done, results


def all_shards(results: dict[int, dict]) -> dict:
    """Totals over every finished shard whose figures are known, whichever run wrote it
    (so a regeneration resumed over several runs states its whole decoding time):
    the fields of :data:`SHARD_FIELDS` summed, ``shards``, tokens/s and target calls
    per token."""
    tot = {k: sum(r[k] for r in results.values()) for k in SHARD_FIELDS}
    tot["shards"] = len(results)
    tot["tokens_per_s"] = tot["new_tokens"] / tot["seconds"] if tot["seconds"] else 0.0
    tot["target_calls_per_token"] = tot["target_calls"] / max(1, tot["new_tokens"])
    return tot


def write_manifest(out: Path, settings: dict, shards: int, done: set[int], totals: dict,
                   results: dict[int, dict]) -> None:
    """``manifest.json``, written atomically; ``results``: each finished shard's figures
    (kept across reruns) and their sum, ``all_shards``."""
    body = {"settings": settings, "settings_sha256": hashlib.sha256(
        json.dumps(settings, sort_keys=True).encode()).hexdigest(), "shards": shards,
        "shards_done": len(done), "complete": len(done) == shards, **totals,
        "all_shards": all_shards(results),
        "shard_results": {str(i): results[i] for i in sorted(results)}}
    tmp = out / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(body, indent=2))
    os.replace(tmp, out / MANIFEST)


def write_shard(out: Path, index: int, records: list[dict]) -> None:
    """``shard-NNNNN.jsonl``, whole or absent."""
    path = out / f"shard-{index:05d}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    os.replace(tmp, path)


def run(cfg: Any, target: str, draft: str | None, out: Path) -> dict:
    """The whole regeneration on Ray actors (``regenerate.actors``); returns the totals
    (answers, new tokens, target calls, capped answers, seconds, tokens/s, target calls
    per token) and writes them to the manifest."""
    import ray

    from speclab.data.token_stream import chat_template_of

    r = cfg.regenerate
    shards, read = plan(cfg)
    settings = settings_of(cfg, target)
    done, results = open_output(out, settings, len(shards))
    template = chat_template_of(cfg.corpus)
    print(f"[regenerate] {read['read']}; {read['conversations']} {r.split} conversations in "
          f"{len(shards)} shards ({len(done)} already done) -> {out}", flush=True)

    @ray.remote
    class Answerer:
        """Holds one target (and drafter) in the batched engine."""

        def __init__(self) -> None:
            import torch

            from speclab.api import Decoder

            torch.set_num_threads(max(1, int(r.cpus_per_actor)))
            device = "cuda" if r.gpus_per_actor > 0 else cfg.models.device
            self.dec = Decoder.from_pretrained(target, draft, cfg.models.dtype, device)
            if self.dec.tokenizer is None:
                raise ValueError("models.target: no tokenizer beside the target")

        def shard(self, index: int, records: list[dict]) -> ShardResult:
            t0 = time.perf_counter()
            rows, totals = answer_shard(self.dec, records, cfg, template,
                                        r.seed + 1_000_003 * index)
            write_shard(out, index, rows)
            return ShardResult(index, seconds=time.perf_counter() - t0, **totals)

    todo = [i for i in range(len(shards)) if i not in done]
    turns_in = [sum(len(user_turns(Conversation(x["id"], x["messages"]), r.turns))
                    for x in s) for s in shards]  # user turns to answer, per shard
    totals = {"answers": 0, "new_tokens": 0, "target_calls": 0, "capped": 0, "too_long": 0,
              "seconds": 0.0}
    t0 = time.perf_counter()
    if todo:
        actors = [Answerer.options(num_cpus=r.cpus_per_actor, num_gpus=r.gpus_per_actor,
                                   max_restarts=0).remote()
                  for _ in range(min(r.actors, len(todo)))]
        try:
            pending = {}
            for a in actors:
                if todo:
                    i = todo.pop(0)
                    pending[a.shard.remote(i, shards[i])] = a
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                actor = pending.pop(ref)
                res: ShardResult = ray.get(ref)  # an actor's error stops the job
                done.add(res.index)
                results[res.index] = {k: getattr(res, k) for k in SHARD_FIELDS}
                for k in SHARD_FIELDS[:-1]:
                    totals[k] += getattr(res, k)
                wall = time.perf_counter() - t0
                rate = totals["new_tokens"] / wall if wall else 0.0
                left = sum(n for i, n in enumerate(turns_in) if i not in done)
                eta = wall / max(1, totals["answers"]) * left
                print(f"[regenerate] shard {res.index} done ({len(done)}/{len(shards)}): "
                      f"{res.answers} answers, {res.new_tokens} tokens in {res.seconds:.0f}s; "
                      f"{rate:.1f} tokens/s, ETA {eta / 60:.1f} min", flush=True)
                write_manifest(out, settings, len(shards), done, {}, results)
                if todo:
                    i = todo.pop(0)
                    pending[actor.shard.remote(i, shards[i])] = actor
        finally:
            for a in actors:
                ray.kill(a)
    totals["seconds"] = time.perf_counter() - t0
    new = max(1, totals["new_tokens"])
    totals.update({"tokens_per_s": totals["new_tokens"] / max(totals["seconds"], 1e-9),
                   "target_calls_per_token": totals["target_calls"] / new,
                   "conversations": read["conversations"]})
    write_manifest(out, settings, len(shards), done, {"last_run": totals, "read": read},
                   results)
    return totals

