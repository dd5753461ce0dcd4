"""Serve benchmark: each method through Serve at several loads (client counts, open-loop
request rates), paired with plain decoding through Serve, next to the in-process engine
on the same prompts.

    .venv/bin/python -m serve_apps.bench --config experiments/serve_reference.yaml \\
        [--methods ar,chain,eagle,medusa] [--clients 1,4,16] [--requests 8] [--passes 6] \\
        [--rates 2,8 --rate-requests 64] [--max-tokens 48] [--eagle-model URI] \\
        [--medusa-model URI] [--out bench_out/serve_bench.json] [key=value ...]

First, with no server up, the in-process :class:`speclab.api.Decoder` decodes the load
test's 8 prompts one at a time for each method (greedy; with 8 requests per client, one
client sends exactly these). Then ``speclab serve`` starts each method's app on a free
127.0.0.1 port in its own process group (warmed up with one request) and stops it (its
whole process tree) before the next method's. When ``--methods`` holds ``ar`` and others,
plain decoding's app stays up throughout and each other method is timed PAIRED with it
(:func:`serve_apps.paired.paired_load`: ``--passes`` passes, alternating which side goes
first; one client: a pair per request, more: a pair per pass), so its speedup over plain
decoding through Serve has a 95% interval (:func:`speclab.paired_timing.speedup_figures`;
6 passes or more for a true 95%). ``--rates`` adds open-loop loads (alone, they replace
the default client counts): ``--rate-requests`` requests a pass arriving as a Poisson
process of each rate, the same seeded schedule on both apps of a pair
(:func:`serve_apps.paired.paired_open_load`; the pair compares the requests' summed
latencies, since under an open loop tokens/s follows the offered rate). Both apps being
up, each side's timings include the other app's idle processes. Prints a table (tokens/s,
share of the in-process figure, mean and p50 latency, tau, target calls per token, every
served output equal to the in-process one, the speedup over ar with its interval) and
where a round's time went (ingress, draft model, target call: hop, target model forward
and the target's rules, batch wait), and writes JSON (per method and load also the rounds
per draft budget and what the method's replicas' ``auto`` budgets had learned by then,
from ``/health``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

from serve_apps.loadtest import PROMPTS, load_label, run_load, run_open_load, summarize
from serve_apps.paired import paired_load, paired_open_load
from speclab.api import Decoder
from speclab.bench import EAGLE_RUN
from speclab.config import ServeJob
from speclab.models.registry import resolve_models
from speclab.paired_timing import normalize_ar, speedup_figures
from speclab.paths import repo_root
from speclab.proctree import stop_process_tree
from speclab.timing import now


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_process(cfg, method: dict, prompts: list[str], max_tokens: int) -> dict:
    """The engine in this process, prompts one after another: tokens/s and outputs. Both
    models load as the target deployment's does (``models.dtype``, its device and
    attention), so the figure is comparable with the served one; the clock waits for
    the device."""
    target, draft = resolve_models(cfg.models.target, cfg.models.draft)
    device = cfg.device_of("target")
    dec = Decoder.from_pretrained(target, draft, cfg.models.dtype, device,
                                  attn_implementation=cfg.models.attn_implementation)
    params = {k: v for k, v in method.items() if k != "name"}
    dec.generate(prompts[0], method=method["name"], max_new_tokens=8, **params)  # warm-up
    outs, tokens, t0 = {}, 0, now(device)
    taus = []
    for p in prompts:
        res = dec.generate(p, method=method["name"], max_new_tokens=max_tokens, **params)
        outs[p] = res.token_ids
        tokens += len(res.token_ids)
        taus.append(res.stats.tau)
    wall = now(device) - t0
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "tau": statistics.mean(taus), "outputs": outs}


def bench_method(cfg, name: str, eagle_model: str | None = None,
                 medusa_model: str | None = None) -> dict:
    """The method config of row ``name``: the config's own method when it is that one,
    EAGLE / Medusa with the drafter given on the command line (EAGLE under the tree
    ``speclab bench`` gives its EAGLE rows, :data:`speclab.bench.EAGLE_RUN`: under
    EagleConfig's defaults, whose ranking is untuned, the reference pair's EAGLE row ran
    1.13x plain decoding through Serve where this tree ran 1.26x), else the method's
    defaults."""
    if name == cfg.method.name:
        return cfg.method.model_dump(mode="json")
    for method, field, given in (("eagle", "eagle_model", eagle_model),
                                 ("medusa", "medusa_model", medusa_model)):
        if name == method:
            if given is None:
                raise ValueError(f"--{method}-model: the {method!r} row needs a trained "
                                 f"drafter (a folder or a models:/ URI)")
            return {"name": method, field: given,
                    **(EAGLE_RUN if method == "eagle" else {})}
    return {"name": name}


def start_server(config: str, overrides: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``speclab serve`` in its own process group on a free port; waits until ready."""
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "speclab.cli", "serve", "--config",
                                 config, f"serve.port={port}", *overrides],
                                cwd=repo_root(), env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + log.read_text()[-3000:])
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError("server not ready: " + log.read_text()[-3000:])


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the CLI (it shuts Serve and its Ray down), then whatever is left of what it
    started (its process group and every descendant: Ray puts workers in groups of their
    own; :func:`speclab.proctree.stop_process_tree`)."""
    stop_process_tree(proc, grace=30, leader_grace=90)


def breakdown(results: list[dict]) -> dict:
    """Mean seconds per round: where the time of a request's rounds went. The target
    call (``target_call_s``) is the hop (``hop_s``), the target's forward
    (``target_model_s``, the model alone) and the rest of its verify step
    (``target_rule_s``: rules, masks, pruning; 0 where a replica does not report it);
    ``ahead_s`` is the drafting of the next round done during the call (hidden behind it
    unless it outlasted the target: then it shows in ``hop_s``), with the share of rounds
    drafted ahead and their hit rate."""
    ok = [r for r in results if r["status"] == 200]
    rounds = sum(r["stats"]["timing"]["rounds"] for r in ok) or 1
    t = {k: sum(r["stats"]["timing"].get(k, 0.0) for r in ok) / rounds
         for k in ("queue_s", "draft_model_s", "target_call_s", "target_model_s",
                   "target_rule_s", "ahead_s")}
    # drafting ahead (speclab.decoding.lookahead): rounds that had a tree drafted ahead,
    # and the share of them whose tree was ready when the verdict came
    ahead = sum(r["stats"]["timing"].get("ahead_rounds", 0) for r in ok)
    t["ahead_rounds_share"] = ahead / rounds
    t["ahead_hit_rate"] = (sum(r["stats"]["timing"].get("ahead_hits", 0) for r in ok) / ahead
                           if ahead else None)
    per_req = {"http_and_proxy_s": statistics.mean(
        r["latency_s"] - r["stats"]["timing"]["ingress_s"] for r in ok),
        "ingress_to_replica_s": statistics.mean(
        r["stats"]["timing"]["ingress_s"] - r["stats"]["timing"]["replica_s"] for r in ok),
        "prefill_s": statistics.mean(r["stats"]["prefill_s"] for r in ok)}
    t["hop_s"] = t["target_call_s"] - t["target_model_s"] - t["target_rule_s"]
    t["rows_per_target_forward"] = statistics.mean(
        x for r in ok for x in r["stats"]["timing"]["batch_rows"])
    return {"per_round": t, "per_request": per_req}


def _row_line(name: str, s: dict, base: dict) -> str:
    """One line of the results table (``base``: the method's first load)."""
    cell = "-"
    if "speedup" in s:
        cell = f"{s['speedup']:.2f}x [{s['speedup_lo']:.2f}, {s['speedup_hi']:.2f}]"
    return (f"{name:<8} {load_label(s):>7} {s['tokens_per_s']:>8.1f} "
            f"{s['share_of_in_process']:>8.2f} "
            f"{s['tokens_per_s'] / base['tokens_per_s']:>9.2f} {s['mean_s']:>6.2f} "
            f"{s['p50_s']:>6.2f} "
            f"{s['tau']:>5.2f} {s['target_calls_per_token']:>9.3f} {s['errors']:>6} "
            f"{str(s['identical_to_in_process']):>5} {cell:>20}"
            + (" noisy" if s.get("noisy") else ""))


def _breakdown_line(name: str, s: dict) -> str:
    r, q = s["per_round"], s["per_request"]
    return (f"{name:<8} {load_label(s):>7}: queue {1e3 * r['queue_s']:.2f}, draft "
            f"{1e3 * r['draft_model_s']:.2f}, call {1e3 * r['target_call_s']:.2f} (hop "
            f"{1e3 * r['hop_s']:.2f}), target {1e3 * r['target_model_s']:.2f}, rules "
            f"{1e3 * r['target_rule_s']:.2f}, ahead {1e3 * r['ahead_s']:.2f}, rows "
            f"{r['rows_per_target_forward']:.1f}; drafted ahead "
            f"{r['ahead_rounds_share']:.0%}, hits "
            f"{'-' if r['ahead_hit_rate'] is None else format(r['ahead_hit_rate'], '.0%')}"
            f"; per request: http+proxy {1e3 * q['http_and_proxy_s']:.1f}, "
            f"ingress->replica {1e3 * q['ingress_to_replica_s']:.1f}, prefill "
            f"{1e3 * q['prefill_s']:.1f}")


def _served(results: list[dict], summary: dict, local: dict) -> dict:
    """A side's summary with its round breakdown and its check against the in-process
    outputs."""
    same = all(r["token_ids"] == local["outputs"][r["prompt"]]
               for r in results if r["status"] == 200)
    return {**summary, **breakdown(results), "identical_to_in_process": same,
            "share_of_in_process": summary["tokens_per_s"] / local["tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="experiments/serve_reference.yaml")
    p.add_argument("--methods", default="ar,chain",
                   help="comma-separated; 'chain' takes the config's method params; with "
                        "'ar' and others, each other method is timed paired with 'ar'")
    p.add_argument("--clients", help="closed-loop loads: client counts (default 1,4,16 "
                                     "unless --rates is given)")
    p.add_argument("--rates", help="open-loop loads: request rates per second (Poisson "
                                   "arrivals, seeded per pass; a pair compares the "
                                   "requests' summed latencies)")
    p.add_argument("--requests", type=int, default=8, help="requests per client and pass")
    p.add_argument("--rate-requests", type=int, default=64,
                   help="requests per pass of an open-loop load")
    p.add_argument("--passes", type=int, default=6,
                   help="timed passes per client count (paired with ar: its speedup's "
                        "interval needs >= 6 for 95%%)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default="bench_out/serve_bench.json")
    p.add_argument("--eagle-model", help="the 'eagle' row's drafter (folder or models:/ URI; "
                                         "EAGLE-1/2 or EAGLE-3)")
    p.add_argument("--medusa-model", help="the 'medusa' row's heads (folder or models:/ URI)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    a = p.parse_args(argv)

    try:
        cfg = ServeJob.from_yaml(a.config, a.overrides)
        loads = (_loads("clients", a.clients or ("" if a.rates else "1,4,16"), int)
                 + _loads("rates", a.rates or "", float))
        if min(a.requests, a.rate_requests, a.max_tokens, a.passes) < 1:
            raise ValueError("requests, rate-requests, passes and max-tokens must be >= 1")
        names = list(dict.fromkeys(a.methods.split(",")))
        methods = {name: bench_method(cfg, name, a.eagle_model, a.medusa_model)
                   for name in names}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paired = "ar" in names and len(names) > 1
    local = {}
    for name in names:  # every in-process figure first, with no server up
        local[name] = in_process(cfg, methods[name], PROMPTS, a.max_tokens)
        print(f"[{name}] in process: {local[name]['tokens_per_s']:.1f} tok/s, tau "
              f"{local[name]['tau']:.2f}", flush=True)
    report = {"config": a.config, "max_tokens": a.max_tokens, "passes": a.passes,
              "requests": a.requests, "rate_requests": a.rate_requests,
              "paired_with_ar": paired, "methods": {
                  name: {"in_process": {k: v for k, v in local[name].items()
                                        if k != "outputs"}, "serve": {}}
                  for name in names}}
    rows = []
    ar = _start(a, "ar", methods["ar"], out) if paired else None
    try:
        for name in names:
            if paired and name == "ar":
                continue
            proc, url = _start(a, name, methods[name], out)
            try:
                for kind, n in loads:
                    key = n if kind == "clients" else f"{n:g}/s"
                    if paired:
                        pairs, got, sums = (
                            paired_load(ar[1], url, n, a.requests, a.max_tokens, a.passes)
                            if kind == "clients" else
                            paired_open_load(ar[1], url, n, a.rate_requests,
                                             a.max_tokens, a.passes))
                        s = {**_served(got["method"], sums["method"], local[name]),
                             **speedup_figures(normalize_ar(pairs))}
                        base = _served(got["ar"], sums["ar"], local["ar"])
                        report["methods"]["ar"]["serve"].setdefault(key, {})[name] = base
                        rows.append(("ar", base))
                    else:
                        s = _served(*_unpaired(url, kind, n, a), local[name])
                    # what the method's replicas' auto budgets learned by now (None: fixed)
                    s["replica_budgets"] = [
                        r.get("budget") for r in requests.get(url + "/health",
                                                              timeout=60).json()["draft"]]
                    report["methods"][name]["serve"][key] = s
                    rows.append((name, s))
                    print(f"[{name}] {load_label(s)}: {s['tokens_per_s']:.1f} tok/s, p50 "
                          f"{s['p50_s']:.2f}s, identical {s['identical_to_in_process']}"
                          + (f", {s['speedup']:.2f}x [{s['speedup_lo']:.2f}, "
                             f"{s['speedup_hi']:.2f}] over ar" if paired else "")
                          + (f", rounds per budget {s['round_budgets']}"
                             if s["round_budgets"] else ""), flush=True)
            finally:
                stop_server(proc)
    finally:
        if ar is not None:
            stop_server(ar[0])
    firsts = {}
    for name, s in rows:
        firsts.setdefault(name, s)
    print(f"\n{'method':<8} {'load':>7} {'tok/s':>8} {'/in-proc':>8} {'/1st load':>9} "
          f"{'mean s':>6} {'p50 s':>6} {'tau':>5} {'calls/tok':>9} {'errors':>6} "
          f"{'same':>5} {'over ar [95%]':>20}")
    for name, s in rows:
        print(_row_line(name, s, firsts[name]))
    print("\nper round (ms): queue, draft model, target call (hop + target model + target "
          "rules), target model, target rules, drafting ahead during the call, rows per "
          "target forward; rounds drafted ahead and their hit rate")
    for name, s in rows:
        print(_breakdown_line(name, s))
    if paired:
        print(f"\nover ar: each method's paired speedup through Serve, {a.passes} passes "
              f"(one client: a pair per request; more clients, or an open-loop rate: a "
              f"pair per pass, the rate's pair comparing summed latencies), median "
              f"[95% interval]; ar's rows are the runs paired with the method above them")
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"written {out}")
    return 0


def _loads(flag: str, text: str, kind: type) -> list[tuple[str, float]]:
    """``--clients`` / ``--rates`` as ``[("clients" | "rate", value)]``; ValueError naming
    the flag for an entry that is not a positive number."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = kind(x)
        except ValueError:
            value = 0
        if not value > 0:
            raise ValueError(f"--{flag}: {x!r} is not a positive number")
        out.append(("clients" if flag == "clients" else "rate", value))
    return out


def _unpaired(url: str, kind: str, n: float, a: argparse.Namespace
              ) -> tuple[list[dict], dict]:
    """``a.passes`` passes of one load (``kind`` "clients": ``n`` closed-loop clients;
    "rate": ``n`` requests per second, pass ``k``'s schedule seeded ``k``) on the app at
    ``url``: every response and their summary row over the passes' summed wall."""
    results, walls = [], 0.0
    for k in range(a.passes):
        res, summ = (run_load(url, int(n), a.requests, a.max_tokens) if kind == "clients"
                     else run_open_load(url, n, a.rate_requests, a.max_tokens, k))
        results += res
        walls += summ["wall_s"]
    return results, (summarize(results, int(n), walls) if kind == "clients"
                     else summarize(results, 0, walls, n))


def _start(a: argparse.Namespace, name: str, method: dict, out: Path
           ) -> tuple[subprocess.Popen, str]:
    """The app serving ``method`` (its log ``serve_NAME.log`` beside ``out``), warmed up
    with one request."""
    proc, url = start_server(a.config, [*a.overrides, "method=" + json.dumps(method)],
                             out.parent / f"serve_{name}.log")
    try:
        requests.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 8},
                      timeout=120)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


if __name__ == "__main__":
    sys.exit(main())
