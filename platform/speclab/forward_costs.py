"""Measured forward costs, and the engine's own time against them (imports torch).

A method's wall time is its models' forwards plus the engine's own work (building trees,
the verification rule, commits and cache pruning, Python). To tell them apart, each run
measures its models' forward cost curves ONCE (:func:`measure_costs`), counts the
forwards every timed block actually ran (:class:`ForwardRecorder`), and prices them on
the curves:

* ``modelled_s`` = the sum, over the forwards a method ran, of the measured cost of a
  forward of that shape (rows x new tokens) on that model;
* ``engine_overhead`` = ``(wall_s - modelled_s) / wall_s``: the share of the wall time
  that was not model forwards (negative only when noise made the block faster than
  the curve).

The curve of a model: the median seconds of :data:`REPEATS` forwards (one untimed
forward first) by number of new tokens (:data:`TOKEN_POINTS`, plus the prompts' lengths
for prefills) and number of rows (1 decoding one prompt at a time; 1, 2, 4, ... up to
the batch size for the batched engine), timed on the runner the engine uses
(:class:`~speclab.decoding.runner.ModelRunner` alone, else
:class:`~speclab.decoding.batch_runner.BatchRunner`) with its own forward clock: up to
:data:`SMALL` new tokens on top of a prefix of the run's representative context length
(the median prompt plus half the new tokens), with the attention pattern a tree forward
passes; larger counts (prefills) from an empty cache, last position's logits only, and
at a number of rows only where that many of the run's prompts could make such a prefill
(:func:`prefill_shapes`).
Between measured points the cost is interpolated linearly (in tokens, then rows), and
extrapolated from the last two points beyond them. The forwards are timed in rounds (one
forward of every point per round, :class:`CostSampler`), and the evaluation spreads the
rounds over the whole run, between its timed pairs: a short stall of a shared machine
then touches one round, and the median per point is the run's typical cost rather than
a snapshot of one moment. The curve is then made non-decreasing by its lower envelope
(:func:`monotone`: a forward never costs less for more work, and noise only slows).

Covered: the target and the pair's draft model (every forward of theirs goes through
their ``forward``: the hooks see the engine's runners and Hugging Face's ``generate``
alike), and, one prompt at a time, a drafter's own network that says what its forward
takes (``cost_inputs(n)``: an EAGLE drafter, :meth:`speclab.api.Decoder.drafter_networks`;
its tree steps' shape: EAGLE-3's fusion of the target's layers in the round's first
forward counts as the engine's). Not covered: such a network in the batched engine,
and Medusa heads and SpecDec++'s acceptance head: their time counts as the engine's.
Not measured on the compiled fast path (hooks would break the compiled step, and the
compiled forwards cost less than the eager curve): NaN there.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.host import ForwardClock
from speclab.decoding.runner import ModelRunner

#: new-token counts every curve is measured at (draft and verify forwards)
TOKEN_POINTS = (1, 2, 4, 8, 16, 32)
#: up to this many new tokens a point is measured on top of the representative context
SMALL = 32
#: timed forwards per point (their median is the point's cost)
REPEATS = 7


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through ``(xs, ys)`` (xs ascending), linear beyond the ends."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if xs[0] else 1.0) if x > xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if x < x0:  # below the first point: no cheaper than half of it
        return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.5 * y0)
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclass
class CostCurve:
    """Seconds of one forward of one model by rows and new tokens (measured points)."""

    #: rows -> [(new tokens, seconds)] ascending in tokens
    points: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    def cost(self, rows: int, tokens: int) -> float:
        """Interpolated seconds of a ``[rows, tokens]`` forward."""
        rs = sorted(self.points)
        per_rows = []
        for r in rs:
            pts = self.points[r]
            per_rows.append(_interp([t for t, _ in pts], [s for _, s in pts], tokens))
        if len(rs) == 1:
            return per_rows[0]
        return _interp(rs, per_rows, rows)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """JSON-ready: ``{rows: {tokens: seconds}}``."""
        return {str(r): {str(t): s for t, s in pts} for r, pts in self.points.items()}


@dataclass
class CostModel:
    """A run's forward cost curves, one per model (by ``id``), and what a record costs."""

    curves: dict[int, CostCurve] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    def seconds(self, forwards: Counter) -> float:
        """Measured seconds of ``forwards`` (``{(model id, rows, tokens): count}``);
        a model without a curve costs nothing (its time is the engine's)."""
        total = 0.0
        for (mid, rows, tokens), n in forwards.items():
            curve = self.curves.get(mid)
            if curve is not None:
                total += n * curve.cost(rows, tokens)
        return total

    def to_dict(self) -> dict:
        """JSON-ready curves by model name."""
        return {self.names.get(m, str(m)): c.to_dict() for m, c in self.curves.items()}


