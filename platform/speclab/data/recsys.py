"""Recommendation data for AtSpeed: synthetic interactions, real-file loaders, the
chronological 8:1:1 split (AtSpeed A.3.1), and semantic item ids.

Synthetic data: items have latent features drawn around category centres and a Zipf
popularity; users have latent preferences that drift at every interaction; the next item
depends on the user's preference, the previous item (sequential dependency) and
popularity. Sizes are configurable up to the paper's Table 2 scale (e.g. 19k users x 12k
items; generation is batched over users).

Semantic ids: residual k-means over item features, ``levels`` codes of ``codebook``
values each; an item whose codes are already taken gets the nearest free id, changing
the deepest levels first, so every item has a unique id.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Interaction:
    """One (user, item, timestamp) event; ids are the dataset's own."""

    user: int
    item: int
    timestamp: int


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of :func:`synthetic_interactions`."""

    users: int = 500
    items: int = 400
    dim: int = 16
    categories: int = 12
    min_history: int = 5
    max_history: int = 20
    drift: float = 0.15
    sequential: float = 0.5
    popularity_skew: float = 1.0
    temperature: float = 0.5
    seed: int = 0


def item_features(spec: SyntheticSpec) -> torch.Tensor:
    """``[items, dim]`` latent item features around category centres."""
    g = torch.Generator().manual_seed(spec.seed)
    centres = torch.randn(spec.categories, spec.dim, generator=g) * 2.0
    cat = torch.randint(0, spec.categories, (spec.items,), generator=g)
    return centres[cat] + 0.5 * torch.randn(spec.items, spec.dim, generator=g)


def synthetic_interactions(spec: SyntheticSpec) -> tuple[list[Interaction], torch.Tensor]:
    """Interactions (chronological per user) and the item features used for ids."""
    if spec.min_history < 3 or spec.max_history < spec.min_history:
        raise ValueError("min_history must be >= 3 and <= max_history")
    g = torch.Generator().manual_seed(spec.seed + 1)
    feats = item_features(spec)
    unit = torch.nn.functional.normalize(feats, dim=-1)
    ranks = torch.randperm(spec.items, generator=g).float() + 1
    log_pop = -spec.popularity_skew * torch.log(ranks)  # Zipf popularity
    pref = torch.nn.functional.normalize(torch.randn(spec.users, spec.dim, generator=g), dim=-1)
    lengths = torch.randint(spec.min_history, spec.max_history + 1, (spec.users,), generator=g)
    prev = torch.zeros(spec.users, spec.dim)
    events: list[Interaction] = []
    clock = torch.randint(0, 10_000, (spec.users,), generator=g)
    for step in range(int(lengths.max())):
        active = (lengths > step).nonzero().flatten()
        taste = pref[active] + spec.sequential * prev[active]
        scores = taste @ unit.T / spec.temperature + log_pop  # [active, items]
        chosen = torch.multinomial(scores.softmax(-1), 1, generator=g).flatten()
        for u, i in zip(active.tolist(), chosen.tolist()):
            clock[u] += int(torch.randint(1, 1000, (1,), generator=g))
            events.append(Interaction(u, i, int(clock[u])))
        prev[active] = unit[chosen]
        drift = torch.randn(len(active), spec.dim, generator=g) * spec.drift
        pref[active] = torch.nn.functional.normalize(pref[active] + drift, dim=-1)
    return events, feats


def load_amazon_jsonl(path: str | Path) -> list[Interaction]:
    """Amazon-review style JSON lines (``reviewerID``/``user_id``, ``asin``/``item_id``,
    ``unixReviewTime``/``timestamp``); string ids are mapped to integers in order seen."""
    users: dict[str, int] = {}
    items: dict[str, int] = {}
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            u = str(row.get("reviewerID", row.get("user_id")))
            i = str(row.get("asin", row.get("item_id")))
            ts = int(row.get("unixReviewTime", row.get("timestamp")))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"data.path: {path}:{n}: {exc}") from None
        if u == "None" or i == "None":
            raise ValueError(f"data.path: {path}:{n}: needs a user and an item field")
        out.append(Interaction(users.setdefault(u, len(users)), items.setdefault(i, len(items)),
                               ts))
    return out


def load_movielens(path: str | Path) -> list[Interaction]:
    """MovieLens ``ratings.dat`` (``user::item::rating::timestamp``)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split("::")
        if len(parts) != 4:
            raise ValueError(f"data.path: {path}:{n}: expected user::item::rating::timestamp")
        out.append(Interaction(int(parts[0]), int(parts[1]), int(parts[3])))
    return out


