"""Training the EAGLE feature drafter on target features: EAGLE and HASS (pure PyTorch).

A ``feat`` example (:func:`speclab.train.distill_data.feat_example`) is a corpus window
``x_0..x_L`` with the target's features ``f_0..f_{L-1}`` (``f_j`` is the LM-head input
that predicted ``x_{j+1}``) and its top-k distribution at every position. The drafter
runs over the pairs ``(f_j, x_{j+1})``, ``j = 0..L-2``, and its output at pair ``j`` is
compared with ``f_{j+1}`` and with the target's distribution of ``x_{j+2}``:

* ``eagle`` (EAGLE, slides "Training Objectives"): ``w_reg * SmoothL1(f_hat, f) + w_cls *
  CE(p, q)``, with ``p`` the target's kept top-k distribution renormalised;
* ``hass`` (HASS, its ``main_hass.py`` / ``train.sh``): the same two terms plus ``w_topk``
  times HASS's top-K distillation ``-sum_{top-K(p)} p log q`` (``hass_k`` < the stored
  top-k, the target's own probabilities; HASS trains 1.0 reg + 0.1 CE + 1.0 top-K), over
  ``hass_steps`` steps of harmonized context alignment (:func:`hass_forward`).
* ``talf`` (SALF & TALF, section 3.2 and Algorithm 1): on a ``feat_tree`` example
  (:func:`speclab.train.distill_data.feat_forest_example`: a target-built beam tree rooted
  at every position), the drafter follows the path from each root to every node, fed its
  OWN features as at decoding (a depth-``d`` node's input is the drafter's output at its
  parent), with tree attention; the loss is the cross-entropy to the target's
  distribution after every root and every node, averaged over them
  (:func:`talf_loss`); with ``talf_roots`` ``R`` trees drawn per window, every root term
  is kept and the drawn trees' node terms weigh ``T / R``, so that the loss's expectation
  over the draws is exactly the full loss (:func:`talf_weights`). As in the paper there
  is no feature regression term, so ``w_reg``/``w_cls`` do not apply; the paper
  fine-tunes an EAGLE-trained drafter with it (``eagle.init_from``).

Context alignment (:func:`hass_forward`), step ``s >= 2``: at decoding depth ``s - 1``
the drafter's query comes from its OWN previous output, and the key ``d`` positions back
(``d < s - 1``) is the pair it fed itself at depth ``s - 1 - d``; only older positions
carry target features (the slides' keys ``f^(s_1:j-1)``). Training keeps one key/value
set per step, as HASS's ``cnets_hass.py`` does: step ``s`` feeds pair ``j`` the step
``s - 1`` output at ``j - 1`` and runs ONE forward over these ``T`` new pairs on top of the
drafter's cache of the earlier steps' sets, with a per-offset mask: target pairs ``<= j -
s + 1`` and, for ``d = 0 .. s - 2``, pair ``j - d`` of step ``s - d``'s set. Every layer's
keys are then exactly those of step-by-step decoding on the same tokens (the test compares
steps 3 and 4 with real decoding). The loss counts positions ``j >= s - 1`` (HASS also
counts the earlier ones, whose context is the sequence start). As in HASS the fed-back
features are detached (``hass_detach``; False keeps their graph, a variant) and the step
losses are summed (``hass_reduce: sum``; ``mean`` averages them, a variant).

EAGLE-3 (``eagle3``, an :class:`~speclab.families.eagle.model3.Eagle3Model`): the drafter reads
the FUSED features of the target's chosen layers (``feat3`` data) and has no regression
target; its training-time test is :func:`hass_forward` over ``ttt_steps`` steps (step
``s`` feeds pair ``j`` the drafter's own step ``s - 1`` output at ``j - 1``, with the same
per-step key/value sets, so each step sees exactly what decoding at depth ``s - 1``
sees), the fed-back outputs NOT detached (EAGLE-3 back-propagates through them) and the
steps' cross-entropies to the target's distribution summed with weights ``ttt_decay **
(s - 1)`` (0.8 in EAGLE-3's code), over positions ``j >= s - 1``. With a draft vocabulary
the target's kept top-k is restricted to it and renormalised, as EAGLE-3 restricts the
target's distribution (:func:`draft_vocab_targets`). No feature noise (EAGLE-3 adds
none). TALF applies unchanged (:func:`talf_logits` runs depth by depth on a cache, so
pass 0 may read fused features and later passes the drafter's own).

Feature noise (EAGLE's and HASS's ``AddUniformNoise(std=0.2)``): in training, ``eagle`` and
``hass`` add ``(U[0, 1) - 0.5) * feature_noise * ref / L`` to the target features the
drafter READS (``L`` the window's positions, ``ref`` 512 as in their code:
``eagle.feature_noise_len``); the regression targets stay clean; validation and TALF use
clean features (:func:`feature_noise`).

Architecture (not a training knob): speclab's drafter keeps the LLaMA decoder's input norm
in layer 0 and a final norm (:mod:`speclab.families.eagle.model`), which EAGLE-1/2 and HASS leave
out; saved drafters depend on it, so it stays.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from speclab import losses
from speclab.decoding.tree import additive_mask


def encode_features(features: torch.Tensor) -> bytes:
    """``[L, H]`` features -> float16 bytes (how a Parquet row stores them)."""
    return features.to(torch.float16).cpu().numpy().tobytes()


def decode_features(data: bytes, hidden: int) -> torch.Tensor:
    """float16 bytes -> ``[L, H]`` float32 features."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.float16).reshape(-1, hidden).copy()
                            ).float()


