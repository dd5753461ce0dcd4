"""AtSpeed drafter alignment data and losses on it (pure PyTorch; no Ray).

Alignment data (``D'`` of AtSpeed eq. 3-4): the top-K beam sequences for a history
under the mixture ``(1-lambda) M_q + lambda M_p`` of a drafter ``q`` and the target
``p`` (``lambda = 1``: the target's own top-K beams, the data of AtSpeed-R and of the
baselines); for each of the K beams and each of its L positions, the target's full
log-softmax ``[V]``, the trie's valid tokens ``[V]`` and ``log p(y_K)`` (the K-th
beam's token at that position).

Losses (``loss_name``): ``atspeed_s`` / ``atspeed_r`` (alignment over the beams, weight
``alpha``) + ``(1 - alpha)`` L_Rec on the true next item; baselines ``sft`` (L_Rec only),
``seq_kd`` (CE on the target's top-1 beam), ``word_kd`` (forward KL to the target's
distribution along the top-1 beam), ``tvd_kd`` (TVD along the top-1 beam).
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
    ``log_p_k`` ``[L]``.
    """
    if draft is None or lam == 1.0:
        beams, _ = constrained_beam_search(target, prompt, trie, k)
    else:
        beams = mixture_beam_search(target, draft, prompt, trie, k, lam)
    bt = BeamTree(target, prompt)
    prefixes = sorted({b[0][:i] for b in beams for i in range(trie.length)}, key=len)
    bt.score([p for p in prefixes if p])
    v = target.vocab_size
    logp = torch.zeros(len(beams), trie.length, v)
    valid = torch.zeros(len(beams), trie.length, v, dtype=torch.bool)
    for j, (seq, _) in enumerate(beams):
        for t in range(trie.length):
            logp[j, t] = bt.logits[seq[:t]].float().log_softmax(-1)
            valid[j, t, trie.allowed(seq[:t])] = True
    last = beams[-1][0]
    log_p_k = torch.stack([logp[-1, t, last[t]] for t in range(trie.length)])
    return {"beams": [list(b[0]) for b in beams], "target_logp": logp.half(),
            "valid": valid, "log_p_k": log_p_k}


def _beam_batch(rows: list[dict], prompts: list[list[int]], top1: bool) -> dict:
    """Prompt + beam sequences as a right-padded batch; ``answer`` picks the L positions."""
    seqs, logp, valid, log_p_k = [], [], [], []
    for row, prompt in zip(rows, prompts):
        beams = row["beams"][:1] if top1 else row["beams"]
        for j, beam in enumerate(beams):
            seqs.append((prompt, beam))
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
            "log_p_k": torch.stack(log_p_k)}


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
    """The drafter's loss on a batch from :func:`collate_align` (tensors on its device)."""
    rec_b = batch["rec"]
    rec_logits = model(input_ids=rec_b["inputs"]).logits
    rec = losses.cross_entropy(rec_logits, rec_b["labels"], rec_b["mask"])
    if loss_name == "sft":
        return rec
    b = batch["beams"]
    logits = _answer_logits(model, b)
    ones = torch.ones(b["labels"].shape, device=logits.device)
    if loss_name == "seq_kd":
        return losses.cross_entropy(logits, b["labels"], ones)
    if loss_name in ("word_kd", "tvd_kd"):
        p = b["target_logp"].exp()
        if loss_name == "word_kd":
            per = (p * (b["target_logp"] - logits.float().log_softmax(-1))).sum(-1)
        else:
            per = 0.5 * (p - logits.float().softmax(-1)).abs().sum(-1)
        return per.mean()
    if loss_name == "atspeed_s":
        align = losses.atspeed_s(logits, b["labels"], b["target_logp"], b["valid"],
                                 b["log_p_k"], ones, min(k, int(b["valid"].sum(-1).min())), 1.0)
    else:
        align = losses.atspeed_r(logits, b["labels"], b["target_logp"], b["valid"], ones,
                                 min(k, int(b["valid"].sum(-1).min())), 1.0)
    return alpha * align + (1 - alpha) * rec


