"""Evaluate decoding methods over a prompt set and aggregate their stats (no Ray here).

Timing protocol: methods run one after another in the same process; before each method
the autoregressive baseline runs over the same prompts again (A B A B ...), and a
method's speedup is the AR wall time of ITS block over its own wall time. Hardware-
independent figures (tau, target calls per token, acceptance) come from all prompts.
Each block also records ``peak_gpu_mb``: the most GPU memory PyTorch held while it ran
(:func:`speclab.timing.peak_gpu_mb`; NaN when the target is not on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from speclab import theory
from speclab.api import Decoder, GenerationResult
from speclab.decoding.loop import tau
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


@dataclass
class Totals:
    """Summed counters over prompts for one method."""

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
    #: ``at_least[k - 1]``: rounds that accepted at least ``k`` draft tokens
    at_least: list[int] = field(default_factory=lambda: [0] * ACCEPT_POSITIONS)
    outputs: list[list[int]] = field(default_factory=list)
    #: one :class:`PromptFigures` per prompt, in prompt order (the spread over prompts)
    per_prompt: list[PromptFigures] = field(default_factory=list)
    #: the prompts ran as one batch: per-prompt wall times are the batch's, no spread
    batched: bool = False
    #: MiB of GPU memory held at most while the block ran (NaN: not on CUDA / not measured)
    peak_gpu_mb: float = math.nan

    def add(self, res: GenerationResult) -> None:
        s = res.stats
        self.prompts += 1
        self.new_tokens += s.new_tokens
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
        for n in s.accepted_lengths:  # n committed = n - 1 accepted + 1 from the target
            for k in range(min(n - 1, ACCEPT_POSITIONS)):
                self.at_least[k] += 1
        self.outputs.append(res.token_ids)
        self.per_prompt.append(PromptFigures(
            s.new_tokens, sum(s.accepted_lengths), s.target_calls, s.accepted_tokens,
            s.judged_tokens, s.wall_s))

    def merge(self, other: Totals) -> None:
        for k in ("prompts", "new_tokens", "committed", "target_calls", "forwards", "draft_calls",
                  "drafted", "accepted", "judged", "wall_s", "draft_s", "verify_s", "rounds"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.at_least = [a + b for a, b in zip(self.at_least, other.at_least)]
        self.outputs += other.outputs
        self.per_prompt += other.per_prompt
        self.batched = self.batched or other.batched
        self.peak_gpu_mb = max_mb(self.peak_gpu_mb, other.peak_gpu_mb)


def run_prompts(dec: Decoder, run: MethodRun, prompts: list[list[int]], gen: dict) -> Totals:
    """Generate for every prompt with one method; ``gen`` holds Decoder.generate kwargs
    (``batch_size`` > 1, or a Decoder on the compiled fast path: the prompts go through
    the batched engine together, and the wall, draft and verify times and the forwards
    are the batch's). ``peak_gpu_mb``: the block's peak GPU memory (NaN off CUDA)."""
    totals = Totals()
    gen = dict(gen)
    seed, batch_size = gen.pop("seed", 0), gen.pop("batch_size", 1) or 1
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


def interleaved_comparison(
    dec: Decoder, runs: list[MethodRun], prompts: list[list[int]], gen: dict, warmup: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """For each method: AR block then method block on the same prompts.

    Returns ``{name: {"totals": Totals, "ar": Totals}}`` where ``ar`` is the AR block
    timed right before that method. ``progress`` gets a line per finished method (its
    place in the list, tokens, tokens/s against AR's, tau).
    """
    if warmup and prompts:
        for run in [MethodRun("ar"), *runs]:
            run_prompts(dec, run, prompts[:1], {**gen, "max_new_tokens": 8})
    out = {}
    for i, run in enumerate(runs, start=1):
        ar = run_prompts(dec, MethodRun("ar"), prompts, gen)
        totals = run_prompts(dec, run, prompts, gen)
        out[run.name] = {"run": run, "totals": totals, "ar": ar}
        if progress is not None:
            def rate(t: Totals) -> float:
                return t.new_tokens / t.wall_s if t.wall_s else 0.0

            progress(f"method {i}/{len(runs)} {run.name}: {len(prompts)} prompts, "
                     f"{totals.new_tokens} tokens, {rate(totals):.1f} tokens/s (AR "
                     f"{rate(ar):.1f}), tau {tau(totals.committed, totals.target_calls):.2f}")
    return out


def summarize(
    run: MethodRun, totals: Totals, ar: Totals, reference_outputs: list[list[int]] | None = None
) -> dict:
    """One table row: hardware-independent figures next to wall-clock ones.

    ``c`` = time of one draft forward / time of one target forward (AR per-token time);
    ``predicted_speedup``: Leviathan Theorem 3.8 for chains (measured alpha, gamma, c),
    the SpecDec++ cost model (eq. 2.1 with the measured call counts) for other methods.
    """
    n = max(totals.new_tokens, 1)
    t_target = ar.wall_s / max(ar.forwards, 1)
    t_draft = totals.draft_s / totals.draft_calls if totals.draft_calls else 0.0
    c = t_draft / t_target if t_target else 0.0
    alpha = totals.accepted / totals.judged if totals.judged else 0.0
    tokens_per_s = totals.new_tokens / totals.wall_s if totals.wall_s else 0.0
    ar_tps = ar.new_tokens / ar.wall_s if ar.wall_s else 0.0
    speedup = tokens_per_s / ar_tps if ar_tps else 0.0
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
        "speedup": speedup,
        "c": c,
        "predicted_speedup": predicted,
        "measured_over_predicted": speedup / predicted if predicted else None,
        "draft_s": totals.draft_s,
        "verify_s": totals.verify_s,
        "wall_s": totals.wall_s,
        "peak_gpu_mb": totals.peak_gpu_mb,  # NaN when the models are not on CUDA
        # acceptance per draft position: the fraction of rounds accepting >= k tokens
        **{f"accept_at_{k + 1}": c / totals.rounds if totals.rounds else 0.0
           for k, c in enumerate(totals.at_least)},
    }
    row.update(prompt_spread(totals, ar))
    if reference_outputs is not None:
        row["identical_to_ar"] = totals.outputs == reference_outputs
    return row


def prompt_spread(totals: Totals, ar: Totals) -> dict[str, float | None]:
    """``<column>_std`` for tau, target_calls_per_token, acceptance_rate, tokens_per_s
    and speedup: the sample standard deviation over prompts of each prompt's own figure
    (``speedup``: the prompt's tokens/s over the same prompt's tokens/s in the AR block
    timed before the method). The wall-clock ones are None when either block ran
    batched (one wall time for the whole batch)."""
    per = totals.per_prompt
    out: dict[str, float | None] = {
        "tau_std": spread([tau(p.committed, p.target_calls) for p in per]),
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


COLUMNS = [
    ("method", "{}"), ("tau", "{:.2f}"), ("target_calls_per_token", "{:.3f}"),
    ("acceptance_rate", "{:.2f}"), ("tokens_per_s", "{:.1f}"), ("speedup", "{:.2f}x"),
    ("predicted_speedup", "{:.2f}x"), ("measured_over_predicted", "{:.2f}"),
    ("identical_to_ar", "{}"),
]


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    """A plain-text table of ``rows`` (missing cells shown as ``-``)."""
    header = [c for c, _ in columns]
    cells = [[(fmt.format(r[c]) if c in r and r[c] is not None else "-") for c, fmt in columns]
             for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    """:func:`format_table`'s table in Markdown (what MLflow shows as a run's
    description)."""
    header = [c for c, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[c]) if c in r and r[c] is not None
                                        else "-" for c, fmt in columns) + " |")
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
