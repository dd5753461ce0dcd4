"""GGUF files wherever a model is named: converted once to a cached Hugging Face folder.

Many users hold small models as GGUF files (llama.cpp's format). ``path/to/x.gguf``
given as a target or a draft (any job, ``speclab generate``, ``bench``, the Serve app)
is converted by :func:`gguf_folder`: transformers reads it (``gguf_file=``; quantized
weights are dequantized, which needs the ``gguf`` and ``accelerate`` packages), the
GGUF quantization marker is cleared so the model saves as an ordinary folder, and the
folder is kept under ``$SPECLAB_HOME/models/gguf/<sha256 prefix>/`` with ``source.json``
(the file, its sha256, the check below). Later uses find it by the file's checksum, so
a changed file is converted again.

The check, at build: greedy continuations of the saved folder equal those of the
GGUF-loaded model on ``check_prompts`` (rendered with the model's chat template when it
has one); a mismatch removes the folder and raises :class:`GgufError`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch

from speclab.models.tokenizer import chat_ids
from speclab.paths import speclab_home

#: prompts the conversion check decodes (chat turns; rendered with the chat template)
CHECK_PROMPTS: tuple[str, ...] = (
    "What is the capital of Portugal?",
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into French and Spanish.",
    "What is 17 times 23?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Name two differences between TCP and UDP.",
)


class GgufError(ValueError):
    """A GGUF file that cannot be converted (or whose conversion changed its outputs)."""


def is_gguf(source: str | Path) -> bool:
    """Whether ``source`` names a GGUF file (by its suffix)."""
    return str(source).lower().endswith(".gguf")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """The sha256 hex digest of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_cache_root() -> Path:
    """Where converted GGUF files live: ``$SPECLAB_HOME/models/gguf``."""
    return speclab_home() / "models" / "gguf"


def _load_gguf(path: Path):
    """(tokenizer, float32 model) of the GGUF file ``path`` through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                            trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32,
                                                     trust_remote_code=False)
    except (ImportError, ModuleNotFoundError) as err:  # gguf / accelerate missing
        raise GgufError(f"{path}: reading GGUF needs the gguf and accelerate packages "
                        f"({err})") from err
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        raise GgufError(f"{path}: transformers cannot read this GGUF file ({err})") from err
    return tok, model.eval()


def render_prompt(tokenizer, text: str) -> list[int]:
    """``text`` as one user turn through the tokenizer's chat template (with the
    assistant's turn opened), or as plain text when it has none: token ids."""
    if getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, text)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` of ``max_new_tokens`` after ``ids``: new ids."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(ids):].tolist()


def _save_plain(tok, model, folder: Path) -> None:
    """Save the dequantized model as an ordinary HF folder (the GGUF quantizer marker
    cleared: transformers refuses to serialise a model it thinks is quantized)."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def convert_gguf(path: str | Path, out: str | Path, check_prompts: tuple[str, ...] = CHECK_PROMPTS,
                 check_tokens: int = 16, source: str | None = None) -> Path:
    """Convert the GGUF file ``path`` into the HF folder ``out`` and check it: greedy
    continuations (``check_tokens`` each) of the saved folder equal those of the
    GGUF-loaded model on ``check_prompts``. Writes ``out/source.json``; returns ``out``.
    ``source``: what to record as the origin (default: the file's path)."""
    from transformers import AutoModelForCausalLM

    path, out = Path(path), Path(out)
    t0 = time.perf_counter()
    print(f"[gguf] converting {path.name} ({path.stat().st_size / 1e6:.0f} MB) to a "
          f"Hugging Face folder under {out} (once; dequantized)...", flush=True)
    digest = sha256_file(path)
    tok, model = _load_gguf(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _save_plain(tok, model, tmp)
    saved = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32,
                                                 trust_remote_code=False).eval()
    prompts = [render_prompt(tok, p) for p in check_prompts]
    for text, ids in zip(check_prompts, prompts):
        a, b = greedy(model, ids, check_tokens), greedy(saved, ids, check_tokens)
        if a != b:
            shutil.rmtree(tmp, ignore_errors=True)
            raise GgufError(f"{path}: the converted folder decodes {text!r} differently from "
                            f"the GGUF-loaded model ({b[:8]}... vs {a[:8]}...)")
    record = {"source": source or str(path.resolve()), "gguf_file": path.name,
              "sha256": digest, "architecture": type(model).__name__,
              "check": {"prompts": len(prompts), "greedy_tokens": check_tokens,
                        "identical": True},
              "converted_s": round(time.perf_counter() - t0, 1)}
    (tmp / "source.json").write_text(json.dumps(record, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[gguf] {out}: {record['architecture']}, greedy outputs identical to the GGUF "
          f"model on {len(prompts)} prompts ({record['converted_s']} s)", flush=True)
    return out


def gguf_folder(path: str | Path, field: str = "model") -> Path:
    """The cached HF folder of the GGUF file ``path`` (converted on first use, keyed by
    the file's sha256); :class:`GgufError` naming ``field`` when it cannot be read."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GgufError(f"{field}: GGUF file {str(path)!r} does not exist")
    digest = sha256_file(path)
    out = gguf_cache_root() / digest[:16]
    record = out / "source.json"
    if record.exists() and json.loads(record.read_text()).get("sha256") == digest:
        return out
    try:
        return convert_gguf(path, out)
    except GgufError as err:
        raise GgufError(f"{field}: {err}") from err
