"""Shared fixtures: tiny models written with save_pretrained into a session temp dir."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """The tokenizer of a tiny LLaMA with a ChatML template (SmolLM2's shape)."""
    from transformers import AutoTokenizer

    from tests.gguf_fixture import tiny_chat_llama

    return AutoTokenizer.from_pretrained(tiny_chat_llama(tmp_path_factory.mktemp("tok")))


@pytest.fixture()
def own_home(tmp_path, monkeypatch):
    """A test's own ``$SPECLAB_HOME`` (what it caches, such as a corpus's token shards,
    stays in its temp dir): ``pytestmark = pytest.mark.usefixtures("own_home")``."""
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: torch on one thread for a module's tests
    (idle OpenMP threads spinning against other processes made one generate 70x
    slower). Use it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _noisy_copy(src: str, dst: str, scale: float, seed: int) -> str:
    """A draft that mostly agrees with the target: its weights plus Gaussian noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, str]:
    """Target (2 layers), a close draft (noisy copy) and a weak draft (1 layer, random)."""
    from speclab.models.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    target = str(build_tiny_llama(root / "target", seed=1, vocab_size=64, num_layers=2))
    close = _noisy_copy(target, str(root / "close"), 0.3, seed=2)
    weak = str(build_tiny_llama(root / "weak", seed=3, vocab_size=64, num_layers=1))
    return {"target": target, "close": close, "weak": weak}


@pytest.fixture(scope="session")
def micro_pair(tmp_path_factory) -> dict[str, str]:
    """Vocabulary of 8 tokens: cheap enough for thousands of sampled generations."""
    from speclab.models.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("micro")
    target = str(build_tiny_llama(root / "target", seed=5, vocab_size=8, hidden_size=16,
                                  num_layers=1, num_heads=2))
    with torch.no_grad():  # flatten the distributions so many continuations are likely
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(target)
        m.lm_head.weight.mul_(0.15)
        m.save_pretrained(target)
    draft = str(build_tiny_llama(root / "draft", seed=6, vocab_size=8, hidden_size=16,
                                 num_layers=1, num_heads=2))
    with torch.no_grad():  # an independent draft: q clearly differs from p
        m = AutoModelForCausalLM.from_pretrained(draft)
        m.lm_head.weight.mul_(0.1)
        m.save_pretrained(draft)
    return {"target": target, "draft": draft}


def build_rec_pair(root) -> tuple[str, str]:
    """A tiny random recommender pair (target, draft) with rec_meta.json and id tokenizer:
    40 items with dataset ids 100..139, semantic ids of 3 levels x 4 codes."""
    from speclab.data import recsys
    from speclab.data.rec_dataset import RecMeta, save_rec_tokenizer
    from speclab.models.tiny import build_tiny_llama

    feats = recsys.item_features(recsys.SyntheticSpec(items=40, seed=3))
    codes = recsys.semantic_ids(feats, levels=3, codebook=4)
    meta = RecMeta(list(range(100, 140)), [list(c) for c in codes], 3, 4, history=4)
    out = []
    for name, seed, hidden in (("rec_target", 1, 32), ("rec_draft", 2, 16)):
        folder = build_tiny_llama(root / name, seed=seed, vocab_size=meta.vocab_size,
                                  hidden_size=hidden, num_layers=1)
        meta.save(folder)
        save_rec_tokenizer(meta, folder)
        out.append(str(folder))
    return out[0], out[1]


@pytest.fixture(scope="session")
def rec_pair(tmp_path_factory) -> tuple[str, str]:
    """:func:`build_rec_pair` in a session temp dir."""
    return build_rec_pair(tmp_path_factory.mktemp("rec"))
