"""Many independent requests in the batched engine, addressed by request id.

The Serve replicas hold every live request as a ROW of one batched engine, so the
rounds of concurrent requests share forwards. Requests arrive and leave at any time and
each round only some of them are ready, so both pools here take a subset of their rows
per call; the rows of the other requests feed nothing and keep their state.

* :class:`TargetPool`: ONE :class:`~speclab.decoding.batch_loop.BatchTarget` over every
  request, each row with its own sampling settings, verification rule and rng.
* :class:`DraftPool`: a :class:`~speclab.drafters.batched.BatchDrafter` per distinct
  sampling setting (a drafter samples with its request's settings), built by the
  method's registry entry (batched chain / tree / SALF drafting, else one drafter per
  row).

At temperature 0 every request's tokens equal that request decoded alone. Pure torch:
the deployments in ``serve_apps`` add the transport, the bounds and the batching clock.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from speclab.decoding.batch_loop import BatchTarget
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.rules import RuleSpec
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import Proposal, VerifyResult
from speclab.decoding.tree import TokenTree
from speclab.drafters.batched import BatchDrafter


@dataclass
class NewRow:
    """A request joining a pool: its prompt, sampling settings, rule and seed; for the
    draft pool also what the target's prefill returned (top tokens per prompt position,
    ``[P-1, H]`` features) when the method reads them."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    rule: RuleSpec | None = None
    seed: int = 0
    prefill_top: list[list[int]] | None = None
    features: torch.Tensor | None = None


def _index(rids: list[str], rid: str) -> int:
    try:
        return rids.index(rid)
    except ValueError:
        raise KeyError(rid) from None


class TargetPool:
    """The target side of every live request: one batched cache, a row per request."""

    def __init__(self, runner: BatchRunner, features: bool = False) -> None:
        """``features``: return the last-layer features with prefills and verdicts (the
        method's drafter reads them)."""
        self.batch = BatchTarget(runner, SamplingParams(), RuleSpec("greedy"), features)
        self.rids: list[str] = []
        self.samplings: list[SamplingParams] = []
        self.rules: list[RuleSpec] = []
        self.generators: list[torch.Generator] = []

    def __contains__(self, rid: str) -> bool:
        return rid in self.rids

    def __len__(self) -> int:
        return len(self.rids)

    def track_features(self) -> None:
        """From now on return features (a feature drafter's requests arrived)."""
        self.batch.features = True
        self.batch.runner.track_hidden()

    def start(self, rows: list[NewRow], prefill_top_k: int = 0
              ) -> list[tuple[list[list[int]] | None, torch.Tensor | None]]:
        """Prefill ``prompt_ids[:-1]`` of every new row in ONE forward (a request id that
        is already here starts over). Returns per row the target's ``prefill_top_k`` best
        tokens per prompt position (or None) and its ``[P-1, H]`` features (or None)."""
        for r in rows:
            self.end(r.rid)
        if len({r.rid for r in rows}) != len(rows):
            raise ValueError("rows: a request id appears twice")
        tops, feats = self.batch.join([r.prompt_ids for r in rows], prefill_top_k)
        for r in rows:
            self.rids.append(r.rid)
            self.samplings.append(r.sampling)
            self.rules.append(r.rule or RuleSpec("greedy"))
            self.generators.append(torch.Generator().manual_seed(r.seed))
        return list(zip(tops, feats, strict=True))

    def verify(self, items: list[tuple[str, TokenTree | dict | None]]) -> list[VerifyResult]:
        """ONE target forward over the trees of the requests in ``items`` (request id,
        tree or its wire dict; None: the root alone), each judged by its own rule.
        KeyError for a request id that is not here."""
        rows = [_index(self.rids, rid) for rid, _ in items]
        trees = [TokenTree.from_wire(t) if isinstance(t, dict) else t for _, t in items]
        return self.batch.verify(trees, [self.generators[b] for b in rows], rows,
                                 [self.rules[b] for b in rows],
                                 [self.samplings[b] for b in rows])

    def length(self, rid: str) -> int:
        """KV positions request ``rid`` holds."""
        return self.batch.runner.length(_index(self.rids, rid))

    def end(self, rid: str) -> bool:
        """Request ``rid`` leaves (False if it was not here)."""
        if rid not in self.rids:
            return False
        b = self.rids.index(rid)
        self.batch.drop([b])
        for state in (self.rids, self.samplings, self.rules, self.generators):
            state.pop(b)
        if not self.rids:
            self.batch.runner.release_rows()  # an idle replica holds no cache
        return True


