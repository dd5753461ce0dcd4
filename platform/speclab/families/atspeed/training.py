"""AtSpeed drafter alignment data and losses on it (pure PyTorch; no Ray).

Alignment data (``D'`` of AtSpeed eq. 3-4): the top-K beam sequences for a history
under the mixture ``(1-lambda) M_q + lambda M_p`` of a drafter ``q`` and the target
``p`` (``lambda = 1``: the target's own top-K beams, the data of AtSpeed-R and of the
baselines); for each of the K beams and each of its L positions, the target's full
log-softmax ``[V]``, the trie's valid tokens ``[V]`` and ``log p(y_K)``: the target's
log-probability of the token at that position of ``y_K``, the sequence with the K-th
highest probability under the TARGET (eq. 3; for ``lambda < 1`` it is found by a
separate target beam search, not taken from the mixture's beams).

Losses (``loss_name``): ``atspeed_s`` / ``atspeed_r``: ``alpha * L_Align + (1 - alpha) *
L_Rec`` (eq. 5 / 9) with the paper's reductions: L_Align averages over each beam's
positions, sums over the example's beams and averages over examples (eq. 4); L_Rec sums
the true next item's token CE over its positions and averages over examples (eq. 37).
Each position aligns over its own valid tokens (up to ``k``), never fewer because another
position in the batch has fewer. Baselines: ``sft`` (L_Rec only), ``seq_kd`` (CE on the
target's top-1 beam), ``word_kd`` (forward KL to the target's distribution along the top-1
beam), ``tvd_kd`` (TVD along the top-1 beam); these average over positions.
"""

from __future__ import annotations

import torch

from speclab import losses
from speclab.data.rec_dataset import PAD, RecExample, RecMeta, collate_rec
from speclab.decoding.beam import BeamTree, constrained_beam_search, mixture_beam_search
from speclab.decoding.runner import ModelRunner
from speclab.decoding.trie import ItemTrie

REC_LOSSES = ("sft", "seq_kd", "word_kd", "tvd_kd", "atspeed_s", "atspeed_r")


def alignment_example(target: ModelRunner, trie: ItemTrie, prompt: list[int], k: int,
                      draft: ModelRunner | None = None, lam: float = 1.0) -> dict:
    """Top-``k`` beams for ``prompt`` with the target's distributions along them.

    The beams are the target's (``draft`` None or ``lam == 1``) or those of the mixture
    ``(1-lam) q + lam p`` with ``draft``'s ``q``. Returns ``beams`` (k lists of L ids),
    ``target_logp`` ``[k, L, V]`` (fp16), ``valid`` ``[k, L, V]`` (bool) and
    ``log_p_k`` ``[L]`` (along the target's own K-th beam in both cases).
    """
    target_beams, _ = constrained_beam_search(target, prompt, trie, k)
    if draft is None or lam == 1.0:
        beams = target_beams
    else:
        beams = mixture_beam_search(target, draft, prompt, trie, k, lam)
    y_k = target_beams[-1][0]
    bt = BeamTree(target, prompt)
    seqs = [b[0] for b in beams] + [y_k]
    prefixes = sorted({seq[:i] for seq in seqs for i in range(trie.length)}, key=len)
    bt.score([p for p in prefixes if p])
    v = target.vocab_size
    logp = torch.zeros(len(beams), trie.length, v)
    valid = torch.zeros(len(beams), trie.length, v, dtype=torch.bool)
    for j, (seq, _) in enumerate(beams):
        for t in range(trie.length):
            logp[j, t] = bt.logits[seq[:t]].float().log_softmax(-1)
            valid[j, t, trie.allowed(seq[:t])] = True
    log_p_k = torch.stack([bt.logits[y_k[:t]].float().log_softmax(-1)[y_k[t]]
                           for t in range(trie.length)])
    return {"beams": [list(b[0]) for b in beams], "target_logp": logp.half(),
            "valid": valid, "log_p_k": log_p_k}


