"""A sliding-window family served (``speclab serve``, 127.0.0.1): a Mistral target with a
16-token window and its draft, concurrent ``/generate`` requests batched on the target
replica, contexts longer than the window: every reply equals HF greedy ``generate``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import _noisy_copy
from tests.integration.test_serve import _start, _stop
from tests.unit.test_model_families import BASE, NEW, _hf_greedy, _prompts

pytestmark = pytest.mark.integration


def test_a_sliding_window_family_served_equals_hf_greedy(tmp_path):
    torch.manual_seed(11)
    cfg = AutoConfig.for_model("mistral", **{**BASE, "sliding_window": 16})
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = None
    target = str(tmp_path / "target")
    model.save_pretrained(target)
    draft = _noisy_copy(target, str(tmp_path / "draft"), 0.2, seed=3)
    prompts = _prompts()
    want = [_hf_greedy(target, p) for p in prompts]
    proc, url = _start(tmp_path, [f"models.target={target}", f"models.draft={draft}",
                                  'method={"name": "chain", "gamma": 3}',
                                  "serve.target.num_cpus=0.4", "serve.draft.num_cpus=0.4"])
    try:
        def ask(p):
            r = requests.post(f"{url}/generate", json={"prompt_ids": p, "max_tokens": NEW},
                              timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(ask, prompts * 2))
        assert [g["token_ids"] for g in got] == want * 2
        assert max(g["stats"]["tau"] for g in got) > 1.2  # drafts were accepted
        assert max(max(g["stats"]["timing"]["batch_rows"]) for g in got) > 1  # batched
    finally:
        _stop(proc)
