"""The batched engine: the draft -> verify -> commit loop over MANY rows at once.

The same round as :mod:`.loop`, for ``B`` sequences together: every round each row
drafts its own tree (different sizes and shapes; a batched drafter does it for all rows
in shared draft forwards), ONE target forward verifies every row's tree (padded, with a
per-row tree mask and position ids over the batched cache of
:class:`~speclab.decoding.batch_runner.BatchRunner`), each row applies the rule to its
own logits with its own rng and prunes its own cache. Rows that finish leave the batch
and waiting prompts join between rounds (continuous batching, at most ``batch_size``
rows at once).

Every row keeps the single-sequence statistics (:class:`GenerationStats`, one definition
of tau); :class:`BatchStats` adds the batch's own figures (forwards, wall time). At
temperature 0 each row's tokens equal that prompt decoded alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.loop import GenerationStats, check_max_new_tokens, commit_tokens, eos_set
from speclab.decoding.rules import RuleSpec, apply_rule
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import VerifyResult, check_prompt, committed_tokens
from speclab.decoding.tree import TokenTree
from speclab.drafters.batched import BatchDrafter


@dataclass
class BatchStats:
    """Figures of one batched run: ``target_forwards`` (batched target calls),
    ``draft_forwards``, the largest batch, the wall time and tokens of all rows."""

    rows: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    max_batch: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        return {**self.__dict__, "tokens_per_s": self.tokens_per_s}


@dataclass
class _Row:
    """One sequence in the batch."""

    index: int
    prompt: list[int]
    generator: torch.Generator | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    out: list[int] = field(default_factory=list)
    root: int = -1
    path: list[int] | None = None
    new: list[int] = field(default_factory=list)
    features: torch.Tensor | None = None
    t0: float = 0.0
    draft_calls0: int = 0


class BatchTarget:
    """The target over a batch: prefill of joining rows and ONE forward per round that
    verifies every row's tree with that row's rule outcome and pruning."""

    def __init__(self, runner: BatchRunner, sampling: SamplingParams, rule: RuleSpec,
                 features: bool = False) -> None:
        self.runner, self.sampling, self.rule, self.features = runner, sampling, rule, features
        self.roots: list[int] = []
        if features:
            runner.track_hidden()

    def join(self, prompts: list[list[int]], prefill_top_k: int = 0
             ) -> tuple[list[list[list[int]] | None], list[torch.Tensor | None]]:
        """Prefill ``prompt[:-1]`` of the new rows in ONE forward. Returns per row the
        ``prefill_top_k`` best tokens per prompt position (or None) and, with features,
        the ``[P-1, H]`` prefill features (else None)."""
        for ids in prompts:
            check_prompt(ids, self.runner.vocab_size)
        logits = self.runner.add_rows([list(p[:-1]) for p in prompts])
        tops: list[list[list[int]] | None] = []
        feats: list[torch.Tensor | None] = []
        for r, ids in enumerate(prompts):
            n = len(ids) - 1
            self.roots.append(int(ids[-1]))
            top = None
            if prefill_top_k and n:
                top = logits[r, :n].topk(min(prefill_top_k, logits.shape[-1]), -1).indices.tolist()
            tops.append(top)
            feats.append(self.runner.hidden[r, :n].clone() if self.features else None)
        return tops, feats

    def verify(self, trees: list[TokenTree | None], generators: list[torch.Generator | None],
               rows: list[int] | None = None, rules: list[RuleSpec] | None = None,
               samplings: list[SamplingParams] | None = None) -> list[VerifyResult]:
        """ONE forward over the trees of rows ``rows`` (default: every row, in order;
        ``trees[i]`` None: the root alone); the other rows feed nothing and keep their
        state. Per verified row: the rule (``rules[i]`` / ``samplings[i]`` when given, else
        the batch's), the pruned cache and a :class:`VerifyResult`."""
        rows = list(range(self.runner.rows)) if rows is None else list(rows)
        if len(set(rows)) != len(rows) or len(rows) != len(trees):
            raise ValueError(f"rows: {len(trees)} trees for rows {rows}")
        trees = [t if t is not None else TokenTree(self.roots[b]) for t, b in zip(trees, rows)]
        tokens = [torch.zeros(0, dtype=torch.long) for _ in range(self.runner.rows)]
        positions: list[torch.Tensor | None] = [None] * self.runner.rows
        allowed: list[torch.Tensor | None] = [None] * self.runner.rows
        prefix = []
        for b, tree in zip(rows, trees, strict=True):
            if tree.tokens[0] != self.roots[b]:
                raise ValueError(f"tree: row {b}'s root token {tree.tokens[0]} is not its last "
                                 f"committed token {self.roots[b]}")
            n = self.runner.length(b)
            prefix.append(n)
            tokens[b] = tree.token_tensor()
            if not tree.is_chain():
                positions[b] = tree.position_ids(n)
                allowed[b] = tree.ancestor_matrix()  # + the whole prefix
        logits = self.runner.forward(tokens, positions, allowed)
        out = []
        for i, (b, tree, gen) in enumerate(zip(rows, trees, generators, strict=True)):
            rule = rules[i] if rules is not None else self.rule
            sampling = samplings[i] if samplings is not None else self.sampling
            verdict = apply_rule(rule, tree, logits[b, :len(tree)], sampling, gen)
            self.runner.keep(b, list(range(prefix[i])) + [prefix[i] + j for j in verdict.path])
            new = committed_tokens(tree, verdict)
            self.roots[b] = new[-1]
            feats = self.runner.hidden[b, verdict.path].clone() if self.features else None
            out.append(VerifyResult(verdict.path, new, verdict.accepted, verdict.evaluated,
                                    tree.num_drafted, feats))
        self.runner.maybe_compact()
        return out

    def drop(self, rows: list[int]) -> None:
        """Rows ``rows`` leave the batch."""
        self.runner.drop(rows)
        for b in sorted(rows, reverse=True):
            self.roots.pop(b)


def generate_batch(
    target: BatchTarget,
    drafter: BatchDrafter | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    generators: list[torch.Generator | None],
    eos_token_id: int | Iterable[int] | None = None,
) -> tuple[list[list[int]], list[GenerationStats], BatchStats]:
    """Decode ``prompts`` with at most ``batch_size`` rows at once (``drafter`` None: plain
    decoding; ``generators[i]``: prompt ``i``'s rng). Returns per prompt its new tokens and
    stats (in prompt order) and the batch's figures."""
    check_max_new_tokens(max_new_tokens)
    if isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    eos = eos_set(eos_token_id)
    t_start = time.perf_counter()
    waiting = deque(_Row(i, list(p), g) for i, (p, g) in enumerate(zip(prompts, generators,
                                                                       strict=True)))
    active: list[_Row] = []
    results: dict[int, _Row] = {}
    batch = BatchStats(rows=len(prompts))
    forwards0 = target.runner.calls
    draft0 = drafter.calls if drafter is not None else 0
    while waiting or active:
        joining = [waiting.popleft() for _ in range(min(batch_size - len(active), len(waiting)))]
        if joining:
            t0 = time.perf_counter()
            tops, feats = target.join([r.prompt for r in joining],
                                      drafter.prefill_top_k if drafter is not None else 0)
            if drafter is not None:
                drafter.join([r.prompt for r in joining], [r.generator for r in joining], tops,
                             feats)
            for r in joining:
                r.t0 = t0
                r.stats.prefill_s = time.perf_counter() - t0
                r.draft_calls0 = drafter.calls if drafter is not None else 0
            active += joining
        batch.max_batch = max(batch.max_batch, len(active))
        # 1. draft a tree per row (one batched drafter call)
        t0 = time.perf_counter()
        budgets = [max_new_tokens - len(r.out) - 1 for r in active]
        trees: list[TokenTree | None] = [None] * len(active)
        if drafter is not None:
            trees = drafter.propose([r.path for r in active], [r.new for r in active], budgets,
                                    [r.features for r in active])
        t1 = time.perf_counter()
        # 2. verify every row in one target forward
        verdicts = target.verify(trees, [r.generator for r in active])
        t2 = time.perf_counter()
        batch.draft_s += t1 - t0
        batch.verify_s += t2 - t1
        # 3. commit per row; finished rows leave
        finished = []
        for b, (r, v) in enumerate(zip(active, verdicts, strict=True)):
            r.path, r.new, r.features = v.path, v.new, v.features
            n0 = len(r.out)
            done = commit_tokens(r.out, v.new, max_new_tokens, eos)
            r.stats.draft_s += t1 - t0
            r.stats.verify_s += t2 - t1
            r.stats.add_round(v.drafted, v.accepted, v.evaluated, len(r.out) - n0)
            r.stats.new_tokens = len(r.out)
            r.stats.wall_s = time.perf_counter() - r.t0
            if drafter is not None:
                r.stats.draft_calls = drafter.calls - r.draft_calls0
            if done:
                finished.append(b)
        if finished:
            target.drop(finished)
            if drafter is not None:
                drafter.drop(finished)
            for b in finished:
                results[active[b].index] = active[b]
            active = [r for b, r in enumerate(active) if b not in set(finished)]
    ordered = [results[i] for i in range(len(prompts))]
    batch.new_tokens = sum(len(r.out) for r in ordered)
    batch.target_forwards = target.runner.calls - forwards0
    batch.draft_forwards = (drafter.calls - draft0) if drafter is not None else 0
    batch.wall_s = time.perf_counter() - t_start
    return [r.out for r in ordered], [r.stats for r in ordered], batch