def sampling_key(sampling: SamplingParams) -> str:
    """The draft pool's group of a request: its sampling settings."""
    return json.dumps([sampling.temperature, sampling.top_k, sampling.top_p])


class _DraftGroup:
    def __init__(self, drafter: BatchDrafter) -> None:
        self.drafter = drafter
        self.rids: list[str] = []
        self.calls0: list[int] = []  # the drafter's forwards when each row joined


class DraftPool:
    """The draft side of every live request: per sampling setting, one batched drafter
    with a row per request."""

    def __init__(self, make: Callable[[SamplingParams], BatchDrafter]) -> None:
        """``make(sampling)``: a fresh batched drafter for requests with ``sampling``."""
        self.make = make
        self.groups: dict[str, _DraftGroup] = {}
        self.where: dict[str, str] = {}  # request id -> its group

    def __contains__(self, rid: str) -> bool:
        return rid in self.where

    def __len__(self) -> int:
        return len(self.where)

    def join(self, rows: list[NewRow]) -> None:
        """New rows (a request id that is already here starts over); the rows of one
        group are prefilled together."""
        for r in rows:
            self.end(r.rid)
        by_group: dict[str, list[NewRow]] = {}
        for r in rows:
            by_group.setdefault(sampling_key(r.sampling), []).append(r)
        for key, group_rows in by_group.items():
            if key not in self.groups:
                self.groups[key] = _DraftGroup(self.make(group_rows[0].sampling))
            g = self.groups[key]
            g.drafter.join([r.prompt_ids for r in group_rows],
                           [torch.Generator().manual_seed(r.seed) for r in group_rows],
                           [r.prefill_top for r in group_rows],
                           [r.features for r in group_rows])
            for r in group_rows:
                g.rids.append(r.rid)
                g.calls0.append(g.drafter.calls)
                self.where[r.rid] = key

    def propose(self, items: list[tuple[str, list[int] | None, list[int], int,
                                        torch.Tensor | None]]) -> list[Proposal]:
        """Per item (request id, last accepted ``path``, committed tokens ``new``,
        ``budget``, the target's features on the path): commit the last round, then
        draft a tree (a batched draft forward per step over each group's rows). Returns
        per item the tree (None at budget 0) and the request's draft forwards so far.
        KeyError for a request id that is not here."""
        out: dict[str, Proposal] = {}
        by_group: dict[str, list[tuple]] = {}
        for item in items:
            if item[0] not in self.where:
                raise KeyError(item[0])
            by_group.setdefault(self.where[item[0]], []).append(item)
        for key, group_items in by_group.items():
            g = self.groups[key]
            n = len(g.rids)
            paths: list[list[int] | None] = [None] * n
            news: list[list[int]] = [[] for _ in range(n)]
            budgets, feats = [0] * n, [None] * n
            for rid, path, new, budget, f in group_items:
                b = g.rids.index(rid)
                paths[b], news[b], budgets[b], feats[b] = path, list(new), budget, f
            trees = g.drafter.propose(paths, news, budgets, feats)
            for rid, *_ in group_items:
                b = g.rids.index(rid)
                out[rid] = Proposal(trees[b], g.drafter.calls - g.calls0[b])
        return [out[item[0]] for item in items]

    def length(self, rid: str) -> int:
        """Positions of draft state request ``rid`` holds."""
        g = self.groups[self.where[rid]]
        return g.drafter.cached_tokens(g.rids.index(rid))

    def end(self, rid: str) -> bool:
        """Request ``rid`` leaves (False if it was not here)."""
        key = self.where.pop(rid, None)
        if key is None:
            return False
        g = self.groups[key]
        b = g.rids.index(rid)
        g.drafter.drop([b])
        g.rids.pop(b)
        g.calls0.pop(b)
        if not g.rids:
            g.drafter.release()
            del self.groups[key]
        return True
