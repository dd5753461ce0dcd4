"""Paired timing through Serve: a method's app and plain decoding's app, both up, timed
side by side, so a served speedup comes with an interval.

The in-process protocol (:mod:`speclab.paired_timing`) times a method in pairs with
plain decoding, adjacent in time, and reads the speedup off the pairs' ratios (their
median, with a distribution-free 95% interval). :func:`paired_load` does the same over
HTTP against two running apps, one serving the method and one serving plain decoding
(``method: ar``), in repeated passes; AR goes first in even passes and the method in odd
ones, so neither side always runs right after the other's work:

* one client: each request is a pair. Request ``i`` of a pass (its prompt) goes to one
  app, then the same request to the other; the pair is the two latencies and token
  counts (``unit`` ``i``: the same request in every pass);
* several clients: each pass is a pair. The whole load (``clients`` threads,
  ``per_client`` requests each) runs on one app, then on the other; the pair is the two
  wall times and token counts (``unit`` -1).

A latency includes everything a client waits for (HTTP, the proxy, the ingress, the
prefill), as plain decoding's does, so the ratio is the speedup a client sees.
"""

from __future__ import annotations

from serve_apps.loadtest import PROMPTS, Send, load_jobs, one_request, send_load, summarize
from speclab.paired_timing import Pair


def _tokens(response: dict) -> int:
    """Tokens of a successful response (0 for a failed one: its pair has no ratio)."""
    return len(response["token_ids"]) if response["status"] == 200 else 0


def paired_load(ar_url: str, url: str, clients: int, per_client: int, max_tokens: int,
                passes: int, prompts: list[str] = PROMPTS, send: Send = one_request
                ) -> tuple[list[Pair], dict[str, list[dict]], dict[str, dict]]:
    """Time the app at ``url`` against plain decoding's app at ``ar_url`` in ``passes``
    paired passes (see the module docstring).

    Each client sends ``per_client`` requests, prompts cycling through ``prompts`` as in
    :func:`serve_apps.loadtest.run_load`. Returns the pairs (one per request at one
    client, one per pass otherwise; read them with
    :func:`speclab.paired_timing.speedup_figures`), every response per side
    (``{"ar": [...], "method": [...]}``) and each side's summary row over all passes
    (:func:`serve_apps.loadtest.summarize`, its wall the sum of the side's walls)."""
    if passes < 1 or clients < 1 or per_client < 1:
        raise ValueError("passes, clients and per_client must be >= 1")
    jobs = load_jobs(clients, per_client, prompts)
    responses: dict[str, list[dict]] = {"ar": [], "method": []}
    walls = {"ar": 0.0, "method": 0.0}
    urls = {"ar": ar_url, "method": url}
    pairs: list[Pair] = []
    for k in range(passes):
        order = ("ar", "method") if k % 2 == 0 else ("method", "ar")
        if clients == 1:
            for i, prompt in enumerate(jobs):
                got = {}
                for side in order:
                    got[side] = send(urls[side], prompt, max_tokens)
                    responses[side].append(got[side])
                    walls[side] += got[side]["latency_s"]
                pairs.append(Pair(unit=i, pass_index=k, ar_s=got["ar"]["latency_s"],
                                  ar_tokens=_tokens(got["ar"]), s=got["method"]["latency_s"],
                                  tokens=_tokens(got["method"])))
            continue
        got_s, got_n = {}, {}
        for side in order:
            results, wall = send_load(urls[side], jobs, clients, max_tokens, send)
            responses[side] += results
            walls[side] += wall
            got_s[side], got_n[side] = wall, sum(_tokens(r) for r in results)
        pairs.append(Pair(unit=-1, pass_index=k, ar_s=got_s["ar"], ar_tokens=got_n["ar"],
                          s=got_s["method"], tokens=got_n["method"]))
    summaries = {side: summarize(responses[side], clients, walls[side]) for side in urls}
    return pairs, responses, summaries