def collate_feat(rows: list[dict]) -> dict[str, torch.Tensor]:
    """``feat`` rows of equal length -> ``tokens [B, L+1]``, ``features [B, L, H]``,
    ``topk_ids/probs [B, L, K]``, and ``loss_mask [B, L+1]`` (1 on the tokens the loss
    covers: a conversation's assistant tokens) where the rows carry one."""
    hidden = int(rows[0]["hidden"])
    out = {
        "tokens": torch.tensor([r["tokens"] for r in rows], dtype=torch.long),
        "features": torch.stack([decode_features(r["features"], hidden) for r in rows]),
        "topk_ids": torch.tensor([r["topk_ids"] for r in rows], dtype=torch.long),
        "topk_probs": torch.tensor([r["topk_probs"] for r in rows], dtype=torch.float),
    }
    if rows[0].get("loss_mask") is not None:
        out["loss_mask"] = torch.tensor([r["loss_mask"] for r in rows], dtype=torch.float)
    return out


@torch.no_grad()
def online_feat_batch(target: torch.nn.Module, rows: list[dict], k: int, spec=None,
                      hooks=None, draft_ids: torch.Tensor | None = None
                      ) -> dict[str, torch.Tensor]:
    """:func:`collate_feat`'s tensors for token-window rows (``windows`` kind) computed
    NOW by the frozen ``target`` on its device: one batched forward over the inputs
    ``tokens[:, :L]`` (equal-length windows, no padding), the features ``spec`` names
    (None: the last layer's; EAGLE-3: the fused layers) kept by ``hooks`` (a
    :class:`~speclab.decoding.features.FeatureHooks` on ``target``; made when None) and
    the target's top-``k`` probabilities. Equal to the offline rows' tensors up to the
    float16 rounding those store. ``draft_ids [V_d]`` (an EAGLE-3 draft vocabulary, target
    ids): also EAGLE-3's teacher, ``teacher_probs [B, L, V_d]`` (the target's logits at
    those ids, softmaxed) and ``teacher_mask [B, L]`` (1 where the target's argmax over
    the whole vocabulary is one of them)."""
    from speclab.decoding.features import FeatureHooks

    device = next(target.parameters()).device
    tokens = torch.tensor([r["tokens"] for r in rows], dtype=torch.long)  # [B, L + 1]
    own = hooks is None
    hooks = hooks or FeatureHooks(target)
    hooks.add(spec)
    try:
        logits = target(input_ids=tokens[:, :-1].to(device), use_cache=False).logits
        feats = hooks.get(spec).float()  # [B, L, F]
        probs, ids = torch.topk(logits.float().softmax(-1), k, dim=-1)  # [B, L, K]
    finally:
        hooks.clear()
        if own:
            hooks.remove()
    out = {"tokens": tokens, "features": feats.cpu(), "topk_ids": ids.cpu(),
           "topk_probs": probs.cpu()}
    if draft_ids is not None:
        draft_ids = draft_ids.to(logits.device)
        inside = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        inside[draft_ids] = True
        # kept on the target's device: [B, L, V_d] floats need no round trip
        out["teacher_probs"] = logits.float().index_select(-1, draft_ids).softmax(-1)
        out["teacher_mask"] = inside[logits.argmax(-1)].float()
    if rows[0].get("loss_mask") is not None:
        out["loss_mask"] = torch.tensor([r["loss_mask"] for r in rows], dtype=torch.float)
    return out


