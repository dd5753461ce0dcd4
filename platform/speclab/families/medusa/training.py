"""Training Medusa heads: MEDUSA-1 and MEDUSA-2 (pure PyTorch).

Data: ``medusa`` examples (:func:`speclab.train.distill_data.medusa_example`): a corpus
prompt and the target's own greedy continuation (self-distillation, as Medusa's recipe
uses when the original training data is not at hand), with the target's features
``h_0..h_{L-1}`` and its top-k distribution at every input (``collate_feat`` tensors).

Labels inside the prompt are corpus text, not the target's own tokens. As Medusa masks
prompts from the head loss and scores its heads on the model's own tokens, a head's
label ``x_{t+k+1}`` counts only when it lies in the continuation (index ``>= first_label``,
the prompt's length): in the heads' losses (unless ``medusa.prompt_labels``, a variant
that also trains on the corpus labels) and always when the heads are scored:
``val_head<k>_top1`` during training (:func:`own_token_accuracies`), and the calibration
(:func:`own_token_hits` and :func:`own_token_ranks`: ``tree.json``, the sparse tree,
``expected_tau.*`` and ``replayed_tau.*``), which by default scores held-out prompts
continued by the target (:mod:`speclab.families.medusa.stages`).

* MEDUSA-1 (frozen backbone; the slides' formula): ``sum_k lambda_k CE(p_t^(k),
  x_{t+k+1})`` with ``lambda_k = decay^k``, on the stored features, so a step never runs
  the backbone (:func:`medusa1_loss`).
* MEDUSA-2 (joint fine-tuning): ``L_LM + lambda_0 L_MEDUSA-1`` on a trainable copy of the
  backbone (:class:`Medusa2Model`). ``L_LM`` is, by default (``lm_loss: kl``), the KL
  from the ORIGINAL target's distribution (Medusa's self-distillation variant, which keeps
  the fine-tuned target close to the original), computed on the stored top-k plus one
  bucket for the rest of the mass (:func:`speclab.losses.topk_kl`: a renormalised top-k
  cross-entropy would push the mass off every other token and ruin the perplexity on
  real text); ``lm_loss: ce`` is the slides' ``-log p^(0)(x_{t+1})``.
  The recipe's warm-up: for the first ``heads_warmup`` steps only the heads train (the
  backbone runs without gradients), then both, the backbone at a lower learning rate
  (the task's parameter groups).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speclab import losses
from speclab.families.medusa.model import MedusaHeads


def _label_span(length: int, k: int, first_label: int) -> tuple[int, int]:
    """Positions ``start..stop-1`` at which head ``k`` (at ``t``, label ``x_{t+k+1}``) has a
    label among ``L + 1`` tokens with index ``>= first_label``."""
    return max(first_label - k - 1, 0), length - k


def head_losses(head_logits: torch.Tensor, tokens: torch.Tensor, first_label: int = 0
                ) -> list[torch.Tensor]:
    """Per-head mean cross-entropy: ``head_logits [K, B, L, V]`` (head ``k`` at features
    ``h_0..h_{L-1}``) against ``tokens [B, L+1]``; head ``k`` at ``t`` predicts
    ``x_{t+k+1}`` (positions with ``t + k + 1 > L`` have no label and are skipped, as are
    those whose label index is below ``first_label``: the prompt's corpus tokens)."""
    n_heads, _, length, vocab = head_logits.shape
    out = []
    for k in range(1, n_heads + 1):
        start, stop = _label_span(length, k, first_label)
        if stop <= start:
            out.append(head_logits.sum() * 0.0)
            continue
        logits = head_logits[k - 1, :, start:stop].reshape(-1, vocab).float()
        out.append(F.cross_entropy(logits, tokens[:, k + 1 + start: k + 1 + stop].reshape(-1)))
    return out


@torch.no_grad()
def own_token_hits(heads: MedusaHeads, features: torch.Tensor, tokens: torch.Tensor,
                   top: int = 10, first_label: int = 0, chunk: int = 32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The counts behind :func:`own_token_accuracies`: ``hits [K, top]`` (positions whose
    label ``x_{t+k+1}``, index ``>= first_label``, is head ``k``'s ``r``-th most likely
    token) and ``counts [K]`` (positions scored per head), so that sequences of several
    lengths and prompt lengths add up. ``features [B, L, H]`` at inputs ``tokens[:, :L]``;
    ``tokens [B, L+1]``."""
    n_heads, length = heads.meta.heads, features.shape[1]
    hits = torch.zeros(n_heads, top)
    counts = torch.zeros(n_heads)
    for begin in range(0, features.shape[0], chunk):
        logits = heads(features[begin: begin + chunk])  # [K, b, L, V]
        rows = tokens[begin: begin + chunk]
        for k in range(1, n_heads + 1):
            start, stop = _label_span(length, k, first_label)
            if stop > start:
                ranked = logits[k - 1, :, start:stop].topk(top, dim=-1).indices  # [b, n, top]
                truth = rows[:, k + 1 + start: k + 1 + stop, None]
                hits[k - 1] += (ranked == truth).float().sum((0, 1)).cpu()
                counts[k - 1] += ranked.shape[0] * ranked.shape[1]
    return hits, counts


@torch.no_grad()
def own_token_ranks(heads: MedusaHeads, features: torch.Tensor, tokens: torch.Tensor,
                    top: int = 10, first_label: int = 0) -> list[list[tuple[int, ...]]]:
    """Per sequence, per position ``t`` (in order) at which a greedy decoding's round can
    start, from the first one, ``t = first_label - 2`` (its root ``x_{t+1}`` ends the
    prompt, head 1's label ``x_{t+2}`` is the first token past it), to ``t = L - 2``:
    the rank of ``x_{t+k+1}`` among head ``k``'s ``top`` most likely tokens, ``k =
    1..K``; ``top`` when it is not among them or lies beyond what the round could still
    draft (``k > L - t - 2``: the last token of the sequence is a round's bonus at the
    latest, as when decoding stops at the token budget or EOS).
    :func:`speclab.families.medusa.trees.replayed_length` replays a tree's rounds on
    them. ``features [B, L, H]`` at inputs ``tokens[:, :L]``; ``tokens [B, L+1]``."""
    n_heads, length = heads.meta.heads, features.shape[1]
    start, stop = max(first_label - 2, 0), length - 1
    if stop <= start:
        return [[] for _ in range(features.shape[0])]
    logits = heads(features[:, start:stop])  # [K, B, n, V]
    ranked = logits.topk(top, dim=-1).indices  # [K, B, n, top]
    padded = torch.cat([tokens, tokens.new_full((tokens.shape[0], n_heads), -1)], dim=1)
    labels = torch.stack([padded[:, start + k + 1: stop + k + 1]
                          for k in range(1, n_heads + 1)])  # [K, B, n]
    hit = ranked == labels[..., None]
    rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, top))
    t = torch.arange(start, stop)
    k = torch.arange(1, n_heads + 1)[:, None]
    rank[(k > length - t - 2)[:, None].expand_as(rank)] = top  # past the budget
    return [[tuple(r) for r in row] for row in rank.permute(1, 2, 0).tolist()]


def hit_rates(hits: torch.Tensor, counts: torch.Tensor) -> list[list[float]]:
    """``acc[k-1][r]`` = ``hits[k-1, r] / counts[k-1]`` (zeros where nothing was scored)."""
    return [(hits[k] / counts[k]).tolist() if counts[k] else [0.0] * hits.shape[1]
            for k in range(hits.shape[0])]


@torch.no_grad()
def own_token_accuracies(heads: MedusaHeads, features: torch.Tensor, tokens: torch.Tensor,
                         top: int = 10, first_label: int = 0, chunk: int = 32
                         ) -> list[list[float]]:
    """Calibration on the target's own tokens: ``acc[k-1][r]`` = the fraction of positions
    whose label ``x_{t+k+1}`` has index ``>= first_label`` (past the corpus prompt) where
    head ``k``'s ``r``-th most likely token (``r = 0..top-1``) is that label.

    ``features [B, L, H]``: the target's features at inputs ``tokens[:, :L]``; ``tokens
    [B, L+1]``. ``first_label`` 0 counts every position
    (:func:`speclab.families.medusa.model.head_accuracies`). Sequences go through the heads
    ``chunk`` at a time."""
    return hit_rates(*own_token_hits(heads, features, tokens, top, first_label, chunk))


def weighted(per_head: list[torch.Tensor], decay: float) -> torch.Tensor:
    """``sum_k decay^k * per_head[k-1]`` (the slides' ``lambda_k = c^k``)."""
    return sum(decay ** k * loss for k, loss in enumerate(per_head, start=1))


def medusa1_loss(heads: MedusaHeads, batch: dict[str, torch.Tensor],
                 decay: float = 0.8, first_label: int = 0) -> torch.Tensor:
    """MEDUSA-1 on a ``collate_feat`` batch (``features [B, L, H]``, ``tokens [B, L+1]``);
    labels with index below ``first_label`` (the prompt) do not count."""
    return weighted(head_losses(heads(batch["features"]), batch["tokens"], first_label),
                    decay)


class Medusa2Model(nn.Module):
    """A trainable backbone (a HF causal LM) with its Medusa heads."""

    def __init__(self, backbone: nn.Module, heads: MedusaHeads) -> None:
        super().__init__()
        self.backbone = backbone
        self.heads = heads

    def forward(self, input_ids: torch.Tensor, frozen: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [B, L]`` -> (LM logits ``[B, L, V]``, head logits ``[K, B, L, V]``).
        ``frozen``: the backbone runs without gradients (the heads-only warm-up)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            hidden = self.backbone.model(input_ids=input_ids).last_hidden_state
            lm_logits = self.backbone.lm_head(hidden)
        return lm_logits, self.heads(hidden)


def medusa2_loss(model: Medusa2Model, batch: dict[str, torch.Tensor], decay: float = 0.8,
                 lambda0: float = 0.2, lm_loss: str = "kl", frozen: bool = False,
                 first_label: int = 0) -> torch.Tensor:
    """MEDUSA-2's ``L_LM + lambda0 * L_MEDUSA-1`` on a ``collate_feat`` batch (the stored
    features are not used: the backbone recomputes them). During the warm-up
    (``frozen``) ``L_LM`` is left out: the backbone does not train. The heads' labels
    with index below ``first_label`` (the prompt) do not count; ``L_LM`` keeps every
    position (it anchors the backbone to the original on the corpus text too)."""
    tokens = batch["tokens"]
    lm_logits, head_logits = model(tokens[:, :-1], frozen)
    medusa = weighted(head_losses(head_logits, tokens, first_label), decay)
    if frozen:
        return lambda0 * medusa
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1, device=tokens.device)
    if lm_loss == "kl":
        lm = losses.topk_kl(lm_logits, batch["topk_ids"], batch["topk_probs"], mask)
    else:
        lm = losses.cross_entropy(lm_logits, tokens[:, 1:], mask)
    return lm + lambda0 * medusa


@torch.no_grad()
def lm_quality(original: nn.Module, tuned: nn.Module, windows: torch.Tensor,
               prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """How far a fine-tuned target (MEDUSA-2) moved from the original.

    ``windows [N, L+1]`` of held-out text: perplexity of each model
    (``ppl_original``, ``ppl_tuned``) and ``top1_agreement`` (teacher-forced argmax
    equality per position); ``prompts``: greedy decoding of ``max_new_tokens`` by each,
    ``greedy_token_agreement`` (equal tokens at equal positions) and
    ``greedy_identical`` (fraction of prompts with identical outputs), and each model's
    ``repeat4_original`` / ``repeat4_tuned`` (:func:`repeated_ngram_share` of its greedy
    outputs: a tuned model that loops is easier to draft for, so a higher tau beside a
    higher share is no gain at unchanged quality)."""
    from speclab.decoding.loop import autoregressive_generate
    from speclab.decoding.runner import ModelRunner
    from speclab.decoding.sampling import SamplingParams

    out: dict[str, float] = {}
    argmax = []
    for name, model in (("original", original), ("tuned", tuned)):
        model.eval()
        logits = model(input_ids=windows[:, :-1]).logits.float()
        ce = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:])
        out[f"ppl_{name}"] = math.exp(float(ce))
        argmax.append(logits.argmax(-1))
    out["top1_agreement"] = float((argmax[0] == argmax[1]).float().mean())
    same = equal = total = 0
    outputs: dict[str, list[list[int]]] = {"original": [], "tuned": []}
    for prompt in prompts:
        a, _ = autoregressive_generate(ModelRunner(original), prompt, max_new_tokens,
                                       SamplingParams(0.0))
        b, _ = autoregressive_generate(ModelRunner(tuned), prompt, max_new_tokens,
                                       SamplingParams(0.0))
        outputs["original"].append(a)
        outputs["tuned"].append(b)
        same += a == b
        equal += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    out["greedy_token_agreement"] = equal / max(total, 1)
    out["greedy_identical"] = same / max(len(prompts), 1)
    for name, seqs in outputs.items():
        out[f"repeat4_{name}"] = repeated_ngram_share(seqs, 4)
    return out


def repeated_ngram_share(sequences: list[list[int]], n: int = 4) -> float:
    """The share of ``n``-grams that repeat an earlier ``n``-gram of the same sequence,
    pooled over ``sequences`` (each a list of token ids): 0 for text that never repeats
    itself, near 1 for a loop. NaN when no sequence holds ``n`` tokens."""
    repeated = counted = 0
    for seq in sequences:
        seen: set[tuple[int, ...]] = set()
        for i in range(len(seq) - n + 1):
            gram = tuple(seq[i:i + n])
            repeated += gram in seen
            seen.add(gram)
            counted += 1
    return repeated / counted if counted else math.nan
