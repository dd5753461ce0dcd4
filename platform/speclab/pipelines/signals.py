"""Stage: the target's distillation signals, generated on Ray actors (distill,
compare_losses, train_head, specdecpp_eval, tune).

The corpus (tokenised with the target's tokenizer) is cut into deterministic windows;
target replicas on Ray actors turn them into what the losses need (``kd``, ``seq``,
``tree`` examples; ``feat`` windows with the target's features for EAGLE drafters, and
``feat_tree`` ones that add a target-built tree at every position for TALF on them;
``medusa`` prompts continued by the target, with its features, for Medusa heads;
``accept`` data for SpecDec++ heads; each kind is an entry of the data-kind registry of
:mod:`speclab.train.distill_data`, looked up by name, plugins included) and write Parquet
shards ``<data>/<kind>/shard-NNNNN.parquet`` one at a time (written to a temporary name, then
renamed, so a shard is either whole or absent). Shards already present are not
regenerated, so a rerun resumes generation too.

Faults: an actor that dies (its process, or the node under it) fails its calls with a
``RayActorError`` (``ActorDiedError``; ``ActorUnavailableError`` while unreachable).
The shards it held are dispatched again, to the surviving actors or to a replacement
actor, up to :data:`MAX_SHARD_ATTEMPTS` times each. Shard names are deterministic, each
writer checks its row count before the atomic rename, and :func:`check_shards` (run at
the end of generation and again before training) requires exactly shards ``0..n-1``
with ``distill.examples`` rows in all, so training sees every example exactly once.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speclab.api import Decoder
from speclab.config.schema import DistillConfig
from speclab.data.token_stream import TokenStream, row_loss_mask, token_stream
from speclab.models.loading import load_model, resolve_source
from speclab.models.registry import resolve_models
from speclab.pipelines.fit import peak_rss_mb
from speclab.train import distill_data as dd
from speclab.train.distill_data import data_kind

MAX_SHARD_ATTEMPTS = 3  # dispatches of one shard before generation gives up
PER_ACTOR_IN_FLIGHT = 2  # shards queued on one actor (one running, one waiting)
ACTOR_START_TIMEOUT_S = 1800.0  # with no shard in flight, how long to wait for an actor
PLAN_FILE = "plan.json"


def plan_starts(d: DistillConfig, seed: int, tokens: TokenStream | Any, kind: str
                ) -> tuple[list[int], int]:
    """Deterministic corpus offsets and length of ``kind``'s inputs (windows / prompts /
    contexts; inside one conversation and ending on an assistant token for a
    conversation corpus: :meth:`TokenStream.starts`); the inputs themselves are sliced
    per shard, so memory stays bounded. Kinds of the same ``draw`` (every corpus-window
    kind: ``kd``, ``windows``, ``feat``, ``feat3`` and their trees) cut the same inputs
    from the same seed, so their drafters (and online against offline features) train
    on the same windows."""
    import torch

    length = data_kind(kind).input_len(d)
    tokens = TokenStream.of(tokens)
    if tokens.numel() <= length + 1:
        raise ValueError(f"corpus: too little text for {kind} examples of {length} tokens")
    draw = data_kind(kind).draw or kind  # kinds of one draw cut the same inputs
    offset = int(hashlib.sha256(draw.encode()).hexdigest()[:6], 16)
    g = torch.Generator().manual_seed(seed + offset)
    return tokens.starts(d.examples, length, g), length


def shard_name(index: int) -> str:
    """The file name of shard ``index`` of a kind (deterministic: one name per shard)."""
    return f"shard-{index:05d}.parquet"


def shard_rows(examples: int, shard_size: int) -> list[int]:
    """Rows of each shard: ``shard_size`` each, the last one the remainder."""
    return [min(shard_size, examples - first) for first in range(0, examples, shard_size)]


def check_shards(data_dir: Path, kinds: set[str], d: DistillConfig) -> dict[str, int]:
    """Check that every ``kind`` folder under ``data_dir`` holds exactly the shards
    ``0..n-1`` of the plan, each with its row count, ``d.examples`` rows in all, so a
    reader of ``shard-*.parquet`` sees every example exactly once. Returns rows per kind;
    raises ``ValueError`` naming the folder and the offending shards otherwise."""
    want = shard_rows(d.examples, d.shard_size)
    totals = {}
    for kind in sorted(kinds):
        folder = Path(data_dir) / kind
        names = {p.name for p in folder.glob("shard-*.parquet")}
        expected = {shard_name(i) for i in range(len(want))}
        missing, extra = sorted(expected - names), sorted(names - expected)
        if missing or extra:
            raise ValueError(f"{folder}: shards {missing} missing and {extra} unexpected "
                             f"(want shard 0..{len(want) - 1} for distill.examples="
                             f"{d.examples}, shard_size={d.shard_size})")
        bad, total = [], 0
        for i, rows in enumerate(want):
            got = _num_rows(folder / shard_name(i))
            total += got or 0
            if got != rows:
                bad.append(f"{shard_name(i)}: {got} rows, want {rows}")
        if bad or total != d.examples:
            raise ValueError(f"{folder}: {total} examples, want {d.examples}; " + "; ".join(bad))
        totals[kind] = total
    return totals


def _num_rows(path: Path) -> int | None:
    """Rows of a Parquet file from its footer, None if it is unreadable."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except (OSError, ValueError):
        return None