def _beam_batch(rows: list[dict], prompts: list[list[int]], top1: bool) -> dict:
    """Prompt + beam sequences as a right-padded batch; ``answer`` picks the L positions,
    ``group [R]`` the example each of the ``R`` beam sequences belongs to."""
    seqs, logp, valid, log_p_k, group = [], [], [], [], []
    for e, (row, prompt) in enumerate(zip(rows, prompts)):
        beams = row["beams"][:1] if top1 else row["beams"]
        for j, beam in enumerate(beams):
            seqs.append((prompt, beam))
            group.append(e)
            logp.append(row["target_logp"][j].float())
            valid.append(row["valid"][j])
            log_p_k.append(row["log_p_k"])
    length = max(len(p) + len(b) for p, b in seqs) - 1
    n_ans = len(seqs[0][1])
    inputs = torch.full((len(seqs), length), PAD, dtype=torch.long)
    answer = torch.zeros(len(seqs), n_ans, dtype=torch.long)  # positions predicting y_t
    labels = torch.zeros(len(seqs), n_ans, dtype=torch.long)
    for i, (p, b) in enumerate(seqs):
        s = torch.tensor(p + b)
        inputs[i, : len(s) - 1] = s[:-1]
        answer[i] = torch.arange(len(p) - 1, len(p) - 1 + n_ans)
        labels[i] = torch.tensor(b)
    return {"inputs": inputs, "answer": answer, "labels": labels,
            "target_logp": torch.stack(logp), "valid": torch.stack(valid),
            "log_p_k": torch.stack(log_p_k), "group": torch.tensor(group)}


def collate_align(rows: list[dict], examples: list[RecExample], meta: RecMeta,
                  loss_name: str) -> dict:
    """Batches a loss needs: ``rec`` (true next item) and/or ``beams`` (target beams)."""
    if loss_name not in REC_LOSSES:
        raise ValueError(f"loss: unknown recommendation loss {loss_name!r}; "
                         f"known: {list(REC_LOSSES)}")
    out = {"rec": collate_rec(examples, meta)}
    if loss_name != "sft":
        top1 = loss_name in ("seq_kd", "word_kd", "tvd_kd")
        out["beams"] = _beam_batch(rows, [e.prompt for e in examples], top1)
    return out


def _answer_logits(model: torch.nn.Module, b: dict) -> torch.Tensor:
    logits = model(input_ids=b["inputs"]).logits  # [B', S, V]
    idx = b["answer"][..., None].expand(-1, -1, logits.shape[-1])
    return logits.gather(1, idx)  # [B', L, V]


def rec_align_loss(model: torch.nn.Module, batch: dict, loss_name: str, alpha: float,
                   k: int) -> torch.Tensor:
    """The drafter's loss on a batch from :func:`collate_align` (tensors on its device).

    ``k`` is the number of candidate tokens per position the alignment uses (AtSpeed's
    ``V_c`` size; each position uses ``min(k, its valid tokens)``).
    """
    rec_b = batch["rec"]
    rec = losses.rec_loss(model(input_ids=rec_b["inputs"]).logits, rec_b["labels"],
                          rec_b["mask"])
    if loss_name == "sft":
        return rec
    b = batch["beams"]
    logits = _answer_logits(model, b)
    if loss_name == "seq_kd":
        return losses.cross_entropy(logits, b["labels"], torch.ones(b["labels"].shape,
                                                                    device=logits.device))
    if loss_name in ("word_kd", "tvd_kd"):
        p = b["target_logp"].exp()
        if loss_name == "word_kd":
            per = (p * (b["target_logp"] - logits.float().log_softmax(-1))).sum(-1)
        else:
            per = 0.5 * (p - logits.float().softmax(-1)).abs().sum(-1)
        return per.mean()
    if loss_name == "atspeed_s":
        per_pos = losses.align_s(logits, b["target_logp"], b["valid"], b["log_p_k"], k)
    else:
        per_pos = losses.align_r(logits, b["target_logp"], b["valid"], k)
    align = losses.per_beam_set(per_pos, b["group"], int(b["group"].max()) + 1)
    return alpha * align + (1 - alpha) * rec
