"""Prometheus metrics of the Serve app, through Ray Serve's metrics support
(:mod:`ray.serve.metrics`): Ray exports them on every node's metrics port
(``ray start --metrics-export-port``; ``speclab serve`` sets ``serve.metrics_port``), with
Ray's ``ray_`` prefix, as it does for vLLM under Ray Serve LLM.

The speculative-decoding counters carry vLLM's names as vLLM's own Ray metrics backend
exports them (``vllm:`` sanitised to ``vllm_``: Ray refuses ``:`` in metric names), so
dashboards built for vLLM under Ray Serve work unchanged:
``ray_vllm_spec_decode_num_drafts`` (rounds of drafting requests),
``ray_vllm_spec_decode_num_draft_tokens``, ``ray_vllm_spec_decode_num_accepted_tokens``
and ``ray_vllm_spec_decode_num_accepted_tokens_per_pos`` (label ``position``: rounds whose
accepted path reached draft position ``position``, from 0). Besides them: request
latency (``speclab_request_latency_seconds``; exact sums in ``speclab_requests`` and
``speclab_request_seconds``), tokens, errors by status (every answer with status >= 400,
validation and routing errors included), and per model deployment the rows per batched
step (``speclab_batch_size``; exact: ``speclab_batch_rows`` / ``speclab_batch_steps``)
and the wait for a batch to close (``speclab_batch_wait_seconds``), and per draft
replica its rounds drafted ahead (``speclab_draft_ahead_hits`` / ``_misses`` /
``_saved_seconds``, :mod:`speclab.decoding.lookahead`). Ray rebuilds a
histogram's ``_sum`` from bucket midpoints, so only the counters give exact means.

The ingress also renders its decoding counters itself under a standalone vLLM server's
exact names (``vllm:spec_decode_num_drafts_total``, ...; :class:`VllmTallies`) on the
app's ``GET /metrics``.

The acceptance ratio a vLLM dashboard shows is ``num_accepted_tokens /
num_draft_tokens``: accepted draft tokens over drafted ones (for a tree, every drafted
node counts, so it is lower than the per-path acceptance of a chain of the same tau).
"""

from __future__ import annotations

from ray.serve import metrics

LATENCY_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
WAIT_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05]


#: upper bounds of the auto budget's histogram buckets (levels: 0, 1, 2, ... 16)
BUDGET_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 8.5, 10.5, 16.5]


class ServeMetrics:
    """A model deployment's batch metrics (Ray Serve tags them with the deployment and
    replica): histograms for the distributions, and exact counters for the means (Ray
    rebuilds a histogram's ``_sum`` from bucket midpoints, so its mean is approximate:
    144 batches of size 1 read a mean of 0.5)."""

    def __init__(self) -> None:
        self.size = metrics.Histogram(
            "speclab_batch_size", description="Requests per batched model step.",
            boundaries=BATCH_BUCKETS)
        self.wait = metrics.Histogram(
            "speclab_batch_wait_seconds", description="Wait for a batch to close.",
            boundaries=WAIT_BUCKETS)
        self.steps = metrics.Counter("speclab_batch_steps", description="Batched model steps.")
        self.rows = metrics.Counter(
            "speclab_batch_rows", description="Requests in batched model steps (exact: "
                                              "rows_total / steps_total is the mean batch size).")
        self.wait_total = metrics.Counter(
            "speclab_batch_waited_seconds",
            description="Seconds batches waited to close, summed exactly.")
        # a draft replica's rounds drafted ahead (speclab.decoding.lookahead)
        self.ahead_hits = metrics.Counter(
            "speclab_draft_ahead_hits",
            description="Rounds whose tree was drafted while the target verified the last.")
        self.ahead_misses = metrics.Counter(
            "speclab_draft_ahead_misses",
            description="Rounds drafted ahead on a guess the verdict did not match.")
        self.ahead_saved = metrics.Counter(
            "speclab_draft_ahead_saved_seconds",
            description="Draft model seconds the hits saved (estimated per round).")

        # a draft replica's auto budget (speclab.decoding.budget): each round's choice
        self.budgets = metrics.Histogram(
            "speclab_draft_budget", description="Draft levels the auto budget gave a round "
                                                "(0: a plain decoding round).",
            boundaries=BUDGET_BUCKETS)

    def budget(self, levels: int) -> None:
        """Record one round's draft budget under ``serve.budget: auto``."""
        self.budgets.observe(levels)

    def ahead(self, hit: bool, saved_s: float) -> None:
        """Record a round drafted ahead: a hit (saving ``saved_s``) or a miss."""
        (self.ahead_hits if hit else self.ahead_misses).inc()
        _inc(self.ahead_saved, saved_s)

    def batch(self, size: int, wait_s: float) -> None:
        """Record one batch of ``size`` steps that waited ``wait_s`` to close."""
        self.size.observe(size)
        self.wait.observe(wait_s)
        self.steps.inc()
        _inc(self.rows, size)
        _inc(self.wait_total, wait_s)


