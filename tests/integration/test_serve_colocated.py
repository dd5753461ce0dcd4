"""``serve.topology: colocated``: the target and the draft side in ONE deployment whose
replicas run every round in process. Started as a user starts it (``speclab serve``,
127.0.0.1), with two replicas: greedy requests alone and 16 concurrent ones return the
offline engine's tokens and rounds and are batched, a seeded sample reproduces the
offline one, plain decoding and a bad request go through the same replicas, and every
request's state is freed on both sides."""

from __future__ import annotations

import time

import pytest
import requests

from serve_apps.loadtest import PROMPTS, run_load
from tests.integration.test_serve import (  # noqa: F401
    METHOD,
    _start,
    _stop,
    assert_same_rounds,
    seeded_samples_equal_offline,
    tiny,
)

pytestmark = pytest.mark.integration


def test_a_colocated_app_decodes_as_the_split_one_and_the_offline_engine(tmp_path,
                                                                         tiny):  # noqa: F811
    from speclab.api import Decoder

    target, draft = tiny
    dec = Decoder.from_pretrained(target, draft)
    want = {p: dec.generate(p, method="salf", max_new_tokens=24, **METHOD) for p in PROMPTS}
    proc, url = _start(tmp_path, [f"models.target={target}", f"models.draft={draft}",
                                  "serve.topology=colocated", "serve.target.replicas=2",
                                  "serve.target.num_cpus=0.5"])
    try:
        deadline = time.time() + 60  # the router learns the second replica shortly after
        while True:
            h = requests.get(url + "/health", timeout=60).json()
            if len(h["target"]) == 2 or time.time() > deadline:
                break
            time.sleep(1)
        # the same two processes answer for both sides
        assert {st["pid"] for st in h["target"]} == {st["pid"] for st in h["draft"]}
        assert len(h["target"]) == 2
        r = requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 24})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["token_ids"] == want[PROMPTS[0]].token_ids
        assert_same_rounds({**body["stats"], **body["stats"]["timing"]},
                           want[PROMPTS[0]].stats)
        results, s = run_load(url, clients=16, per_client=1, max_tokens=24, prompts=PROMPTS)
        assert s["requests"] == 16 and s["errors"] == 0
        for b in results:
            assert b["token_ids"] == want[b["prompt"]].token_ids
        rows = [n for b in results for n in b["stats"]["timing"]["batch_rows"]]
        assert max(rows) > 1, rows  # concurrent requests shared target forwards
        seeded_samples_equal_offline(url, dec, "salf", METHOD, seeds=range(3))
        bad = requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        c = requests.post(url + "/v1/completions", json={"prompt": PROMPTS[1],
                                                         "max_tokens": 24, "temperature": 0})
        assert c.status_code == 200, c.text
        assert c.json()["choices"][0]["text"] == dec.tokenizer.decode(
            want[PROMPTS[1]].token_ids, skip_special_tokens=True)
        h = requests.get(url + "/health", timeout=60).json()
        for st in h["target"] + h["draft"]:  # freed on both sides of each replica
            assert st["sessions"] == 0 and st["cached_tokens"] == 0, st
    finally:
        _stop(proc)


def test_an_auto_budget_through_serve_keeps_outputs_and_shows_its_choices(tmp_path,
                                                                          tiny):  # noqa: F811
    """``serve.budget: auto`` on the split topology: each request's rounds choose their
    depth from the target replica's calibrated costs (measured there once) and the
    request's acceptance; greedy outputs stay the offline engine's, alone and batched;
    each reply lists its rounds' budgets, and Prometheus has their histogram."""
    from speclab.api import Decoder
    from tests.integration.conftest import free_port

    target, draft = tiny
    dec = Decoder.from_pretrained(target, draft)
    want = {p: dec.generate(p, method="chain", gamma=3, max_new_tokens=24).token_ids
            for p in PROMPTS}
    metrics_port = free_port()
    proc, url = _start(tmp_path, [f"models.target={target}", f"models.draft={draft}",
                                  "method={name: chain, gamma: 3}", "serve.budget=auto",
                                  f"serve.metrics_port={metrics_port}"])
    try:
        c = requests.post(url + "/v1/completions", json={"prompt": PROMPTS[0],
                                                         "max_tokens": 24, "temperature": 0})
        assert c.status_code == 200, c.text
        sd = c.json()["speclab"]
        assert len(sd["round_budgets"]) == sd["target_calls"] > 0
        assert all(0 <= b <= 3 for b in sd["round_budgets"])
        results, s = run_load(url, clients=8, per_client=1, max_tokens=24, prompts=PROMPTS)
        assert s["errors"] == 0
        for b in results:
            assert b["token_ids"] == want[b["prompt"]]
        assert (tmp_path / "home" / "calibration").is_dir()  # stored for the next start
        # /health shows what the draft replica's budget learned and its steps' depths
        # (requests share a step's decision: at most one step per round)
        learned = requests.get(url + "/health", timeout=60).json()["draft"][0]["budget"]
        assert learned is not None and learned["plain_ratios"]
        steps = {int(d): n for d, n in learned["steps"].items()}
        assert set(steps) <= set(range(4)) and 0 in steps
        assert 0 < sum(steps.values()) <= sd["target_calls"] + sum(
            b["stats"]["target_calls"] for b in results)
        # every round chose its budget but, per request, at most its last (one token
        # left: nothing to draft); Ray exports the histogram periodically, so it is read
        # until all of them are in
        rounds = sd["target_calls"] + sum(b["stats"]["target_calls"] for b in results)
        chosen = rounds - (1 + len(results))
        deadline, text, counts = time.time() + 120, "", []
        while time.time() < deadline:
            text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            counts = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                      if ln.startswith("ray_speclab_draft_budget_count{")]
            if counts and sum(counts) >= chosen:
                break
            time.sleep(3)
        assert counts and sum(counts) >= chosen, text[-1500:]
    finally:
        _stop(proc)
