"""vLLM's per-request SD statistics (``metrics.speculative_decoding``) from a request's
rounds: the fields add up the way vLLM's documentation defines them, rounds without a
draft are not speculative steps, and a method that does not draft reports null."""

from __future__ import annotations

import pytest

from serve_apps.spec_metrics import spec_decode_metrics
from speclab.api import Decoder
from speclab.config.method import parse_method


def test_the_summary_and_the_detailed_arrays_add_up():
    stats = {"round_accepted": [0, 2, 3, 1, 0], "round_drafted": [3, 3, 3, 3, 0]}
    m = spec_decode_metrics(stats, 3, "summary")
    assert m == {"mean_acceptance_length": 1 + 6 / 4, "draft_acceptance_rate": 6 / 12,
                 "acceptance_histogram": [1, 1, 1, 1], "num_spec_steps": 4,
                 "num_accepted_draft_tokens": 6, "num_draft_tokens": 12, "num_spec_tokens": 3}
    d = spec_decode_metrics(stats, 3, "detailed")
    assert d == {**m, "per_step_accepted": [0, 2, 3, 1], "per_step_drafted": [3, 3, 3, 3]}
    # no knob fixes the length: the histogram reaches the longest accepted draft
    assert spec_decode_metrics(stats, None, "summary")["num_spec_tokens"] == 3
    # nothing drafted: an all-zero histogram; a method that does not draft: null
    empty = spec_decode_metrics({"round_accepted": [0], "round_drafted": [0]}, 4, "summary")
    assert empty["acceptance_histogram"] == [0] * 5 and empty["num_spec_steps"] == 0
    assert spec_decode_metrics(stats, 3, "summary", drafting=False) is None
    with pytest.raises(ValueError, match="level"):
        spec_decode_metrics(stats, 3, "none")
    with pytest.raises(ValueError, match="rounds"):
        spec_decode_metrics({"round_accepted": [1], "round_drafted": []}, 3, "summary")


@pytest.mark.parametrize("method,knobs,k", [
    ("chain", {"gamma": 3}, 3), ("tree", {"depth": 5, "nodes": 8}, 5),
    ("pld", {"ngram": 4}, 4), ("ar", {}, None)])
def test_each_methods_draft_length_bounds_what_a_round_accepts(tiny_pair, method, knobs, k):
    spec = parse_method({"name": method, **knobs})
    assert spec.draft_length() == k
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    res = dec.generate(prompt_ids=[1, 2, 3, 4, 5, 1, 2, 3], method=method,
                       max_new_tokens=20, **knobs)
    st = res.stats.to_dict()
    assert len(st["round_drafted"]) == len(st["round_accepted"]) == st["target_calls"]
    assert sum(st["round_drafted"]) == st["drafted_tokens"]
    m = spec_decode_metrics(st, spec.draft_length(), "detailed", spec.drafting)
    if k is None:
        assert m is None
    else:
        assert max(m["per_step_accepted"], default=0) <= k == m["num_spec_tokens"]
