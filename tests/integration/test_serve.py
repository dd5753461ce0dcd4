"""The Serve app end to end, started the way a user starts it (``speclab serve``) on
127.0.0.1: the openai client (completions and chat), streaming, the native routes, bad
requests, the documented API, Prometheus metrics, an API key, a load of 16 concurrent
clients checked against the offline engine and batched, and killed target and draft
replicas.

The module's app has TWO target replicas, so every request also exercises the
session-affinity router (a call reaching the wrong replica would find no state).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from serve_apps import loadtest
from serve_apps.loadtest import PROMPTS, one_request, run_load, run_open_load
from tests.conftest import build_rec_pair
from tests.integration.conftest import ROOT, free_port, listening_addresses, stop_process_tree

pytestmark = pytest.mark.integration
METHOD = {"nodes": 8, "batch": 2, "salf_threshold": 0.3, "depth": 4}  # as in the smoke config


def _start(root: Path, overrides: list[str], tries: int = 3) -> tuple[subprocess.Popen, str]:
    """``speclab serve --config experiments/smoke/serve.yaml`` on a free port, ready; a
    port that another process took between :func:`free_port` and the proxy's bind
    (``Failed to bind to address``) is tried again on a new one, ``tries`` times."""
    for attempt in range(tries):
        try:
            return _start_once(root, overrides)
        except _PortTaken:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """The server could not bind the port it was given."""


def _start_once(root: Path, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "SPECLAB_HOME": str(root / "home"), "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    log = root / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "speclab.cli", "serve", "--config",
             "experiments/smoke/serve.yaml", f"serve.port={port}", *overrides],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)  # its embedded Ray and Serve live in its tree
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            _stop(proc)  # whatever it left behind
            if "Failed to bind to address" in log.read_text():
                raise _PortTaken(port)
            pytest.fail("server exited: " + log.read_text()[-3000:])
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)
    _stop(proc)
    pytest.fail("server not ready: " + log.read_text()[-3000:])


def assert_same_rounds(served: dict, want) -> None:
    """A served request's rounds (``served``: its stats with ``ahead_hits``) are the
    offline engine's (``want``: its GenerationStats), unless some round was drafted
    ahead and hit: that round's tree was a subtree of a deeper one (the tokens are the
    same, the acceptance need not be), so then the rounds need only add up."""
    if served["ahead_hits"] == 0:
        assert served["accepted_lengths"] == want.accepted_lengths
        assert served["target_calls"] == want.target_calls
        assert served["tau"] == pytest.approx(want.tau)
    else:
        assert sum(served["accepted_lengths"]) == sum(want.accepted_lengths)
        assert served["target_calls"] == len(served["accepted_lengths"])


def assert_vllm_metrics(metrics: dict, served: dict, want=None) -> None:
    """``metrics.speculative_decoding`` at ``detailed`` (vLLM's per-request schema) holds
    the request's rounds (``served``: the ``speclab`` field), its summary adds up from its
    per-step arrays, and without rounds drafted ahead it is the offline engine's
    (``want``: its GenerationStats): every round that verified a draft."""
    m = metrics["speculative_decoding"]
    acc, drafted = m["per_step_accepted"], m["per_step_drafted"]
    assert len(acc) == len(drafted) == m["num_spec_steps"] <= served["target_calls"]
    assert sum(acc) == m["num_accepted_draft_tokens"] and sum(drafted) == m["num_draft_tokens"]
    assert all(0 <= a <= d for a, d in zip(acc, drafted, strict=True)) and min(drafted) > 0
    assert m["acceptance_histogram"] == [acc.count(j) for j in range(m["num_spec_tokens"] + 1)]
    assert m["num_spec_tokens"] == METHOD["depth"]  # SALF's: the tree's depth
    assert m["mean_acceptance_length"] == pytest.approx(1 + sum(acc) / len(acc))
    assert m["draft_acceptance_rate"] == pytest.approx(sum(acc) / sum(drafted))
    if want is not None and served["ahead_hits"] == 0:
        rounds = [(a, d) for a, d in zip(want.round_accepted, want.round_drafted, strict=True)
                  if d > 0]
        assert acc == [a for a, _ in rounds] and drafted == [d for _, d in rounds]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the CLI (it shuts Serve down, then its embedded Ray), then stop whatever is
    left of the process group and the processes it started (Serve's actors, raylet...)."""
    stop_process_tree(proc, grace=30, leader_grace=90)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    from speclab.models.registry import ensure_tiny_pair

    return ensure_tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny):
    """The smoke app (SALF) with two target replicas and a recommender pair; prompts
    longer than 16 tokens are prefilled in chunks (``serve.prefill_chunk``), so every
    test here checks chunked prefill against the offline engine too."""
    root = tmp_path_factory.mktemp("serve")
    target, draft = tiny
    rec_target, rec_draft = build_rec_pair(root)
    metrics_port = free_port()
    proc, url = _start(root, [
        f"models.target={target}", f"models.draft={draft}", "serve.target.replicas=2",
        f"serve.metrics_port={metrics_port}", "serve.prefill_chunk=16",  # every test
        "serve.target.num_cpus=0.4", "serve.draft.num_cpus=0.4",
        f"serve.rec_target={rec_target}", f"serve.rec_draft={rec_draft}", "serve.rec_n=6",
        "serve.rec_gamma=2", "serve.spec_decode_metrics=detailed"])
    yield {"url": url, "target": target, "draft": draft, "rec_target": rec_target,
           "rec_draft": rec_draft, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    _stop(proc)


@pytest.fixture(scope="module")
def offline(server):
    """The offline engine's greedy text / tokens for each prompt (same method)."""
    from speclab.api import Decoder

    dec = Decoder.from_pretrained(server["target"], server["draft"])
    out = {}
    for p in PROMPTS:
        res = dec.generate(p, method="salf", max_new_tokens=24, **METHOD)
        out[p] = (res.token_ids, dec.tokenizer.decode(res.token_ids, skip_special_tokens=True),
                  res.stats)
    return out


def test_openai_client_completion_equals_the_offline_engine(server, offline):
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smoke-serve"]
    for p in PROMPTS[:3]:
        res = client.completions.create(model="smoke-serve", prompt=p, max_tokens=24,
                                        temperature=0)
        assert res.choices[0].text == offline[p][1]
        assert res.usage.completion_tokens == len(offline[p][0])
        chunks = [c.choices[0].text for c in client.completions.create(
            model="smoke-serve", prompt=p, max_tokens=24, temperature=0, stream=True)
            if c.choices]  # the last chunk: usage, no choices (as OpenAI's)
        assert "".join(chunks) == offline[p][1]
        assert sum(1 for c in chunks if c) > 1  # really streamed, round by round


def test_openai_clients_neutral_parameters_are_accepted_and_others_named(server, offline):
    """What LangChain, LiteLLM and lm-eval-harness send on every request: the documented
    parameters at their neutral values change nothing; a value that would change the
    behaviour is a 400 naming the parameter; ``stream_options`` works on completions."""
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    p = PROMPTS[0]
    res = client.completions.create(
        model="smoke-serve", prompt=p, max_tokens=24, temperature=0, top_p=1, n=1,
        presence_penalty=0, frequency_penalty=0, logit_bias={}, best_of=1, suffix=None,
        echo=False, logprobs=None, stop=None, seed=0, user="u", stream=False)
    assert res.choices[0].text == offline[p][1]
    chunks = list(client.completions.create(
        model="smoke-serve", prompt=p, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline[p][1]
    assert chunks[-1].usage.completion_tokens == len(offline[p][0])
    chat = client.chat.completions.create(
        model="smoke-serve", max_tokens=8, temperature=0, presence_penalty=0,
        frequency_penalty=0, logit_bias={}, response_format={"type": "text"},
        top_logprobs=None, tools=[], parallel_tool_calls=False, metadata={}, store=False,
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "def add"},
                                               {"type": "text", "text": "(a, b):"}]}])
    plain = client.chat.completions.create(
        model="smoke-serve", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "def add(a, b):"}])
    assert chat.choices[0].message.content == plain.choices[0].message.content
    for route, extra, param in [
            ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
            ("completions", {"best_of": 3}, "best_of"),
            ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
            ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
            ("chat", {"response_format": {"type": "json_object"}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as err:
            if route == "completions":
                client.completions.create(model="smoke-serve", prompt=p, max_tokens=4,
                                          **extra)
            else:
                client.chat.completions.create(model="smoke-serve", max_tokens=4, messages=[
                    {"role": "user", "content": "x"}], **extra)
        body = err.value.body
        assert body["param"] == param and "not supported (only" in body["message"], body
    url = server["url"] + "/v1/completions"
    for body, param in [({"prompt": "", "max_tokens": 2}, "prompt"),
                        ({"prompt": [], "max_tokens": 2}, "prompt")]:
        r = requests.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = requests.post(url, data=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert "invalid JSON" in r.json()["error"]["message"]
    spec = requests.get(server["url"] + "/openapi.json").json()
    assert not [path for path, ops in spec["paths"].items() for op in ops.values()
                if "422" in op.get("responses", {})]


def test_logprobs_and_echo_are_the_targets_own_distribution(server, offline):
    """``logprobs`` / ``echo`` (completions) and ``logprobs`` / ``top_logprobs`` (chat),
    through the openai client, equal the target's log-softmax over the whole sequence
    (one plain forward), streamed or not, the prompt as text or token ids; the scoring
    call lm-eval-harness makes (``echo``, ``logprobs=1``, ``max_tokens=1``) gives the
    continuation's log-likelihood; out-of-range values are 400s naming the field."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    tok = AutoTokenizer.from_pretrained(server["target"])
    model = AutoModelForCausalLM.from_pretrained(server["target"])
    p = PROMPTS[1]
    ids = tok.encode(p, add_special_tokens=False)
    out_ids = offline[p][0][:12]
    seq = ids + out_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
    want = ref[torch.arange(len(seq) - 1), seq[1:]].tolist()  # seq[i+1] given seq[:i+1]
    res = client.completions.create(model="smoke-serve", prompt=p, max_tokens=len(out_ids),
                                    temperature=0, logprobs=2, echo=True)
    lp = res.choices[0].logprobs
    assert res.choices[0].text == p + offline[p][1][:len(res.choices[0].text) - len(p)]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(seq)
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), torch.tensor(want), atol=1e-4)
    assert lp.tokens == [tok.decode([t]) if "\ufffd" not in tok.decode([t])
                         else tok.convert_ids_to_tokens(t) for t in seq]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for i, top in enumerate(lp.top_logprobs[len(ids):]):  # greedy: the best is the chosen
        assert 2 <= len(top) <= 3 and max(top, key=top.get) == lp.tokens[len(ids) + i]
        assert max(top.values()) == pytest.approx(ref[len(ids) - 1 + i].max().item(), abs=1e-4)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="smoke-serve", prompt=ids, max_tokens=len(out_ids), temperature=0, logprobs=2,
        stream=True) if c.choices and c.choices[0].logprobs]
    got = [x for c in streamed for x in c.token_logprobs]
    assert len(streamed) > 1
    assert torch.allclose(torch.tensor(got), torch.tensor(want[len(ids) - 1:]), atol=1e-4)
    # lm-eval-harness' loglikelihood request: context + continuation, echoed
    ctx, cont = ids, out_ids[:3]
    score = client.completions.create(model="smoke-serve", prompt=ctx + cont, max_tokens=1,
                                      temperature=0, logprobs=1, echo=True).choices[0].logprobs
    assert sum(score.token_logprobs[len(ctx):len(ctx) + 3]) == pytest.approx(
        sum(want[len(ids) - 1:len(ids) + 2]), abs=1e-3)
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model="smoke-serve", messages=msgs, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(
        c.logprob, abs=1e-5) for c in content)  # greedy: the chosen is the best
    plain = client.chat.completions.create(model="smoke-serve", messages=msgs, max_tokens=8,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == chat.choices[0].message.content
    url = server["url"] + "/v1"
    for route, body, param in [
            ("completions", {"prompt": p, "logprobs": 21}, "logprobs"),
            ("completions", {"prompt": p, "logprobs": -1}, "logprobs"),
            ("completions", {"prompt": [1, 2], "logprobs": 1, "max_tokens": 1,
                             "stop": 5}, "stop"),
            ("completions", {"prompt": [1, 10 ** 9], "max_tokens": 1}, "prompt_ids"),
            ("chat/completions", {"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
            ("chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21},
             "top_logprobs")]:
        r = requests.post(f"{url}/{route}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_langchain_openai_chat_and_completions(server, offline):
    """LangChain's OpenAI integration (installed from PyPI) against the app: chat
    (invoke, stream, logprobs) and completions, as its users call them."""
    from langchain_openai import ChatOpenAI, OpenAI

    common = {"base_url": server["url"] + "/v1", "api_key": "unused", "model": "smoke-serve",
              "temperature": 0, "max_tokens": 8, "max_retries": 0}
    chat = ChatOpenAI(**common)
    msgs = [("system", "be brief"), ("human", "def add(a, b):")]
    reply = chat.invoke(msgs)
    assert reply.content and reply.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(c.content for c in chat.stream(msgs)) == reply.content
    scored = chat.bind(logprobs=True, top_logprobs=1).invoke(msgs)
    assert scored.content == reply.content
    assert len(scored.response_metadata["logprobs"]["content"]) >= 1
    p = PROMPTS[0]
    text = OpenAI(**{**common, "max_tokens": 24}).invoke(p)
    assert text == offline[p][1]


def test_chat_completions_through_the_openai_client(server):
    """Messages go through the chat template (the tiny tokenizer has none: the documented
    plain template); the reply equals the offline engine on that prompt, with usage and
    the SD stats in the ``speclab`` extension, streamed or not."""
    import openai

    from serve_apps.chat import chat_prompt
    from speclab.api import Decoder

    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"}]
    dec = Decoder.from_pretrained(server["target"], server["draft"])
    prompt = chat_prompt(dec.tokenizer, msgs)
    assert prompt.endswith("<|user|>\ndef add(a, b):\n<|assistant|>\n")
    want = dec.generate(prompt, method="salf", max_new_tokens=16, **METHOD)
    text = dec.tokenizer.decode(want.token_ids, skip_special_tokens=True)
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    res = client.chat.completions.create(model="smoke-serve", messages=msgs, max_tokens=16,
                                         temperature=0)
    assert res.object == "chat.completion" and res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == text
    assert res.usage.prompt_tokens == len(dec.encode(prompt))
    assert res.usage.completion_tokens == len(want.token_ids)
    assert_same_rounds(res.model_extra["speclab"], want.stats)
    # vLLM's per-request SD statistics (serve.spec_decode_metrics: detailed here)
    assert_vllm_metrics(res.model_extra["metrics"], res.model_extra["speclab"], want.stats)
    chunks = list(client.chat.completions.create(model="smoke-serve", messages=msgs,
                                                 max_tokens=16, temperature=0, stream=True))
    # ... streamed: on the final usage chunk, as vLLM sends them
    assert_vllm_metrics(chunks[-1].model_extra["metrics"], chunks[-1].model_extra["speclab"])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="smoke-serve", messages=[], max_tokens=4)


def test_the_http_and_metrics_ports_listen_on_the_loopback_only(server):
    """serve.host defaults to 127.0.0.1: nothing else can reach the app, nor its
    Prometheus port (serve.metrics_port: speclab's forwarder to Ray's exporter)."""
    port = int(server["url"].rsplit(":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}
    metrics_port = int(server["metrics"].rsplit(":", 1)[1].split("/")[0])
    assert listening_addresses(metrics_port) == {"127.0.0.1"}
    r = requests.get(server["metrics"], timeout=10)
    assert r.status_code == 200 and "ray_" in r.text
    assert requests.get(server["metrics"].replace("/metrics", "/x"), timeout=10
                        ).status_code == 404


def test_unknown_routes_and_methods_answer_in_openai_error_shape(server):
    r = requests.get(server["url"] + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "/v1/nothing" in r.json()["error"]["message"]
    r = requests.get(server["url"] + "/generate")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param",
                                                              "code"}


def test_openapi_documents_every_error_response_and_the_constraints(server):
    spec = requests.get(server["url"] + "/openapi.json").json()
    want = {"/v1/completions": {"400", "401", "404", "503"},
            "/v1/chat/completions": {"400", "401", "404", "503"},
            "/generate": {"400", "401", "503"}, "/recommend": {"400", "401", "404", "503"}}
    for path, codes in want.items():
        responses = spec["paths"][path]["post"]["responses"]
        assert codes <= set(responses), (path, set(responses))
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
    schemas = spec["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["maximum"] == 256
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["minimum"] == 1
    prompt = json.dumps(schemas["CompletionRequest"]["properties"]["prompt"])
    assert '"minLength": 1' in prompt
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert schemas["RecommendRequest"]["properties"]["history"]["minItems"] == 1


def test_sd_counters_reach_prometheus_under_vllm_names(server):
    """After some requests (those of the tests above), Ray's metrics port serves the
    SD counters under vLLM's names, the request latency and the batch sizes, exact
    counters beside the histograms, and errors by status (400 and 404 included)."""
    for p in PROMPTS[:2]:
        assert requests.post(server["url"] + "/generate",
                             json={"prompt": p, "max_tokens": 16}).status_code == 200
    assert requests.post(server["url"] + "/generate", json={"max_tokens": 2}).status_code == 400
    assert requests.get(server["url"] + "/nope").status_code == 404
    assert requests.post(server["url"] + "/generate", json={  # beyond any tiny context
        "prompt_ids": [5] * 4096, "max_tokens": 2}).status_code == 400
    deadline, text = time.time() + 90, ""
    names = ["ray_vllm_spec_decode_num_drafts_total",
             "ray_vllm_spec_decode_num_draft_tokens_total",
             "ray_vllm_spec_decode_num_accepted_tokens_total",
             "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total",
             "ray_speclab_request_latency_seconds_count", "ray_speclab_batch_size_count",
             "ray_speclab_batch_rows_total", "ray_speclab_batch_steps_total",
             "ray_speclab_requests_total", "ray_speclab_request_seconds_total",
             "ray_speclab_draft_ahead_misses_total",
             'ray_speclab_request_errors_total{', 'status="404"',
             'ray_speclab_requests_refused_total{', 'reason="context_length_exceeded"']
    while time.time() < deadline:
        text = requests.get(server["metrics"], timeout=10).text
        if all(n in text for n in names):
            break
        time.sleep(3)

    def value(name: str, needle: str = "") -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and needle in line)

    assert value(names[0]) > 0 and value(names[1]) >= value(names[2]) > 0, text[-2000:]
    assert value(names[3], 'position="0"') >= value(names[3], 'position="1"')
    assert value(names[4], 'route="generate"') >= 2
    assert value(names[5], 'deployment="target"') > 0
    assert value(names[5], 'deployment="draft"') > 0
    for side in ("target", "draft"):  # exact: each step has >= 1 row, the mean is >= 1
        steps = value(names[7], f'deployment="{side}"')
        assert steps > 0 and value(names[6], f'deployment="{side}"') >= steps
    assert value(names[10], 'deployment="draft"') > 0  # rounds drafted ahead that missed
    generate = value(names[8], 'route="generate"')
    assert generate >= 2 and value(names[9], 'route="generate"') > 0
    assert value(names[4], 'route="generate"') == generate  # one observation per request
    for status in ("400", "404"):
        assert value("ray_speclab_request_errors_total", f'status="{status}"') >= 1, \
            [ln for ln in text.splitlines() if "errors" in ln]
    for reason in ("context_length_exceeded", "invalid_request_error"):  # what and why
        assert value("ray_speclab_requests_refused_total", f'reason="{reason}"') >= 1, \
            [ln for ln in text.splitlines() if "refused" in ln]
    # the app's own /metrics: a standalone vLLM server's exact names (one ingress replica)
    own = requests.get(server["url"] + "/metrics", timeout=10)
    assert own.status_code == 200 and own.headers["content-type"].startswith("text/plain")
    samples = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
               for ln in own.text.splitlines() if ln and not ln.startswith("#")}
    label = '{model_name="smoke-serve"}'
    drafts = samples[f"vllm:spec_decode_num_drafts_total{label}"]
    drafted = samples[f"vllm:spec_decode_num_draft_tokens_total{label}"]
    accepted = samples[f"vllm:spec_decode_num_accepted_tokens_total{label}"]
    assert drafts > 0 and drafted >= accepted > 0, own.text[:2000]
    assert samples['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name='
                   '"smoke-serve",position="0"}'] <= drafts
    count = samples[f"vllm:e2e_request_latency_seconds_count{label}"]
    assert count >= 2 and samples[
        'vllm:e2e_request_latency_seconds_bucket{model_name="smoke-serve",le="+Inf"}'] == count


def test_generate_returns_tokens_and_the_sd_stats(server, offline):
    p = PROMPTS[0]
    r = requests.post(server["url"] + "/generate", json={"prompt": p, "max_tokens": 24})
    assert r.status_code == 200, r.text
    body = r.json()
    tokens, _, stats = offline[p]
    assert body["token_ids"] == tokens and body["method"] == "salf"
    st = body["stats"]
    assert_same_rounds({**st, **st["timing"]}, stats)
    assert st["draft_calls"] > 0
    # rounds drafted ahead while the target verified, if the replica's measurement
    # (AheadTrial) still has it on after the requests of the tests above
    assert len(st["accepted_lengths"]) > st["timing"]["ahead_rounds"]
    assert st["timing"]["ahead_rounds"] >= st["timing"]["ahead_hits"] >= 0
    # sampling goes through the same loop (lossless rule, seeded)
    r = requests.post(server["url"] + "/generate", json={
        "prompt": p, "max_tokens": 12, "temperature": 0.8, "seed": 3})
    assert r.status_code == 200 and len(r.json()["token_ids"]) <= 12
    # a stop string ends the text before it
    text = offline[p][1]
    stop = text[5:8]
    r = requests.post(server["url"] + "/v1/completions", json={
        "prompt": p, "max_tokens": 24, "temperature": 0, "stop": stop})
    assert r.json()["choices"][0] == {"text": text[: text.find(stop)], "index": 0,
                                      "logprobs": None, "finish_reason": "stop"}
    # ... and keeps the statistics of the rounds that ran, on every route, streamed or not
    sd = r.json()["speclab"]
    assert sd["tau"] >= 1 and sd["target_calls"] == len(sd["accepted_lengths"]) >= 1
    assert sd["tau"] == pytest.approx(sum(sd["accepted_lengths"]) / sd["target_calls"])
    assert sd["draft_calls"] >= 1
    r = requests.post(server["url"] + "/generate", json={
        "prompt": p, "max_tokens": 24, "temperature": 0, "stop": stop})
    st = r.json()["stats"]
    assert r.json()["finish_reason"] == "stop" and st["tau"] >= 1 and st["target_calls"] >= 1
    assert len(st["accepted_lengths"]) == st["target_calls"] and st["timing"]["ingress_s"] > 0
    r = requests.post(server["url"] + "/v1/completions", json={
        "prompt": p, "max_tokens": 24, "temperature": 0, "stop": stop, "stream": True},
        stream=True)
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: {")]
    last = events[-1]  # OpenAI's shape: usage and stats ride on a chunk without choices
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and last["choices"] == []
    assert last["usage"]["completion_tokens"] >= 1
    assert last["speclab"]["tau"] >= 1 and last["speclab"]["target_calls"] >= 1
    for st in _replica_stats(server["url"]).values():  # stopped early: states freed now
        assert st["sessions"] == 0, st


def test_recommend_returns_the_target_beam_search_top_k(server):
    from speclab.recommend import Recommender

    rec = Recommender.from_pretrained(server["rec_target"])
    history = [101, 105, 120]
    want = rec.recommend(history, k=4, method="beam")["items"]
    r = requests.post(server["url"] + "/recommend", json={"history": history, "k": 4})
    assert r.status_code == 200, r.text
    assert r.json()["items"] == want  # strict top-K verification is lossless
    assert r.json()["stats"]["target_calls"] >= 1
    bad = requests.post(server["url"] + "/recommend", json={"history": [999], "k": 4})
    assert bad.status_code == 400 and "unknown item id" in bad.json()["error"]["message"]


def test_recommend_serves_relaxed_sampling_verification(server):
    """``verify: relaxed`` runs AtSpeed Algorithm 2 through the same beam loop: k distinct
    catalogue items, reproducible for a seed, and the per-seed draws differ."""
    from speclab.data.rec_dataset import RecMeta

    items = set(RecMeta.load(server["rec_target"]).items)
    body = {"history": [101, 105, 120], "k": 4, "verify": "relaxed"}
    runs = [requests.post(server["url"] + "/recommend", json={**body, "seed": s})
            for s in (0, 0, 1, 2, 3)]
    assert all(r.status_code == 200 for r in runs), runs[0].text
    got = [r.json()["items"] for r in runs]
    assert all(len(set(g)) == 4 and set(g) <= items for g in got)
    assert got[0] == got[1]  # same seed, same sample
    assert len({tuple(sorted(g)) for g in got}) > 1  # sampling, not a fixed answer
    assert runs[0].json()["stats"]["verify"] == "relaxed"
    bad = requests.post(server["url"] + "/recommend", json={**body, "verify": "loose"})
    assert bad.status_code == 400 and "verify" in bad.json()["error"]["message"]


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens: must be <="),
    ("/v1/completions", {"prompt": "x", "n": 3}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/generate", {"prompt_ids": [1, 10**9]}, 400, "outside"),
    ("/generate", {"prompt": "x", "prompt_ids": [1]}, 400, "exactly one"),
    ("/generate", {"prompt": "x", "verify": "greedy", "temperature": 0.5}, 400, "verify"),
    ("/recommend", {"history": [101], "k": 50}, 400, "k"),
])
def test_bad_requests_get_a_json_4xx_naming_the_field(server, path, body, status, needle):
    r = requests.post(server["url"] + path, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert requests.get(server["url"] + "/health").json()["status"] == "ok"


def test_malformed_json_is_a_400(server):
    r = requests.post(server["url"] + "/generate", data="{not json",
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_each_error_cause_gets_its_own_sentence_and_param(server):
    """The causes a pydantic union once reported as "Input should be a valid string" (a
    list of prompts, negative token ids, an image part, a JSON-schema response format)
    and a missing or non-object body: one sentence each, ``param`` naming the field."""
    image = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt",
         "one prompt per request (got a list of 2)"),
        ("/v1/completions", {"prompt": [5, -1]}, "prompt",
         "token ids must be >= 0 (got -1 at index 1)"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": image}]},
         "messages.0.content", "part 0 is of type 'image_url'"),
        ("/v1/chat/completions", {**chat, "response_format": schema}, "response_format",
         "does not constrain the output"),
        ("/v1/completions", None, "prompt", "a JSON object with prompt (got no body)"),
        ("/v1/chat/completions", [], "messages", "(got an array)"),
    ]
    for route, body, param, words in cases:
        r = requests.post(server["url"] + route, json=body, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, (body, err)
        assert words in err["message"] and "valid string" not in err["message"], (body, err)
    assert requests.get(server["url"] + "/health", timeout=30).status_code == 200


def test_a_prompt_beyond_the_context_is_refused_at_once_naming_it(server):
    """prompt + max_tokens beyond the target's max_position_embeddings: 400 before any
    decoding, naming the route's prompt field, with OpenAI's code; at the limit: 200."""
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(server["target"]).max_position_embeddings
    url = server["url"]
    cases = [("/generate", {"prompt_ids": [5] * context, "max_tokens": 1}, "prompt_ids"),
             ("/v1/completions", {"prompt": [5] * (context - 3), "max_tokens": 4}, "prompt"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * context}],
                                       "max_tokens": 4}, "messages")]
    for route, body, param in cases:
        t0 = time.perf_counter()
        r = requests.post(url + route, json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, (route, err)
        assert err["code"] == "context_length_exceeded"
        assert f"maximum context length is {context} tokens" in err["message"]
        assert time.perf_counter() - t0 < 5  # refused, not decoded
    r = requests.post(url + "/v1/completions", json={"prompt": [5] * (context - 4),
                                                      "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


def _states_freed_at(url: str, limit_s: float = 30) -> float:
    """``time.perf_counter()`` once no target or draft replica holds a request state."""
    from serve_apps.soak import replica_states

    t_end = time.perf_counter() + limit_s
    while time.perf_counter() < t_end:
        if all(st["sessions"] == 0 for st in replica_states(url)):
            return time.perf_counter()
        time.sleep(0.05)
    pytest.fail(f"request states still held {limit_s} s later")


def test_a_client_that_goes_away_stops_its_requests_work_within_a_second(server):
    """A non-streamed completion whose client closes the connection after 0.3 s: its
    rounds stop and both deployments free its states within a second, long before the
    request would have ended (its full run, timed first, is the yardstick)."""
    url = server["url"]
    body = {"prompt": "def f(x):", "max_tokens": 256, "temperature": 0}
    t0 = time.perf_counter()
    full = requests.post(url + "/v1/completions", json=body, timeout=120).json()
    full_s = time.perf_counter() - t0
    assert full["usage"]["completion_tokens"] == 256  # no early end of sequence
    _states_freed_at(url)
    t0 = time.perf_counter()
    with pytest.raises(requests.ReadTimeout):
        requests.post(url + "/v1/completions", json=body, timeout=(10, 0.3))
    gone = time.perf_counter()  # the client closed its connection here
    freed = _states_freed_at(url)
    print(f"full request {full_s:.2f} s; states freed {freed - gone:.2f} s after the client left")
    # within a second, and well before the rounds left would have ended on their own
    assert freed - gone < min(1.0, (full_s - 0.3) / 2), (freed - gone, full_s)


def test_a_request_deadline_returns_what_was_decoded_by_then(server):
    """``timeout`` on each route: decoding ends at the deadline; the reply holds a prefix
    of the full greedy output, ``deadline_exceeded``, finish_reason length and the SD
    stats of the rounds run (tau >= 1); the states are freed; a bad timeout is a 400."""
    url = server["url"]
    body = {"prompt": "def f(x):", "max_tokens": 256, "temperature": 0}
    full = requests.post(url + "/generate", json=body, timeout=120).json()
    assert len(full["token_ids"]) == 256 and full["deadline_exceeded"] is False
    t0 = time.perf_counter()
    cut = requests.post(url + "/generate", json={**body, "timeout": 0.2}, timeout=120).json()
    took = time.perf_counter() - t0
    n = len(cut["token_ids"])
    print(f"timeout 0.2 s: {n} tokens in {took:.2f} s")
    assert cut["deadline_exceeded"] is True and cut["finish_reason"] == "length", cut
    assert n < 256 and cut["token_ids"] == full["token_ids"][:n], (n, took)
    stats = cut["stats"]
    if n:
        assert stats["tau"] >= 1 and stats["target_calls"] == len(stats["accepted_lengths"])
    comp = requests.post(url + "/v1/completions", json={**body, "timeout": 0.2},
                         timeout=120).json()
    assert comp["speclab"]["deadline_exceeded"] is True
    assert comp["choices"][0]["finish_reason"] == "length"
    assert comp["usage"]["completion_tokens"] < 256
    chunks = []
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 256,
            "temperature": 0, "stream": True, "timeout": 0.2}) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    assert chunks[-1]["choices"] == [] and chunks[-1]["speclab"]["deadline_exceeded"] is True
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    _states_freed_at(url)
    r = requests.post(url + "/generate", json={**body, "timeout": -1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text


# ---- fuzzing every route's JSON body (Hypothesis) ----

FUZZ_BASE = {  # a valid body per route; examples mutate, drop or add fields
    "/generate": {"prompt": "def f(x):", "max_tokens": 6},
    "/v1/completions": {"prompt": "def f", "max_tokens": 6},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
    "/recommend": {"history": [101, 102], "k": 3},
}
FUZZ_FIELDS = ["prompt", "prompt_ids", "max_tokens", "max_completion_tokens", "temperature",
               "top_p", "top_k", "stop", "seed", "stream", "n", "verify", "model", "messages",
               "history", "k", "gamma", "echo", "logprobs", "user", "stream_options", "timeout",
               "bogus"]
RAW_BODIES = [b"", b"{", b"null", b"[]", b'"x"', b"1e999", b'{"max_tokens": NaN}',
              b'{"prompt": "x", "temperature": Infinity}', b"\xff\xfe", b'{"prompt": "\\ud800"}',
              b'{"prompt": "x", "prompt": 3}', b'{"history": [1e400]}', b"[" * 2000]


def _fuzz_strategies():
    from hypothesis import strategies as st

    leaf = (st.none() | st.booleans() | st.integers() | st.integers(-2, 30)
            | st.floats(allow_nan=False, allow_infinity=False) | st.floats(-1, 3)
            | st.text(max_size=20) | st.sampled_from(["greedy", "sample", "relaxed", "user",
                                                      "speclab", "\x00", "\n\n"]))
    value = st.recursive(leaf, lambda c: st.lists(c, max_size=3)
                         | st.dictionaries(st.sampled_from(["role", "content", "x"]) | st.text(
                             max_size=6), c, max_size=3), max_leaves=8)
    return st, value


def _check_answer(r: requests.Response, what) -> None:
    """A 2xx, or a 4xx in OpenAI's error shape that names the field; never a 5xx."""
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["message"] and err["type"].endswith("_error"), err
        if err["param"]:
            assert err["param"].split(".")[0] in err["message"], err


def test_fuzzed_bodies_of_every_route_get_2xx_or_a_named_4xx(server):
    """Hypothesis: JSON bodies derived from a valid one (fields replaced by any JSON value,
    dropped, added; streamed or not) and raw non-JSON bodies, on every POST route. The
    server answers each within 60 s, never 5xx, and frees every request's state."""
    from hypothesis import HealthCheck, given, settings

    st, value = _fuzz_strategies()
    url = server["url"]
    n = int(os.environ.get("SPECLAB_FUZZ_EXAMPLES", 60))
    tried = {"json": 0, "raw": 0}

    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(sorted(FUZZ_BASE)), data=st.data())
    def one(route, data):
        if data.draw(st.integers(0, 9), label="raw?") == 0:
            raw = data.draw(st.sampled_from(RAW_BODIES) | st.binary(max_size=40), label="raw")
            r = requests.post(url + route, data=raw, timeout=60,
                              headers={"content-type": "application/json"})
            tried["raw"] += 1
            _check_answer(r, raw)
            return
        body = dict(FUZZ_BASE[route])
        if data.draw(st.integers(0, 4), label="whole?") == 0:
            body = data.draw(value, label="body")  # anything at all, not even a mapping
        else:
            for _ in range(data.draw(st.integers(1, 3), label="edits")):
                field = data.draw(st.sampled_from(FUZZ_FIELDS), label="field")
                if data.draw(st.integers(0, 5), label="drop?") == 0:
                    body.pop(field, None)
                else:
                    body[field] = data.draw(value, label=field)
        tried["json"] += 1
        streamed = isinstance(body, dict) and body.get("stream") is True
        with requests.post(url + route, json=body, timeout=60, stream=streamed) as r:
            _check_answer(r, body)
            if streamed and r.status_code == 200:
                text = r.content.decode()  # the whole event stream, within the timeout
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]

    one()
    print(f"\n[fuzz] {tried['json']} JSON bodies and {tried['raw']} raw bodies")
    assert requests.get(url + "/health", timeout=30).json()["status"] == "ok"
    deadline = time.time() + 30
    while True:  # every request's state is freed on both sides
        left = [st for st in _replica_stats(url).values() if st["sessions"]]
        if not left or time.time() > deadline:
            break
        time.sleep(1)
    assert not left, left


def test_a_poisoned_request_never_changes_the_requests_batched_with_it(server, offline):
    """Temperatures too small to represent (1e-60, the smallest double) once made the
    target's batched verify raise, failing every request in that batch with a 503. Sent
    concurrently with ordinary requests, each poisoned one is answered (greedy: the
    argmax) and the ordinary ones get exactly their offline output."""
    url = server["url"]
    poison = [{"prompt": PROMPTS[0], "max_tokens": 24, "temperature": t}
              for t in (1e-60, 5e-324, 1e-300)]
    normal = [{"prompt": p, "max_tokens": 24, "temperature": 0} for p in PROMPTS[:4]]
    routes = ["/v1/completions", "/generate"]
    jobs = [(r, b) for r in routes for b in [*poison, *normal, *poison]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: requests.post(url + job[0], json=job[1],
                                                          timeout=120), jobs))
    for (route, body), r in zip(jobs, answers, strict=True):
        assert r.status_code == 200, (route, body, r.status_code, r.text[:300])
        if route == "/generate":  # tiny T: greedy
            assert r.json()["token_ids"] == offline[body["prompt"]][0], (route, body)
        else:
            assert r.json()["choices"][0]["text"] == offline[body["prompt"]][1], (route, body)


def test_short_soak_of_mixed_traffic_returns_every_replica_to_its_baseline(server):
    """The soak command's loop for 20 s: greedy, sampled, streamed, dropped streams, stop
    strings, chat and bad requests from 4 clients; nothing fails, every replica frees
    every request's state and stays within the memory bound (serve_apps.soak)."""
    from serve_apps.soak import MIX, print_report, soak, verdict

    report = soak(server["url"], duration_s=20, clients=4, max_tokens=8)
    print_report(report)
    assert verdict(report) == [], verdict(report)
    assert set(report["by_kind"]) == set(MIX), report["by_kind"]
    assert report["requests"] >= 40


def _replica_stats(url: str) -> dict[int, dict]:
    """Stats of every target and draft replica (keyed by pid), from /health."""
    h = requests.get(url + "/health", timeout=60).json()
    return {st["pid"]: {**st, "side": side} for side in ("target", "draft") for st in h[side]}


def _one(url: str, prompt: str) -> tuple[float, dict]:
    body = one_request(url, prompt, 24)
    return body["latency_s"], body


def test_load_of_16_concurrent_clients_is_answered_correctly_without_leaks(server, offline):
    """Through the load benchmark (serve_apps.loadtest): 16 clients x 3 requests."""
    url = server["url"]
    before = _replica_stats(url)
    results, s = run_load(url, clients=16, per_client=3, max_tokens=24, prompts=PROMPTS)
    assert s["requests"] == 48 and s["errors"] == 0
    for body in results:  # greedy: exactly the offline output
        assert body["token_ids"] == offline[body["prompt"]][0]
    # and batched: rounds of concurrent requests shared target forwards
    rows = [n for body in results for n in body["stats"]["timing"]["batch_rows"]]
    assert max(rows) > 1, rows
    after = _replica_stats(url)
    print(f"\n[load] {s['requests']} requests from 16 clients in {s['wall_s']:.1f}s: p50 "
          f"{s['p50_s']:.2f}s p95 {s['p95_s']:.2f}s, {s['tokens_per_s']:.1f} tokens/s, tau "
          f"{s['tau']:.2f}; rss MB before {[round(x['rss_mb']) for x in before.values()]} "
          f"after {[round(x['rss_mb']) for x in after.values()]}")
    assert sorted(st["side"] for st in after.values()) == ["draft", "target", "target"]
    for st in after.values():  # every request's state was freed on both sides
        assert st["sessions"] == 0 and st["cached_tokens"] == 0, st
        assert st["evicted"] == 0 and st["expired"] == 0, st


def test_an_open_loop_load_is_answered_correctly(server, offline, tmp_path, capsys):
    """Requests arriving as a Poisson process (serve_apps.loadtest --rate), sent whatever
    is in flight: each gets its exact offline output; the CLI's table and JSON say the
    offered rate."""
    url = server["url"]
    results, s = run_open_load(url, rate=30.0, n=12, max_tokens=24, seed=5)
    assert s["requests"] == 12 and s["errors"] == 0 and s["rate"] == 30.0
    for body in results:
        assert body["token_ids"] == offline[body["prompt"]][0]
    out = tmp_path / "load.json"
    assert loadtest.main(["--url", url, "--rate", "30", "--requests", "6", "--max-tokens",
                          "24", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["rate"] == 30.0 and summary["requests"] == 6 and summary["errors"] == 0
    assert "30/s" in capsys.readouterr().out
    assert loadtest.main(["--url", url, "--rate", "0"]) == 2


@pytest.mark.parametrize("side", ["target", "draft"])
def test_killed_replica_is_replaced_and_later_requests_succeed(server, offline, side):
    """A target replica (it holds the rows of its key's requests) or the draft replica
    (it drives every request's rounds) is SIGKILLed mid-load: requests in flight on it
    get a 503, the others their exact output; Serve replaces it, later requests
    succeed and no state is left behind."""
    url = server["url"]
    victim = next(pid for pid, st in _replica_stats(url).items() if st["side"] == side)
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_one, url, p) for p in jobs]
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)  # mid-load
        results = [f.result() for f in futures]
    statuses = {body["status"] for _, body in results}
    assert statuses <= {200, 503}, [b for _, b in results if b["status"] not in (200, 503)]
    for (_, body), prompt in zip(results, jobs):
        if body["status"] == 503:
            assert body["error"]["type"] == "service_unavailable"
        else:
            assert body["token_ids"] == offline[prompt][0]
    deadline, ok = time.time() + 120, 0
    while time.time() < deadline and ok < 8:  # Serve replaces the replica
        _, body = _one(url, PROMPTS[ok % len(PROMPTS)])
        ok = ok + 1 if body["status"] == 200 else 0
        if body["status"] != 200:
            time.sleep(1)
    assert ok == 8, json.dumps(body)[:500]
    while time.time() < deadline:  # Serve starts a new replica in its place
        stats = _replica_stats(url)
        if len(stats) == 3 and all(st["sessions"] == 0 for st in stats.values()):
            break
        time.sleep(2)
    assert victim not in stats and len(stats) == 3, stats
    for st in stats.values():  # failed requests freed their state on the survivors too
        assert st["sessions"] == 0, st
    print(f"\n[fault] {side}: {sum(b['status'] == 503 for _, b in results)} of {len(jobs)} "
          f"requests in flight got 503 after the kill; the rest were answered correctly")