def pair_mask(batch: dict[str, torch.Tensor], t: int) -> torch.Tensor | None:
    """``[B, T]``: 1 where pair ``j``'s prediction (the token ``tokens[:, j + 2]``) is one
    the loss covers (``batch["loss_mask"]``: a conversation's assistant tokens); None
    where the batch has no mask (every position counts)."""
    m = batch.get("loss_mask")
    return None if m is None else m[:, 2: t + 2]


def scored_mask(batch: dict[str, torch.Tensor], t: int) -> torch.Tensor | None:
    """``[B, T]``: :func:`pair_mask` times EAGLE-3's teacher mask (``teacher_mask[:, 1:T +
    1]``: the target's argmax inside the draft vocabulary) where the batch has one: the
    pairs the loss scores; None when neither masks anything."""
    m = pair_mask(batch, t)
    if "teacher_mask" in batch:
        inside = batch["teacher_mask"][:, 1:t + 1]
        m = inside if m is None else m.to(inside.device) * inside
    return m


def _decode(data: bytes, dtype, shape) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=dtype).reshape(shape).copy())


def collate_forest(rows: list[dict], roots: int = 0,
                   generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``feat_tree`` rows -> :func:`collate_feat`'s tensors plus the trees of ``R`` roots
    per row: ``forest_roots [B, R]`` (the root's pair index, ascending), ``forest_tokens``
    and ``forest_parents [B, R, D, k]`` (long) and ``forest_ids/probs [B, R, D, k, K]``.

    ``roots`` 0 keeps every root (``R = L - 1``); ``n`` keeps ``n`` trees drawn at random per
    row (with ``generator``), at a fraction of the cost; :func:`talf_weights` weighs their
    node terms so that the loss's expectation over the draws is the full loss. A row
    whose trees were drawn when it was made (``forest_roots`` stored:
    ``eagle.talf_data_roots``) holds fewer trees than pairs; the draw is then among them,
    which is still a uniform draw of the window's roots, so the same weights hold."""
    out = collate_feat(rows)
    shape = [int(v) for v in rows[0]["forest_shape"]]
    n_all = shape[0]
    n = n_all if roots <= 0 else min(roots, n_all)
    picks = [torch.arange(n_all) if n == n_all else
             torch.randperm(n_all, generator=generator)[:n].sort().values for _ in rows]
    out["forest_roots"] = torch.stack([
        _decode(r["forest_roots"], np.int32, [n_all]).long()[pick] if "forest_roots" in r
        else pick for r, pick in zip(rows, picks, strict=True)])
    cols = (("forest_tokens", np.int32, shape[:3]), ("forest_parents", np.int8, shape[:3]),
            ("forest_ids", np.int32, shape), ("forest_probs", np.float16, shape))
    for key, dtype, shp in cols:
        t = torch.stack([_decode(r[key], dtype, shp)[pick] for r, pick in zip(rows, picks)])
        out[key] = t.float() if dtype is np.float16 else t.long()
    return out


def forest_mask(parents: torch.Tensor, roots: torch.Tensor, pairs: int) -> torch.Tensor:
    """Bool ``[B, S, S]`` over ``pairs`` context pairs followed by the forest's nodes in
    depth-major order (``S = pairs + D * R * k``, node ``(d, r, i)`` at ``pairs + (d * R + r)
    * k + i``): context pairs are causal; a node sees the context pairs up to its root's
    (pair ``roots[r]``, whose token is the root), its ancestors and itself.

    ``parents [B, R, D, k]``: the parent's beam slot at depth ``d - 1`` (-1 at depth 1);
    ``roots [B, R]``: each tree's root pair."""
    b, n_roots, depth, k = parents.shape
    width = n_roots * k
    size = pairs + depth * width
    allowed = torch.zeros(b, size, size, dtype=torch.bool, device=parents.device)
    allowed[:, :pairs, :pairs] = torch.tril(torch.ones(pairs, pairs, dtype=torch.bool,
                                                       device=parents.device))
    diag = torch.arange(width, device=parents.device)
    for d in range(depth):
        start = pairs + d * width
        if d == 0:  # the root's pair row: pairs 0..root
            idx = roots[:, :, None].expand(b, n_roots, size)
            rows = allowed.gather(1, idx)[:, :, None, :].expand(b, n_roots, k, size)
        else:
            prev = allowed[:, start - width: start].view(b, n_roots, k, size)
            idx = parents[:, :, d, :, None].expand(b, n_roots, k, size)
            rows = prev.gather(2, idx)
        rows = rows.reshape(b, width, size).clone()
        rows[:, diag, start + diag] = True
        allowed[:, start: start + width] = rows
    return allowed


def talf_weights(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-term weights ``[B, T + D * R * k]`` of :func:`talf_logits`' terms: 1 for the
    ``T`` root terms (pass 0 scores every pair anyway) and ``T / R`` for the node terms of
    the ``R`` drawn trees. Every row then weighs ``T * (1 + D * k)`` in all, as with every
    tree kept, and since each tree is drawn with probability ``R / T`` the weighted mean's
    expectation over the draws is exactly the full loss (``R = T``: all ones)."""
    feats, f_tok = batch["features"], batch["forest_tokens"]  # [B, L, H], [B, R, D, k]
    b, n_roots, depth, k = f_tok.shape
    t = feats.shape[1] - 1
    nodes = torch.full((b, depth * n_roots * k), t / n_roots, device=feats.device)
    out = torch.cat([torch.ones(b, t, device=feats.device), nodes], 1)
    pm = pair_mask(batch, t)
    if pm is None:
        return out
    at_roots = pm.to(feats.device).gather(1, batch["forest_roots"].to(feats.device))  # [B, R]
    return out * torch.cat([pm.to(feats.device), at_roots[:, None, :, None].expand(
        b, depth, n_roots, k).reshape(b, -1)], 1)


def talf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TALF on a :func:`collate_forest` batch (the module docstring): the cross-entropy
    over the ``T`` roots' and ``R * D * k`` nodes' next tokens to the target's kept top-K
    (renormalised), from :func:`talf_logits`, averaged with :func:`talf_weights`."""
    logits, ids, probs = talf_logits(model, batch)
    probs = draft_vocab_targets(model, ids, probs)
    return losses.soft_ce(logits, ids, probs, talf_weights(batch).to(logits.device))


def draft_vocab_targets(model: torch.nn.Module, ids: torch.Tensor, probs: torch.Tensor
                        ) -> torch.Tensor:
    """The target's kept probabilities ``probs [..., K]`` at ``ids [..., K]`` with the
    entries outside the drafter's draft vocabulary (an EAGLE-3 ``t2d``) zeroed (the losses
    renormalise what is left); unchanged for a drafter over the whole vocabulary."""
    t2d = getattr(getattr(model, "module", model), "t2d", None)  # DDP wraps the drafter
    if t2d is None or bool(t2d.all()):
        return probs
    return probs * t2d.to(ids.device)[ids].to(probs.dtype)


def eagle3_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int = 7,
                decay: float = 0.8) -> torch.Tensor:
    """EAGLE-3's training-time test on a :func:`collate_feat` batch of fused features
    (the module docstring): ``sum_s decay ** (s - 1) * CE_s`` over ``steps`` steps of
    :func:`hass_forward` (fed-back outputs not detached), ``CE_s`` the cross-entropy at
    pairs ``j >= s - 1`` to EAGLE-3's teacher where the batch has it (``teacher_probs [B,
    L, V_d]``, the target's distribution over the draft vocabulary, and ``teacher_mask [B,
    L]``, its argmax inside it: :func:`online_feat_batch`), else to the target's kept
    top-k restricted to the draft vocabulary (the ``topk`` variant). ``features [B, L,
    F]``, ``tokens [B, L + 1]``, ``topk_ids/probs [B, L, K]``. Each step's CE is the mean
    over its scored positions (EAGLE-3's code divides by all ``B * T`` positions: a
    factor per batch, the fraction scored, that only rescales the step size)."""
    tokens, feats = batch["tokens"], batch["features"]
    b, length, _ = feats.shape
    t = length - 1
    outputs = hass_forward(model, feats[:, :-1], tokens[:, 1:length], min(steps, t), False)
    pm = scored_mask(batch, t)
    teacher = "teacher_probs" in batch
    if teacher:  # EAGLE-3's: the whole distribution over the draft vocab
        draft_ids = getattr(model, "module", model).draft_ids  # DDP wraps the drafter
        probs = batch["teacher_probs"][:, 1:]
    else:  # the variant: the stored top-k, restricted to the draft vocabulary
        ids = batch["topk_ids"][:, 1:]
        probs = draft_vocab_targets(model, ids, batch["topk_probs"][:, 1:])
    total = 0.0
    for s, (_, logits) in enumerate(outputs, start=1):
        valid = (torch.arange(t, device=feats.device) >= s - 1).float().expand(b, t)
        valid = valid if pm is None else valid * pm.to(valid.device)
        if teacher:
            logq = logits.float().log_softmax(-1).index_select(-1, draft_ids)  # [B, T, V_d]
            step = losses.masked_mean(-(probs * logq).sum(-1), valid)
        else:
            step = losses.soft_ce(logits, ids, probs, valid)
        total = total + decay ** (s - 1) * step
    return total


def talf_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's logits after every root and node of a :func:`collate_forest` batch,
    ``[B, T + D * R * k, V]`` (the ``T`` pairs, then nodes in :func:`forest_mask`'s order),
    with the target's kept ``ids/probs [B, T + D * R * k, K]`` there.

    Pass 0 runs the ``T = L - 1`` context pairs with the target's features (pair ``j``'s
    token ``x_{j+1}`` is the root of tree ``j``); pass ``d`` adds the depth-``d`` nodes,
    whose inputs are the previous pass's outputs at their parents, and scores them."""
    from transformers import DynamicCache

    tokens, feats = batch["tokens"], batch["features"]
    b, length, _ = feats.shape
    t = length - 1
    f_tok, parents, roots = (batch["forest_tokens"], batch["forest_parents"],
                             batch["forest_roots"])  # [B, R, D, k], [B, R]
    _, n_roots, depth, k = f_tok.shape
    width = n_roots * k
    allowed = forest_mask(parents, roots, t)
    ctx_pos = torch.arange(t, device=feats.device).expand(b, t)
    node_pos = (roots[:, :, None] + 1).expand(b, n_roots, k).reshape(b, width)  # depth 1
    cache = DynamicCache()  # pass d appends its nodes; earlier outputs never change
    out_f, logits = model(feats[:, :-1], tokens[:, 1:length], position_ids=ctx_pos,
                          past_key_values=cache, use_cache=True)
    scored, prev = [logits], out_f  # prev: the last pass's outputs at the newest nodes
    hidden = out_f.shape[-1]  # the drafter's own width (EAGLE-3 reads wider features)
    neg = torch.finfo(out_f.dtype).min
    for d in range(depth):
        if d == 0:  # depth 1: fed the output at the root's pair
            idx = roots[:, :, None].expand(b, n_roots, hidden)
            parent_out = prev.gather(1, idx)[:, :, None, :].expand(b, n_roots, k, hidden)
        else:
            idx = parents[:, :, d, :, None].expand(b, n_roots, k, hidden)
            parent_out = prev.view(b, n_roots, k, hidden).gather(2, idx)
        start, size = t + d * width, t + (d + 1) * width
        mask = torch.zeros(b, 1, width, size, dtype=out_f.dtype, device=feats.device)
        mask.masked_fill_(~allowed[:, None, start:size, :size], neg)
        prev, logits = model(parent_out.reshape(b, width, hidden),
                             f_tok[:, :, d].reshape(b, width), position_ids=node_pos + d,
                             attention_mask=mask, past_key_values=cache, use_cache=True)
        scored.append(logits)
    k_top = batch["forest_ids"].shape[-1]
    ids = torch.cat([batch["topk_ids"][:, 1:]]
                    + [batch["forest_ids"][:, :, d].reshape(b, width, k_top)
                       for d in range(depth)], 1)
    probs = torch.cat([batch["topk_probs"][:, 1:]]
                      + [batch["forest_probs"][:, :, d].reshape(b, width, k_top)
                         for d in range(depth)], 1)
    return torch.cat(scored, 1), ids, probs


def hass_step_mask(t: int, step: int, device: torch.device) -> torch.Tensor:
    """Bool ``[T, step * T]``: which keys step ``step``'s pair ``j`` (a row) sees among the
    ``step`` key/value sets (set 0: the target's pairs; set ``m >= 1``: the pairs fed at step
    ``m + 1``), as decoding at depth ``step - 1`` would: target pairs ``<= j - step + 1``
    and, at offset ``d = 0 .. step - 2``, pair ``j - d`` of set ``step - 1 - d``."""
    i = torch.arange(t, device=device)
    sets = [i[None, :] <= i[:, None] - step + 1]  # set 0: the target's features
    for m in range(1, step):
        sets.append(i[None, :] == i[:, None] - (step - 1 - m))
    return torch.cat(sets, 1)


def hass_forward(model: torch.nn.Module, features: torch.Tensor, input_ids: torch.Tensor,
                 steps: int, detach: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The drafter's outputs at every step of HASS's harmonized context alignment (the
    module docstring): ``features [B, T, H]`` (the target's ``f_j``) and ``input_ids [B, T]``
    (``x_{j+1}``) -> ``[(f_hat [B, T, H], logits [B, T, V])]`` for steps ``1..steps``.

    Step 1 is the plain teacher-forced forward. Step ``s >= 2`` feeds pair ``j`` the step
    ``s - 1`` output at pair ``j - 1`` (pair 0 keeps ``f_0``), detached when ``detach`` (as
    HASS does), and runs one forward over these ``T`` pairs on top of the cache holding
    the earlier steps' key/value sets, masked by :func:`hass_step_mask`; at ``j >= s - 1``
    its output is that of decoding ``s - 1`` steps past pair ``j - s + 1`` on the same
    tokens, at every layer."""
    from transformers import DynamicCache

    b, t, _ = features.shape
    pos = torch.arange(t, device=features.device).expand(b, t)
    if steps <= 1:
        return [model(features, input_ids, position_ids=pos)]
    cache = DynamicCache()  # the key/value sets of the steps so far, in step order
    out = [model(features, input_ids, position_ids=pos, past_key_values=cache,
                 use_cache=True)]
    for s in range(2, steps + 1):
        prev = out[-1][0]
        # pair j <- j-1; pair 0 has no own output (EAGLE-3: its features are wider), and
        # only rows the loss skips (j < s - 1) ever see it
        first = (features[:, :1].to(prev.dtype) if features.shape[-1] == prev.shape[-1]
                 else torch.zeros_like(prev[:, :1]))
        fed = torch.cat([first, prev[:, :-1]], 1)
        if detach:
            fed = fed.detach()
        allowed = hass_step_mask(t, s, features.device)
        mask = additive_mask(allowed, prev.dtype).expand(b, 1, t, s * t)
        out.append(model(fed, input_ids, position_ids=pos, attention_mask=mask,
                         past_key_values=cache, use_cache=True))
    return out


def feature_noise(shape: torch.Size | tuple[int, ...], std: float, ref_len: int = 512,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """EAGLE's and HASS's ``AddUniformNoise``: ``(U[0, 1) - 0.5) * std * ref_len / L`` of
    ``shape`` ``[B, L, H]`` (``L`` the window's feature positions; their code has
    ``ref_len`` 512 and ``std`` 0.2), added to the features the drafter reads in training
    (:func:`eagle_loss`'s ``batch["feature_noise"]``)."""
    length = int(shape[1])
    return (torch.rand(shape, generator=generator) - 0.5) * (std * ref_len / max(length, 1))


def feature_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], w_reg: float = 1.0,
                 w_cls: float = 0.1, w_topk: float = 0.0, top_k: int | None = None,
                 steps: int = 1, detach: bool = True, reduce: str = "sum") -> torch.Tensor:
    """EAGLE's and HASS's loss on a :func:`collate_feat` batch (the module docstring).

    ``model(features [B, T, H], input_ids [B, T], position_ids, attention_mask,
    past_key_values, use_cache) -> (f_hat [B, T, H], logits [B, T, V])`` (an
    :class:`~speclab.families.eagle.model.EagleModel`). ``batch["feature_noise"]``
    (``[B, L, H]``, optional; :func:`feature_noise`) is added to the features the drafter
    reads, not to the regression targets. At each of ``steps`` steps
    (:func:`hass_forward`; ``detach``): ``w_reg * reg + w_cls * CE``, plus ``w_topk *
    top-K`` (the target's ``top_k``) when ``w_topk`` > 0, summed over the steps
    (``reduce: sum``, HASS) or averaged (``mean``). EAGLE: one step, no top-K term.
    """
    if reduce not in ("sum", "mean"):
        raise ValueError(f"hass_reduce: sum or mean, got {reduce!r}")
    tokens, feats = batch["tokens"], batch["features"]
    b, length, _ = feats.shape
    t = length - 1
    read = feats if batch.get("feature_noise") is None else \
        feats + batch["feature_noise"].to(feats.device, feats.dtype)
    inp_f, inp_x = read[:, :-1], tokens[:, 1:length]  # pairs (f_j, x_{j+1}), j < T
    tgt_f = feats[:, 1:]  # [B, T, H]: the clean features
    ids, probs = batch["topk_ids"][:, 1:], batch["topk_probs"][:, 1:]  # [B, T, K]

    def step_loss(f_hat: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor):
        reg = F.smooth_l1_loss(f_hat.float(), tgt_f.float(), reduction="none").mean(-1)
        reg = (reg * mask).sum() / mask.sum().clamp_min(1.0)
        out = w_reg * reg + w_cls * losses.soft_ce(logits, ids, probs, mask)
        if w_topk:
            out = out + w_topk * losses.hass_topk(logits, ids, probs, mask, top_k=top_k)
        return out

    outputs = hass_forward(model, inp_f, inp_x, min(steps, t), detach)
    pm = pair_mask(batch, t)
    total = []
    for s, (f_hat, logits) in enumerate(outputs, start=1):
        valid = (torch.arange(t, device=feats.device) >= s - 1).float().expand(b, t)
        valid = valid if pm is None else valid * pm.to(valid.device)
        total.append(step_loss(f_hat, logits, valid))
    return sum(total) / (len(total) if reduce == "mean" else 1)


def eagle_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], loss: str = "eagle",
               w_reg: float = 1.0, w_cls: float = 0.1, hass_k: int | None = None,
               hass_steps: int = 3, w_topk: float = 1.0, hass_detach: bool = True,
               hass_reduce: str = "sum") -> torch.Tensor:
    """:func:`feature_loss` with the ``eagle`` group's field names: ``loss`` ``hass``
    runs ``hass_steps`` steps with the ``w_topk`` top-``hass_k`` term, ``eagle`` one step
    without it (the objectives themselves: :mod:`speclab.families.eagle.objectives`)."""
    hass = loss == "hass"
    return feature_loss(model, batch, w_reg, w_cls, w_topk if hass else 0.0, hass_k,
                        hass_steps if hass else 1, hass_detach, hass_reduce)


@torch.no_grad()
def top1_agreement(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Fraction of pairs where the drafter's argmax is the target's (step 1, teacher
    features): the per-token greedy acceptance proxy EAGLE reports."""
    feats, tokens = batch["features"], batch["tokens"]
    t = feats.shape[1] - 1
    _, logits = model(feats[:, :-1], tokens[:, 1: t + 1])
    return float((logits.argmax(-1) == batch["topk_ids"][:, 1:, 0]).float().mean())


def engine_acceptance(target: torch.nn.Module, model: torch.nn.Module, prompts: list[list[int]],
                      max_new_tokens: int, depth: int = 5) -> dict[str, float]:
    """:func:`~speclab.train.engine_probe.engine_figures` of greedy EAGLE-2 decoding
    (``tree_top_k`` 4, ``depth``, 16 nodes) with the drafter as it is now."""
    from speclab.decoding.drafting import DraftTraits
    from speclab.families.eagle.drafter import EagleDrafter
    from speclab.train.engine_probe import engine_figures

    traits = DraftTraits(needs_features=True, feature_layers=model.meta.feature_layers)
    return engine_figures(target, lambda: EagleDrafter(model, top_k=4, depth=depth, nodes=16),
                          prompts, max_new_tokens, depth, traits)
