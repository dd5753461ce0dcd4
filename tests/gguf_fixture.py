"""Test support: a tiny LLaMA with a ChatML template written as a GGUF file (F32
tensors, a byte-level BPE tokenizer), the shape SmolLM2-135M-Instruct's file has, so
GGUF loading is tested without any download.

The writer follows llama.cpp's ``convert_hf_to_gguf.py`` for LLaMA: tensor names from
gguf's own name map, Q/K rows permuted into llama.cpp's rotary layout (transformers'
GGUF loader permutes them back), the vocabulary, merges and token types as
``tokenizer.ggml.*`` metadata and the chat template as ``tokenizer.chat_template``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_chat_llama(folder: Path, seed: int = 0, vocab: int = 320) -> Path:
    """A tiny random LLaMA (2 layers, hidden 64, 4 heads / 2 KV heads, tied embeddings)
    with a byte-level BPE tokenizer whose specials are ChatML's, saved to ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = ["What is the capital of Portugal? Lisbon is the capital.",
            "def reverse(s): return s[::-1]  # reverse a string"] * 20
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         rope_theta=10000.0, bos_token_id=fast.bos_token_id,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for Q / K rows (``convert_hf_to_gguf.LlamaModel.permute``)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(folder: Path, out: Path) -> Path:
    """The HF LLaMA in ``folder`` as a GGUF file ``out`` (F32)."""
    import gguf
    from safetensors.numpy import load_file

    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    n_layers, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("tiny-chat-llama")
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or
                               cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok["model"]["vocab"]
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    by_id = {i: t for t, i in {**vocab, **added}.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])  # 3: control
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template(tok_cfg.get("chat_template") or
                        (folder / "chat_template.jinja").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    tensors = load_file(str(folder / "model.safetensors"))
    for name, data in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        base, _, suffix = name.rpartition(".")
        data = data.astype(np.float32)
        if base.endswith("q_proj"):
            data = _permute(data, n_head)
        elif base.endswith("k_proj"):
            data = _permute(data, n_kv)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