def chronological_split(events: list[Interaction], fractions=(0.8, 0.1)):
    """Split ALL interactions by time into train / validation / test (8:1:1)."""
    ordered = sorted(events, key=lambda e: (e.timestamp, e.user, e.item))
    a = int(len(ordered) * fractions[0])
    b = int(len(ordered) * (fractions[0] + fractions[1]))
    return ordered[:a], ordered[a:b], ordered[b:]


def _kmeans(x: torch.Tensor, k: int, iters: int, g: torch.Generator) -> torch.Tensor:
    """``[n, d]`` -> ``[k, d]`` centroids (k-means++-free: random init, Lloyd steps)."""
    cent = x[torch.randperm(x.shape[0], generator=g)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x, cent).argmin(-1)
        for c in range(k):
            members = x[assign == c]
            if len(members):
                cent[c] = members.mean(0)
    return cent


def semantic_ids(features: torch.Tensor, levels: int = 4, codebook: int = 32,
                 iters: int = 15, seed: int = 0) -> list[tuple[int, ...]]:
    """Residual k-means codes ``[items]`` of ``levels`` values in ``[0, codebook)``, unique."""
    n = features.shape[0]
    if n > codebook ** levels:
        raise ValueError(f"codebook: {codebook}^{levels} ids cannot name {n} items")
    g = torch.Generator().manual_seed(seed)
    residual = features.float().clone()
    orders = []  # per level: [n, k] codes sorted by distance (the first is the assignment)
    for _ in range(levels):
        cent = _kmeans(residual, min(codebook, n), iters, g)
        order = torch.cdist(residual, cent).argsort(-1)
        residual = residual - cent[order[:, 0]]
        orders.append(order.tolist())
    ids: list[tuple[int, ...]] = []
    taken: set[tuple[int, ...]] = set()
    for item in range(n):
        # the nearest free id, changing the deepest levels first (product varies the last
        # position fastest); the first candidate is the residual k-means code itself
        for code in itertools.product(*(orders[lvl][item] for lvl in range(levels))):
            if code not in taken:
                break
        ids.append(code)
        taken.add(code)
    return ids


def id_tokens(ids: list[tuple[int, ...]], offset: int, codebook: int) -> list[tuple[int, ...]]:
    """Codes -> token ids: level ``l`` code ``c`` is token ``offset + l * codebook + c``."""
    return [tuple(offset + lvl * codebook + c for lvl, c in enumerate(code)) for code in ids]


def interaction_features(
    events: list[Interaction], dim: int = 16
) -> tuple[list[int], torch.Tensor]:
    """Item features for real data without them: a rank-``dim`` SVD of the user x item
    interaction matrix. Returns (item ids in index order, ``[items, dim]`` features)."""
    users = sorted({e.user for e in events})
    items = sorted({e.item for e in events})
    u_ix = {u: i for i, u in enumerate(users)}
    i_ix = {it: i for i, it in enumerate(items)}
    mat = torch.zeros(len(users), len(items))
    for e in events:
        mat[u_ix[e.user], i_ix[e.item]] += 1.0
    q = min(dim, min(mat.shape))
    _, s, v = torch.svd_lowrank(mat, q=q)
    feats = v * s  # [items, q]
    if q < dim:
        feats = torch.cat([feats, torch.zeros(len(items), dim - q)], dim=1)
    return items, feats
