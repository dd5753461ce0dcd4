"""Collate generated examples into training batches and compute a drafter's loss on them;
the built-in entries of the loss registry (:class:`speclab.losses.Loss`).

Collates, one per data kind (:mod:`speclab.train.distill_data`):

* ``kd``: ``inputs [B, L]``, ``labels [B, L]``, ``topk_ids/probs [B, L, K]``, ``mask [B, L]``;
* ``seq``: ``inputs [B, L]``, ``labels [B, L]``, ``mask [B, L]`` (response positions only);
* ``tree``: ``inputs [B, S]`` = context[:-1] + tree nodes (root = context[-1]),
  ``positions [B, S]``, additive ``attn [B, 1, S, S]`` (causal context; a node sees the
  context and its ancestors), ``node_index [B, T]`` (sequence index of each node),
  ``topk_ids/probs [B, T, K]``, ``node_mask [B, T]``.

Applies (``(model, batch, fn, knobs) -> scalar``: the drafter's forward and the call of
the loss function): :func:`on_labels` (CE on ``labels``), :func:`on_topk` (the target's
kept distribution), :func:`on_topk_hass` (the same, first ``knobs["hass_k"]`` entries),
:func:`on_tree_nodes` (one forward per tree with tree attention, the node logits).
A new built-in loss: its function in :mod:`speclab.losses` and one entry in
:data:`BUILTIN`; a loss from outside the package registers the same kind of entry with
:func:`speclab.losses.register_loss`.
"""

from __future__ import annotations

import torch

from speclab import losses


def collate_kd(rows: list[dict]) -> dict:
    """Corpus windows with the target's top-k (all rows have the same length)."""
    tokens = torch.tensor([r["tokens"] for r in rows], dtype=torch.long)  # [B, L+1]
    mask = torch.tensor([r["loss_mask"] for r in rows], dtype=torch.float)[:, 1:] \
        if rows and rows[0].get("loss_mask") is not None else \
        torch.ones(tokens.shape[0], tokens.shape[1] - 1)  # conversations: assistant tokens
    out = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "mask": mask}
    if rows and "topk_ids" in rows[0]:
        out["topk_ids"] = torch.tensor([r["topk_ids"] for r in rows], dtype=torch.long)
        out["topk_probs"] = torch.tensor([r["topk_probs"] for r in rows], dtype=torch.float)
    return out


def collate_seq(rows: list[dict]) -> dict:
    """Prompt + target continuation, right-padded; loss on continuation tokens only."""
    length = max(len(r["tokens"]) for r in rows) - 1
    inputs = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    for b, r in enumerate(rows):
        t = torch.tensor(r["tokens"], dtype=torch.long)
        n = len(t) - 1
        inputs[b, :n], labels[b, :n] = t[:-1], t[1:]
        mask[b, r["loss_from"] - 1 : n] = 1.0  # positions predicting response tokens
    return {"inputs": inputs, "labels": labels, "mask": mask}


def collate_trees(rows: list[dict], dtype: torch.dtype = torch.float32) -> dict:
    """Context + tree per row, padded to the longest; one forward per tree."""
    c = max(len(r["tokens"]) for r in rows) - 1  # context positions before the root
    t = max(len(r["tree_tokens"]) for r in rows)
    s = c + t
    b_n, k = len(rows), len(rows[0]["topk_ids"][0])
    inputs = torch.zeros(b_n, s, dtype=torch.long)
    positions = torch.zeros(b_n, s, dtype=torch.long)
    allowed = torch.eye(s, dtype=torch.bool).repeat(b_n, 1, 1)  # padding sees itself only
    node_index = torch.zeros(b_n, t, dtype=torch.long)
    node_mask = torch.zeros(b_n, t)
    ids = torch.zeros(b_n, t, k, dtype=torch.long)
    probs = torch.zeros(b_n, t, k)
    for b, r in enumerate(rows):
        ctx = r["tokens"][:-1]
        n_ctx = len(ctx)
        inputs[b, :n_ctx] = torch.tensor(ctx, dtype=torch.long)
        positions[b, :n_ctx] = torch.arange(n_ctx)
        allowed[b, :n_ctx, :n_ctx] = torch.tril(torch.ones(n_ctx, n_ctx, dtype=torch.bool))
        parents = r["tree_parents"]
        depth = [0] * len(parents)
        for i, p in enumerate(parents):
            depth[i] = depth[p] + 1 if p >= 0 else 0
            col = c + i
            inputs[b, col] = r["tree_tokens"][i]
            positions[b, col] = n_ctx + depth[i]
            allowed[b, col, :n_ctx] = True
            if p >= 0:
                allowed[b, col] |= allowed[b, c + p]  # the parent's view: context + ancestors
            allowed[b, col, col] = True
            node_index[b, i] = col
            node_mask[b, i] = 1.0
        n = len(parents)
        ids[b, :n] = torch.tensor(r["topk_ids"], dtype=torch.long)
        probs[b, :n] = torch.tensor(r["topk_probs"], dtype=torch.float)
    attn = torch.zeros(b_n, 1, s, s, dtype=dtype)
    attn.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return {"inputs": inputs, "positions": positions, "attn": attn, "node_index": node_index,
            "node_mask": node_mask, "topk_ids": ids, "topk_probs": probs}