def _check_plan(folder: Path, plan: dict) -> None:
    """Write ``folder``'s plan stamp, or refuse shards made with a different plan."""
    stamp = folder / PLAN_FILE
    if stamp.exists():
        old = json.loads(stamp.read_text())
        if old != plan:
            diff = {k: (old.get(k), v) for k, v in plan.items() if old.get(k) != v}
            raise ValueError(f"{folder}: its shards were generated with another plan "
                             f"(was, now: {diff}); use another output.run_name or remove "
                             "the folder")
        return
    tmp = stamp.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(plan, sort_keys=True))
    tmp.replace(stamp)


@dataclass
class _Shard:
    kind: str
    index: int
    path: Path
    first: int  # index of its first example
    rows: int
    attempts: int = 0


@dataclass
class _Actors:
    """The generation actors by slot: handles, which are ready, their queued shards."""

    make: Any
    limit: int  # actor starts allowed in all (replacements included)
    handles: dict[int, Any] = field(default_factory=dict)
    starting: dict[Any, int] = field(default_factory=dict)  # ready() ref -> slot
    ready: dict[int, dict] = field(default_factory=dict)  # slot -> {"pid", "node"}
    load: dict[int, int] = field(default_factory=dict)
    started: int = 0

    def start(self) -> None:
        if self.started >= self.limit:
            raise RuntimeError(f"generation: {self.started} actors started and lost; "
                               "giving up (see the actors' errors above)")
        slot, self.started = self.started, self.started + 1
        self.handles[slot] = self.make()
        self.starting[self.handles[slot].ready.remote()] = slot

    def drop(self, slot: int) -> bool:
        """Forget a lost actor (and make sure it is gone); False if already dropped."""
        import ray

        handle = self.handles.pop(slot, None)
        self.ready.pop(slot, None)
        self.load.pop(slot, None)
        if handle is None:
            return False
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001  (already dead or unreachable)
            pass
        return True

    def kill_all(self) -> None:
        for slot in list(self.handles):
            self.drop(slot)