class RequestMetrics:
    """The ingress's per-request metrics: vLLM's SD counters, latency, tokens, errors."""

    def __init__(self, model_name: str) -> None:
        tags = {"model_name": model_name}

        def counter(name: str, description: str, keys: tuple[str, ...] = ()):
            c = metrics.Counter(name, description=description, tag_keys=("model_name", *keys))
            c.set_default_tags(dict(tags))  # Serve adds its tags to the dict given
            return c

        self.drafts = counter("vllm_spec_decode_num_drafts", "Rounds that verified a draft.")
        self.draft_tokens = counter("vllm_spec_decode_num_draft_tokens", "Draft tokens.")
        self.accepted = counter("vllm_spec_decode_num_accepted_tokens",
                                "Accepted draft tokens.")
        self.per_pos = counter("vllm_spec_decode_num_accepted_tokens_per_pos",
                               "Rounds accepting a draft token at each position.",
                               ("position",))
        self.tokens = counter("speclab_generation_tokens", "Tokens generated.")
        self.errors = counter("speclab_request_errors", "Requests answered with an error.",
                              ("status",))
        self.refused = counter("speclab_requests_refused",
                               "Requests refused, by reason (the error's code, else its type: "
                               "context_length_exceeded, invalid_request_error, ...).",
                               ("reason",))
        self.latency = metrics.Histogram(
            "speclab_request_latency_seconds", description="End-to-end request latency.",
            boundaries=LATENCY_BUCKETS, tag_keys=("model_name", "route"))
        self.latency.set_default_tags(dict(tags))
        self.requests = counter("speclab_requests", "Requests answered (exact count).",
                                ("route",))
        self.seconds = counter("speclab_request_seconds",
                               "End-to-end seconds of answered requests, summed exactly "
                               "(seconds_total / requests_total is the mean latency).",
                               ("route",))

        self.model_name = model_name
        self.local = VllmTallies()

    def request(self, route: str, latency_s: float, stats: dict | None) -> None:
        """Record a finished request (``stats``: its SD stats, None without decoding)."""
        self.latency.observe(latency_s, tags={"route": route})
        self.requests.inc(tags={"route": route})
        _inc(self.seconds, latency_s, {"route": route})
        if not stats:
            return
        c = sd_counts(stats)
        self.local.add(latency_s, c)
        _inc(self.tokens, c["tokens"])
        if c["draft_tokens"]:
            self.draft_tokens.inc(c["draft_tokens"])
            _inc(self.accepted, c["accepted"])
        if c["drafts"]:
            self.drafts.inc(c["drafts"])
            for pos, n in c["per_pos"].items():
                _inc(self.per_pos, n, {"position": str(pos)})

    def vllm_text(self) -> str:
        """This replica's decoding counters as Prometheus text under the exact names a
        standalone vLLM server exports (``vllm:spec_decode_num_drafts_total``, ...)."""
        return self.local.render(self.model_name)

    def error(self, status: int) -> None:
        """Count a request answered with HTTP ``status``."""
        self.errors.inc(tags={"status": str(status)})

    def refusal(self, reason: str) -> None:
        """Count a request refused for ``reason`` (a bounded set: error codes and types)."""
        self.refused.inc(tags={"reason": reason})


