"""Soak run of the Serve app: mixed traffic for a set time, then a check that every
replica is back at its baseline.

    .venv/bin/python -m serve_apps.soak --config experiments/smoke/serve.yaml \\
        --duration 600 --clients 6 [--out bench_out/soak.json] [key=value ...]
    .venv/bin/python -m serve_apps.soak --url http://127.0.0.1:8000 --duration 60

Without ``--url`` it starts ``speclab serve --config ... [key=value ...]`` in its own
process group on a free port and stops that group at the end. Each client thread loops
over a weighted mix until the time is up:

- ``greedy``: ``/v1/completions`` at temperature 0;
- ``sample``: ``/generate`` at temperature 0.8 with a seed;
- ``stream``: a streamed completion read to ``[DONE]``;
- ``disconnect``: a streamed completion the client drops after its first chunk;
- ``stop``: a completion with stop strings;
- ``chat``: ``/v1/chat/completions``;
- ``bad``: a malformed or invalid body, which must get a 4xx in OpenAI's error shape.

It reports requests by kind, errors by kind (``status`` or exception type), latency
percentiles, and from ``/health`` the resident memory (MB) and live request states
(sessions, cached tokens) of every target and draft replica at the start (after a
warm-up) and at the end (after the in-flight requests settle). Exit status 1 if any
request failed unexpectedly (a 5xx, a timeout, a 4xx for a valid request, a bad request
not answered 4xx) or if a replica still holds request state at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import requests

from serve_apps.bench import start_server, stop_server

PROMPTS = ["def main(", "import os\n", "class Foo:", "for i in range(", "return self.",
           "if x is None:", "with open(", "print("]
MIX = {"greedy": 3, "sample": 2, "stream": 2, "disconnect": 1, "stop": 1, "chat": 1, "bad": 2}
BAD_BODIES = [
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "n": 2}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
    ("/generate", {"prompt_ids": [-1]}),
    ("/generate", {"prompt": "x", "prompt_ids": [1]}),
    ("/generate", "{not json"),
    ("/generate", [1, 2, 3]),
]


def replica_states(url: str, timeout: float = 60) -> list[dict]:
    """Every target and draft replica's ``/health`` entry (pid, rss_mb, sessions, ...),
    each tagged with its ``side``."""
    h = requests.get(url + "/health", timeout=timeout).json()
    return [{**st, "side": side} for side in ("target", "draft") for st in h[side]]


def one(url: str, kind: str, rng: random.Random, max_tokens: int) -> tuple[bool, str]:
    """Send one request of ``kind``; (ok, what) where ``what`` is "ok" or the failure."""
    prompt = rng.choice(PROMPTS)
    comp = {"prompt": prompt, "max_tokens": max_tokens}
    if kind == "greedy":
        r = requests.post(url + "/v1/completions", json={**comp, "temperature": 0}, timeout=120)
    elif kind == "sample":
        r = requests.post(url + "/generate", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
            "seed": rng.randrange(2**31)})
    elif kind == "stop":
        r = requests.post(url + "/v1/completions", timeout=120,
                          json={**comp, "temperature": 0, "stop": ["\n", "):", "e"]})
    elif kind == "chat":
        r = requests.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0})
    elif kind in ("stream", "disconnect"):
        with requests.post(url + "/v1/completions", json={**comp, "stream": True},
                           stream=True, timeout=120) as r:
            if r.status_code != 200:
                return False, f"{kind}: status {r.status_code}"
            lines = r.iter_lines()
            if kind == "disconnect":
                next(lines, None)  # one chunk, then the client goes away
                return True, "ok"
            body = b"\n".join(lines)
            if not body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body:
                return False, f"{kind}: stream did not end with [DONE]"
            return True, "ok"
    else:  # bad
        route, body = rng.choice(BAD_BODIES)
        if isinstance(body, str):
            r = requests.post(url + route, data=body, timeout=60,
                              headers={"content-type": "application/json"})
        else:
            r = requests.post(url + route, json=body, timeout=60)
        body = r.json() if r.headers.get("content-type", "").startswith(
            "application/json") else None
        err = body.get("error") if isinstance(body, dict) else None
        if 400 <= r.status_code < 500 and isinstance(err, dict) and err.get("message"):
            return True, "ok"
        return False, f"bad: status {r.status_code}"
    if r.status_code != 200:
        return False, f"{kind}: status {r.status_code}"
    return True, "ok"


def soak(url: str, duration_s: float, clients: int = 4, max_tokens: int = 16,
         seed: int = 0, settle_s: float = 60) -> dict:
    """Run the mix against ``url`` for ``duration_s`` with ``clients`` threads; the report
    (requests and errors by kind, latencies, replica states before and after)."""
    for p in PROMPTS[:2]:  # warm-up: the first request of a replica pays its setup
        requests.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 2,
                                                     "temperature": 0}, timeout=300)
    before = replica_states(url)
    kinds, weights = zip(*MIX.items())
    sent, errors = Counter(), Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    lock = threading.Lock()
    stop_at = time.time() + duration_s

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.time() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            t0 = time.perf_counter()
            try:
                ok, what = one(url, kind, rng, max_tokens)
            except Exception as exc:  # noqa: BLE001  (any failure is counted, never lost)
                ok, what = False, f"{kind}: {type(exc).__name__}"
            with lock:
                sent[kind] += 1
                latency[kind].append(time.perf_counter() - t0)
                if not ok:
                    errors[what] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    deadline = time.time() + settle_s  # dropped streams end on the replicas shortly after
    while True:
        after = replica_states(url)
        if all(st["sessions"] == 0 for st in after) or time.time() > deadline:
            break
        time.sleep(1)
    return {"url": url, "duration_s": round(wall, 1), "clients": clients,
            "requests": sum(sent.values()), "by_kind": dict(sent), "errors": dict(errors),
            "latency_s": {k: {"p50": round(statistics.median(v), 3),
                              "max": round(max(v), 3)} for k, v in latency.items()},
            "replicas_before": before, "replicas_after": after}


def verdict(report: dict, max_rss_growth_mb: float = 200.0) -> list[str]:
    """What went wrong (empty when the soak passed): failed requests, replicas that
    still hold request state, replicas whose resident memory grew by more than
    ``max_rss_growth_mb``, and replicas that were replaced during the run."""
    problems = [f"{n} x {what}" for what, n in report["errors"].items()]
    start = {(s["side"], s["pid"]): s for s in report["replicas_before"]}
    for st in report["replicas_after"]:
        if st["sessions"] or st["cached_tokens"]:
            problems.append(f"{st['side']} replica {st['pid']} still holds {st['sessions']} "
                            f"request(s), {st['cached_tokens']} cached tokens")
        s0 = start.get((st["side"], st["pid"]))
        if s0 is None:
            problems.append(f"{st['side']} replica {st['pid']} is new (one was replaced)")
        elif st["rss_mb"] - s0["rss_mb"] > max_rss_growth_mb:
            problems.append(f"{st['side']} replica {st['pid']} grew from {s0['rss_mb']:.0f} "
                            f"to {st['rss_mb']:.0f} MB")
    return problems


def print_report(report: dict) -> None:
    """The tables: requests and errors by kind, then replica memory and state."""
    print(f"\nsoak: {report['requests']} requests from {report['clients']} clients in "
          f"{report['duration_s']} s")
    print(f"{'kind':12s} {'sent':>6s} {'p50 s':>7s} {'max s':>7s}")
    for kind, n in sorted(report["by_kind"].items()):
        lat = report["latency_s"][kind]
        print(f"{kind:12s} {n:6d} {lat['p50']:7.3f} {lat['max']:7.3f}")
    print("errors:", report["errors"] or "none")
    start = {(s["side"], s["pid"]): s for s in report["replicas_before"]}
    print(f"{'replica':16s} {'rss MB start':>12s} {'end':>8s} {'sessions start':>15s} "
          f"{'end':>5s} {'cached end':>11s}")
    for st in report["replicas_after"]:
        s0 = start.get((st["side"], st["pid"]), {})
        print(f"{st['side'] + ' ' + str(st['pid']):16s} {s0.get('rss_mb', float('nan')):12.1f} "
              f"{st['rss_mb']:8.1f} {s0.get('sessions', '-')!s:>15s} {st['sessions']:5d} "
              f"{st['cached_tokens']:11d}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running app (default: start one from --config)")
    where.add_argument("--config", help="serve config to start (speclab serve)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-mb", type=float, default=200.0,
                   help="a replica growing more than this fails the soak")
    p.add_argument("--out", default="bench_out/soak.json")
    p.add_argument("overrides", nargs="*", help="key=value for the started app")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.clients < 1 or args.max_tokens < 1:
        p.error("--duration, --clients and --max-tokens must be positive")
    proc = None
    if args.config:
        out_dir = Path(args.out).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        proc, url = start_server(args.config, args.overrides, out_dir / "soak_server.log")
    else:
        url = args.url.rstrip("/")
    try:
        report = soak(url, args.duration, args.clients, args.max_tokens, args.seed)
    finally:
        if proc is not None:
            stop_server(proc)
    report["problems"] = verdict(report, args.max_rss_growth_mb)
    print_report(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    if report["problems"]:
        print("FAILED:", *report["problems"], sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
