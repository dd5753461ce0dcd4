"""``serve_apps.paired.paired_load``: plain decoding's app and a method's app timed side
by side, the order alternating by pass, pairs read as the in-process protocol reads
them (a fake ``send`` stands for the HTTP calls; the real bench: docs/serve.md)."""

from __future__ import annotations

import threading
import time

import pytest

from serve_apps.loadtest import poisson_arrivals, send_open
from serve_apps.paired import paired_load, paired_open_load
from speclab.paired_timing import normalize_ar, speedup_figures

AR, CHAIN = "http://127.0.0.1:1", "http://127.0.0.1:2"


class FakeApps:
    """Answers like ``one_request``: AR takes 10 ms a token, times ``slow`` (a
    machine-wide slowdown), the method ``1 / speedup`` of AR's time; the method's request
    for prompt ``fail`` is refused (400)."""

    def __init__(self, speedup: float = 1.5, tokens: int = 10, fail: str | None = None,
                 sleep: bool = False):
        self.speedup, self.tokens, self.fail, self.sleep = speedup, tokens, fail, sleep
        self.calls: list[tuple[str, str]] = []
        self.slow = 1.0

    def __call__(self, url: str, prompt: str, max_tokens: int) -> dict:
        assert max_tokens == self.tokens
        self.calls.append((url, prompt))
        if prompt == self.fail and url == CHAIN:
            return {"status": 400, "latency_s": 0.01, "prompt": prompt}
        latency = 0.01 * self.tokens * self.slow / (1.0 if url == AR else self.speedup)
        if self.sleep:  # several clients: a pass is timed by its wall clock
            time.sleep(latency)
        return {"status": 200, "latency_s": latency, "prompt": prompt,
                "token_ids": list(range(self.tokens)),
                "stats": {"target_calls": self.tokens if url == AR else 4,
                          "tau": 1.0 if url == AR else 2.5}}


def test_one_client_pairs_each_request_and_alternates_who_goes_first():
    apps = FakeApps()
    pairs, got, sums = paired_load(AR, CHAIN, 1, 3, 10, passes=2, prompts=["a", "b", "c"],
                                   send=apps)
    # pass 0: AR then the method per request; pass 1: the method first
    assert apps.calls == [(AR, "a"), (CHAIN, "a"), (AR, "b"), (CHAIN, "b"), (AR, "c"),
                          (CHAIN, "c"), (CHAIN, "a"), (AR, "a"), (CHAIN, "b"), (AR, "b"),
                          (CHAIN, "c"), (AR, "c")]
    assert [(p.unit, p.pass_index) for p in pairs] == [(0, 0), (1, 0), (2, 0), (0, 1),
                                                         (1, 1), (2, 1)]
    assert all(p.ratio == pytest.approx(1.5) for p in pairs)
    assert len(got["ar"]) == len(got["method"]) == 6
    assert sums["method"]["tokens"] == 60 and sums["method"]["errors"] == 0
    # one client: tokens/s over the sum of its latencies
    assert sums["ar"]["tokens_per_s"] == pytest.approx(100.0)
    assert sums["method"]["tokens_per_s"] == pytest.approx(150.0)
    assert sums["method"]["target_calls_per_token"] == pytest.approx(0.4)