def sd_counts(stats: dict) -> dict:
    """What one request adds to vLLM's SD counters, from its SD ``stats``: ``tokens``,
    ``draft_tokens``, ``accepted``, ``drafts`` (rounds that verified a draft; 0 without
    drafting) and ``per_pos`` (``{position: rounds whose accepted path reached it}``)."""
    drafted = int(stats.get("drafted_tokens", 0))
    rounds = [n - 1 for n in stats.get("accepted_lengths", [])] if drafted else []
    return {"tokens": int(stats.get("new_tokens", 0)), "draft_tokens": drafted,
            "accepted": int(stats.get("accepted_tokens", 0)) if drafted else 0,
            "drafts": len(rounds),
            "per_pos": {pos: sum(1 for a in rounds if a > pos)
                        for pos in range(max(rounds, default=0))}}


class VllmTallies:
    """Plain sums of what :class:`RequestMetrics` records, kept in the ingress replica
    for its own ``/metrics`` route: Ray refuses ``:`` in metric names, so the exact
    names of a standalone vLLM server (what the stock vLLM Grafana dashboard queries)
    are rendered here. One replica's view: with several ingress replicas, scrape Ray's
    metrics port (``ray_vllm_*``, summed over replicas) instead."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = self.tokens = 0
        self.per_pos: dict[int, int] = {}
        self.requests = 0
        self.latency_sum = 0.0
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)

    def add(self, latency_s: float, counts: dict) -> None:
        """One finished decoding request with its :func:`sd_counts`."""
        self.requests += 1
        self.latency_sum += latency_s
        for i, le in enumerate(LATENCY_BUCKETS):
            self.latency_buckets[i] += latency_s <= le
        self.tokens += counts["tokens"]
        self.draft_tokens += counts["draft_tokens"]
        self.accepted += counts["accepted"]
        self.drafts += counts["drafts"]
        for pos, n in counts["per_pos"].items():
            self.per_pos[pos] = self.per_pos.get(pos, 0) + n

    def render(self, model: str) -> str:
        """Prometheus text exposition (version 0.0.4)."""
        label = 'model_name="' + model.replace("\\", "\\\\").replace('"', '\\"') + '"'
        out = []

        def counter(name: str, help_: str, rows: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter"])
            out.extend(f"{name}_total{{{labels}}} {value}" for labels, value in rows)

        counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                [(label, self.drafts)])
        counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                [(label, self.draft_tokens)])
        counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                [(label, self.accepted)])
        counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [(f'{label},position="{p}"', n) for p, n in sorted(self.per_pos.items())])
        counter("vllm:generation_tokens", "Number of generation tokens processed.",
                [(label, self.tokens)])
        name = "vllm:e2e_request_latency_seconds"
        out.extend([f"# HELP {name} Histogram of end to end request latency in seconds.",
                    f"# TYPE {name} histogram"])
        out.extend(f'{name}_bucket{{{label},le="{le}"}} {n}'
                   for le, n in zip(LATENCY_BUCKETS, self.latency_buckets, strict=True))
        out.append(f'{name}_bucket{{{label},le="+Inf"}} {self.requests}')
        out.append(f"{name}_sum{{{label}}} {self.latency_sum}")
        out.append(f"{name}_count{{{label}}} {self.requests}")
        return "\n".join(out) + "\n"


def _inc(counter, value: float, tags: dict | None = None) -> None:
    if value > 0:  # Ray counters take positive increments only
        counter.inc(value, tags=tags)


#: the ingress replica's metrics, for the HTTP middleware that counts error answers:
#: Serve runs the replica's class and FastAPI app as copies, whose module globals are
#: not this module's, so the two meet here
_ERRORS: dict[str, RequestMetrics] = {}


def count_errors_in(request_metrics: RequestMetrics) -> None:
    """Count this process's error answers in ``request_metrics`` (see :func:`count_error`)."""
    _ERRORS["ingress"] = request_metrics


def count_error(status: int) -> None:
    """Count an answer with HTTP ``status`` (no-op before :func:`count_errors_in`)."""
    if "ingress" in _ERRORS:
        _ERRORS["ingress"].error(status)


def count_refusal(reason: str) -> None:
    """Count a refusal for ``reason`` (no-op before :func:`count_errors_in`)."""
    if "ingress" in _ERRORS:
        _ERRORS["ingress"].refusal(reason)
