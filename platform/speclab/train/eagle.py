"""Training the EAGLE feature drafter on target features: EAGLE and HASS (pure PyTorch).

A ``feat`` example (:func:`speclab.train.distill_data.feat_example`) is a corpus window
``x_0..x_L`` with the target's features ``f_0..f_{L-1}`` (``f_j`` is the LM-head input
that predicted ``x_{j+1}``) and its top-k distribution at every position. The drafter
runs over the pairs ``(f_j, x_{j+1})``, ``j = 0..L-2``, and its output at pair ``j`` is
compared with ``f_{j+1}`` and with the target's distribution of ``x_{j+2}``:

* ``eagle`` (EAGLE, slides "Training Objectives"): ``w_reg * SmoothL1(f_hat, f) + w_cls *
  CE(p, q)``, with ``p`` the target's kept top-k distribution renormalised;
* ``hass``: the same regression, the classification term replaced by HASS's top-K
  distillation ``-sum_{top-K(p)} p log q`` (``hass_k`` < the stored top-k, the target's
  own probabilities) and ``hass_steps`` steps of harmonized context alignment.

Context alignment, step ``s >= 2``: at decoding depth ``s - 1`` the drafter's query comes
from its OWN previous output and the last ``s - 1`` keys/values are its own too; only
older positions carry target features. Training reproduces that with one forward over
``2T`` pairs per step: the target half (true features, causal) and an own half whose
pair ``j`` takes the previous step's output at ``j - 1``. An own query at ``j`` attends
to target pairs ``<= j - s + 1`` and own pairs ``j - s + 2 .. j`` (the attention mask);
the loss counts positions with ``j >= s - 1``. Own keys all come from step ``s - 1``
(at decoding the key ``d`` positions back has depth ``s - 1 - d``): the one-forward
approximation HASS also makes. Steps are averaged with equal weights.

* ``talf`` (SALF & TALF, section 3.2 and Algorithm 1): on a ``feat_tree`` example
  (:func:`speclab.train.distill_data.feat_forest_example`: a target-built beam tree rooted
  at every position), the drafter follows the path from each root to every node, fed its
  OWN features as at decoding (a depth-``d`` node's input is the drafter's output at its
  parent), with tree attention; the loss is the cross-entropy to the target's
  distribution after every root and every node, averaged over them
  (:func:`talf_loss`). As in the paper there is no feature regression term, so
  ``w_reg``/``w_cls`` do not apply; the paper fine-tunes an EAGLE-trained drafter with
  it (``eagle.init_from``).
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
    ``topk_ids/probs [B, L, K]``."""
    hidden = int(rows[0]["hidden"])
    return {
        "tokens": torch.tensor([r["tokens"] for r in rows], dtype=torch.long),
        "features": torch.stack([decode_features(r["features"], hidden) for r in rows]),
        "topk_ids": torch.tensor([r["topk_ids"] for r in rows], dtype=torch.long),
        "topk_probs": torch.tensor([r["topk_probs"] for r in rows], dtype=torch.float),
    }


def _decode(data: bytes, dtype, shape) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=dtype).reshape(shape).copy())


