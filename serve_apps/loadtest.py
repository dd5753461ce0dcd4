"""Load benchmark of a running speclab Serve app: concurrent clients over HTTP.

    .venv/bin/python -m serve_apps.loadtest --url http://127.0.0.1:8000 --clients 16 \\
        --requests 3 --max-tokens 32 [--rate R] [--out bench_out/serve_load.json]

Closed loop (the default): each of ``--clients`` client threads sends ``--requests``
``POST /generate`` calls one after another, so at most ``--clients`` requests are in
flight. Open loop (``--rate R``): ``--requests`` requests in all arrive as a Poisson
process of ``R`` requests per second (seeded: the same schedule on every run), each
sent at its arrival whatever is still in flight, as users' requests arrive at a service.
Prompts cycle through a fixed list of code openings. Prints a table (requests, errors,
mean / p50 / p95 / max latency, tokens/s over the wall time, mean tau and target calls
per token from the servers' SD stats) and writes it as JSON; ``/health`` before and after
shows each replica's live request states and resident memory (and its peak GPU memory,
``peak_gpu_mb``, where a replica on CUDA reports one).
"""

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

PROMPTS = ["def main(", "import os\n", "class Foo:", "for i in range(", "return self.",
           "if x is None:", "with open(", "print("]


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    """``POST /generate``; the JSON body plus ``status``, ``latency_s`` and ``prompt``."""
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json={"prompt": prompt, "max_tokens": max_tokens},
                      timeout=600)
    try:
        body = r.json()
    except ValueError:
        body = {"error": {"message": r.text[:200]}}
    return {**body, "status": r.status_code, "latency_s": time.perf_counter() - t0,
            "prompt": prompt}


#: ``(url, prompt, max_tokens) -> response`` (:func:`one_request`)
Send = Callable[[str, str, int], dict]


def load_jobs(clients: int, per_client: int, prompts: list[str] = PROMPTS) -> list[str]:
    """The prompts of a load: client ``c``'s ``i``-th request sends prompt ``c + i``
    (cycling through ``prompts``)."""
    return [prompts[(c + i) % len(prompts)] for c in range(clients) for i in range(per_client)]


def send_load(url: str, jobs: list[str], clients: int, max_tokens: int,
              send: Send = one_request) -> tuple[list[dict], float]:
    """``jobs`` (prompts) sent by ``clients`` threads to ``url``: every response, and the
    wall seconds they took."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: send(url, p, max_tokens), jobs))
    return results, time.perf_counter() - t0


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start, increasing) of ``n`` requests of a Poisson
    process of ``rate`` requests per second: exponential gaps from a ``seed``-ed
    generator, so the same ``seed`` gives the same schedule."""
    if n < 1 or not rate > 0:
        raise ValueError(f"an open-loop load needs requests >= 1 and rate > 0, got "
                         f"{n} and {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def send_open(url: str, jobs: list[str], arrivals: list[float], max_tokens: int,
              send: Send = one_request) -> tuple[list[dict], float]:
    """Open loop: ``jobs[i]`` (a prompt) sent to ``url`` at ``arrivals[i]`` seconds after
    the start, whatever is still in flight (a thread per request). Every response, and
    the wall seconds until the last one came back."""
    if len(jobs) != len(arrivals):
        raise ValueError(f"{len(jobs)} jobs but {len(arrivals)} arrival times")
    t0 = time.perf_counter()

    def at(i: int) -> dict:
        time.sleep(max(t0 + arrivals[i] - time.perf_counter(), 0.0))
        return send(url, jobs[i], max_tokens)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(at, range(len(jobs))))
    return results, time.perf_counter() - t0


def run_load(url: str, clients: int, per_client: int, max_tokens: int,
             prompts: list[str] = PROMPTS) -> tuple[list[dict], dict]:
    """Every response, and the summary row (latencies in seconds)."""
    results, wall = send_load(url, load_jobs(clients, per_client, prompts), clients,
                              max_tokens)
    return results, summarize(results, clients, wall)


def run_open_load(url: str, rate: float, n: int, max_tokens: int, seed: int = 0,
                  prompts: list[str] = PROMPTS) -> tuple[list[dict], dict]:
    """``n`` requests arriving at ``rate`` per second (:func:`poisson_arrivals` with
    ``seed``; request ``i`` sends prompt ``i``, cycling): every response, and the
    summary row (``clients`` 0, ``rate`` set)."""
    results, wall = send_open(url, load_jobs(1, n, prompts), poisson_arrivals(n, rate, seed),
                              max_tokens)
    return results, summarize(results, 0, wall, rate)