def generate(cfg: Any, target: str, data_dir: Path, kinds: set[str],
             tokens: TokenStream | Any,
             draft: str | None = None, head_temperature: float = 0.0,
             stats: dict | None = None, eagles: dict[str, Any] | None = None
             ) -> tuple[dict[str, int], float]:
    """The target's signals on an actor pool; returns (shards per kind, the actors' peak
    RSS in MB). ``cfg``: a job config with ``distill``, ``models`` and ``train`` groups
    (generation settings, dtype/device, seed).

    The ``accept`` kind (SpecDec++ head data) also needs the local ``draft`` folder and
    the temperature the head is trained for.

    Shards of a lost actor are dispatched again (see the module docstring); ``stats``,
    if given, is filled with what happened: ``shards_kept`` / ``shards_written``,
    ``actors`` (pid and node of each actor that started), ``actors_lost``,
    ``redispatched`` (``kind/shard`` names, once per new attempt) and ``errors`` (the
    exception class of each failed call).

    ``eagles`` maps a kind to the ``eagle`` group its rows are made with (its data
    settings, EAGLE-3's layers, TALF's trees), where it is not the job's ``cfg.eagle``
    (``compare_eagle``'s EAGLE-3 rows)."""
    need_draft = sorted(k for k in kinds if data_kind(k).needs_draft)  # unknown kinds: here
    if need_draft and draft is None:
        raise ValueError(f"models.draft: {' and '.join(need_draft)} data needs a drafter")
    import ray

    d, seed = cfg.distill, cfg.train.seed
    tokens = TokenStream.of(tokens)  # a 1-D tensor: plain text
    job_eagle = getattr(cfg, "eagle", None)  # the settings of kinds that read it
    eagle_of = {k: (eagles or {}).get(k, job_eagle) for k in kinds}
    device = "cuda" if d.gen_gpus_per_actor > 0 else cfg.models.device
    dtype = cfg.models.dtype

    @ray.remote
    class Generator:
        """Holds one target replica; turns example inputs into Parquet shards."""

        def __init__(self) -> None:
            self.dec = Decoder.from_pretrained(target, draft, dtype, device)

        def ready(self) -> dict:
            """Where this actor runs: its pid and Ray node id."""
            import os

            return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

        def shard(self, kind: str, inputs: list[list[int]], path: str, first: int,
                  masks: list[list[int]] | None = None) -> float:
            """Write one shard (whole, checked, atomically); returns the peak RSS in MB.
            ``masks``: the inputs' loss masks (conversations), stored as each row's
            ``loss_mask`` over its ``tokens``."""
            import os
            import resource
            import uuid

            import pyarrow as pa
            import pyarrow.parquet as pq

            ctx = dd.SignalContext(self.dec.target, self.dec.draft, self.dec.eos_token_id, d,
                                   seed, eagle_of[kind], head_temperature)
            rows = dd.data_kind(kind).make(ctx, inputs, first)
            if len(rows) != len(inputs):
                raise RuntimeError(f"{path}: {len(rows)} rows for {len(inputs)} inputs")
            if masks is not None:
                for row, x, m in zip(rows, inputs, masks, strict=True):
                    if "tokens" in row:
                        row["loss_mask"] = row_loss_mask(row["tokens"], x, m)
            # a name of its own: a lost writer never shares a temporary file with its heir
            tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
            try:
                pq.write_table(pa.Table.from_pylist(rows), tmp)
                if pq.read_metadata(tmp).num_rows != len(inputs):
                    raise RuntimeError(f"{tmp}: wrote a truncated shard")
                os.replace(tmp, path)  # atomic: a shard is whole or absent
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    stats = stats if stats is not None else {}
    stats.update({"shards_kept": 0, "shards_written": 0, "actors": [], "actors_lost": 0,
                  "redispatched": [], "errors": []})
    written, todo, inputs_of = {}, deque(), {}
    for kind in sorted(kinds):
        folder = data_dir / kind
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.tmp"):  # left by a writer killed mid-write
            stale.unlink(missing_ok=True)
        starts, length = plan_starts(d, seed, tokens, kind)
        settings = data_kind(kind).settings
        _check_plan(folder, {"kind": kind, "examples": d.examples, "shard_size": d.shard_size,
                             "length": length, "seed": seed,
                             "starts_sha256": hashlib.sha256(
                                 json.dumps(starts).encode()).hexdigest(),
                             **(settings(eagle_of[kind]) if settings else {})})
        rows = shard_rows(len(starts), d.shard_size)
        written[kind] = len(rows)
        inputs_of[kind] = (starts, length)
        for i, n in enumerate(rows):
            path = folder / shard_name(i)
            if path.exists():
                if _num_rows(path) == n:
                    stats["shards_kept"] += 1
                    continue  # resumed generation: finished shards are kept
                print(f"[generate] {path}: unreadable or {_num_rows(path)} rows, not {n}; "
                      "generating it again", flush=True)
                path.unlink()
            todo.append(_Shard(kind, i, path, i * d.shard_size, n))

    def chunk(s: _Shard) -> tuple[list[list[int]], list[list[int]] | None]:
        starts, length = inputs_of[s.kind]
        mine = starts[s.first : s.first + s.rows]
        return tokens.inputs(mine, length), tokens.masks(mine, length)

    def make():
        return Generator.options(num_cpus=d.gen_cpus_per_actor, num_gpus=d.gen_gpus_per_actor,
                                 max_restarts=0).remote()

    actors = _Actors(make, limit=d.gen_actors * MAX_SHARD_ATTEMPTS)
    peak = 0.0
    try:
        if todo:
            peak = _run(actors, todo, chunk, min(d.gen_actors, len(todo)), stats)
    finally:
        actors.kill_all()
        for kind in kinds:  # a writer killed mid-write may leave its temporary file
            for stale in (data_dir / kind).glob("*.tmp"):
                stale.unlink(missing_ok=True)
    check_shards(data_dir, kinds, d)
    return written, peak