def collate_forest(rows: list[dict], roots: int = 0,
                   generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``feat_tree`` rows -> :func:`collate_feat`'s tensors plus the trees of ``R`` roots
    per row: ``forest_roots [B, R]`` (the root's pair index, ascending), ``forest_tokens``
    and ``forest_parents [B, R, D, k]`` (long) and ``forest_ids/probs [B, R, D, k, K]``.

    ``roots`` 0 keeps every root (``R = L - 1``); ``n`` keeps ``n`` drawn at random per row
    (with ``generator``): an unbiased sample of the same per-root loss terms at a
    fraction of the cost."""
    out = collate_feat(rows)
    shape = [int(v) for v in rows[0]["forest_shape"]]
    n_all = shape[0]
    n = n_all if roots <= 0 else min(roots, n_all)
    picks = [torch.arange(n_all) if n == n_all else
             torch.randperm(n_all, generator=generator)[:n].sort().values for _ in rows]
    out["forest_roots"] = torch.stack(picks)
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


def talf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TALF on a :func:`collate_forest` batch (the module docstring): the mean
    cross-entropy over the ``T`` roots' and ``R * D * k`` nodes' next tokens to the
    target's kept top-K (renormalised), from :func:`talf_logits`."""
    logits, ids, probs = talf_logits(model, batch)
    return losses.soft_ce(logits, ids, probs, torch.ones(ids.shape[:2], device=ids.device))


def talf_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's logits after every root and node of a :func:`collate_forest` batch,
    ``[B, T + D * R * k, V]`` (the ``T`` pairs, then nodes in :func:`forest_mask`'s order),
    with the target's kept ``ids/probs [B, T + D * R * k, K]`` there.

    Pass 0 runs the ``T = L - 1`` context pairs with the target's features (pair ``j``'s
    token ``x_{j+1}`` is the root of tree ``j``); pass ``d`` adds the depth-``d`` nodes,
    whose inputs are the previous pass's outputs at their parents, and scores them."""
    tokens, feats = batch["tokens"], batch["features"]
    b, length, hidden = feats.shape
    t = length - 1
    f_tok, parents, roots = (batch["forest_tokens"], batch["forest_parents"],
                             batch["forest_roots"])  # [B, R, D, k], [B, R]
    _, n_roots, depth, k = f_tok.shape
    width = n_roots * k
    allowed = forest_mask(parents, roots, t)
    neg = torch.finfo(feats.dtype).min
    ctx_pos = torch.arange(t, device=feats.device).expand(b, t)
    node_pos = (roots[:, :, None] + 1).expand(b, n_roots, k).reshape(b, width)  # depth 1
    inp_f, inp_x, pos = [feats[:, :-1]], [tokens[:, 1:length]], [ctx_pos]
    out_f, logits = model(inp_f[0], inp_x[0], position_ids=ctx_pos)
    scored, prev = [logits], out_f  # prev: the last pass's outputs at the newest nodes
    for d in range(depth):
        if d == 0:  # depth 1: fed the output at the root's pair
            idx = roots[:, :, None].expand(b, n_roots, hidden)
            parent_out = prev.gather(1, idx)[:, :, None, :].expand(b, n_roots, k, hidden)
        else:
            idx = parents[:, :, d, :, None].expand(b, n_roots, k, hidden)
            parent_out = prev.view(b, n_roots, k, hidden).gather(2, idx)
        inp_f.append(parent_out.reshape(b, width, hidden))
        inp_x.append(f_tok[:, :, d].reshape(b, width))
        pos.append(node_pos + d)
        size = t + (d + 1) * width
        mask = torch.zeros(b, 1, size, size, dtype=feats.dtype, device=feats.device)
        mask.masked_fill_(~allowed[:, None, :size, :size], neg)
        out_f, logits = model(torch.cat(inp_f, 1), torch.cat(inp_x, 1),
                              position_ids=torch.cat(pos, 1), attention_mask=mask)
        prev = out_f[:, -width:]
        scored.append(logits[:, -width:])
    k_top = batch["forest_ids"].shape[-1]
    ids = torch.cat([batch["topk_ids"][:, 1:]]
                    + [batch["forest_ids"][:, :, d].reshape(b, width, k_top)
                       for d in range(depth)], 1)
    probs = torch.cat([batch["topk_probs"][:, 1:]]
                      + [batch["forest_probs"][:, :, d].reshape(b, width, k_top)
                         for d in range(depth)], 1)
    return torch.cat(scored, 1), ids, probs


def _context_mask(t: int, step: int, device: torch.device) -> torch.Tensor:
    """Bool ``[2T, 2T]``: target rows causal over the target half; own row ``j`` sees
    target pairs ``<= j - step + 1`` and own pairs ``j - step + 2 .. j``."""
    i = torch.arange(t, device=device)
    causal = i[None, :] <= i[:, None]  # [T, T] key <= query
    to_target = i[None, :] <= i[:, None] - step + 1
    to_own = causal & (i[None, :] >= i[:, None] - step + 2)
    top = torch.cat([causal, torch.zeros(t, t, dtype=torch.bool, device=device)], 1)
    bottom = torch.cat([to_target, to_own], 1)
    return torch.cat([top, bottom], 0)


def eagle_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], loss: str = "eagle",
               w_reg: float = 1.0, w_cls: float = 0.1, hass_k: int | None = None,
               hass_steps: int = 3) -> torch.Tensor:
    """The drafter's loss on a :func:`collate_feat` batch (see the module docstring).

    ``model(features [B, T, H], input_ids [B, T], position_ids, attention_mask) ->
    (f_hat [B, T, H], logits [B, T, V])`` (an :class:`~speclab.models.eagle.EagleModel`).
    """
    tokens, feats = batch["tokens"], batch["features"]
    b, length, _ = feats.shape
    t = length - 1
    inp_f, inp_x = feats[:, :-1], tokens[:, 1:length]  # pairs (f_j, x_{j+1}), j < T
    tgt_f = feats[:, 1:]  # [B, T, H]
    ids, probs = batch["topk_ids"][:, 1:], batch["topk_probs"][:, 1:]  # [B, T, K]

    def step_loss(f_hat: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor):
        reg = F.smooth_l1_loss(f_hat.float(), tgt_f.float(), reduction="none").mean(-1)
        reg = (reg * mask).sum() / mask.sum().clamp_min(1.0)
        if loss == "hass":
            cls = losses.hass_topk(logits, ids, probs, mask, top_k=hass_k)
        else:
            cls = losses.soft_ce(logits, ids, probs, mask)
        return w_reg * reg + w_cls * cls

    pos = torch.arange(t, device=feats.device).expand(b, t)
    f_hat, logits = model(inp_f, inp_x, position_ids=pos)
    full = torch.ones(b, t, device=feats.device)
    total = [step_loss(f_hat, logits, full)]
    steps = hass_steps if loss == "hass" else 1
    for s in range(2, min(steps, t) + 1):
        own_f = torch.cat([inp_f[:, :1], f_hat[:, :-1]], 1)  # own pair j <- output at j-1
        allowed = _context_mask(t, s, feats.device)
        mask4 = additive_mask(allowed, f_hat.dtype).expand(b, 1, 2 * t, 2 * t)
        out_f, out_logits = model(torch.cat([inp_f, own_f], 1), torch.cat([inp_x, inp_x], 1),
                                  position_ids=torch.cat([pos, pos], 1),
                                  attention_mask=mask4)
        f_hat, logits = out_f[:, t:], out_logits[:, t:]
        valid = (torch.arange(t, device=feats.device) >= s - 1).float().expand(b, t)
        total.append(step_loss(f_hat, logits, valid))
    return sum(total) / len(total)


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
    from speclab.drafters.eagle import EagleDrafter
    from speclab.train.engine_probe import engine_figures

    return engine_figures(target, lambda: EagleDrafter(model, top_k=4, depth=depth, nodes=16),
                          prompts, max_new_tokens, depth)
