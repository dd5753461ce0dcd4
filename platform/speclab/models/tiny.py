"""Tiny LLaMA-architecture models for tests, smoke runs and the reference pair."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    eos_token_id: int | None = None,
    num_kv_heads: int | None = None,
) -> LlamaConfig:
    """A small LlamaConfig (sdpa attention, no tied embeddings; ``num_kv_heads``:
    grouped-query attention, default one key/value head per query head)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_positions,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_tiny_llama(path: str | Path, seed: int = 0, **config_kwargs) -> Path:
    """Write a randomly initialised tiny LLaMA to ``path`` with ``save_pretrained``.

    Random weights are scaled up so the next-token distributions are peaked enough
    to make greedy decoding well defined (no near-ties) yet not degenerate.
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_kwargs))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = Path(path)
    model.save_pretrained(path)
    return path
