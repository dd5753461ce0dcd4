"""``speclab serve`` with the feature drafters, ``method=eagle`` and ``method=medusa``: the
target deployment returns the accepted path's features with every verdict (packed
tensors, not JSON floats), the draft deployment holds each request's feature state (the
EAGLE drafter, or the Medusa heads: they live with the draft deployment, so the target
deployment stays model-agnostic), and the served output and per-round acceptance equal
the offline engine's at T=0 (and AR's tokens), through /generate and /v1/completions."""

from __future__ import annotations

import pytest
import requests

from serve_apps.loadtest import PROMPTS
from tests.integration.test_serve import (  # noqa: F401
    _replica_stats,
    _start,
    _stop,
    assert_same_rounds,
    seeded_samples_equal_offline,
    tiny,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_served_with_features_crossing_deployments(tmp_path, tiny, version):  # noqa: F811
    """EAGLE-1/2 and EAGLE-3 (the target returns the fused features of the layers the
    draft replica's drafter names; a draft vocabulary of the 32 most frequent tokens)."""
    from speclab.api import Decoder
    from speclab.families.eagle.model import save_eagle
    from tests.unit.test_eagle import _train
    from tests.unit.test_eagle3 import train_eagle3

    target, _ = tiny
    model = (_train(target, 120)[0] if version == 1 else
             train_eagle3(target, 80, 32))
    folder = save_eagle(model, tmp_path / "eagle")
    knobs = {"tree_top_k": 3, "depth": 4, "nodes": 10}
    dec = Decoder.from_pretrained(target)
    want = dec.generate(PROMPTS[0], method="eagle", eagle_model=str(folder),
                        max_new_tokens=32, **knobs)
    ar = dec.generate(PROMPTS[0], method="ar", max_new_tokens=32)
    assert want.token_ids == ar.token_ids and want.stats.accepted_tokens > 0
    method = ("method={name: eagle, eagle_model: " + str(folder)
              + ", tree_top_k: 3, depth: 4, nodes: 10}")
    proc, url = _start(tmp_path, [f"models.target={target}", method])
    try:
        r = requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 32})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["method"] == "eagle" and body["token_ids"] == want.token_ids
        st = {**body["stats"], **body["stats"]["timing"]}
        assert_same_rounds(st, want.stats)
        # the rounds were drafted ahead on the drafter's own features while the target
        # verified (greedy), then re-synced on the target's
        assert st["ahead_rounds"] > 0
        c = requests.post(url + "/v1/completions", json={"prompt": PROMPTS[0],
                                                         "max_tokens": 32, "temperature": 0})
        assert c.status_code == 200, c.text
        assert c.json()["choices"][0]["text"] == dec.tokenizer.decode(
            want.token_ids, skip_special_tokens=True)
        seeded_samples_equal_offline(url, dec, "eagle", {"eagle_model": str(folder), **knobs})
        for st in _replica_stats(url).values():  # feature state freed with the request
            assert st["sessions"] == 0, st
    finally:
        _stop(proc)


def test_medusa_served_with_the_heads_in_the_draft_deployment(tmp_path, tiny):  # noqa: F811
    from speclab.api import Decoder
    from speclab.families.medusa.model import save_medusa
    from tests.unit.test_medusa import _train

    target, _ = tiny
    heads, _ = _train(target, 60)
    folder = save_medusa(heads, tmp_path / "medusa", heads.tree)
    dec = Decoder.from_pretrained(target)
    want = dec.generate(PROMPTS[0], method="medusa", medusa_model=str(folder), nodes=8,
                        max_new_tokens=32)
    ar = dec.generate(PROMPTS[0], method="ar", max_new_tokens=32)
    assert want.token_ids == ar.token_ids and want.stats.accepted_tokens > 0
    proc, url = _start(tmp_path, [f"models.target={target}",
                                  "method={name: medusa, medusa_model: " + str(folder)
                                  + ", nodes: 8}"])
    try:
        r = requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 32})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["method"] == "medusa" and body["token_ids"] == want.token_ids
        assert body["stats"]["accepted_lengths"] == want.stats.accepted_lengths
        bad = requests.post(url + "/generate", json={"prompt": "", "max_tokens": 4})
        assert bad.status_code == 400
        again = requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 32})
        assert again.status_code == 200 and again.json()["token_ids"] == want.token_ids
        for st in _replica_stats(url).values():
            assert st["sessions"] == 0, st
    finally:
        _stop(proc)
