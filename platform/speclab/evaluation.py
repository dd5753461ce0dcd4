"""Evaluate decoding methods over a prompt set and aggregate their stats (no Ray here).

Timing protocol (:func:`interleaved_comparison`, used by ``bench``, ``evaluate``, the
retrieval evaluation and the sweeps): every method is timed in PAIRS with plain (AR)
decoding of the same work, one right after the other: per prompt when prompts decode one
at a time, per pass over the whole batch on the batched engine (``batch_size`` > 1 or
the compiled fast path), over ``timing_passes`` passes (:data:`TIMING_PASSES`; AR first
in even passes, the method first in odd ones; within a pass prompt by prompt, every
method's pair of a prompt before the next prompt, so a noisy stretch touches every
method a little, not one method a lot). ``speedup`` is the median of the paired ratios
with a distribution-free 95% interval (``speedup_lo`` / ``speedup_hi``), next to the
ratio of totals (``speedup_totals`` = ``tokens_per_s`` / ``ar_tokens_per_s``, both over
every timed pass); ``ar_spread`` and ``noisy`` flag a row whose AR timings moved or
whose two figures disagree (:mod:`speclab.paired_timing`). Hardware-independent figures
(tau, target calls per token, acceptance, outputs) come from the first pass.

Each run also measures its models' forward cost curves once
(:mod:`speclab.forward_costs`) and counts the forwards every block ran: ``modelled_s``
is what those forwards cost on the curves; the engine's own share of the time,
``(wall - modelled) / wall``, is taken per timed block: ``engine_overhead`` is its median
over the blocks with a 95% interval (``engine_overhead_lo`` / ``engine_overhead_hi``),
``engine_overhead_totals`` the share of the summed times
(:func:`speclab.paired_timing.overhead_figures`). The same forwards are also clocked
where they ran (``forward_s``): ``engine_clocked`` is the engine's share without the
cost model (:func:`clocked`).

Each block also records ``peak_gpu_mb``: the most GPU memory PyTorch held while it ran
(:func:`speclab.timing.peak_gpu_mb`; NaN when the target is not on CUDA).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from speclab import theory
from speclab.agreement import agreement_cell
from speclab.api import Decoder, GenerationResult
from speclab.decoding.loop import tau
from speclab.forward_costs import REPEATS, CostModel, CostSampler, ForwardRecorder, engine_overhead
from speclab.paired_timing import (
    TIMING_PASSES,
    Pair,
    baseline_figures,
    normalize_ar,
    overhead_figures,
    speedup_figures,
    unit_speedups,
)
from speclab.timing import max_mb, peak_gpu_mb, reset_peak_gpu


@dataclass(frozen=True)
class MethodRun:
    """One method configuration to evaluate (``label`` names it in tables)."""

    method: str
    params: dict = field(default_factory=dict)
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if not self.params:
            return self.method
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.method}({inner})"

    @property
    def key(self) -> str:
        """``name`` as a valid MLflow metric prefix, e.g. ``chain_gamma3``; a name longer
        than :data:`MAX_KEY` (e.g. one holding a folder path) is cut and made unique with
        a hash of the whole name, so ``<prefix><key>.<metric>`` stays within MLflow's
        250-character limit."""
        out = self.name.replace("(", "_").replace(")", "").replace(",", "_").replace("=", "")
        out = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in out)
        if len(out) > MAX_KEY:
            import hashlib

            digest = hashlib.sha1(self.name.encode()).hexdigest()[:10]
            out = f"{out[: MAX_KEY - 11]}_{digest}"
        return out


#: longest metric prefix a method gets (MLflow keys are at most 250 characters)
MAX_KEY = 160


#: draft positions whose acceptance :func:`summarize` reports (``accept_at_1..``)
ACCEPT_POSITIONS = 6


@dataclass(frozen=True)
class PromptFigures:
    """One prompt's counters (what the spread over prompts is computed from)."""

    new_tokens: int
    committed: int
    target_calls: int
    accepted: int
    judged: int
    wall_s: float


def spread(values: list[float]) -> float:
    """Sample standard deviation of ``values`` (0.0 for fewer than two)."""
    import statistics

    return statistics.stdev(values) if len(values) >= 2 else 0.0


def _add_s(a: float, b: float) -> float:
    """``a + b`` where NaN means "not measured" (NaN only when both are)."""
    if math.isnan(a):
        return b
    return a if math.isnan(b) else a + b