def test_plain_decoding_app_with_an_api_key(tmp_path, tiny):
    """``method: ar``: the target deployment drives the requests alone; ``--api-key``
    makes every API route ask for it as a Bearer token (401 in OpenAI's shape), while
    /health stays open for probes."""
    import openai

    from speclab.api import Decoder

    target, _ = tiny
    want = Decoder.from_pretrained(target).generate(PROMPTS[1], method="ar", max_new_tokens=20)
    proc, url = _start(tmp_path, [f"models.target={target}", "method={name: ar}",
                                  "--api-key=s3cret"])
    try:
        r = requests.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        r = requests.post(url + "/generate", json={"prompt": PROMPTS[1], "max_tokens": 20},
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = requests.post(url + "/generate", json={"prompt": PROMPTS[1], "max_tokens": 20},
                          headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == want.token_ids and r.json()["method"] == "ar"
        assert r.json()["stats"]["target_calls"] == len(want.token_ids)
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        res = client.completions.create(model="smoke-serve", prompt=PROMPTS[1], max_tokens=20,
                                        temperature=0)
        assert res.usage.completion_tokens == len(want.token_ids)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0
                          ).completions.create(model="smoke-serve", prompt="x", max_tokens=2)
        assert requests.get(url + "/health").status_code == 200
        _second_server_on_its_port_is_one_line(tmp_path, url)
        _exits_when_its_ray_dies(proc, tmp_path / "serve.log")
    finally:
        _stop(proc)


def _second_server_on_its_port_is_one_line(tmp_path, url: str) -> None:
    """`speclab serve` on a busy port: exit 2 and one line naming serve.port, before Ray."""
    port = url.rsplit(":", 1)[1]
    env = {**os.environ, "SPECLAB_HOME": str(tmp_path / "home2")}
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run([sys.executable, "-m", "speclab.cli", "serve", "--config",
                          "experiments/smoke/serve.yaml", "method={name: ar}", "--api-key=k",
                          f"serve.port={port}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip() == f"error: serve.port: cannot listen on 127.0.0.1:{port} " \
                                 "(already in use)", res.stderr[-2000:]


def _exits_when_its_ray_dies(proc: subprocess.Popen, log: Path) -> None:
    """SIGKILL the raylet of the server's embedded Ray: the CLI must exit non-zero (a
    supervisor restarts it) instead of sleeping on a port that answers nothing."""
    import psutil

    raylets = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if p.name() == "raylet"]
    assert raylets, [p.name() for p in psutil.Process(proc.pid).children(recursive=True)]
    for p in raylets:
        p.kill()
    t0 = time.time()
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("speclab serve still running 120 s after its raylet died: "
                    + log.read_text()[-2000:])
    text = log.read_text()
    assert rc != 0 and "exiting so a supervisor can restart it" in text, text[-2000:]
    print(f"\n[serve] exited with status {rc} {time.time() - t0:.0f} s after its raylet died")


def seeded_samples_equal_offline(url: str, dec, method: str, knobs: dict,
                                 seeds=range(6), prompt: str = PROMPTS[1]) -> None:
    """A served request with a seed at T>0 returns exactly the tokens (and acceptance)
    of ``Decoder.generate(..., seed=...)``: one rng per sampled request, shared by its
    drafter and its rule, whose state travels between the deployments with each round.
    Different seeds give different samples (the check can fail)."""
    outs = set()
    for seed in seeds:
        want = dec.generate(prompt, method=method, max_new_tokens=20, temperature=1.0,
                            seed=seed, **knobs)
        r = requests.post(url + "/generate", json={"prompt": prompt, "max_tokens": 20,
                                                   "temperature": 1.0, "seed": seed})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == want.token_ids, seed
        assert r.json()["stats"]["accepted_lengths"] == want.stats.accepted_lengths, seed
        outs.add(tuple(want.token_ids))
    assert len(outs) > 1


def test_seeded_sampling_through_serve_reproduces_the_offline_engine(server):
    """A tree method (the module's SALF app)."""
    from speclab.api import Decoder

    dec = Decoder.from_pretrained(server["target"], server["draft"])
    seeded_samples_equal_offline(server["url"], dec, "salf", METHOD)


def test_seeded_chain_sampling_through_serve_reproduces_the_offline_engine(tmp_path, tiny):
    """A chain drafts by sampling from q with the request's rng, then the rule draws
    from the same rng: both halves of each round continue one generator."""
    from speclab.api import Decoder

    target, draft = tiny
    dec = Decoder.from_pretrained(target, draft)
    proc, url = _start(tmp_path, [f"models.target={target}", f"models.draft={draft}",
                                  "method={name: chain, gamma: 4}"])
    try:
        seeded_samples_equal_offline(url, dec, "chain", {"gamma": 4})
    finally:
        _stop(proc)


def test_specdecpp_app_loads_the_head_once_and_stays_lossless(tmp_path, tiny):
    """SpecDec++ served: the draft deployment holds the drafter AND its acceptance head
    (a random head here); greedy output equals the offline engine's (lossless)."""
    import torch

    from speclab.api import Decoder
    from speclab.decoding.acceptance_head import AcceptanceHead, save_head

    target, draft = tiny
    torch.manual_seed(0)
    head = save_head(AcceptanceHead(64, depth=1), tmp_path / "head")
    dec = Decoder.from_pretrained(target, draft)
    want = dec.generate(PROMPTS[0], method="specdecpp", max_new_tokens=24, head=str(head),
                        stop_threshold=0.5)
    ar = dec.generate(PROMPTS[0], method="ar", max_new_tokens=24)
    assert want.token_ids == ar.token_ids
    proc, url = _start(tmp_path, [f"models.target={target}", f"models.draft={draft}",
                                  f"method={{name: specdecpp, head: '{head}', "
                                  "stop_threshold: 0.5}"])
    try:
        r = requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 24})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == want.token_ids
        assert_same_rounds({**r.json()["stats"], **r.json()["stats"]["timing"]}, want.stats)
    finally:
        _stop(proc)