def progress_line(done: int, total: int, rows: int, elapsed_s: float) -> str:
    """``5/12 shards (320 examples) in 151 s, 2.1 examples/s, ETA 211 s``: generation's
    progress after ``done`` of the ``total`` shards to write this run (``rows`` examples,
    ``elapsed_s`` since it started; the ETA assumes the remaining shards go at the same
    rate as the written ones)."""
    rate = rows / elapsed_s if elapsed_s > 0 else 0.0
    eta = elapsed_s / done * (total - done) if done else float("nan")
    return (f"{done}/{total} shards ({rows} examples) in {elapsed_s:.0f} s, "
            f"{rate:.1f} examples/s, ETA {eta:.0f} s")


def _run(actors: _Actors, todo: deque, chunk, size: int, stats: dict) -> float:
    """Dispatch ``todo`` over ``size`` actors until every shard is written; a lost actor's
    shards go back to the front of the queue and a replacement actor is started (while
    the budget of starts lasts). Returns the actors' peak RSS in MB."""
    import ray
    from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError

    lost_errors = (RayActorError, ObjectLostError, WorkerCrashedError, NodeDiedError)
    in_flight: dict[Any, tuple[_Shard, int]] = {}
    peak = 0.0
    total, rows, t0 = len(todo), 0, time.perf_counter()
    for _ in range(size):
        actors.start()

    def wrote(s: _Shard) -> None:
        nonlocal rows
        stats["shards_written"] += 1
        rows += s.rows
        print("[generate] " + progress_line(stats["shards_written"], total, rows,
                                            time.perf_counter() - t0), flush=True)

    def lose(slot: int, exc: BaseException) -> None:
        stats["errors"].append(type(exc).__name__)  # one per failed call
        if actors.drop(slot):
            stats["actors_lost"] += 1
            print(f"[generate] actor {slot} lost ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:200] if str(exc) else ''})", flush=True)

    while todo or in_flight:
        # keep the pool at full size while there is work (a lost actor gets a successor)
        while todo and len(actors.handles) < size and actors.started < actors.limit:
            actors.start()
            print(f"[generate] actor {actors.started - 1} started as a replacement", flush=True)
        for slot in sorted(actors.ready, key=lambda s: actors.load[s]):
            while todo and actors.load[slot] < PER_ACTOR_IN_FLIGHT:
                s = todo.popleft()
                s.attempts += 1
                inputs, masks = chunk(s)
                ref = actors.handles[slot].shard.remote(s.kind, inputs, str(s.path), s.first,
                                                        masks)
                in_flight[ref] = (s, slot)
                actors.load[slot] += 1
        if not in_flight and not actors.starting:  # shards left, every actor lost
            actors.start()  # raises once the budget of starts is spent
        waiting = list(in_flight) + list(actors.starting)
        done, _ = ray.wait(waiting, num_returns=1,
                           timeout=None if in_flight else ACTOR_START_TIMEOUT_S)
        if not done:
            raise RuntimeError(f"generation: no actor could start in {ACTOR_START_TIMEOUT_S:.0f}"
                               f" s with {len(todo)} shards left (resources: "
                               f"{ray.available_resources()})")
        ref = done[0]
        if ref in actors.starting:
            slot = actors.starting.pop(ref)
            try:
                info = ray.get(ref)
            except lost_errors as exc:
                lose(slot, exc)
                continue
            if slot in actors.handles:
                actors.ready[slot], actors.load[slot] = info, 0
                stats["actors"].append(info)
            continue
        s, slot = in_flight.pop(ref)
        if slot in actors.load:
            actors.load[slot] -= 1
        try:
            peak = max(peak, ray.get(ref))
        except lost_errors as exc:
            lose(slot, exc)
            error = exc
        else:
            if _num_rows(s.path) == s.rows:
                wrote(s)
                continue
            error = RuntimeError(f"{s.path}: missing or not {s.rows} rows after writing")
        if _num_rows(s.path) == s.rows:  # written whole before its actor was lost
            wrote(s)
            continue
        name = f"{s.kind}/{s.path.name}"
        if s.attempts >= MAX_SHARD_ATTEMPTS:
            raise RuntimeError(f"generation: shard {name} ({s.path}) failed {s.attempts} "
                               f"times; last error: {type(error).__name__}: {error}")
        stats["redispatched"].append(name)
        print(f"[generate] shard {name} dispatched again (attempt {s.attempts + 1} of "
              f"{MAX_SHARD_ATTEMPTS})", flush=True)
        todo.appendleft(s)
    return peak


