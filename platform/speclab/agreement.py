"""Outputs against plain decoding: identical, a near tie, or differing.

Identity is exact at float32: any difference is a failure. In bfloat16 / float16 a
many-token forward (a verified chain or tree) and a one-token forward round differently,
so a method can pick the other of two near-tied tokens and the outputs part from there.
Such a difference is a NEAR TIE when, at the first differing position (one plain
forward over the context plain decoding saw), the target's logit of plain decoding's
token exceeds that of the method's token by at most :data:`TIE_ULPS` units in the last
place of the dtype at the top logit's magnitude; a larger margin is a failure. Used by
``speclab check-model``, ``speclab bench`` and the evaluation on Ray actors (each actor
compares its shard, :func:`merge_agreements` joins them); :func:`agreement_cell` shows
the result in every table.
Nothing here imports Ray or MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

#: a low-precision difference is a near tie when the margin is within this many ulps
TIE_ULPS = 8


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def choice_margin(model: torch.nn.Module, context: list[int], want: int,
                  got: int | None) -> tuple[float, float]:
    """How far apart two choices are after ``context`` (one plain forward of the
    ``[1, len(context)]`` ids): the target's logit of ``want`` (plain decoding's token)
    minus that of ``got`` (the method's token; None, where the method's output ended
    there: the top-2 margin instead), and the near-tie tolerance there (:data:`TIE_ULPS`
    ulps of the model's dtype at the top logit)."""
    with torch.no_grad():
        device = next(model.parameters()).device
        logits = model(torch.tensor([context], device=device)).logits[0, -1].float()
    if got is None:
        top = logits.topk(2).values
        margin = float(top[0] - top[1])
    else:
        margin = float(logits[want] - logits[got])
    eps = torch.finfo(next(model.parameters()).dtype).eps
    return margin, TIE_ULPS * eps * max(abs(float(logits.max())), 1.0)


def compare_outputs(model: torch.nn.Module, prompts: list[list[int]], got: list[list[int]],
                    want: list[list[int]]) -> dict:
    """Count ``got`` against ``want`` (plain decoding's outputs), prompt by prompt:
    ``{"identical", "near_ties", "differing", "first_differences": [{"position",
    "margin", "near_tie"}]}`` (``margin``: :func:`choice_margin` at the first
    difference). At float32 weights nothing is a near tie."""
    exact = next(model.parameters()).dtype == torch.float32
    row = {"identical": 0, "near_ties": 0, "differing": 0, "first_differences": []}
    for p, g, w in zip(prompts, got, want, strict=True):
        at = first_difference(g, w)
        if at is None:
            row["identical"] += 1
            continue
        if at == len(w):  # plain decoding ended here and the method went on
            margin, tol = math.inf, 0.0
        else:
            margin, tol = choice_margin(model, p + w[:at], w[at], g[at] if at < len(g) else None)
        tie = not exact and margin <= tol
        row["near_ties" if tie else "differing"] += 1
        row["first_differences"].append({"position": at, "margin": round(margin, 5),
                                         "near_tie": tie})
    return row


def merge_agreements(parts: list[dict]) -> dict:
    """:func:`compare_outputs` results over disjoint prompt sets (e.g. one per actor
    shard) as one: the counts summed, the first differences in order."""
    out = {"identical": 0, "near_ties": 0, "differing": 0, "first_differences": []}
    for part in parts:
        for key in ("identical", "near_ties", "differing"):
            out[key] += part[key]
        out["first_differences"] += part["first_differences"]
    return out


def mark_agreement(model: torch.nn.Module, prompts: list[list[int]], row: dict,
                   outputs: list[list[int]], reference: list[list[int]],
                   key: str = "identical_to_ar") -> dict:
    """Where ``row[key]`` is False, add how the outputs differ from ``reference`` (plain
    decoding's, prompt by prompt; :func:`compare_outputs`): ``identical``, ``near_ties``
    (a low-precision rounding tie decided the other way), ``differing`` (anything else:
    a failure) and ``first_differences``. Returns ``row``."""
    if row.get(key) is False:
        row.update(compare_outputs(model, prompts, outputs, reference))
    return row


def agreement_cell(key: str) -> Callable[[dict], str]:
    """A table cell for ``key``: ``True``; ``ties k/n`` where every difference is a
    near tie; ``False`` (with the failing count where it was classified)."""
    def fmt(row: dict) -> str:
        v = row.get(key)
        if v is None:
            return "-"
        if v or "differing" not in row:
            return str(v)
        n = row["identical"] + row["near_ties"] + row["differing"]
        if row["differing"]:
            return f"False ({row['differing']}/{n} differ)"
        return f"ties {row['near_ties']}/{n}"
    return fmt
