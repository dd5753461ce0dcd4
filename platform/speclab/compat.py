"""``speclab check-model``: a compatibility report for a user's own checkpoint.

It loads the target (and draft) as every speclab surface does (so a model the engine
cannot decode correctly is refused here, with the reason), describes them (family,
attention implementation, sliding windows, dtype, tied embeddings), then decodes a few
prompts with plain decoding and each applicable method, one prompt at a time and
batched, and compares every output with plain decoding (and plain decoding with the
family's own Hugging Face greedy ``generate``).

Identity is exact at float32: any difference is a failure. In bfloat16 / float16 a
many-token forward (a verified tree) and a one-token forward round differently, so a
method can pick the other of two near-tied tokens: where an output differs, the report
gives the first differing position and the target's top-2 logit margin there, and
counts it as a NEAR TIE (not a failure) when that margin is within
:data:`TIE_ULPS` units in the last place of the dtype at the top logit's magnitude;
a larger margin is a failure. Nothing here imports Ray or MLflow.
"""

from __future__ import annotations

import time

import torch

from speclab.api import Decoder
from speclab.decoding.attention import attention_layout

#: methods checked with a draft model, and without one, with their knobs
DRAFT_METHODS = {"chain": {"gamma": 4}, "tree": {"tree_top_k": 2, "depth": 4, "nodes": 8},
                 "salf": {"nodes": 8, "batch": 2, "salf_threshold": 0.2}}
NO_DRAFT_METHODS = {"pld": {}}
#: a low-precision difference is a near tie when the margin is within this many ulps
TIE_ULPS = 8


def describe(model) -> dict:
    """Family, architecture, size, dtype, attention implementation and layout."""
    cfg = model.config
    return {"model_type": cfg.model_type, "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "attn_implementation": cfg._attn_implementation,
            "attention": attention_layout(cfg).describe(),
            "vocab_size": int(cfg.vocab_size),
            "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False))}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(model, context: list[int]) -> tuple[float, float]:
    """The target's top-2 logit margin after ``context`` (one plain forward) and the
    near-tie tolerance there (:data:`TIE_ULPS` ulps of the dtype at the top logit)."""
    with torch.no_grad():
        device = next(model.parameters()).device
        logits = model(torch.tensor([context], device=device)).logits[0, -1]
    top = logits.float().topk(2).values
    eps = torch.finfo(logits.dtype).eps
    return float(top[0] - top[1]), TIE_ULPS * eps * max(abs(float(top[0])), 1.0)


def _hf_greedy(model, prompt: list[int], n: int, eos) -> list[int]:
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=n,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _compare(model, prompts, got, want, exact: bool) -> dict:
    """Identical / near-tie / differing counts of ``got`` against ``want``."""
    row = {"identical": 0, "near_ties": 0, "differing": 0, "first_differences": []}
    for p, g, w in zip(prompts, got, want, strict=True):
        at = first_difference(g, w)
        if at is None:
            row["identical"] += 1
            continue
        margin, tol = top2_margin(model, p + w[:at])
        tie = not exact and margin <= tol
        row["near_ties" if tie else "differing"] += 1
        row["first_differences"].append({"position": at, "top2_margin": round(margin, 5),
                                         "near_tie": tie})
    return row


def check_model(dec: Decoder, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Decode ``prompts`` with plain decoding and each applicable method (single and
    batched); returns ``{"target", "draft", "rows", "problems"}``. A row: ``method``,
    ``mode``, counts of ``identical`` / ``near_ties`` / ``differing`` outputs against
    plain decoding (plain decoding: against HF ``generate``), ``tau``, ``tokens_per_s``."""
    model = dec.target.model
    exact = next(model.parameters()).dtype == torch.float32
    report = {"target": describe(model),
              "draft": describe(dec.draft.model) if dec.draft is not None else None,
              "rows": [], "problems": []}
    n = max_new_tokens
    hf = [_hf_greedy(model, p, n, dec.eos_token_id) for p in prompts]
    methods = {"ar": {}, **NO_DRAFT_METHODS, **(DRAFT_METHODS if dec.draft else {})}
    ar: list[list[int]] = []
    for name, knobs in methods.items():
        for mode in ("single", "batched"):
            t0 = time.perf_counter()
            if mode == "single":
                res = [dec.generate(prompt_ids=p, method=name, max_new_tokens=n, **knobs)
                       for p in prompts]
            else:
                res = dec.generate(prompts=prompts, method=name, max_new_tokens=n, **knobs)
            wall = time.perf_counter() - t0
            got = [r.token_ids for r in res]
            if name == "ar" and mode == "single":
                ar = got
            want = hf if name == "ar" else ar
            row = {"method": name, "mode": mode, "against": "hf_generate" if name == "ar"
                   else "ar", "prompts": len(prompts),
                   **_compare(model, prompts, got, want, exact),
                   "tau": sum(r.stats.tau for r in res) / len(res),
                   "tokens_per_s": sum(len(g) for g in got) / wall if wall else 0.0}
            report["rows"].append(row)
            if row["differing"]:
                report["problems"].append(
                    f"{name} ({mode}): {row['differing']} of {len(prompts)} outputs differ "
                    f"from {row['against']} beyond a near tie")
    return report
