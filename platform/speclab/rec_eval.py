"""AtSpeed evaluation (no Ray): WS@K, AS@K, Recall@K, NDCG@K per (verification, drafter,
K, N), the paper's Table 1 shape.

For every test example the target's own search (constrained beam search for ``strict``;
sampling beam search for ``relaxed``) and beam SD run one after the other on the same
process (A B A B), so WS@K = baseline wall time / SD wall time compares like with like.
AS@K = accepted drafted steps per user; Recall/NDCG score SD's ranked list against the
example's true next item (identical to the baseline's under strict verification).
``WS@K_std`` / ``AS@K_std``: the standard deviation over users of each user's own
figure (wall-time ratio, accepted steps).
"""

from __future__ import annotations

import math
import time

import torch

from speclab.data.rec_dataset import RecExample
from speclab.decoding.beam import (
    beam_speculative_sampling,
    beam_speculative_search,
    constrained_beam_search,
    sampling_beam_search,
)
from speclab.evaluation import spread
from speclab.recommend import Recommender


def recall_ndcg(ranked: list[int], truth: int, k: int) -> tuple[float, float]:
    """Recall@k (hit) and NDCG@k of one ranked list with one relevant item."""
    top = ranked[:k]
    if truth not in top:
        return 0.0, 0.0
    return 1.0, 1.0 / math.log2(top.index(truth) + 2)


def evaluate(rec: Recommender, drafts: dict[str, object], examples: list[RecExample],
             ks: list[int], ns: list[int], gamma: int, verify_modes: list[str],
             seed: int = 0) -> list[dict]:
    """Rows of the Table 1 shape; ``drafts`` maps a drafter name to its ModelRunner."""
    trie, target = rec.trie, rec.target
    rows = []
    for verify in verify_modes:
        for name, draft in drafts.items():
            for n in ns:
                for k in ks:
                    if k > len(rec.meta.items) or k > n:
                        continue
                    base_s = sd_s = 0.0
                    accepted = calls = 0
                    rec_sum = ndcg_sum = base_rec = 0.0
                    ws_users, as_users = [], []  # per user: the spread over users
                    for i, ex in enumerate(examples):
                        g1 = torch.Generator().manual_seed(seed + i)
                        g2 = torch.Generator().manual_seed(seed + i)
                        t0 = time.perf_counter()
                        if verify == "strict":
                            base, _ = constrained_beam_search(target, ex.prompt, trie, k)
                        else:
                            base = sampling_beam_search(target, ex.prompt, trie, k, g1)
                        t1 = time.perf_counter()
                        if verify == "strict":
                            out, st = beam_speculative_search(target, draft, ex.prompt, trie,
                                                              k, n, gamma)
                        else:
                            out, st = beam_speculative_sampling(target, draft, ex.prompt, trie,
                                                                k, gamma, g2, n=n)
                        t2 = time.perf_counter()
                        base_s, sd_s = base_s + t1 - t0, sd_s + t2 - t1
                        ws_users.append((t1 - t0) / (t2 - t1) if t2 > t1 else 0.0)
                        as_users.append(st.accepted_steps)
                        accepted += st.accepted_steps
                        calls += st.target_calls
                        truth = rec.meta.items[ex.target]
                        r, nd = recall_ndcg([trie.item_of(s) for s, _ in out], truth, k)
                        rec_sum, ndcg_sum = rec_sum + r, ndcg_sum + nd
                        base_rec += recall_ndcg([trie.item_of(s) for s, _ in base], truth, k)[0]
                    m = max(len(examples), 1)
                    rows.append({
                        "verify": verify, "method": name, "K": k, "N": n, "gamma": gamma,
                        "WS@K": base_s / sd_s if sd_s else 0.0, "AS@K": accepted / m,
                        "WS@K_std": spread(ws_users), "AS@K_std": spread(as_users),
                        "target_calls_per_user": calls / m, "Recall@K": rec_sum / m,
                        "NDCG@K": ndcg_sum / m, "baseline_Recall@K": base_rec / m,
                        "users": len(examples), "baseline_s": base_s, "sd_s": sd_s})
    return rows
