"""Grouped-query attention for several-token queries without copying the cache
(:mod:`speclab.decoding.gqa_attention`): the same attention as transformers' ``sdpa``
(which repeats every key/value head for such queries), and the engine's models use it."""

import pytest
import torch
from torch.nn import functional as F  # noqa: N812
from transformers.integrations import sdpa_attention

from speclab.api import Decoder
from speclab.decoding.gqa_attention import NAME, packed_sdpa, use_packed_attention
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama

from .test_engine_greedy import prompts


class _Heads(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("kind", ["additive", "bool", "one mask for every row"])
def test_packed_attention_equals_attention_over_repeated_heads(n, kind):
    """Query [B, 9, n, D] over keys [B, 3, S, D]: packed_sdpa's output is the attention
    over each query head's own key/value head (repeat_interleave), masked positions
    left out."""
    g = torch.Generator().manual_seed(n)
    b, kv, s, d = 2, 3, 11, 8
    q = torch.randn(b, 9, n, d, generator=g)
    k, v = torch.randn(b, kv, s, d, generator=g), torch.randn(b, kv, s, d, generator=g)
    seen = torch.rand(b if kind != "one mask for every row" else 1, 1, n, s, generator=g) > 0.3
    seen[..., 0] = True  # every query sees something
    mask = seen if kind == "bool" else torch.zeros(seen.shape).masked_fill(~seen, -1e9)
    got, weights = packed_sdpa(_Heads(), q, k, v, mask, scaling=0.5)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1),
                                          v.repeat_interleave(3, 1), attn_mask=mask,
                                          scale=0.5).transpose(1, 2)
    assert weights is None and got.shape == (b, n, 9, d)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def gqa_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gqa")
    kw = dict(vocab_size=64, hidden_size=48, num_heads=6, num_kv_heads=2)
    return (str(build_tiny_llama(root / "target", seed=11, num_layers=2, **kw)),
            str(build_tiny_llama(root / "draft", seed=11, num_layers=1, **kw)))


def test_the_engine_verifies_drafts_of_a_gqa_model_without_repeating_its_cache(
        gqa_pair, monkeypatch):
    """A target with 6 query heads over 2 key/value heads: the Decoder switches both
    models to the packed attention, chains and trees (one row and batched) decode what
    plain decoding and the stock sdpa model's greedy generate do, and no forward repeats
    the cache (transformers' repeat_kv is never called)."""
    target, draft = gqa_pair
    stock = load_model(target)
    assert stock.config._attn_implementation == "sdpa"
    ps = prompts(4)
    with torch.no_grad():
        want = [stock.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               min_new_tokens=12, pad_token_id=0)[0, len(p):].tolist()
                for p in ps]
    dec = Decoder.from_pretrained(target, draft)
    assert dec.target.model.config._attn_implementation == NAME
    assert dec.draft.model.config._attn_implementation == NAME
    repeats = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv",
                        lambda x, n: repeats.append(n) or real(x, n))
    for method, knobs in [("ar", {}), ("chain", {"gamma": 4}),
                          ("tree", {"tree_top_k": 3, "depth": 3, "nodes": 8})]:
        alone = [dec.generate(prompt_ids=p, method=method, max_new_tokens=12, **knobs)
                 for p in ps]
        batched = dec.generate(prompts=ps, method=method, max_new_tokens=12, batch_size=3,
                               **knobs)
        assert [r.token_ids for r in alone] == want, method
        assert [r.token_ids for r in batched] == want, method
    assert repeats == []
    # the check can fail: the stock model repeats its heads for a several-token masked query
    pad = torch.ones(1, len(ps[0]) + 1, dtype=torch.long)
    pad[0, 0] = 0
    stock(input_ids=torch.tensor([[0, *ps[0]]]), attention_mask=pad)
    assert repeats


def test_models_without_sdpa_are_left_alone(gqa_pair):
    """An eager model keeps its attention; a packed one stays packed."""
    eager = load_model(gqa_pair[0], attn_implementation="eager")
    assert not use_packed_attention(eager)
    assert eager.config._attn_implementation == "eager"
    packed = load_model(gqa_pair[0])
    assert use_packed_attention(packed) and use_packed_attention(packed)


def test_an_eagle_drafter_with_grouped_heads_drafts_without_repeating_them(
        gqa_pair, tmp_path, monkeypatch):
    """An EAGLE drafter whose layer groups its heads (as public EAGLE-3 checkpoints of
    LLaMA-3 do: 32 over 8) is built with the packed attention; its tree steps and the
    target's verification never repeat a cache, and the output is plain decoding's."""
    from dataclasses import replace

    from speclab.families.eagle.model import EagleMeta, EagleModel, save_eagle

    target = load_model(gqa_pair[0])
    model = EagleModel(replace(EagleMeta.for_target(target.config), kv_heads=2))
    assert model.config._attn_implementation == NAME
    folder = str(save_eagle(model, tmp_path / "eagle"))
    dec = Decoder.from_pretrained(gqa_pair[0])
    ps = prompts(3)
    want = [r.token_ids for r in dec.generate(prompts=ps, method="ar", max_new_tokens=10)]
    repeats = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv",
                        lambda x, n: repeats.append(n) or real(x, n))
    got = dec.generate(prompts=ps, method="eagle", eagle_model=folder, tree_top_k=3, depth=3,
                       nodes=8, max_new_tokens=10)
    assert [r.token_ids for r in got] == want
    assert repeats == []
