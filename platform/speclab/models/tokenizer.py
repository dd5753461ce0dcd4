"""Train a byte-level BPE tokenizer and save it as a transformers tokenizer."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from speclab.data.conversations import template_ids

EOS = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path):
    """Train byte-level BPE on ``texts``; save to ``out_dir``; return the HF tokenizer.

    The vocabulary has ``vocab_size`` entries including the ``<|endoftext|>`` EOS token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size: must be >= 300 for byte-level BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    hf.save_pretrained(str(out_dir))
    return hf


def chat_ids(tokenizer, text: str, field: str = "chat") -> list[int]:
    """``text`` as one user turn through ``tokenizer``'s chat template, the assistant's
    turn opened (``add_generation_prompt``): token ids. ValueError naming ``field`` when
    the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{field}: the target's tokenizer has no chat template")
    return template_ids(tokenizer, [{"role": "user", "content": text}])