def test_aasd_app_sends_the_prefill_top_tokens_to_the_drafter(tmp_path, tiny):
    """AASD (no draft model; relaxed, so compared with the offline AASD output, not AR):
    its alignment sampling reads the target's prefill top tokens, which the target
    deployment sends to the draft deployment at the start of each request."""
    from speclab.api import Decoder

    target, _ = tiny
    params = {"ngram": 6, "max_key": 3, "candidates": 2, "align_k": 2, "aasd_alpha": 0.2,
              "aasd_beta": 0.1}
    prompt = "def f(x):\n    return x + 1\n\ndef g(x):\n    return x"
    dec = Decoder.from_pretrained(target)
    want = dec.generate(prompt, method="aasd", max_new_tokens=24, **params)
    blind = dec.generate(prompt, method="aasd", max_new_tokens=24, **{**params, "align_k": 0})
    assert blind.stats.drafted_tokens != want.stats.drafted_tokens  # the tops matter here
    proc, url = _start(tmp_path, [f"models.target={target}",
                                  "method=" + json.dumps({"name": "aasd", **params})])
    try:
        r = requests.post(url + "/generate", json={"prompt": prompt, "max_tokens": 24})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == want.token_ids
        assert r.json()["stats"]["accepted_lengths"] == want.stats.accepted_lengths
        assert r.json()["stats"]["drafted_tokens"] == want.stats.drafted_tokens
        assert r.json()["method"] == "aasd"
    finally:
        _stop(proc)


@pytest.mark.parametrize("override,message", [
    ("serve.port=0", "serve.port"),
    ("serve.rec_target=/x", "rec_target and rec_draft: give both"),
    ("serve.target.num_cpus=0", "serve.target.num_cpus"),
    ("models.target=/nonexistent/model", "models.target"),
    ("serve.draft.num_gpus=1", "models.device: 'cpu' but serve.draft.num_gpus is 1"),
    ("models.device=cuda", "models.device: 'cuda' but serve.target.num_gpus is 0"),
])
def test_bad_serve_config_is_refused_before_anything_starts(override, message):
    res = subprocess.run([sys.executable, "-m", "speclab.cli", "serve", "--config",
                          "experiments/smoke/serve.yaml", override], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr and "embedded local Ray" not in res.stdout
