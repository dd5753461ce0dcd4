"""The EAGLE-3 feature drafter (pure PyTorch): fused multi-layer features, no feature
regression, an optional reduced draft vocabulary.

EAGLE-3 (Li et al., 2025) reads the target's hidden states at three layers (low, middle,
high; :mod:`speclab.decoding.features`), concatenated ``g_t = [l_t, m_t, h_t]`` ``[3H]``,
and fuses them with ``fc: [3H] -> [H]`` (no bias). Its one decoder layer takes the token
embedding and a hidden state side by side::

    a   = hidden_norm(h);  e = input_norm(Embed(x_{t+1}))
    h'  = h + o_proj(attention(q, k, v from concat(e, a) [2H]))
    out = h' + MLP(post_attention_norm(h'))

``h`` is ``fc(g_t)`` for a pair with target features and the drafter's OWN ``out`` of the
parent for a pair inside the draft (:class:`~speclab.families.eagle.drafter.EagleDrafter` feeds
it back exactly as it does for EAGLE; the model tells the two apart by width). The next
token's logits are ``lm_head(norm(out))`` over the DRAFT vocabulary ``V_d``: draft id ``i``
is target id ``i + d2t[i]`` and ``t2d`` ``[V]`` marks the target ids in it (the maps
public EAGLE-3 checkpoints carry); :meth:`Eagle3Model.forward` returns them scattered into
the target's vocabulary (``finfo.min`` elsewhere, probability 0), so every tree builder and
rule works unchanged. The embedding is a frozen copy of the target's; the LM head starts
from the target's rows of the draft vocabulary and is trained.

On disk it is a speclab EAGLE folder (:func:`speclab.families.eagle.model.save_eagle`) whose meta
has ``version: 3``, ``feature_layers`` and ``draft_vocab_size``.

The public EAGLE-3 variants are meta switches (defaults: the EAGLE code's drafter above);
each computes what the code that trains it computes:

==================================  ================================================
meta (public flag)                  what changes
==================================  ================================================
``residual_norm``                   ``h' = hidden_norm(h) + o_proj(...)``: the residual
(speculators ``norm_before_residual``)  is the normed state
``fc_input_norm``                   ``fc(input_norm(g_t))``: one RMS norm over the
(speculators ``norm_before_fc``)    fused ``[k * H_t]``
``fc_state_norms``                  ``fc(concat(fc_norm_i(state_i)))``: one RMS norm
(``fc_norm``, speculators and       per fused state (EAGLE-3.1)
SpecForge)
``feed_normed``                     ``out`` is ``norm(out)``: the LM head reads it and
(speculators' ``norm_output``)      it is what is fed back inside the draft
``head_norm`` false                 logits ``lm_head(out)``, no final norm
(SpecForge's ``norm_output: false``)
``target_hidden_size`` ``H_t``      ``fc: [k * H_t] -> [H]``; the embedding is the
                                    drafter's own ``[V, H]``
``qkv_bias`` / ``o_bias``           biases on q/k/v / o_proj (``attention_bias``: both)
==================================  ================================================
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from speclab.decoding.features import layer_ids, num_decoder_layers
from speclab.families.eagle.model import kept_positions

if TYPE_CHECKING:
    from speclab.families.eagle.model import EagleMeta


def eagle3_meta(config, feature_layers=None, draft_vocab_size: int = 0) -> EagleMeta:
    """The meta of an EAGLE-3 drafter for a target with HF ``config``: ``feature_layers``
    (None: EAGLE-3's low / middle / high, :func:`~speclab.decoding.features.eagle3_layers`)
    resolved against the target's depth; ``draft_vocab_size`` 0: the target's vocabulary."""
    from speclab.families.eagle.model import EagleMeta

    ids = layer_ids("eagle3" if feature_layers is None else feature_layers,
                    num_decoder_layers(config), "eagle.feature_layers")
    base = EagleMeta.for_target(config, 1)
    if not 0 <= draft_vocab_size <= base.vocab_size:
        raise ValueError(f"eagle.draft_vocab: {draft_vocab_size} is not in [0, "
                         f"{base.vocab_size}] (the target's vocabulary)")
    return replace(base, version=3, feature_layers=tuple(ids),
                   draft_vocab_size=draft_vocab_size if draft_vocab_size != base.vocab_size
                   else 0, fc_bias=False)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over ``concat(input_norm(e), hidden_norm(h))``
    (``[2H]`` in, ``[H]`` out), residual on ``h``, then a LLaMA MLP block."""

    def __init__(self, meta: EagleMeta) -> None:
        super().__init__()
        config = meta.layer_config()
        h = meta.hidden_size
        head_dim = meta.head_dim or h // meta.heads
        attn_config = copy.deepcopy(config)
        attn_config.hidden_size = 2 * h
        attn_config.head_dim = head_dim
        attn_config.attention_bias = meta.qkv_bias
        self.self_attn = LlamaAttention(attn_config, layer_idx=0)
        self.self_attn.o_proj = nn.Linear(meta.heads * head_dim, h, bias=meta.o_bias)
        self.residual_norm = meta.residual_norm
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(h, eps=meta.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(h, eps=meta.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=meta.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, position_embeddings,
                attention_mask: torch.Tensor, past_key_values=None) -> torch.Tensor:
        """``emb``, ``hidden`` ``[B, T, H]`` -> ``[B, T, H]`` (the residual is
        ``hidden_norm(hidden)`` with ``meta.residual_norm``)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), normed], -1)
        attn, _ = self.self_attn(x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask,
                                 past_key_values=past_key_values)
        hidden = (normed if self.residual_norm else hidden) + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Model(nn.Module):
    """The EAGLE-3 drafter (module docstring); the same call as
    :class:`~speclab.families.eagle.model.EagleModel`, so the EAGLE drafter, the training losses
    and the runners take either."""

    def __init__(self, meta: EagleMeta) -> None:
        super().__init__()
        if meta.version != 3 or not meta.feature_layers:
            raise ValueError(f"eagle_model: not an EAGLE-3 meta (version {meta.version}, "
                             f"feature_layers {meta.feature_layers})")
        h, v, k = meta.hidden_size, meta.vocab_size, len(meta.feature_layers)
        th = meta.target_hidden_size or h
        if th != h and k * th == h:
            raise ValueError(f"eagle_model: {k} fused target states of target_hidden_size="
                             f"{th} are as wide as the drafter's own state ({h}): the "
                             f"drafter tells the two apart by width")
        if meta.fc_input_norm and meta.fc_state_norms:
            raise ValueError("eagle_model: norm_before_fc (one norm over the fused states) "
                             "and fc_norm (one per state) exclude each other")
        if meta.feed_normed and not meta.head_norm:
            raise ValueError("eagle_model: feed_normed (the LM head and the next step read "
                             "norm(out)) needs head_norm")
        self.meta = meta
        self.config = meta.layer_config()  # the cache's shape: one layer
        vd = meta.draft_vocab_size or v
        self.embed = nn.Embedding(v, h)
        self.embed.weight.requires_grad_(False)
        self.input_norm = LlamaRMSNorm(k * th, eps=meta.rms_norm_eps) \
            if meta.fc_input_norm else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(th, eps=meta.rms_norm_eps)
                                     for _ in range(k)) if meta.fc_state_norms else None
        self.fc = nn.Linear(k * th, h, bias=meta.fc_bias)
        self.layer = Eagle3Layer(meta)
        self.rotary = LlamaRotaryEmbedding(self.config)
        self.norm = LlamaRMSNorm(h, eps=meta.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool) if vd == v else
                             torch.zeros(v, dtype=torch.bool))

    @property
    def draft_ids(self) -> torch.Tensor:
        """``[V_d]``: the target id of every draft id (``arange(V_d) + d2t``)."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use ``target_ids`` ``[V_d]`` (distinct, ascending) as the draft vocabulary:
        ``d2t``, ``t2d`` and the LM head's rows (copied from the current full-vocabulary
        head when it has ``V`` rows)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).cpu()
        if ids.numel() != self.d2t.shape[0]:
            raise ValueError(f"eagle.draft_vocab: {ids.numel()} ids for a draft vocabulary "
                             f"of {self.d2t.shape[0]}")
        if (ids[1:] <= ids[:-1]).any() or ids.min() < 0 or ids.max() >= self.meta.vocab_size:
            raise ValueError("eagle.draft_vocab: ids must be distinct, ascending and in the "
                             "target's vocabulary")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    @classmethod
    def from_target(cls, target: nn.Module, feature_layers=None,
                    draft_ids: torch.Tensor | None = None) -> Eagle3Model:
        """A fresh drafter for ``target`` (a HF causal LM): its embedding copied and frozen,
        the LM head started from the target's rows of ``draft_ids`` (None: the whole
        vocabulary), ``feature_layers`` as :func:`eagle3_meta`."""
        vd = 0 if draft_ids is None else int(len(draft_ids))
        model = cls(eagle3_meta(target.config, feature_layers, vd))
        head = target.get_output_embeddings().weight
        with torch.no_grad():
            model.embed.weight.copy_(target.get_input_embeddings().weight)
            if draft_ids is None or vd == model.meta.vocab_size:
                model.lm_head.weight.copy_(head)
            else:
                ids = torch.as_tensor(draft_ids, dtype=torch.long)
                model.set_draft_vocab(ids)
                model.lm_head.weight.copy_(head[ids.to(head.device)])
        return model.to(next(target.parameters()).dtype)

    def _mask(self, attention_mask: torch.Tensor | None, b: int, t: int, past: int,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An additive ``[B, 1, T, past + T]`` mask: causal after the cache when
        ``attention_mask`` is None, a ``[B, past + T]`` padding mask combined with
        causality, or a 4D mask as it is."""
        if attention_mask is not None and attention_mask.ndim == 4:
            return attention_mask.to(dtype)
        allowed = torch.ones(t, past + t, dtype=torch.bool, device=device).tril(past)
        allowed = allowed[None].expand(b, t, past + t)
        if attention_mask is not None:
            allowed = allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
        out = torch.zeros(b, 1, t, past + t, dtype=dtype, device=device)
        return out.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """The target's fused states ``[B, T, k * H_t]`` -> ``h`` ``[B, T, H]``: the
        variants' norms (``input_norm`` over all, or ``fc_norm`` per state), then ``fc``."""
        if self.input_norm is not None:
            states = self.input_norm(states)
        if self.fc_norm is not None:
            chunks = states.chunk(len(self.fc_norm), -1)
            states = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], -1)
        return self.fc(states)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``features [B, T, F]`` (the target's fused ``[B, T, k * H_t]`` or the drafter's
        own ``[B, T, H]``), ``input_ids [B, T]`` -> ``(out [B, T, H], logits [B, T, V])``
        over the target's vocabulary (``finfo.min`` outside the draft vocabulary); ``out``
        is the state fed back for the next draft step (``norm(out)`` with
        ``meta.feed_normed``). ``attention_mask``: None (causal), ``[B, S]`` padding or
        ``[B, 1, T, S]`` additive. ``logits_to_keep``: logits at those positions only
        (:func:`~speclab.families.eagle.model.kept_positions`: a catch-up over a long
        prompt computed ``[B, T, V]`` float logits nobody read, most of a first step)."""
        del use_cache  # the cache is used whenever given
        dtype = self.fc.weight.dtype
        emb = self.embed(input_ids).to(dtype)
        if self.meta.embed_scale != 1.0:
            emb = emb * self.meta.embed_scale
        hidden = features.to(dtype)
        if hidden.shape[-1] != self.meta.hidden_size:
            hidden = self.fuse(hidden)
        b, t = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=emb.device).expand(b, t)
        mask = self._mask(attention_mask, b, t, past, dtype, emb.device)
        out = self.layer(emb, hidden, self.rotary(hidden, position_ids), mask, past_key_values)
        if self.meta.feed_normed:  # speculators' norm_output: the normed state goes on
            out = self.norm(out)
            return out, self.target_logits(self.lm_head(kept_positions(out, logits_to_keep)))
        head_in = kept_positions(out, logits_to_keep)
        head_in = self.norm(head_in) if self.meta.head_norm else head_in
        return out, self.target_logits(self.lm_head(head_in))

    def cost_inputs(self, n: int) -> dict[str, torch.Tensor]:
        """:func:`~speclab.families.eagle.model.feature_inputs`: what a forward of ``n`` new tokens
        takes besides them."""
        from speclab.families.eagle.model import feature_inputs

        return feature_inputs(self, n)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., V_d]`` -> ``[..., V]`` (``finfo.min`` at target
        ids outside the draft vocabulary)."""
        v = self.meta.vocab_size
        if logits.shape[-1] == v:
            return logits
        full = logits.new_full((*logits.shape[:-1], v), torch.finfo(logits.dtype).min)
        return full.index_copy_(-1, self.draft_ids, logits)