class ForwardRecorder:
    """Counts the forwards of ``models`` by shape and clocks them in place: a forward
    pre-hook on each top-level model records ``(id(model), rows, new tokens)`` of its
    ``input_ids`` (or ``inputs_embeds``) and starts a
    :class:`~speclab.decoding.host.ForwardClock` (CUDA events on a GPU: nothing waits),
    a forward hook stops it (a forward inside another recorded one is not clocked
    twice). Use as a context manager (hooks removed on exit); :meth:`take` returns the
    counts and the clocked seconds so far and starts over."""

    def __init__(self, models: list[torch.nn.Module]) -> None:
        self.models = list({id(m): m for m in models if m is not None}.values())
        self.counts: Counter = Counter()
        device = next((p.device for m in self.models for p in m.parameters()),
                      torch.device("cpu"))
        self.clock = ForwardClock(device)
        self._depth = 0
        self._handles: list = []

    def __enter__(self) -> ForwardRecorder:
        def stop(module, args, output) -> None:
            self._depth -= 1
            if self._depth == 0:
                self.clock.stop()

        for m in self.models:
            def start(module, args, kwargs, mid=id(m)):
                x = kwargs.get("input_ids")
                if x is None:
                    x = args[0] if args else kwargs.get("inputs_embeds")
                if x is not None and x.dim() >= 2:
                    self.counts[(mid, int(x.shape[0]), int(x.shape[1]))] += 1
                if self._depth == 0:
                    self.clock.start()
                self._depth += 1
            self._handles.append(m.register_forward_pre_hook(start, with_kwargs=True))
            self._handles.append(m.register_forward_hook(stop, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> tuple[Counter, float]:
        """The counts since the last call and the seconds those forwards took, clocked
        where they ran (and reset both)."""
        out, self.counts = self.counts, Counter()
        return out, self.clock.take()


def token_points(prompts: list[list[int]]) -> list[int]:
    """:data:`TOKEN_POINTS`, then powers of two up to the longest prompt and the longest
    prompt itself (what a prefill processes)."""
    longest = max((len(p) for p in prompts), default=1)
    pts = set(TOKEN_POINTS)
    t = 2 * SMALL
    while t < longest:
        pts.add(t)
        t *= 2
    pts.add(max(longest, 1))
    return sorted(pts)


def prefill_shapes(lengths: list[int], rows: int, tokens: list[int]) -> list[int]:
    """The new-token points of ``tokens`` worth measuring at ``rows`` rows: every one up
    to :data:`SMALL`, and a prefill of ``t`` tokens per row only where ``rows`` prompts
    of ``lengths`` could make one (at least ``rows`` of them hold ``t / 2`` tokens or
    more: :func:`~speclab.decoding.batch_runner.prefill_groups` pads a row to at most
    twice its length). 32 ShareGPT prompts at 32 rows: the sampler spent over 20 minutes
    on 32-row prefills of up to 1,465 tokens that the engine never runs."""
    return [t for t in tokens
            if t <= SMALL or sum(1 for n in lengths if 2 * n >= t) >= rows]


def row_points(batch_size: int) -> list[int]:
    """1, 2, 4, ... below ``batch_size``, and ``batch_size``."""
    pts, r = {batch_size}, 1
    while r < batch_size:
        pts.add(r)
        r *= 2
    return sorted(pts)


@dataclass
class _Point:
    """One point of a curve: ``call()`` runs a forward of ``rows`` x ``tokens`` on
    ``runner`` (timed by the runner's own clock); ``times``: its timings so far."""

    model: int
    rows: int
    tokens: int
    runner: object
    call: object
    after: object = None  # untimed, after each call (a prefill's cache is freed)
    times: list[float] = field(default_factory=list)

    def run(self) -> float:
        """One forward: its seconds on the runner's clock."""
        s0 = self.runner.seconds
        self.call()
        dt = self.runner.seconds - s0
        if self.after is not None:
            self.after()
        return dt


def _batched_points(model: torch.nn.Module, rows: int, tokens: list[int],
                    prefix: list[int], ids) -> tuple[list[_Point], list]:
    """The points of ``[rows, tokens]`` forwards on a :class:`BatchRunner` (and the
    runners to release at the end)."""
    runner = BatchRunner(model)
    runner.add_rows([prefix] * rows, logits=False)
    base = runner.length(0)

    def small(new: list[torch.Tensor], allowed) -> None:
        runner.forward(new, allowed=allowed)
        for b in range(rows):
            runner.crop(b, base)
        runner.compact()  # (outside the runner's forward clock)

    def prefill(fresh: BatchRunner, new: list[torch.Tensor]) -> None:
        fresh.add_rows([q.tolist() for q in new], logits=False)

    points, runners = [], [runner]
    for t in tokens:
        new = [ids(t) for _ in range(rows)]
        if t <= SMALL:  # a tree's pattern over the new tokens, on top of the prefix
            allowed = None if t == 1 else [torch.ones(t, t, dtype=torch.bool).tril()] * rows
            points.append(_Point(id(model), rows, t, runner,
                                 functools.partial(small, new, allowed)))
        else:  # a prefill of t tokens per row, from an empty cache
            fresh = BatchRunner(model)
            runners.append(fresh)
            points.append(_Point(id(model), rows, t, fresh,
                                 functools.partial(prefill, fresh, new), fresh.release_rows))
    return points, runners


def _single_points(model: torch.nn.Module, tokens: list[int], prefix: list[int], ids
                   ) -> tuple[list[_Point], list]:
    """The points of one-row forwards on a :class:`ModelRunner` (and its runners); a model
    with ``cost_inputs(n)`` (a drafter's own network) gets them with every forward."""
    extra = getattr(model, "cost_inputs", None)

    def run(r: ModelRunner, new: torch.Tensor, allowed=None, last_only: bool = False) -> None:
        if extra is None:
            r.forward(new, allowed=allowed, last_only=last_only)
        else:  # (the drafter computes every position's logits)
            r.run(new, None, allowed, **extra(len(new)))

    runner = ModelRunner(model)
    runner.reset()
    run(runner, torch.tensor(prefix), last_only=True)
    base = runner.length

    def small(new: torch.Tensor, allowed) -> None:
        run(runner, new, allowed)
        runner.crop(base)

    def prefill(fresh: ModelRunner, new: torch.Tensor) -> None:
        fresh.reset()
        run(fresh, new, last_only=True)

    points, runners = [], [runner]
    for t in tokens:
        new = ids(t)
        if t <= SMALL:
            allowed = None if t == 1 else torch.ones(t, base + t, dtype=torch.bool).tril(base)
            points.append(_Point(id(model), 1, t, runner, functools.partial(small, new, allowed)))
        else:
            fresh = ModelRunner(model)
            runners.append(fresh)
            points.append(_Point(id(model), 1, t, fresh, functools.partial(prefill, fresh, new),
                                 fresh.release))
    return points, runners


class CostSampler:
    """The forward cost curves of a Decoder's target and draft model, measured in rounds.

    Every point (model x rows x new tokens, see the module docstring) is prepared and run
    once untimed at construction; each :meth:`round` then times every point once. The
    rounds can be spread over a whole run (between its timed pairs: :meth:`spread`), so
    the curve is the run's typical cost, not a snapshot of one moment of a shared
    machine; :meth:`model` gives the curves (median per point, then :func:`monotone`)."""

    def __init__(self, dec, prompts: list[list[int]], max_new_tokens: int,
                 batch_size: int = 1, networks: dict[str, torch.nn.Module] | None = None
                 ) -> None:
        """``networks``: drafters' own networks with ``cost_inputs`` (name -> module,
        :meth:`speclab.api.Decoder.drafter_networks`), measured one prompt at a time only
        (``batch_size`` 1)."""
        batched = batch_size > 1
        lengths = sorted(len(p) for p in prompts) or [1]
        context = lengths[len(lengths) // 2] + max_new_tokens // 2
        rows = row_points(batch_size) if batched else [1]
        tokens = token_points(prompts)
        self.points: list[_Point] = []
        self.names: dict[int, str] = {}
        self._runners: list = []
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            models = [(name, side.model) for name, side in (("target", dec.target),
                                                            ("draft", dec.draft)) if side]
            models += [] if batched else list((networks or {}).items())
            target_vocab = int(dec.target.model.config.vocab_size)
            for name, model in models:
                if id(model) in self.names:
                    continue
                self.names[id(model)] = name
                # a drafter's own network reads the target's vocabulary
                vocab = target_vocab if hasattr(model, "cost_inputs") else \
                    int(model.config.vocab_size)

                def ids(n: int, vocab=vocab) -> torch.Tensor:
                    return torch.randint(0, vocab, (n,), generator=gen)

                prefix = ids(max(context, 1)).tolist()
                for r in rows:
                    shapes = prefill_shapes(lengths, r, tokens)
                    pts, runners = (_batched_points(model, r, shapes, prefix, ids) if batched
                                    else _single_points(model, tokens, prefix, ids))
                    self.points += pts
                    self._runners += runners
            for pt in self.points:  # first forwards of each shape: untimed
                pt.run()

    @torch.inference_mode()
    def round(self) -> None:
        """Time every point once."""
        for pt in self.points:
            pt.times.append(pt.run())

    @property
    def rounds(self) -> int:
        """Rounds timed so far."""
        return min((len(pt.times) for pt in self.points), default=0)

    def spread(self, slots: int, rounds: int = REPEATS) -> Callable[[], None]:
        """A function to call ``slots`` times over a run (e.g. after every timed pair):
        together the calls time ``rounds`` rounds, evenly spread (several per call when
        there are fewer slots than rounds)."""
        state = {"calls": 0, "start": self.rounds}

        def between() -> None:
            state["calls"] += 1
            due = state["start"] + (rounds * min(state["calls"], slots)) // max(slots, 1)
            while self.rounds < due:
                self.round()
        return between

    def model(self) -> CostModel:
        """The curves: each point's median timing (at least one round is timed first),
        made non-decreasing; the measuring runners are released."""
        if self.rounds == 0:
            self.round()
        out = CostModel(names=dict(self.names))
        for mid in self.names:
            curve = CostCurve()
            for pt in self.points:
                if pt.model == mid:
                    curve.points.setdefault(pt.rows, []).append(
                        (pt.tokens, statistics.median(pt.times)))
            out.curves[mid] = monotone(curve)
        for r in self._runners:
            r.release()
        self._runners = []
        return out


def monotone(curve: CostCurve) -> CostCurve:
    """``curve`` made non-decreasing in tokens and in rows by its lower envelope: each
    point's cost is the least of its own and every larger shape's. A forward never costs
    less for more work, and noise on a shared machine only ever slows a timing down, so
    a point above a larger shape's is a slowed one."""
    rows = sorted(curve.points)
    pts = {r: dict(curve.points[r]) for r in rows}
    for r in rows:
        best = math.inf
        for t in sorted(pts[r], reverse=True):
            best = pts[r][t] = min(pts[r][t], best)
    for t in set().union(*(pts[r] for r in rows)) if rows else ():
        best = math.inf
        for r in reversed(rows):
            if t in pts[r]:
                best = pts[r][t] = min(pts[r][t], best)
    return CostCurve({r: sorted(pts[r].items()) for r in rows})


def measure_costs(dec, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 1,
                  repeats: int = REPEATS) -> CostModel | None:
    """The cost curves of ``dec``'s target and draft model (a
    :class:`~speclab.api.Decoder`) at this run's shapes and context, ``repeats`` rounds
    timed now, one after the other (:class:`CostSampler` spreads them over a run
    instead); None on the compiled fast path (not measured, see the module docstring)."""
    if getattr(dec, "compile", False):
        return None
    sampler = CostSampler(dec, prompts, max_new_tokens, batch_size)
    for _ in range(repeats):
        sampler.round()
    return sampler.model()


def engine_overhead(wall_s: float, modelled_s: float) -> float:
    """``(wall_s - modelled_s) / wall_s``; NaN when either is unknown or no time passed.
    With the forwards' clocked time for ``modelled_s``: ``engine_clocked``."""
    if not wall_s or wall_s <= 0 or modelled_s is None or math.isnan(modelled_s):
        return math.nan
    return (wall_s - modelled_s) / wall_s
