"""Fairness benchmark of a running speclab Serve app: a short request's latency alone and
while long prompts keep arriving (a command, not a test):

    .venv/bin/python -m serve_apps.fairness --url http://127.0.0.1:8000 \\
        --long-clients 3 --long-tokens 400 [--short 30] [--out bench_out/fairness.json]

First ``--short`` short requests (``POST /generate``, an 8-token prompt, ``--max-tokens``
tokens) one after another on the idle app: their median latency. Then
``--long-clients`` threads each send ``--long-tokens``-token prompts (``prompt_ids``,
``--long-max-tokens`` each) back to back while the same short requests run again: their
median latency under that load. Prints both, their ratio (with the spread: the 25th and
75th percentiles) and writes JSON. A replica that prefills a long prompt in one forward
holds every request of its batch meanwhile; the ratio measures that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

SHORT_PROMPT_IDS = [5, 17, 29, 41, 53, 65, 77, 89]


def _short(url: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json={"prompt_ids": SHORT_PROMPT_IDS,
                                               "max_tokens": max_tokens, "temperature": 0},
                      timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def _quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"p25_s": q[0], "p50_s": statistics.median(xs), "p75_s": q[2]}


def measure(url: str, long_clients: int, long_tokens: int, short: int, max_tokens: int,
            long_max_tokens: int) -> dict:
    """The idle and loaded figures (see the module docstring)."""
    _short(url, max_tokens)  # warm-up
    idle = [_short(url, max_tokens) for _ in range(short)]
    stop, longs, errors = threading.Event(), [], []
    ids = [3 + (7 * i) % 250 for i in range(long_tokens)]

    def long_client() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = requests.post(url + "/generate", json={"prompt_ids": ids, "temperature": 0,
                                                       "max_tokens": long_max_tokens},
                              timeout=600)
            (longs if r.status_code == 200 else errors).append(time.perf_counter() - t0)

    threads = [threading.Thread(target=long_client, daemon=True) for _ in range(long_clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the long prompts are arriving
    loaded = [_short(url, max_tokens) for _ in range(short)]
    stop.set()
    for t in threads:
        t.join(timeout=600)
    out = {"idle": _quartiles(idle), "loaded": _quartiles(loaded),
           "long_requests": len(longs), "long_errors": len(errors),
           "long_p50_s": statistics.median(longs) if longs else None,
           "long_clients": long_clients, "long_tokens": long_tokens, "short": short,
           "max_tokens": max_tokens}
    out["ratio"] = out["loaded"]["p50_s"] / out["idle"]["p50_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--long-clients", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=400)
    p.add_argument("--long-max-tokens", type=int, default=8)
    p.add_argument("--short", type=int, default=30, help="short requests per phase")
    p.add_argument("--max-tokens", type=int, default=16, help="of each short request")
    p.add_argument("--out", default="bench_out/fairness.json")
    a = p.parse_args(argv)
    if min(a.long_clients, a.long_tokens, a.short, a.max_tokens, a.long_max_tokens) < 1:
        print("error: every count must be >= 1", file=sys.stderr)
        return 2
    res = measure(a.url, a.long_clients, a.long_tokens, a.short, a.max_tokens,
                  a.long_max_tokens)
    for phase in ("idle", "loaded"):
        q = res[phase]
        print(f"{phase:>6}: short request p50 {q['p50_s']:.3f} s "
              f"[p25 {q['p25_s']:.3f}, p75 {q['p75_s']:.3f}]")
    print(f"loaded / idle: {res['ratio']:.2f}x ({res['long_requests']} long requests of "
          f"{res['long_tokens']} tokens, {res['long_errors']} errors)")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
