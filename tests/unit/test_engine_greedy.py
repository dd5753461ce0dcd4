"""Temperature 0: every method reproduces the target's greedy decoding and HF generate."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from speclab.api import Decoder

SETTINGS = [
    ("ar", {}),
    ("chain", {"gamma": 1}),
    ("chain", {"gamma": 4}),
    ("tree", {"tree_top_k": 3, "depth": 4, "nodes": 10}),
    ("tree", {"tree_top_k": 1, "depth": 2, "nodes": 2}),
    ("optimal", {"nodes": 12, "batch": 3, "depth": 6}),
    ("salf", {"nodes": 16, "batch": 4, "salf_threshold": 0.3}),
    ("salf", {"nodes": 6, "batch": 1, "salf_threshold": 0.8}),
    ("salf", {"nodes": 12, "batch": 3, "salf_threshold": 0.2, "score_temperature": 0.5}),
    ("tree", {"tree_top_k": 2, "depth": 6, "nodes": 8, "score_temperature": 0.5}),
]


def prompts(n=24, vocab=64):
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def references(tiny_pair):
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair["target"]).eval()
    out = []
    for ids in prompts():
        gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out.append((ids, gen[0, len(ids):].tolist()))
    return out


@pytest.mark.parametrize("draft", ["close", "weak"])
def test_every_method_equals_hf_greedy(tiny_pair, references, draft):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair[draft])
    accepted = 0
    for method, hp in SETTINGS:
        for ids, want in references:
            res = dec.generate(prompt_ids=ids, method=method, max_new_tokens=24, **hp)
            assert res.token_ids == want, (method, hp, ids)
            assert res.stats.new_tokens == len(want)
            accepted += res.stats.accepted_tokens
    if draft == "close":  # the close draft must really exercise multi-token acceptance
        assert accepted > 500


def test_stats_are_consistent(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    res = dec.generate(prompt_ids=[1, 2, 3], method="chain", gamma=4, max_new_tokens=40)
    s = res.stats
    assert s.new_tokens == 40
    assert sum(s.accepted_lengths) >= s.new_tokens
    assert s.target_calls == len(s.accepted_lengths)
    assert s.tau == pytest.approx(sum(s.accepted_lengths) / s.target_calls)
    assert 0 < s.acceptance_rate <= 1
    assert s.verification_rate == pytest.approx(s.target_calls / 40)
    assert s.draft_calls > 0 and s.wall_s >= s.draft_s + s.verify_s
    ar = dec.generate(prompt_ids=[1, 2, 3], method="ar", max_new_tokens=40).stats
    assert ar.target_calls == 40 and ar.tau == 1.0 and ar.verification_rate == 1.0


def test_generation_stops_at_eos(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    full = dec.generate(prompt_ids=[5, 6, 7], method="ar", max_new_tokens=30).token_ids
    eos = full[7]
    dec.eos_token_id = eos
    for method in ("ar", "chain", "tree", "salf"):
        out = dec.generate(prompt_ids=[5, 6, 7], method=method, max_new_tokens=30).token_ids
        assert out == full[: full.index(eos) + 1], method


def test_stats_count_no_token_past_eos(tiny_pair):
    """The round that meets EOS counts only the tokens it commits (tau is not inflated)."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    checked, original = 0, dec.eos_token_id
    for ids in prompts(12):
        ar = dec.generate(prompt_ids=ids, method="ar", max_new_tokens=24).token_ids
        dec.eos_token_id = ar[min(3, len(ar) - 1)]  # an EOS the target emits early
        try:
            res = dec.generate(prompt_ids=ids, method="chain", gamma=6, max_new_tokens=24)
        finally:
            dec.eos_token_id = original
        assert res.token_ids[-1] == ar[min(3, len(ar) - 1)]
        assert sum(res.stats.accepted_lengths) == res.stats.new_tokens == len(res.token_ids)
        checked += 1
    assert checked == 12
