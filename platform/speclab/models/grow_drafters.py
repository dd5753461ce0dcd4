"""Drafters trained against the ``reference`` target, carried to ``reference-large``.

``reference-large`` (:mod:`speclab.reference_large`) computes the reference
target's function with every hidden state ``k`` copies of the small one's side by side
(``tile``), so a drafter that reads the target's features is carried to it by tiling its
weights the same way: it then proposes exactly what the small one proposes on the small
target, and its tau on ``reference-large`` is the small one's on ``reference`` (up to the
bfloat16 rounding of the stored weights). EAGLE drafters (any version) are widened by
:func:`~speclab.reference_large.widen_eagle`; Medusa heads by
:func:`widen_medusa`. :func:`widen_drafter_folder` is what

    speclab reference --large --widen SRC --out DST

runs: it reads which kind of drafter ``SRC`` holds, widens it, checks it against the
small one on held-out tokens and writes the check beside it (``widened.json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import torch

from speclab.families.eagle.model import is_eagle_folder
from speclab.families.medusa.model import (
    MedusaHeads,
    MedusaMeta,
    is_medusa_folder,
    load_medusa,
    save_medusa,
)
from speclab.models.loading import load_model
from speclab.reference_large import (
    ReferenceLarge,
    build_log,
    ensure_reference_large,
    held_out_ids,
    logits_and_features,
    tile_linear,
    widen_eagle_folder,
    widened_summary,
)


@torch.no_grad()
def widen_medusa(heads: MedusaHeads, k: int, target: torch.nn.Module,
                 name: str = "reference-large") -> MedusaHeads:
    """Medusa heads for ``target``, the ``k``x wide model whose last feature is ``k``
    copies of the small target's: each head's ``W1 [H, H]`` becomes ``k x k`` blocks of
    ``W1 / k`` and its bias is tiled (so ``SiLU(W1' tile(h) + b1') = tile(SiLU(W1 h +
    b1))`` and the residual stays tiled), its ``W2 [V, H]`` becomes ``k`` blocks of
    ``W2 / k`` (logits unchanged). Returns float32 heads whose meta is ``target``'s
    (its sizes and LM head fingerprint, named ``name``), keeping the calibration
    (``heads.tree``: accuracies of the same function). ``heads`` is left unchanged."""
    m = heads.meta
    if int(target.config.hidden_size) != m.hidden_size * k:
        raise ValueError(f"widen_medusa: target hidden_size {target.config.hidden_size} is "
                         f"not {k} x the heads' {m.hidden_size}")
    wide = MedusaHeads(replace(MedusaMeta.for_target(target, name, m.heads), blocks=m.blocks))
    wide.w1.copy_(torch.stack([tile_linear(w, k) for w in heads.w1.float()]))
    wide.b1.copy_(heads.b1.float().repeat(1, k))
    wide.w2.copy_(heads.w2.float().repeat(1, 1, k) / k)
    wide.tree = heads.tree
    return wide.eval()


def widen_medusa_folder(src: str, out: str, large: ReferenceLarge | None = None,
                        log: Callable[[str], None] = build_log, ids: list[int] | None = None
                        ) -> dict:
    """``speclab reference --large --widen SRC --out DST`` for Medusa heads (a
    :func:`~speclab.families.medusa.model.save_medusa` folder, e.g. a ``train_medusa`` run's
    MEDUSA-1 heads) trained on the ``reference`` target: widened (:func:`widen_medusa`)
    into heads for ``reference-large`` and saved in bfloat16 with their calibration
    (``tree.json``) to ``out``, with ``widened.json`` (the source and the check). Heads
    for another target (MEDUSA-2's, whose target was fine-tuned, included) are refused by
    name (``--widen``). The check, on 128 held-out tokens (``ids`` replaces them), each
    head set fed its own target's features: the largest logit difference and the greedy
    agreement of every head."""
    large = large or ensure_reference_large()
    small_dir, k = large.grown_from
    small = load_model(small_dir)
    heads = load_medusa(src, small, field="--widen")
    wide_target = load_model(large.target, dtype="float32")
    wide = widen_medusa(heads, k, wide_target)
    ids = ids or held_out_ids(small_dir, 128)
    with torch.no_grad():
        s_logits = heads(logits_and_features(small, ids)[1]).float()  # [K, T, V]
        l_logits = wide(logits_and_features(wide_target, ids)[1]).float()
    agree = (s_logits.argmax(-1) == l_logits.argmax(-1)).float().mean(-1)  # [K]
    check = {"source": str(src), "reference_large": large.folder, "kind": "medusa",
             "heads": wide.meta.heads, "tokens": len(ids),
             "logits_max_abs_diff": float((s_logits - l_logits).abs().max()),
             "greedy_agreement": float(agree.min()),
             "greedy_agreement_per_head": [round(float(a), 4) for a in agree]}
    check["summary"] = widened_summary(check, out, f"{check['heads']} Medusa heads")
    folder = save_medusa(wide.to(torch.bfloat16), out, tree=heads.tree)
    (folder / "widened.json").write_text(json.dumps(check, indent=2))
    log(f"widened {src} ({wide.meta.heads} Medusa heads) -> {folder}: greedy agreement "
        f"{check['greedy_agreement']:.3f} (the worst head), logits max |diff| "
        f"{check['logits_max_abs_diff']:.3f}")
    return check


def widen_drafter_folder(src: str, out: str, large: ReferenceLarge | None = None,
                         log: Callable[[str], None] = build_log, ids: list[int] | None = None
                         ) -> dict:
    """Widen the drafter in ``src`` for ``reference-large``: Medusa heads
    (:func:`widen_medusa_folder`) or an EAGLE drafter of any version
    (:func:`~speclab.reference_large.widen_eagle_folder`); the check's ``kind``
    says which and its ``summary`` is the line to print. A folder that holds neither is
    refused, naming ``--widen``."""
    if is_medusa_folder(src):
        return widen_medusa_folder(src, out, large, log, ids)
    if is_eagle_folder(src):
        return widen_eagle_folder(src, out, large, log, ids)
    raise ValueError(f"--widen: {src} holds neither a speclab EAGLE drafter nor speclab "
                     "Medusa heads (config.json with kind speclab-eagle / speclab-medusa)")
