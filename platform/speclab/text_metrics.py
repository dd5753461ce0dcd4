"""Text accuracy metrics of the AASD paper's tasks: Edit Sim, ROUGE-L, token F1."""

from __future__ import annotations

import re
from collections import Counter


def edit_sim(pred: str, ref: str) -> float:
    """``1 - Levenshtein(pred, ref) / max(len)`` over characters, in [0, 1]."""
    if not pred and not ref:
        return 1.0
    prev = list(range(len(ref) + 1))
    for i, a in enumerate(pred, 1):
        cur = [i] + [0] * len(ref)
        for j, b in enumerate(ref, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a != b))
        prev = cur
    return 1.0 - prev[-1] / max(len(pred), len(ref))


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def token_f1(pred: str, ref: str) -> float:
    """SQuAD-style F1 over lower-cased word tokens."""
    p, r = _words(pred), _words(ref)
    common = sum((Counter(p) & Counter(r)).values())
    if not p or not r or not common:
        return float(p == r)
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F-measure: longest common subsequence of word tokens."""
    p, r = _words(pred), _words(ref)
    if not p or not r:
        return float(p == r)
    prev = [0] * (len(r) + 1)
    for a in p:
        cur = [0]
        for j, b in enumerate(r, 1):
            cur.append(prev[j - 1] + 1 if a == b else max(prev[j], cur[j - 1]))
        prev = cur
    lcs = prev[-1]
    if not lcs:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


METRICS = {"edit_sim": edit_sim, "f1": token_f1, "rouge_l": rouge_l}