@dataclass
class Totals:
    """Summed counters over prompts for one method.

    The counters (tokens, calls, acceptance, outputs, per-prompt figures) are those of
    ONE pass over the prompts (the first); the timed figures (``wall_s``, ``draft_s``,
    ``verify_s``, ``timed_tokens``, ``modelled_s``) are summed over ``passes`` passes
    (:meth:`absorb`). Built by :meth:`add` alone, both are the same pass."""

    prompts: int = 0
    new_tokens: int = 0
    committed: int = 0  # tokens committed over all rounds (sum of accepted lengths)
    target_calls: int = 0  # rounds, per row: one target call each at batch 1
    forwards: int = 0  # target model forwards (a batched forward verifies many rows' rounds)
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    judged: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0
    #: ``at_least[k - 1]``: rounds that accepted at least ``k`` draft tokens, among the
    #: ``reach[k - 1]`` rounds whose draft budget could reach position ``k``
    at_least: list[int] = field(default_factory=lambda: [0] * ACCEPT_POSITIONS)
    reach: list[int] = field(default_factory=lambda: [0] * ACCEPT_POSITIONS)
    #: rounds by their draft budget in levels (0: a plain round; the ``auto`` budget's
    #: choices, or a fixed method's length cut by the tokens left)
    budgets: Counter = field(default_factory=Counter)
    outputs: list[list[int]] = field(default_factory=list)
    #: one :class:`PromptFigures` per prompt, in prompt order (the spread over prompts)
    per_prompt: list[PromptFigures] = field(default_factory=list)
    #: the prompts ran as one batch: per-prompt wall times are the batch's, no spread
    batched: bool = False
    #: MiB of GPU memory held at most while the block ran (NaN: not on CUDA / not measured)
    peak_gpu_mb: float = math.nan
    #: timed passes summed into the timed figures
    passes: int = 1
    #: tokens generated over every timed pass (what ``wall_s`` generated)
    timed_tokens: int = 0
    #: measured cost of the forwards the timed passes ran (NaN: not measured)
    modelled_s: float = math.nan
    #: the seconds those forwards took, clocked where they ran (NaN: not recorded)
    forward_s: float = math.nan
    #: the forwards the timed passes ran: ``{(model id, rows, new tokens): count}``
    shapes: Counter = field(default_factory=Counter)
    #: the method's A/B pairs with AR (:mod:`speclab.paired_timing`; empty: not paired)
    pairs: list[Pair] = field(default_factory=list)

    def add(self, res: GenerationResult) -> None:
        s = res.stats
        self.prompts += 1
        self.new_tokens += s.new_tokens
        self.timed_tokens += s.new_tokens
        self.committed += sum(s.accepted_lengths)
        self.target_calls += s.target_calls
        self.forwards += s.target_calls
        self.draft_calls += s.draft_calls
        self.drafted += s.drafted_tokens
        self.accepted += s.accepted_tokens
        self.judged += s.judged_tokens
        self.wall_s += s.wall_s
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        self.rounds += len(s.accepted_lengths)
        for accepted, reach in zip(s.round_accepted, s.round_reach, strict=True):
            for k in range(min(reach, ACCEPT_POSITIONS)):  # rounds that could reach k + 1
                self.reach[k] += 1
                self.at_least[k] += accepted > k
        self.budgets.update(s.round_reach)
        self.outputs.append(res.token_ids)
        self.per_prompt.append(PromptFigures(
            s.new_tokens, sum(s.accepted_lengths), s.target_calls, s.accepted_tokens,
            s.judged_tokens, s.wall_s))

    def merge(self, other: Totals) -> None:
        """Add ``other``: more prompts of the same passes (another prompt, another actor's
        shard). ``other``'s pairs are renumbered after this totals' prompts, so a pair's
        ``unit`` stays its prompt's index in the merged ``per_prompt`` order (the parts'
        order: with several actors, the prompts as dealt to them, the same for every
        method of one evaluation)."""
        offset = len(self.per_prompt)
        for k in ("prompts", "new_tokens", "committed", "target_calls", "forwards", "draft_calls",
                  "drafted", "accepted", "judged", "wall_s", "draft_s", "verify_s", "rounds",
                  "timed_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.at_least = [a + b for a, b in zip(self.at_least, other.at_least)]
        self.reach = [a + b for a, b in zip(self.reach, other.reach)]
        self.budgets = self.budgets + other.budgets
        self.outputs += other.outputs
        self.per_prompt += other.per_prompt
        self.batched = self.batched or other.batched
        self.peak_gpu_mb = max_mb(self.peak_gpu_mb, other.peak_gpu_mb)
        self.passes = max(self.passes, other.passes)
        self.modelled_s = _add_s(self.modelled_s, other.modelled_s)
        self.forward_s = _add_s(self.forward_s, other.forward_s)
        self.shapes = self.shapes + other.shapes
        self.pairs = self.pairs + [replace(p, unit=p.unit + offset) if p.unit >= 0 else p
                                   for p in other.pairs]

    def absorb(self, other: Totals) -> None:
        """Add ``other``'s timed figures only: further passes over the same prompts (the
        counters stay those of the first pass)."""
        for k in ("wall_s", "draft_s", "verify_s", "timed_tokens", "passes"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.modelled_s = _add_s(self.modelled_s, other.modelled_s)
        self.forward_s = _add_s(self.forward_s, other.forward_s)
        self.shapes = self.shapes + other.shapes
        self.peak_gpu_mb = max_mb(self.peak_gpu_mb, other.peak_gpu_mb)


def run_prompts(dec: Decoder, run: MethodRun, prompts: list[list[int]], gen: dict,
                first: int = 0) -> Totals:
    """Generate for every prompt with one method; ``gen`` holds Decoder.generate kwargs
    (``batch_size`` > 1, or a Decoder on the compiled fast path: the prompts go through
    the batched engine together, and the wall, draft and verify times and the forwards
    are the batch's; ``timing_passes`` is the protocol's, ignored here). Prompt ``i``
    samples with seed ``seed + first + i`` (``first``: its index in the whole prompt
    set, so a prompt decoded alone gets the seed it gets in the set).
    ``peak_gpu_mb``: the block's peak GPU memory (NaN off CUDA)."""
    totals = Totals()
    gen = dict(gen)
    gen.pop("timing_passes", None)
    seed, batch_size = gen.pop("seed", 0) + first, gen.pop("batch_size", 1) or 1
    device = dec.target.device
    reset_peak_gpu(device)
    if batch_size > 1 or dec.compile:  # (the fast path is the batched engine's)
        for res in dec.generate(prompts=prompts, batch_size=batch_size, method=run.method,
                                seed=seed, **gen, **run.params):
            totals.add(res)
        b = dec.last_batch
        totals.wall_s, totals.draft_s, totals.verify_s = b.wall_s, b.draft_s, b.verify_s
        totals.forwards, totals.draft_calls = b.target_forwards, b.draft_forwards
        totals.batched = True
    else:
        for i, ids in enumerate(prompts):
            res = dec.generate(prompt_ids=ids, method=run.method, seed=seed + i, **gen,
                               **run.params)
            totals.add(res)
    totals.peak_gpu_mb = peak_gpu_mb(device)
    return totals


#: one timed block: ``(prompts, index of the first in the prompt set) -> Totals``
Block = Callable[[list[list[int]], int], Totals]


#: seconds between two progress lines within a pass of :func:`paired_passes`
PROGRESS_EVERY_S = 20.0


def _eta(done: float, elapsed: float) -> str:
    """``N s, ETA M s``: ``elapsed`` seconds for the fraction ``done`` of the work, the
    rest at the same pace (``N s`` alone once done)."""
    if done >= 1:
        return f"{elapsed:.0f} s"
    return f"{elapsed:.0f} s, ETA {elapsed * (1 - done) / done:.0f} s"


def paired_passes(blocks: dict[str, Block], baseline: Block, prompts: list[list[int]],
                  passes: int = TIMING_PASSES, batched: bool = False,
                  record: Callable[[], Counter] | None = None,
                  between: Callable[[], None] | None = None,
                  progress: Callable[[str], None] | None = None
                  ) -> dict[str, tuple[Totals, Totals]]:
    """The paired protocol (module docstring) over any timed blocks: ``{name: (method
    totals, its AR totals)}``. Each pass runs, prompt by prompt (``batched``: once over
    all prompts), every block of ``blocks`` paired with ``baseline`` on the same prompts,
    the baseline first in even passes and second in odd ones. Totals: counters of the
    first pass, timings summed over all; the method's ``pairs`` carry every pair with its
    AR timing normalised by the median AR timing of the same prompt (every method's).
    ``record()`` (when given) returns the forwards run since it was last called and the
    seconds they took (:meth:`speclab.forward_costs.ForwardRecorder.take`): each block's
    ``shapes`` (:func:`price` turns them into ``modelled_s``) and ``forward_s``. ``between()`` runs
    after every prompt's pairs (untimed: e.g. a round of forward cost measurements).
    ``progress`` gets a line per pass."""
    if passes < 1:
        raise ValueError(f"timing_passes: must be >= 1, got {passes}")
    units = [(-1, prompts, 0)] if batched else [(i, [p], i) for i, p in enumerate(prompts)]
    final: dict[str, list[Totals]] = {}
    pairs: dict[str, list[Pair]] = {name: [] for name in blocks}
    if record is not None:
        record()  # forget forwards before the first timed block

    def timed(block: Block, ps: list[list[int]], first: int) -> Totals:
        t = block(ps, first)
        if record is not None:
            t.shapes, t.forward_s = record()
        return t

    t_start = said = time.perf_counter()
    for k in range(passes):
        cur = {name: [Totals(), Totals()] for name in blocks}
        for j, (unit, ps, first) in enumerate(units, start=1):
            for name, block in blocks.items():
                if k % 2 == 0:
                    ar = timed(baseline, ps, first)
                    m = timed(block, ps, first)
                else:
                    m = timed(block, ps, first)
                    ar = timed(baseline, ps, first)
                cur[name][0].merge(m)
                cur[name][1].merge(ar)
                pairs[name].append(Pair(unit, k, ar.wall_s, ar.new_tokens, m.wall_s,
                                        m.new_tokens, shapes=m.shapes, ar_shapes=ar.shapes))
            if between is not None:
                between()
            now = time.perf_counter()
            if progress is not None and j < len(units) and now - said >= PROGRESS_EVERY_S:
                said = now
                progress(f"pass {k + 1}/{passes}, prompt {j}/{len(units)}: "
                         + _eta((k * len(units) + j) / (passes * len(units)), now - t_start))
        for name, (m, ar) in cur.items():
            if k == 0:
                final[name] = [m, ar]
            else:
                final[name][0].absorb(m)
                final[name][1].absorb(ar)
        if progress is not None:
            said = time.perf_counter()
            progress(f"pass {k + 1}/{passes}: {len(prompts)} prompts x {len(blocks)} "
                     f"methods, each paired with AR; " + _eta((k + 1) / passes, said - t_start))
    flat = normalize_ar([p for name in blocks for p in pairs[name]])
    at = 0
    for name in blocks:
        final[name][0].pairs = flat[at: at + len(pairs[name])]
        at += len(pairs[name])
    return {name: (m, ar) for name, (m, ar) in final.items()}


def price(results: dict[str, tuple[Totals, Totals]], costs: CostModel) -> None:
    """Set ``modelled_s`` of every totals in ``results`` (:func:`paired_passes`'s) and of
    each of its pairs' blocks: the cost of the recorded forwards (``shapes``) on
    ``costs``' curves."""
    for pair in results.values():
        for t in pair:
            t.modelled_s = costs.seconds(t.shapes)
            t.pairs = [replace(p, modelled_s=costs.seconds(p.shapes),
                               ar_modelled_s=costs.seconds(p.ar_shapes)) for p in t.pairs]


#: forward cost curves measured so far, per Decoder and run shape (a sweep's trials reuse
#: their worker's Decoder: its curves are measured once, not once per trial)
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _costs_key(prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> tuple:
    lengths = sorted(len(p) for p in prompts) or [0]
    return (batch_size, max_new_tokens, lengths[-1], lengths[len(lengths) // 2])


def recorder_for(dec: Decoder, networks: dict | None = None) -> ForwardRecorder:
    """A :class:`~speclab.forward_costs.ForwardRecorder` on ``dec``'s target and draft
    model and the drafters' own ``networks`` (name -> module)."""
    return ForwardRecorder([dec.target.model, dec.draft.model if dec.draft else None,
                            *(networks or {}).values()])


def interleaved_comparison(
    dec: Decoder, runs: list[MethodRun], prompts: list[list[int]], gen: dict, warmup: bool = True,
    progress: Callable[[str], None] | None = None, passes: int | None = None,
    forward_costs: bool | CostModel = True,
) -> dict[str, dict]:
    """Every method of ``runs`` paired with AR on the same prompts (:func:`paired_passes`).

    ``passes``: timed passes (default ``gen["timing_passes"]``, else
    :data:`TIMING_PASSES`). ``forward_costs``: measure the models' forward cost curves
    (:class:`speclab.forward_costs.CostSampler`, its rounds spread between the timed
    pairs; once per Decoder and run shape) and price every block's forwards on them
    (``modelled_s``); a :class:`~speclab.forward_costs.CostModel` prices on that one;
    False, or the compiled fast path: ``modelled_s`` NaN. Returns ``{name: {"run":
    MethodRun, "totals": Totals, "ar": Totals, "costs": CostModel | None}}`` where ``ar``
    holds the AR timings paired with that method (:func:`pooled_ar` pools every method's:
    the AR row). ``progress`` gets a line per pass and then per method (its place in the
    list, tokens, tokens/s against its AR's, tau, speedup with its interval).
    """
    gen = dict(gen)
    passes = passes or gen.pop("timing_passes", None) or TIMING_PASSES
    gen.pop("timing_passes", None)
    batch_size = gen.get("batch_size", 1) or 1
    if warmup and prompts:
        for run in [MethodRun("ar"), *runs]:
            run_prompts(dec, run, prompts[:1], {**gen, "max_new_tokens": 8})
        dec.forget_budgets()  # the warm-up's first-use costs must not steer the timed passes
    if any(r.params.get("budget") == "auto" for r in runs) and not dec.compile:
        # the auto budget's curves up to the timed batch (read, or measured now, before
        # the timed passes): the one-prompt warm-up asked for one row only
        dec.calibration(min(batch_size, len(prompts)))
    batched = batch_size > 1 or dec.compile
    costs = forward_costs if isinstance(forward_costs, CostModel) else None
    sampler = key = None
    # the drafters' own networks the warm-up loaded (EAGLE): priced one prompt at a time
    networks = {} if batched else dec.drafter_networks()
    if forward_costs is True and prompts and not dec.compile:
        key = (*_costs_key(prompts, gen.get("max_new_tokens", 64), batch_size),
               tuple(sorted(id(m) for m in networks.values())))
        costs = _COSTS.get(dec, {}).get(key)
        if costs is None:
            sampler = CostSampler(dec, prompts, gen.get("max_new_tokens", 64), batch_size,
                                  networks)
    recorder = recorder_for(dec, networks) if costs is not None or sampler is not None \
        else None
    between = None
    if sampler is not None:
        sampler.round()  # one round now, the rest spread between the pairs
        spread = sampler.spread(passes * (1 if batched else len(prompts)), REPEATS - 1)

        def between() -> None:
            spread()
            recorder.take()  # the measurements' forwards are no method's

    def block(run: MethodRun) -> Block:
        return lambda ps, first: run_prompts(dec, run, ps, gen, first)

    blocks = {run.name: block(run) for run in runs}
    with recorder if recorder is not None else contextlib.nullcontext():
        res = paired_passes(blocks, block(MethodRun("ar")), prompts, passes, batched,
                            recorder.take if recorder is not None else None, between,
                            progress)
    if sampler is not None:
        costs = sampler.model()
        _COSTS.setdefault(dec, {})[key] = costs
    if costs is not None:
        price(res, costs)
    out = {}
    for i, run in enumerate(runs, start=1):
        totals, ar = res[run.name]
        out[run.name] = {"run": run, "totals": totals, "ar": ar, "costs": costs}
        if progress is not None:
            def rate(t: Totals) -> float:
                return t.timed_tokens / t.wall_s if t.wall_s else 0.0

            fig = speedup_figures(totals.pairs)
            progress(f"method {i}/{len(runs)} {run.name}: {len(prompts)} prompts, "
                     f"{totals.new_tokens} tokens, {rate(totals):.1f} tokens/s (AR "
                     f"{rate(ar):.1f}), tau {tau(totals.committed, totals.target_calls):.2f}, "
                     f"speedup {fig['speedup']:.2f}x [{fig['speedup_lo']:.2f}, "
                     f"{fig['speedup_hi']:.2f}]")
    return out


def merge_results(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """:func:`interleaved_comparison`'s results over disjoint prompt sets (actors' shards,
    categories) as one result of the same shape: each method's ``totals`` and ``ar``
    merged in part order (so ``outputs`` follow the parts' prompts in that order), its
    ``run`` and ``costs`` from the first part that has it."""
    merged: dict[str, dict] = {}
    for part in parts:
        for name, res in part.items():
            slot = merged.setdefault(name, {"run": res.get("run"), "totals": Totals(),
                                            "ar": Totals(), "costs": res.get("costs")})
            slot["totals"].merge(res["totals"])
            slot["ar"].merge(res["ar"])
    return merged


def pooled_ar(results: dict[str, dict]) -> Totals:
    """The AR row's totals: the first pass's counters of the first method's AR, the timed
    figures and pairs of every method's AR (:func:`interleaved_comparison`'s results,
    possibly merged over actors)."""
    entries = list(results.values())
    out = copy.deepcopy(entries[0]["ar"])
    for e in entries[1:]:
        out.absorb(e["ar"])
    out.pairs = [p for e in entries for p in e["totals"].pairs]
    return out


def overheads(totals: Totals, ar: Totals) -> dict[str, float]:
    """``engine_overhead`` (median over the timed blocks), its interval and
    ``engine_overhead_totals`` (:func:`speclab.paired_timing.overhead_figures`; the AR
    row, ``totals is ar``, from its own blocks); without priced pairs, the totals' share
    for all three figures' centre and NaN bounds."""
    if totals.pairs and not all(math.isnan(p.modelled_s) for p in totals.pairs):
        return overhead_figures(totals.pairs, ar_side=totals is ar)
    share = engine_overhead(totals.wall_s, totals.modelled_s)
    return {"engine_overhead": share, "engine_overhead_lo": math.nan,
            "engine_overhead_hi": math.nan, "engine_overhead_totals": share}


def clocked(totals: Totals) -> dict[str, float]:
    """``forward_s`` (the timed forwards' own seconds, clocked where they ran) and
    ``engine_clocked`` = ``(wall_s - forward_s) / wall_s`` over every timed pass: the
    engine's share with no cost model in between (NaN when not recorded). Unlike
    ``engine_overhead`` it counts a forward at what it cost in the run; a model whose
    forward costs depend on what ran before (weights in the CPU caches or not) makes
    the two differ."""
    return {"forward_s": totals.forward_s,
            "engine_clocked": engine_overhead(totals.wall_s, totals.forward_s)}


def summarize(
    run: MethodRun, totals: Totals, ar: Totals, reference_outputs: list[list[int]] | None = None
) -> dict:
    """One table row: hardware-independent figures next to wall-clock ones.

    ``c`` = time of one draft forward / time of one target forward (AR per-token time);
    ``predicted_speedup``: Leviathan Theorem 3.8 for chains (measured alpha, gamma, c),
    the SpecDec++ cost model (eq. 2.1 with the measured call counts) for other methods.
    Wall-clock figures (module docstring): ``tokens_per_s`` and ``ar_tokens_per_s`` over
    every timed pass, ``speedup`` (median paired ratio) with ``speedup_lo`` /
    ``speedup_hi`` / ``speedup_coverage`` / ``speedup_pairs``, ``speedup_totals``,
    ``ar_spread``, ``noisy``, ``timing_note``, and (prompt by prompt, not batched)
    ``speedup_per_prompt`` (:func:`speclab.paired_timing.unit_speedups`); ``modelled_s``
    and ``engine_overhead`` with ``engine_overhead_lo`` / ``_hi`` / ``_totals``
    (:func:`overheads`; NaN when the forward costs were not measured); ``forward_s``
    and ``engine_clocked`` (:func:`clocked`). The AR row (``totals is ar``) has
    speedup 1 with the interval ``[1, 1]``. Totals without pairs (built by hand) get the
    ratio of totals as ``speedup`` and NaN for the interval and the spread.
    """
    n = max(totals.new_tokens, 1)
    t_target = ar.wall_s / max(ar.forwards * max(ar.passes, 1), 1)
    t_draft = (totals.draft_s / (totals.draft_calls * max(totals.passes, 1))
               if totals.draft_calls else 0.0)
    c = t_draft / t_target if t_target else 0.0
    alpha = totals.accepted / totals.judged if totals.judged else 0.0
    tokens_per_s = totals.timed_tokens / totals.wall_s if totals.wall_s else 0.0
    ar_tps = ar.timed_tokens / ar.wall_s if ar.wall_s else 0.0
    ratio_of_totals = tokens_per_s / ar_tps if ar_tps else 0.0
    if totals is ar:
        timing = baseline_figures(ar.pairs)
    elif totals.pairs:
        timing = speedup_figures(totals.pairs, ratio_of_totals)
    else:
        timing = {"speedup": ratio_of_totals, "speedup_lo": math.nan, "speedup_hi": math.nan,
                  "speedup_coverage": math.nan, "speedup_pairs": 0,
                  "speedup_totals": ratio_of_totals, "ar_spread": math.nan, "noisy": False,
                  "timing_note": ""}
    speedup = timing["speedup"]
    if run.method == "chain":
        gamma = int(run.params.get("gamma", 4))
        predicted = theory.walltime_improvement(min(alpha, 1.0), gamma, c)
    elif run.method == "ar":
        predicted = 1.0
    else:
        model_time = theory.total_time(t_draft, t_target, totals.draft_calls, totals.target_calls)
        predicted = (t_target * n) / model_time if model_time else 0.0
    if totals.forwards != totals.target_calls or ar.forwards != ar.target_calls:
        predicted = None  # batched: the per-sequence cost models do not apply
    row = {
        "method": run.name,
        "prompts": totals.prompts,
        "new_tokens": totals.new_tokens,
        "tau": tau(totals.committed, totals.target_calls),
        "target_calls_per_token": totals.target_calls / n,
        "target_forwards_per_token": totals.forwards / n,
        "draft_calls_per_token": totals.draft_calls / n,
        "acceptance_rate": alpha,
        "discard_rate": (totals.drafted - totals.accepted) / n,
        "tokens_per_s": tokens_per_s,
        "ar_tokens_per_s": ar_tps,
        "decode_s": totals.wall_s,  # its timed decoding, every pass (summed over actors)
        **timing,
        "passes": totals.passes,
        "c": c,
        "predicted_speedup": predicted,
        "measured_over_predicted": speedup / predicted if predicted else None,
        "draft_s": totals.draft_s,
        "verify_s": totals.verify_s,
        "wall_s": totals.wall_s,
        "modelled_s": totals.modelled_s,  # NaN: forward costs not measured
        **overheads(totals, ar),
        **clocked(totals),
        "peak_gpu_mb": totals.peak_gpu_mb,  # NaN when the models are not on CUDA
        # the rounds' draft budgets: their mean and how many rounds had each
        # ("budget:rounds" pairs, e.g. "0:12 3:40")
        "budget_mean": (sum(b * c for b, c in totals.budgets.items())
                        / max(sum(totals.budgets.values()), 1)),
        "budget_histogram": " ".join(f"{b}:{c}" for b, c in sorted(totals.budgets.items())),
        # acceptance per draft position: the fraction of rounds accepting >= k tokens,
        # among the rounds whose budget could reach k (NaN: none could, e.g. AR)
        **{f"accept_at_{k + 1}": c / n if n else math.nan
           for k, (c, n) in enumerate(zip(totals.at_least, totals.reach, strict=True))},
    }
    row.update(prompt_spread(totals, ar))
    if totals.pairs and totals is not ar and not totals.batched:
        row["speedup_std"] = spread([r for r in (p.ratio for p in totals.pairs)
                                     if not math.isnan(r)])  # over every paired ratio
        # each prompt's own speedup (median over passes), in prompt order: what a
        # paired speedup ordering of two methods reads (speclab.orderings)
        row["speedup_per_prompt"] = unit_speedups(totals.pairs, len(totals.per_prompt))
    if reference_outputs is not None:
        row["identical_to_ar"] = totals.outputs == reference_outputs
    return row


def prompt_spread(totals: Totals, ar: Totals) -> dict[str, float | list[float] | None]:
    """``tau_per_prompt``, each prompt's own tau (first pass, prompt order: what paired
    comparisons of two drafters on the same prompts read, :mod:`speclab.orderings`), and
    ``<column>_std`` for tau, target_calls_per_token, acceptance_rate, tokens_per_s
    and speedup: the sample standard deviation over prompts of each prompt's own figure
    in the first pass (``speedup``: the prompt's tokens/s over the same prompt's tokens/s
    in its AR timing; :func:`summarize` replaces it by the spread of every paired ratio
    when the totals carry pairs). The wall-clock ones are None when either block ran
    batched (one wall time for the whole batch)."""
    per = totals.per_prompt
    taus = [tau(p.committed, p.target_calls) for p in per]
    out: dict[str, float | list[float] | None] = {
        "tau_per_prompt": taus,
        "tau_std": spread(taus),
        "target_calls_per_token_std": spread([p.target_calls / max(p.new_tokens, 1)
                                              for p in per]),
        "acceptance_rate_std": spread([p.accepted / p.judged if p.judged else 0.0
                                       for p in per]),
        "tokens_per_s_std": None, "speedup_std": None,
    }
    if not totals.batched and not ar.batched:
        def rates(prompts: list[PromptFigures]) -> list[float]:
            return [p.new_tokens / p.wall_s if p.wall_s else 0.0 for p in prompts]

        tps, ar_tps = rates(per), rates(ar.per_prompt)
        out["tokens_per_s_std"] = spread(tps)
        if len(ar_tps) == len(tps):
            out["speedup_std"] = spread([m / a for m, a in zip(tps, ar_tps) if a])
    return out


def speedup_cell(row: dict) -> str:
    """``1.84x [1.71, 1.90]``: the median paired ratio and its 95% interval (no interval:
    the ratio alone)."""
    s, lo, hi = row.get("speedup"), row.get("speedup_lo"), row.get("speedup_hi")
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return f"{s:.2f}x"
    return f"{s:.2f}x [{lo:.2f}, {hi:.2f}]"


def overhead_cell(row: dict) -> str:
    """``engine_overhead`` as ``9% [7, 11]`` (its interval in percent) or ``9%``; ``-``
    when not measured."""
    o, lo, hi = (row.get(k) for k in ("engine_overhead", "engine_overhead_lo",
                                      "engine_overhead_hi"))
    if o is None or math.isnan(o):
        return "-"
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return f"{o:.0%}"
    return f"{o:.0%} [{lo * 100:.0f}, {hi * 100:.0f}]"


#: a table column: its key (the header) and a format string or a function of the row
Column = tuple[str, "str | Callable[[dict], str]"]

COLUMNS: list[Column] = [
    ("method", "{}"), ("tau", "{:.2f}"), ("target_calls_per_token", "{:.3f}"),
    ("acceptance_rate", "{:.2f}"), ("tokens_per_s", "{:.1f}"), ("speedup", speedup_cell),
    ("speedup_totals", "{:.2f}x"), ("engine_overhead", overhead_cell),
    ("engine_clocked", "{:.0%}"), ("predicted_speedup", "{:.2f}x"),
    ("measured_over_predicted", "{:.2f}"), ("noisy", "{}"),
    ("identical_to_ar", agreement_cell("identical_to_ar")),
]


def cell(row: dict, key: str, fmt) -> str:
    """One table cell: ``fmt`` (a format string or a function of the row) applied to
    ``row[key]``; ``-`` for a missing, None or NaN value."""
    if callable(fmt):
        return fmt(row)
    v = row.get(key)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


#: method labels longer than this are shown by a short name and a legend
SHORT_LABEL = 24


def auto_label(p: dict) -> str:
    """The automatic label of a method's settings ``p`` (``name`` and knobs):
    ``name(k=v,...)``, knobs sorted; ``name`` alone without knobs."""
    knobs = {k: v for k, v in p.items() if k not in ("name", "label")}
    inner = ",".join(f"{k}={v}" for k, v in sorted(knobs.items()))
    return f"{p.get('name')}({inner})" if knobs else str(p.get("name"))


def distinct_knobs(params: list[dict]) -> list[str]:
    """Each method's ``name`` with only the knobs whose values differ between the
    methods of that name in ``params`` (``chain(gamma=2)`` beside ``chain(gamma=4)``,
    but ``salf`` alone)."""
    out = []
    for p in params:
        same = [q for q in params if q.get("name") == p.get("name")]
        differ = sorted(k for k in p if k not in ("name", "label")
                        and any(q.get(k) != p[k] for q in same))
        inner = ",".join(f"{k}={p[k]}" for k in differ)
        out.append(f"{p.get('name')}({inner})" if inner else str(p.get("name")))
    return out


def short_labels(labels: list[str]) -> dict[str, str]:
    """Short names for the automatic labels (``name(k=v,...)``) longer than
    :data:`SHORT_LABEL`: the name with only the knobs that differ between the labels of
    that name (:func:`distinct_knobs`, as the MLflow child runs are named), e.g.
    ``tree(depth=3,nodes=6,...)`` -> ``tree``; ``{}`` when every label fits, or when two
    names would be the same."""
    unique = list(dict.fromkeys(labels))
    parsed = []
    for label in unique:
        name, _, inner = label.partition("(")
        pairs = [kv.split("=", 1) for kv in inner[:-1].split(",")] if inner else []
        p = {"name": name, **{kv[0]: kv[1] for kv in pairs if len(kv) == 2}}
        parsed.append(p if label.endswith(")") == bool(inner) and auto_label(p) == label
                      else None)
    shorts = distinct_knobs([p or {"name": label} for p, label in zip(parsed, unique)])
    out = {label: short for label, short, p in zip(unique, shorts, parsed)
           if p is not None and len(label) > SHORT_LABEL and short != label}
    names = [out.get(label, label) for label in unique]
    return out if len(set(names)) == len(names) else {}


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    """A plain-text table of ``rows`` (missing cells shown as ``-``); method labels
    longer than :data:`SHORT_LABEL` get a short name and a legend under the table."""
    header = [c for c, _ in columns]
    short = short_labels([str(r.get("method", "")) for r in rows]) if "method" in header \
        else {}
    cells = [[short.get(v, v) if c == "method" else v
              for c, v in ((c, cell(r, c, fmt)) for c, fmt in columns)] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    lines += [f"  {s}: {label}" for label, s in short.items()]
    return "\n".join(lines)


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    """:func:`format_table`'s table in Markdown (what MLflow shows as a run's
    description)."""
    header = [c for c, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r, c, fmt) for c, fmt in columns) + " |")
    return "\n".join(lines)


def greedy_oracle(dec: Decoder, prompt: list[int], max_new_tokens: int) -> tuple[int, int]:
    """SpecDec++ Lemma 2.1 for one prompt: ``(N, |S|)``.

    ``X``: the target's greedy tokens (N of them); ``Y_i``: the draft's argmax given
    ``prompt + X_<i`` (one teacher-forced draft forward); ``S``: positions where they
    differ. Stopping right before every disagreement gives the oracle
    ``N_target = |S| + 1`` and ``N_discarded = 0``.
    """
    import torch

    if dec.draft is None:
        raise ValueError("draft: the oracle needs a draft model")
    x = dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=max_new_tokens).token_ids
    dec.draft.reset()
    logits = dec.draft.forward(torch.tensor(prompt + x, dtype=torch.long))
    y = logits[len(prompt) - 1: len(prompt) - 1 + len(x)].argmax(-1).tolist()
    return len(x), sum(a != b for a, b in zip(x, y))


def pareto_dominated(point: tuple[float, float], others: list[tuple[float, float]]) -> bool:
    """True when some point of ``others`` is at least as low on both coordinates and
    strictly lower on one (both rates are costs: lower is better)."""
    return any(o[0] <= point[0] and o[1] <= point[1] and o != point for o in others)


def median_call_time(runner, call: Callable[[], object], n: int = 16) -> float:
    """Median seconds ``runner`` (a :class:`~speclab.decoding.runner.ModelRunner`)
    spends in one of ``n`` calls of ``call`` (which runs one forward on it)."""
    import statistics

    times = []
    for _ in range(n):
        s0 = runner.seconds
        call()
        times.append(runner.seconds - s0)
    return statistics.median(times)


def forward_times(dec: Decoder, prompt: list[int], n: int = 16) -> tuple[float, float]:
    """``(t_draft, t_target)``: median seconds of one single-token forward after
    ``prompt`` (SpecDec++ eq. 2.3's constants); ``t_draft`` is 0 without a draft."""
    import torch

    out = []
    for runner in (dec.draft, dec.target):
        if runner is None:
            out.append(0.0)
            continue
        runner.reset()
        runner.forward(torch.tensor(prompt, dtype=torch.long))
        out.append(median_call_time(
            runner, lambda r=runner: r.forward(torch.tensor([prompt[-1]], dtype=torch.long)), n))
    return out[0], out[1]
