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
  wall times and token counts (``unit`` -1);
* an open-loop load (:func:`paired_open_load`): each pass is a pair. The same Poisson
  arrival schedule runs on one app, then on the other; the pair is the two sums of the
  requests' latencies and token counts (``unit`` -1).

A latency includes everything a client waits for (HTTP, the proxy, the ingress, the
prefill), as plain decoding's does, so the ratio is the speedup a client sees.
"""

from __future__ import annotations

from collections.abc import Callable

from serve_apps.loadtest import (
    PROMPTS,
    Send,
    load_jobs,
    one_request,
    poisson_arrivals,
    send_load,
    send_open,
    summarize,
)
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
    if clients > 1:
        def whole_pass(side_url: str, _k: int) -> tuple[list[dict], float, float]:
            results, wall = send_load(side_url, jobs, clients, max_tokens, send)
            return results, wall, wall

        return _pass_pairs(ar_url, url, passes, whole_pass, clients, None)
    responses: dict[str, list[dict]] = {"ar": [], "method": []}
    walls = {"ar": 0.0, "method": 0.0}
    urls = {"ar": ar_url, "method": url}
    pairs: list[Pair] = []
    for k in range(passes):
        for i, prompt in enumerate(jobs):
            got = {}
            for side in _order(k):
                got[side] = send(urls[side], prompt, max_tokens)
                responses[side].append(got[side])
                walls[side] += got[side]["latency_s"]
            pairs.append(Pair(unit=i, pass_index=k, ar_s=got["ar"]["latency_s"],
                              ar_tokens=_tokens(got["ar"]), s=got["method"]["latency_s"],
                              tokens=_tokens(got["method"])))
    summaries = {side: summarize(responses[side], clients, walls[side]) for side in urls}
    return pairs, responses, summaries


def paired_open_load(ar_url: str, url: str, rate: float, n: int, max_tokens: int,
                     passes: int, prompts: list[str] = PROMPTS, send: Send = one_request,
                     seed: int = 0
                     ) -> tuple[list[Pair], dict[str, list[dict]], dict[str, dict]]:
    """Open loop: time the app at ``url`` against plain decoding's app at ``ar_url`` under
    ``n`` requests a pass arriving at ``rate`` per second
    (:func:`serve_apps.loadtest.send_open`; pass ``k``'s schedule is
    :func:`serve_apps.loadtest.poisson_arrivals` with ``seed + k``, the same for both
    sides). Each pass is a pair (``unit`` -1): the whole schedule on one app, then on the
    other, the order alternating by pass; a side's time is the SUM of its requests'
    latencies, so a pair's ratio is how much less time a request waits per token at that
    load (its tokens/s over the wall would only repeat the offered rate). Returns what
    :func:`paired_load` returns; the summaries carry ``rate`` (``clients`` 0)."""
    if passes < 1 or n < 1:
        raise ValueError("passes and requests must be >= 1")
    jobs = load_jobs(1, n, prompts)
    schedules = [poisson_arrivals(n, rate, seed + k) for k in range(passes)]

    def open_pass(side_url: str, k: int) -> tuple[list[dict], float, float]:
        results, wall = send_open(side_url, jobs, schedules[k], max_tokens, send)
        return results, sum(r["latency_s"] for r in results), wall

    return _pass_pairs(ar_url, url, passes, open_pass, 0, rate)


def _order(k: int) -> tuple[str, str]:
    """Which side goes first in pass ``k``: AR in even passes, the method in odd ones."""
    return ("ar", "method") if k % 2 == 0 else ("method", "ar")


def _pass_pairs(ar_url: str, url: str, passes: int,
                one_pass: Callable[[str, int], tuple[list[dict], float, float]],
                clients: int, rate: float | None
                ) -> tuple[list[Pair], dict[str, list[dict]], dict[str, dict]]:
    """A pair per pass: ``one_pass(side's url, k)`` gives the side's responses, its time
    for the pair and its wall seconds."""
    responses: dict[str, list[dict]] = {"ar": [], "method": []}
    walls = {"ar": 0.0, "method": 0.0}
    urls = {"ar": ar_url, "method": url}
    pairs: list[Pair] = []
    for k in range(passes):
        got_s, got_n = {}, {}
        for side in _order(k):
            results, got_s[side], wall = one_pass(urls[side], k)
            responses[side] += results
            walls[side] += wall
            got_n[side] = sum(_tokens(r) for r in results)
        pairs.append(Pair(unit=-1, pass_index=k, ar_s=got_s["ar"], ar_tokens=got_n["ar"],
                          s=got_s["method"], tokens=got_n["method"]))
    summaries = {side: summarize(responses[side], clients, walls[side], rate)
                 for side in urls}
    return pairs, responses, summaries