def test_a_slow_pass_moves_both_sides_and_the_interval_holds_the_speedup():
    apps = FakeApps(speedup=1.3)
    slow_at = {2: 3.0, 4: 0.5}  # the machine slows down (or speeds up) for whole passes

    def send(url, prompt, max_tokens):  # one request a pass here: two calls a pass
        apps.slow = slow_at.get(len(apps.calls) // 2, 1.0)
        return apps(url, prompt, max_tokens)

    pairs, _, _ = paired_load(AR, CHAIN, 1, 1, 10, passes=8, prompts=["p"], send=send)
    fig = speedup_figures(normalize_ar(pairs))
    assert fig["speedup"] == pytest.approx(1.3)
    assert fig["speedup_lo"] == pytest.approx(1.3) and fig["speedup_hi"] == pytest.approx(1.3)
    assert fig["speedup_pairs"] == 8 and fig["speedup_coverage"] >= 0.95


def test_several_clients_pair_whole_passes():
    apps = FakeApps(speedup=2.0, tokens=3, sleep=True)  # walls of a few ms
    pairs, got, sums = paired_load(AR, CHAIN, 4, 2, 3, passes=3, prompts=["a", "b"],
                                   send=apps)
    assert [(p.unit, p.pass_index) for p in pairs] == [(-1, 0), (-1, 1), (-1, 2)]
    assert all(p.tokens == p.ar_tokens == 24 for p in pairs)
    # the method's requests of pass 1 all come before its AR ones
    urls = [u for u, _ in apps.calls]
    assert urls[:8] == [AR] * 8 and urls[8:16] == [CHAIN] * 8
    assert urls[16:24] == [CHAIN] * 8 and urls[24:32] == [AR] * 8
    assert len(got["method"]) == 24 and sums["method"]["clients"] == 4
    # each pass's pair holds its two walls (timed by the clock: only their sign is sure)
    assert all(p.s > 0 and p.ar_s > 0 for p in pairs)
    assert sums["ar"]["wall_s"] == pytest.approx(sum(p.ar_s for p in pairs))
    assert sums["method"]["wall_s"] == pytest.approx(sum(p.s for p in pairs))


def test_a_failed_request_leaves_its_pair_without_a_ratio():
    apps = FakeApps(fail="b")
    pairs, _, sums = paired_load(AR, CHAIN, 1, 2, 10, passes=1, prompts=["a", "b"],
                                 send=apps)
    assert pairs[1].tokens == 0 and pairs[0].tokens == 10
    fig = speedup_figures(normalize_ar(pairs))
    assert fig["speedup_pairs"] == 1
    assert sums["method"]["errors"] == 1


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_counts_below_one_are_refused(args):
    clients, per_client, passes = args
    with pytest.raises(ValueError, match="passes, clients and per_client"):
        paired_load(AR, CHAIN, clients, per_client, 10, passes, send=FakeApps())


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    a = poisson_arrivals(4000, 8.0, seed=3)
    assert a == poisson_arrivals(4000, 8.0, seed=3)
    assert a != poisson_arrivals(4000, 8.0, seed=4)
    assert all(x < y for x, y in zip(a, a[1:], strict=False)) and a[0] > 0
    assert a[-1] / len(a) == pytest.approx(1 / 8.0, rel=0.1)  # the mean gap
    for n, rate in ((0, 1.0), (3, 0.0), (3, -2.0), (3, float("nan"))):
        with pytest.raises(ValueError, match="requests >= 1 and rate > 0"):
            poisson_arrivals(n, rate)


def test_an_open_loop_sends_each_request_at_its_arrival_whatever_is_in_flight():
    lock, live, peak, sent = threading.Lock(), [0], [0], {}
    t0 = time.perf_counter()

    def send(url, prompt, max_tokens):
        with lock:
            sent[prompt] = time.perf_counter() - t0
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.2)  # every request still in flight when the last one arrives
        with lock:
            live[0] -= 1
        return {"status": 200, "latency_s": 0.2, "prompt": prompt}

    arrivals = [0.0, 0.01, 0.02, 0.08]
    results, wall = send_open(AR, ["a", "b", "c", "d"], arrivals, 5, send)
    assert [r["prompt"] for r in results] == ["a", "b", "c", "d"]
    assert all(sent[p] >= t for p, t in zip("abcd", arrivals, strict=True))
    assert peak[0] == 4  # a closed loop of fewer clients would have waited
    assert wall >= 0.28
    with pytest.raises(ValueError, match="2 jobs but 1 arrival"):
        send_open(AR, ["a", "b"], [0.0], 5, send)


def test_an_open_loop_pairs_whole_passes_by_their_summed_latencies():
    apps = FakeApps(speedup=1.6, tokens=4)
    starts = []

    def send(url, prompt, max_tokens):
        starts.append((url, prompt))
        return apps(url, prompt, max_tokens)

    pairs, got, sums = paired_open_load(AR, CHAIN, 400.0, 6, 4, passes=3,
                                        prompts=["a", "b", "c"], send=send)
    assert [(p.unit, p.pass_index) for p in pairs] == [(-1, 0), (-1, 1), (-1, 2)]
    # a side's time is the sum of its latencies: the ratio is the per-token latency's
    assert all(p.ar_s == pytest.approx(6 * 0.04) for p in pairs)
    assert all(p.ratio == pytest.approx(1.6) for p in pairs)
    assert all(p.tokens == p.ar_tokens == 24 for p in pairs)
    urls = [u for u, _ in starts]  # pass 1 runs the method first
    assert urls[:6] == [AR] * 6 and urls[6:12] == [CHAIN] * 6 and urls[12:18] == [CHAIN] * 6
    assert sorted(p for _, p in starts[:6]) == ["a", "a", "b", "b", "c", "c"]
    assert sums["method"]["rate"] == 400.0 and sums["method"]["clients"] == 0
    assert sums["method"]["requests"] == 18 and len(got["ar"]) == 18
    assert sums["ar"]["mean_s"] == pytest.approx(0.04)
    with pytest.raises(ValueError, match="passes and requests"):
        paired_open_load(AR, CHAIN, 1.0, 0, 4, passes=1, send=send)


@pytest.mark.parametrize("argv,msg", [
    (["--rates", "0,abc"], "--rates: '0' is not a positive number"),
    (["--clients", "4,x"], "--clients: 'x' is not a positive number"),
    (["--rates", "2", "--rate-requests", "0"], "rate-requests"),
])
def test_the_serve_bench_refuses_bad_loads_by_name(argv, msg, capsys):
    from serve_apps.bench import main

    assert main(argv) == 2
    assert msg in capsys.readouterr().err