def summarize(results: list[dict], clients: int, wall: float,
              rate: float | None = None) -> dict:
    """The summary row of ``results`` (responses of :func:`one_request`) sent by
    ``clients`` clients (0 for an open-loop load of ``rate`` requests per second) in
    ``wall`` seconds: requests, errors, mean / p50 / p95 / max latency (seconds), tokens
    and tokens/s over ``wall``, mean tau, target calls per token, and ``round_budgets``:
    rounds per draft budget in levels (0: plain), from each response's per-round
    statistics (``round_reach``: an ``auto`` budget's choices)."""
    ok = [r for r in results if r["status"] == 200]
    lat = sorted(r["latency_s"] for r in ok) or [0.0]
    tokens = sum(len(r["token_ids"]) for r in ok)
    calls = sum(r["stats"]["target_calls"] for r in ok)
    summary = {
        "clients": clients, "rate": rate, "requests": len(results),
        "errors": len(results) - len(ok), "mean_s": statistics.mean(lat),
        "p50_s": statistics.median(lat), "p95_s": lat[int(0.95 * (len(lat) - 1))],
        "max_s": lat[-1], "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
        "tau": statistics.mean(r["stats"]["tau"] for r in ok) if ok else 0.0,
        "target_calls_per_token": calls / tokens if tokens else 0.0,
        "round_budgets": {str(k): v for k, v in sorted(Counter(
            b for r in ok for b in r["stats"].get("round_reach", [])).items())}}
    return summary


def load_label(summary: dict) -> str:
    """How a summary row's load was offered: ``"16 cl"`` (closed loop, 16 clients) or
    ``"2.5/s"`` (open loop, 2.5 requests per second)."""
    rate = summary.get("rate")
    return f"{summary['clients']} cl" if rate is None else f"{rate:g}/s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=3,
                   help="requests per client (closed loop) or in all (--rate)")
    p.add_argument("--rate", type=float,
                   help="open loop: requests arrive as a Poisson process of RATE per second")
    p.add_argument("--seed", type=int, default=0, help="the open loop's arrival schedule")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default="bench_out/serve_load.json")
    a = p.parse_args(argv)
    if a.clients < 1 or a.requests < 1 or a.max_tokens < 1:
        print("error: clients, requests and max-tokens must be >= 1", file=sys.stderr)
        return 2
    if a.rate is not None and not a.rate > 0:
        print(f"error: rate must be > 0, got {a.rate}", file=sys.stderr)
        return 2
    before = requests.get(a.url + "/health", timeout=60).json()
    if a.rate is None:
        _, s = run_load(a.url, a.clients, a.requests, a.max_tokens)
    else:
        _, s = run_open_load(a.url, a.rate, a.requests, a.max_tokens, a.seed)
    after = requests.get(a.url + "/health", timeout=60).json()
    print(f"{'load':>9} {'requests':>8} {'errors':>6} {'mean s':>7} {'p50 s':>7} {'p95 s':>7} "
          f"{'max s':>7} {'tok/s':>8} {'tau':>5} {'calls/tok':>9}")
    print(f"{load_label(s):>9} {s['requests']:>8} {s['errors']:>6} {s['mean_s']:>7.2f} "
          f"{s['p50_s']:>7.2f} {s['p95_s']:>7.2f} {s['max_s']:>7.2f} {s['tokens_per_s']:>8.1f} "
          f"{s['tau']:>5.2f} {s['target_calls_per_token']:>9.3f}")
    for side in ("target", "draft"):
        print(f"{side}: live states after {[r['sessions'] for r in after[side]]}, rss MB "
              f"{[round(r['rss_mb']) for r in before[side]]} -> "
              f"{[round(r['rss_mb']) for r in after[side]]}")
        gpu = [r.get("peak_gpu_mb") for r in after[side]]  # None / NaN: not on CUDA
        gpu = [round(g) if isinstance(g, int | float) and not math.isnan(g) else None
               for g in gpu]
        if any(g is not None for g in gpu):
            print(f"{side}: peak GPU MB {gpu}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": s, "method": after["method"],
                               "health_before": before, "health_after": after}, indent=1))
    print(f"written {out}")
    return 0 if s["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
