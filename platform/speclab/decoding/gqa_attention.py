"""Attention of a several-token query over a grouped-query (GQA) cache, without copying
the cache.

A model with ``H`` query heads over ``KV`` key/value heads (``G = H / KV`` queries per
key/value head: SmolLM2 9 / 3, LLaMA-3 32 / 8) attends through transformers' ``sdpa``
function. Given a mask, that function packs the groups into the query only when the query
holds ONE token; for more (a verification forward over a chain or a tree, a drafter's
catch-up) it repeats every key and value head ``G`` times (``repeat_kv``), a copy of the
whole cache in every layer of every such forward. Measured on SmolLM2-135M in bfloat16
(2 cores, 16 rows, 1,465 cached positions): a forward of 2 new tokens per row took
670 ms against 120 ms for 1, 57% of it in those copies; speculation verifies several
tokens every round, so it paid that where plain decoding did not.

:func:`packed_sdpa` packs the groups for any query length: query ``[B, H, n, D]`` ->
``[B, KV, G n, D]`` (head ``h = kv G + g``, so a reshape), a mask shared by the heads
``[B, 1, n, S]`` -> ``[B, 1, G n, S]``, one ``scaled_dot_product_attention`` over the
``KV`` heads, the output back to ``[B, n, H, D]``: the same products and softmax per
(head, query) as the repeated form. What it does not cover (no mask, a per-head mask, a
position bias, soft-capping, attention sinks, dropout, one group, one token) goes to
transformers' own ``sdpa`` function unchanged.

:func:`use_packed_attention` switches a model loaded with ``sdpa`` to it (registered
under :data:`NAME` with transformers' attention and mask interfaces); the engine's
:class:`~speclab.api.Decoder` does so for its target and draft models, and EAGLE
drafters build their layers with it. Pure torch: no Ray, no MLflow.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F  # noqa: N812
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: the attention implementation's name in transformers' registries
NAME = "speclab_sdpa"

_registered = False


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None,
                dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function interface (``ALL_ATTENTION_FUNCTIONS``).

    Args:
        query: ``[B, H, n, D]``; key, value: ``[B, KV, S, D]`` (the cache and the new
            tokens); attention_mask: additive or bool, ``[B or 1, 1, n, S]``.
    Returns:
        ``([B, n, H, D], None)``, as transformers' ``sdpa_attention_forward``.
    """
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    b, heads, n, dim = query.shape
    plain = (groups == 1 or n == 1 or attention_mask is None or attention_mask.dim() != 4
             or attention_mask.shape[1] != 1 or attention_mask.shape[2] != n or dropout
             or key.shape[1] * groups != heads or key.shape[-1] != value.shape[-1]
             or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux",
                                                       "sinks", "cache"))
             or kwargs.get("output_attentions"))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    kv = heads // groups
    q = query.reshape(b, kv, groups * n, dim)
    mb, _, _, s = attention_mask.shape
    mask = attention_mask[:, :, None].expand(mb, 1, groups, n, s).reshape(mb, 1, groups * n, s)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, n, dim).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`packed_sdpa` as :data:`NAME` (once per process), with sdpa's mask
    builder (a model called without a 4-D mask builds the mask sdpa would)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` attention to :func:`packed_sdpa`
    (in place; other implementations, eager included, are left alone). True when it
    runs :data:`NAME` afterwards."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == NAME:
        return True
    if impl != "sdpa" or not callable(getattr(model, "set_attn_implementation", None)):
        return False
    register()
    model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME
