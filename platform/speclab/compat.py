"""``speclab check-model``: a compatibility report for a user's own checkpoint.

It loads the target (and draft) as every speclab surface does (so a model the engine
cannot decode correctly is refused here, with the reason), describes them (family,
attention implementation, sliding windows, dtype, tied embeddings), then decodes a few
prompts with plain decoding and each applicable method, one prompt at a time and
batched, and compares every output with plain decoding (and plain decoding with the
family's own Hugging Face greedy ``generate``).

Identity is exact at float32: any difference is a failure. In bfloat16 / float16 a
method can pick the other of two near-tied tokens: where an output differs, the report
gives the first differing position and the margin there between the target's logits
of plain decoding's token and the method's, and counts it as a NEAR TIE (not a
failure) or a failure (:mod:`speclab.agreement`).
Nothing here imports Ray or MLflow.
"""

from __future__ import annotations

import time

import torch

from speclab.agreement import compare_outputs
from speclab.api import Decoder
from speclab.decoding.attention import attention_layout

#: methods checked with a draft model, and without one, with their knobs
DRAFT_METHODS = {"chain": {"gamma": 4}, "tree": {"tree_top_k": 2, "depth": 4, "nodes": 8},
                 "salf": {"nodes": 8, "batch": 2, "salf_threshold": 0.2}}
NO_DRAFT_METHODS = {"pld": {}}


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


def _hf_greedy(model, prompt: list[int], n: int, eos) -> list[int]:
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=n,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_model(dec: Decoder, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Decode ``prompts`` with plain decoding and each applicable method (single and
    batched); returns ``{"target", "draft", "rows", "problems"}``. A row: ``method``,
    ``mode``, counts of ``identical`` / ``near_ties`` / ``differing`` outputs against
    plain decoding (plain decoding: against HF ``generate``), ``tau``, ``tokens_per_s``."""
    model = dec.target.model
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
                   **compare_outputs(model, prompts, got, want),
                   "tau": sum(r.stats.tau for r in res) / len(res),
                   "tokens_per_s": sum(len(g) for g in got) / wall if wall else 0.0}
            report["rows"].append(row)
            if row["differing"]:
                report["problems"].append(
                    f"{name} ({mode}): {row['differing']} of {len(prompts)} outputs differ "
                    f"from {row['against']} beyond a near tie")
    return report
