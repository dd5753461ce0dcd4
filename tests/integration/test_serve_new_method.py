"""A method registered by a test file alone (``repeat``, tests/unit/test_method_registry.py)
is served by the Serve app: ``$SPECLAB_METHODS`` names the module, the draft deployment
imports it, and the served output equals the offline engine's (greedy: AR's)."""

from __future__ import annotations

import pytest
import requests

from serve_apps.loadtest import PROMPTS
from tests.integration.test_serve import _start, _stop, tiny  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


def test_method_registered_in_a_test_file_runs_through_serve(tmp_path, tiny, monkeypatch):  # noqa: F811
    from speclab.api import Decoder

    monkeypatch.setenv("SPECLAB_METHODS", "tests.unit.test_method_registry")
    import tests.unit.test_method_registry  # noqa: F401  (registers `repeat` here too)

    target, _ = tiny
    dec = Decoder.from_pretrained(target)
    want = dec.generate(PROMPTS[0], method="repeat", span=3, max_new_tokens=24)
    assert want.token_ids == dec.generate(PROMPTS[0], method="ar", max_new_tokens=24).token_ids
    proc, url = _start(tmp_path, [f"models.target={target}", "method={name: repeat, span: 3}"])
    try:
        r = requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 24})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["method"] == "repeat" and body["token_ids"] == want.token_ids
        assert body["stats"]["accepted_lengths"] == want.stats.accepted_lengths
        assert body["stats"]["drafted_tokens"] == want.stats.drafted_tokens > 0
        assert body["stats"]["draft_s"] > 0 and body["stats"]["verify_s"] > 0
    finally:
        _stop(proc)