def on_labels(model: torch.nn.Module, batch: dict, fn, knobs: dict) -> torch.Tensor:
    """``fn(logits [B, L, V], labels [B, L], mask [B, L])`` (``sft``, ``seq_kd``)."""
    del knobs
    logits = model(input_ids=batch["inputs"]).logits  # [B, L, V]
    return fn(logits, batch["labels"], batch["mask"])


def on_topk(model: torch.nn.Module, batch: dict, fn, knobs: dict) -> torch.Tensor:
    """``fn(logits [B, L, V], topk_ids [B, L, K], topk_probs [B, L, K], mask [B, L])``."""
    del knobs
    logits = model(input_ids=batch["inputs"]).logits  # [B, L, V]
    return fn(logits, batch["topk_ids"], batch["topk_probs"], batch["mask"])


def on_topk_hass(model: torch.nn.Module, batch: dict, fn, knobs: dict) -> torch.Tensor:
    """:func:`on_topk` with ``top_k=knobs["hass_k"]`` (HASS top-K; None: all K)."""
    logits = model(input_ids=batch["inputs"]).logits  # [B, L, V]
    return fn(logits, batch["topk_ids"], batch["topk_probs"], batch["mask"],
              top_k=knobs.get("hass_k"))


def on_tree_nodes(model: torch.nn.Module, batch: dict, fn, knobs: dict) -> torch.Tensor:
    """``fn(node_logits [B, T, V], topk_ids/probs [B, T, K], node_mask [B, T])`` from one
    forward per (context + tree) row with tree attention (``talf``)."""
    del knobs
    logits = model(input_ids=batch["inputs"], position_ids=batch["positions"],
                   attention_mask=batch["attn"]).logits  # [B, S, V]
    idx = batch["node_index"][..., None].expand(-1, -1, logits.shape[-1])
    node_logits = logits.gather(1, idx)  # [B, T, V]
    return fn(node_logits, batch["topk_ids"], batch["topk_probs"], batch["node_mask"])


BUILTIN: tuple[losses.Loss, ...] = (
    losses.Loss("sft", losses.cross_entropy, "kd", collate_kd, on_labels,
                "cross-entropy on corpus windows"),
    losses.Loss("word_kd", losses.word_kd, "kd", collate_kd, on_topk, "forward KL(p || q)"),
    losses.Loss("seq_kd", losses.cross_entropy, "seq", collate_seq, on_labels,
                "cross-entropy on the target's greedy continuations"),
    losses.Loss("tvd_kd", losses.tvd_kd, "kd", collate_kd, on_topk, "total variation"),
    losses.Loss("hass_topk", losses.hass_topk, "kd", collate_kd, on_topk_hass,
                "HASS top-K distillation"),
    losses.Loss("talf", losses.talf, "tree", collate_trees, on_tree_nodes,
                "cross-entropy over target-built draft trees"),
)
for _loss in BUILTIN:
    losses.register_loss(_loss)


def batch_loss(model: torch.nn.Module, loss_name: str, batch: dict,
               hass_k: int | None = None) -> torch.Tensor:
    """The drafter's loss ``loss_name`` on a batch collated by its entry's ``collate``
    (tensors on the model's device)."""
    entry = losses.loss_entry(loss_name)
    return entry.apply(model, batch, entry.fn, {"hass_k": hass_k})