def generate_logged(cfg: Any, prep: Prepared, data_dir: Path, tracker, kinds: set[str],
                    job: str, eagles: dict[str, Any] | None = None) -> dict[str, int]:
    """:func:`generate` of ``kinds`` for ``prep.target`` (``eagles``: as there), with its
    wall time, the peak memory of the driver and the actors and the shard counts logged
    to ``tracker``."""
    import time

    t0 = time.perf_counter()
    stats: dict = {}
    shards, actor_peak = generate(cfg, prep.target, data_dir, kinds, prep.tokens, stats=stats,
                                  eagles=eagles)
    tracker.log_metrics({"generate_s": time.perf_counter() - t0,
                         "generate_driver_peak_rss_mb": peak_rss_mb(),
                         "generate_actor_peak_rss_mb": actor_peak,
                         "generate_shards_kept": stats["shards_kept"],
                         "generate_shards_written": stats["shards_written"],
                         "generate_actors_lost": stats["actors_lost"],
                         "generate_shards_redispatched": len(stats["redispatched"]),
                         **{f"shards.{k}": v for k, v in shards.items()}})
    print(f"[{job}] generated {shards} in {time.perf_counter() - t0:.0f}s ("
          f"{stats['shards_written']} shards written, {stats['shards_kept']} kept, "
          f"{stats['actors_lost']} actors lost, {len(stats['redispatched'])} shards "
          "dispatched again)", flush=True)
    return shards


@dataclass
class Prepared:
    """Inputs checked and loaded on the driver before any Ray work."""

    target: str
    tokenizer: object
    tokens: TokenStream  # the tokenised training corpus
    vocab: int
    eos: int | None
    #: EAGLE jobs: the trained window against the evaluation's longest context
    #: (:func:`speclab.families.eagle.stages.context_window`); empty for the other jobs
    window: dict[str, int] = field(default_factory=dict)


def prepare_target(cfg: Any) -> Prepared:
    """Resolve the target, check tokenizer/vocabulary, load the corpus (ValueError if bad).
    ``cfg``: a job config with ``models``, ``tokenizer`` and ``corpus`` groups."""
    from transformers import AutoTokenizer

    target, _ = resolve_models(cfg.models.target, None)
    target = resolve_source(target, "models.target")  # models:/ URIs -> a local folder
    target_cfg = load_model(target, field="models.target").config
    tok = AutoTokenizer.from_pretrained(target, trust_remote_code=False)
    if cfg.tokenizer.path:
        other = AutoTokenizer.from_pretrained(cfg.tokenizer.path, trust_remote_code=False)
        if len(other) != len(tok):
            raise ValueError(f"tokenizer.path: vocabulary of {len(other)} tokens does not "
                             f"match the target's tokenizer ({len(tok)} tokens)")
    if len(tok) > target_cfg.vocab_size:
        raise ValueError(f"models.target: tokenizer has {len(tok)} tokens but the model's "
                         f"vocab_size is {target_cfg.vocab_size}")
    tokens = token_stream(cfg.corpus, tok, "train")
    return Prepared(target, tok, tokens, int(target_cfg.vocab_size), tok.eos_token_id)
