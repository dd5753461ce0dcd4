"""Distillation losses for drafters, with shapes in comments (pure PyTorch).

Notation: ``B`` sequences, ``L`` positions, ``V`` vocabulary, ``K`` kept target entries.
The target's distribution ``p`` is stored sparsely as its top-``K`` entries per position
(``ids [B, L, K]``, ``probs [B, L, K]``: the target's own probabilities there, NOT
renormalised, which is what the generation stage writes to disk). Losses that compare
whole distributions (``word_kd``, ``tvd_kd``, ``talf``) renormalise ``p`` over the kept
entries; ``hass_topk`` uses ``p`` as it is. The drafter's logits give ``q``.
Every loss takes ``mask [B, L]`` (1 = position counts) and optional per-sequence
``weights [B]``, and returns the weighted mean over counted positions.

* ``sft`` / ``seq_kd``: cross-entropy on data / on target-generated sequences;
* ``word_kd``: forward KL(p || q) (AtSpeed sec. 4.1 WordKD);
* ``tvd_kd``: total variation 0.5 * sum |p - q| (TVD-KD);
* ``hass_topk``: HASS top-K distillation, -sum_{k in top-K(p)} p_k log q_k with the
  target's unrenormalised ``p_k`` (the slides' formula);
* ``topk_kl``: KL(p || q) between the distributions coarsened to the kept entries plus
  ONE bucket for the rest of the mass (the target's unrenormalised ``p``): a true
  divergence that is 0 only when ``q`` matches ``p`` on the kept entries and on the rest,
  so, unlike a renormalised top-k objective, it does not push ``q``'s mass off the
  tokens outside the top-k (MEDUSA-2's self-distillation ``L_LM``);
* ``talf``: cross-entropy summed over every node of target-built draft trees (the
  caller runs one drafter forward per tree with tree attention and passes the node
  logits here as ``[B, T, V]`` with ``mask`` over real nodes).

A loss the ``distill`` job can use is ONE registry entry, :class:`Loss`: its function,
the data kind (target signal) it needs and how its batches are built and fed to it.
Every consumer (config validation of ``distill.loss`` / ``compare.losses``, signal
generation, the training task) looks the entry up by name. The built-in entries are
listed in ``BUILTIN`` of :mod:`speclab.train.distill_batches`; :func:`register_loss`
adds one from outside the package, in a module named in ``$SPECLAB_PLUGINS`` so that
Ray workers register it too (:mod:`speclab.plugins`; see
``tests/integration/test_loss_registry.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speclab.plugins import load_plugins

LossFn = Callable[..., torch.Tensor]


def masked_mean(per_pos: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean of ``per_pos [B, L]`` over positions where ``mask [B, L]`` is 1
    (``weights [B]``: per row)."""
    mask = mask.to(per_pos.dtype)
    if weights is not None:
        mask = mask * weights.to(per_pos.dtype)[:, None]
    return (per_pos * mask).sum() / mask.sum().clamp_min(1e-8)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, L, V]``, ``labels [B, L]`` -> scalar CE (``sft`` and ``seq_kd``)."""
    per_pos = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # [B, L]
    return masked_mean(per_pos, mask, weights)


def _kept(probs: torch.Tensor) -> torch.Tensor:
    """``probs [B, L, K]`` renormalised over the kept entries (sums to 1 on the last axis)."""
    p = probs.float()
    return p / p.sum(-1, keepdim=True).clamp_min(1e-12)


def _student_logq(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log q at the kept entries: ``logits [B, L, V]``, ``ids [B, L, K]`` -> ``[B, L, K]``."""
    return logits.float().log_softmax(-1).gather(-1, ids)


def word_kd(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Forward KL(p || q) over the target's kept entries: sum_k p_k (log p_k - log q_k).

    ``p`` is renormalised over the kept entries first.
    """
    logq = _student_logq(logits, ids)  # [B, L, K]
    p = _kept(probs)
    per_pos = (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum(-1)  # [B, L]
    return masked_mean(per_pos, mask, weights)


def tvd_kd(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor,
           weights: torch.Tensor | None = None) -> torch.Tensor:
    """Total variation 0.5 * sum_v |p_v - q_v| with p renormalised over its kept entries
    (and zero outside them)."""
    q_kept = _student_logq(logits, ids).exp()  # [B, L, K]
    outside = (1.0 - q_kept.sum(-1)).clamp_min(0.0)  # q mass where p is 0: [B, L]
    per_pos = 0.5 * ((_kept(probs) - q_kept).abs().sum(-1) + outside)
    return masked_mean(per_pos, mask, weights)


def hass_topk(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor,
              weights: torch.Tensor | None = None, top_k: int | None = None) -> torch.Tensor:
    """HASS top-K distillation: -sum over the target's top-K tokens of p_k log q_k.

    ``probs`` are the target's own probabilities at the kept tokens (not renormalised, as
    in HASS); ``top_k`` (<= K) restricts to the first entries (``ids`` sorted by
    probability), again without renormalising.
    """
    if top_k is not None:
        ids, probs = ids[..., :top_k], probs[..., :top_k]
    logq = _student_logq(logits, ids)
    per_pos = -(probs.float() * logq).sum(-1)  # [B, L]
    return masked_mean(per_pos, mask, weights)


def topk_kl(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """KL over the kept entries and one "rest" bucket (module docstring): ``sum_k p_k
    (log p_k - log q_k) + p_r (log p_r - log q_r)`` with ``p_r = 1 - sum_k p_k``, ``q_r = 1 -
    sum_k q_k``; ``probs`` are the target's own (unrenormalised) probabilities."""
    logq = _student_logq(logits, ids)  # [B, L, K]
    p = probs.float()
    p_rest = (1.0 - p.sum(-1)).clamp_min(0.0)  # [B, L]
    q_rest = (1.0 - logq.exp().sum(-1)).clamp_min(1e-12)
    kept = (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum(-1)
    rest = p_rest * (torch.log(p_rest.clamp_min(1e-12)) - torch.log(q_rest))
    return masked_mean(kept + rest, mask, weights)


def soft_ce(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy to the target's kept distribution (renormalised over its ``K``
    entries): ``-sum_k p_k log q_k`` with ``logits [B, L, V]``, ``ids/probs [B, L, K]``."""
    per_pos = -(_kept(probs) * _student_logq(logits, ids)).sum(-1)  # [B, L]
    return masked_mean(per_pos, mask, weights)


def talf(node_logits: torch.Tensor, node_ids: torch.Tensor, node_probs: torch.Tensor,
         node_mask: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """TALF: cross-entropy to the target's distribution at every tree node.

    ``node_logits [B, T, V]`` are the drafter's logits at the ``T`` nodes of each tree
    (one forward per tree with tree attention), ``node_ids/probs [B, T, K]`` the target's
    kept distribution there (renormalised here), ``node_mask [B, T]`` marks real nodes. On
    a one-path tree whose target distributions are one-hot this is exactly the sequence CE.
    """
    return soft_ce(node_logits, node_ids, node_probs, node_mask, weights)


# --- the registry of distillation losses (what ``distill.loss`` names) ---


@dataclass(frozen=True)
class Loss:
    """One distillation loss as the ``distill`` job uses it: everything a consumer needs,
    so none of them dispatches on the loss's name.

    ``fn``: the loss function (above); ``data``: the kind of signal the target must
    generate for it (a data kind of :mod:`speclab.train.distill_data`: ``kd``, ``seq``,
    ``tree``, ... or one registered with ``register_data_kind``); ``collate``: rows of
    that kind -> a batch of tensors (:mod:`speclab.train.distill_batches`); ``apply``:
    ``(model, batch, fn, knobs) -> scalar``, the drafter's forward on the batch and the
    call of ``fn`` (``knobs``: the distill settings a loss may read, ``{"hass_k": ..}``).
    Losses of one data kind draw the same rows each step; each collates them its way. A
    collated batch holds ``inputs`` (the drafter's input ids: the tokens a step counts).
    """

    name: str
    fn: LossFn
    data: str
    collate: Callable[[list[dict]], dict]
    apply: Callable[[torch.nn.Module, dict, LossFn, dict], torch.Tensor]
    doc: str = ""


_LOSSES: dict[str, Loss] = {}
_BUILTIN_LOADED = False


def register_loss(loss: Loss) -> Loss:
    """Add ``loss`` to the registry (a name may be registered once). A module outside the
    package calls this when imported; name it in ``$SPECLAB_PLUGINS`` so that the job's
    Ray workers import it too (:mod:`speclab.plugins`)."""
    old = _LOSSES.get(loss.name)
    if old is not None and _where(old.fn) != _where(loss.fn):  # the same module re-imported
        raise ValueError(f"loss: a loss named {loss.name!r} is already registered")
    _LOSSES[loss.name] = loss
    return loss


def _where(fn) -> tuple[str, str]:
    return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))


def _ensure_builtin() -> None:
    """The built-in entries (registered by :mod:`speclab.train.distill_batches`, which
    knows their batches)."""
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        _BUILTIN_LOADED = True
        importlib.import_module("speclab.train.distill_batches")


def _ensure_loaded() -> None:
    """The built-in entries and the plugin modules of ``$SPECLAB_PLUGINS``."""
    _ensure_builtin()

    load_plugins()


def unknown_losses(names) -> list[str]:
    """The names in ``names`` that no loss is registered under. Plugins are imported
    only when a name is missing, so validating built-in names (config defaults are
    validated while ``speclab.config`` is being imported) never imports a plugin module,
    which may itself import the config or the engine."""
    _ensure_builtin()
    missing = [n for n in names if n not in _LOSSES]
    if missing:
        _ensure_loaded()
        missing = [n for n in names if n not in _LOSSES]
    return missing


def registered_losses() -> dict[str, Loss]:
    """Every registered loss: name -> entry (built-ins and plugins)."""
    _ensure_loaded()
    return dict(_LOSSES)


def loss_entry(name: str) -> Loss:
    """The registry entry of loss ``name``; ``ValueError`` listing the known ones."""
    known = registered_losses()
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"loss: unknown loss {name!r}; known: {sorted(known)}")
    return known[name]


def get_loss(name: str) -> LossFn:
    """Look a loss function up by name; unknown names list the known ones."""
    return loss_entry(name).fn


def loss_data_kinds(names) -> set[str]:
    """The data kinds (target signals) the losses ``names`` need, one per kind."""
    return {loss_entry(n).data for n in names}


# --- AtSpeed alignment losses (recommendation; item ids are constrained token sequences) ---
# Shapes: draft ``logits [R, L, V]`` along ``R`` beam sequences, target ``target_logp
# [R, L, V]`` (log-probabilities; any value where invalid), ``valid [R, L, V]`` bool (tokens
# the item trie allows; at least one per position). Every position keeps its own number of
# valid tokens: a position with fewer than ``k`` valid tokens aligns over those it has.


def _top_valid(scores: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """Indices ``[R, L, k']`` of the ``k`` best VALID entries by ``scores`` and a mask of
    which are real (``k' = min(k, V)``; a position with n < k valid tokens has n real)."""
    ranked = scores.masked_fill(~valid, float("-inf"))
    top = torch.topk(ranked, min(k, scores.shape[-1]), dim=-1)
    return top.indices, torch.isfinite(top.values)


def align_s(logits: torch.Tensor, target_logp: torch.Tensor, valid: torch.Tensor,
            log_p_k: torch.Tensor, k: int) -> torch.Tensor:
    """L_Align-S (AtSpeed eq. 4) per position: ``[R, L]``.

    RKLD over ``V_c`` (the draft's top-``k`` VALID tokens) minus the density
    regularisation, which together equal ``sum_{v in V_c} q(v) (log p(y_K) - log p(v))``
    with ``log_p_k [R, L]`` the target's log-probability of the K-th ranked sequence's
    token there (the K-th sequence under the TARGET). ``q`` is the draft's full softmax, so
    mass outside ``V_c`` is pushed into it.
    """
    logq = logits.float().log_softmax(-1)  # [R, L, V]
    idx, real = _top_valid(logq, valid, k)  # [R, L, k]: V_c
    q_c = logq.gather(-1, idx).exp() * real
    p_c = target_logp.float().gather(-1, idx).masked_fill(~real, 0.0)
    return (q_c * (log_p_k.float()[..., None] - p_c)).sum(-1)


def align_r(logits: torch.Tensor, target_logp: torch.Tensor, valid: torch.Tensor,
            k: int) -> torch.Tensor:
    """L_Align-R (AtSpeed eq. 8) per position: ``[R, L]``.

    TVD between ``p'`` and ``q'``, the target's and the draft's distributions truncated to
    the target's top-``k`` VALID tokens and renormalised (0 where only one token is valid:
    both truncations are then the same point mass).
    """
    target = target_logp.float()
    idx, real = _top_valid(target, valid, k)
    p_t = target.gather(-1, idx).masked_fill(~real, float("-inf")).softmax(-1)
    q_t = logits.float().gather(-1, idx).masked_fill(~real, float("-inf")).softmax(-1)
    return 0.5 * (p_t - q_t).abs().sum(-1)


def per_beam_set(per_pos: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """AtSpeed's reduction of an alignment loss (eq. 4): mean over each beam's ``L``
    positions, summed over the beams of one example, averaged over examples.

    ``per_pos [R, L]``; ``group [R]`` the example (0..n_groups-1) each beam belongs to.
    """
    per_beam = per_pos.mean(-1)  # [R]
    per_example = torch.zeros(n_groups, device=per_pos.device).index_add(0, group, per_beam)
    return per_example.mean()


def rec_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L_Rec (AtSpeed eq. 37): CE summed over each item's ``mask``ed positions, averaged
    over examples. ``logits [B, S, V]``, ``labels [B, S]``, ``mask [B, S]``."""
    per_pos = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # [B, S]
    return (per_pos * mask.to(per_pos.dtype)).sum(-1).mean()


def weighted_bce(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                 w_acc: float = 1.0, w_rej: float = 1.0) -> torch.Tensor:
    """SpecDec++ weighted BCE (section 3.3), averaged over ``mask``ed positions.

    ``-(w_acc * P log sigmoid(z) + w_rej * (1 - P) log(1 - sigmoid(z)))`` with
    ``logits`` z ``[B, N]``, soft labels P ``[B, N]`` in [0, 1], ``mask`` ``[B, N]``.
    """
    if w_acc < 0 or w_rej < 0:
        raise ValueError(f"w_acc / w_rej: must be >= 0, got {w_acc} / {w_rej}")
    z = logits.float()
    per = -(w_acc * target * F.logsigmoid(z) + w_rej * (1 - target) * F.logsigmoid(-z))
    m = mask.float()
    return (per * m).sum() / m.sum().clamp_min(1.0)
