"""Stage: evaluate methods with a target/draft pair on Ray actors (evaluate, distill,
compare_losses, specdecpp_eval).

Prompts are spread over actors that hold the models; each actor runs every method over
its prompts one after another with the AR baseline re-run before each method (A B A B).
The driver merges the counters, prints the table and logs metrics (chain metrics also
with step = gamma), the table (CSV/JSON/TXT) and plots to the active tracker run.
"""

from __future__ import annotations

from typing import Any

from speclab.config import MethodConfig


def _plots(rows: list[dict], runs) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    names = [r["method"] for r in rows]
    for metric, fname in (("tau", "tau_per_method.png"), ("tokens_per_s", "tokens_per_s.png")):
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows)), 3.5))
        ax.bar(range(len(rows)), [r[metric] for r in rows])
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(metric)
        fig.tight_layout()
        figs[fname] = fig
    chain = sorted((run.gamma, row) for run, row in zip(runs, rows[1:]) if run.name == "chain")
    if len(chain) >= 2:
        fig, ax = plt.subplots(figsize=(4.5, 3.5))
        ax.plot([g for g, _ in chain], [r["speedup"] for _, r in chain], "o-", label="measured")
        predicted = [(g, r["predicted_speedup"]) for g, r in chain
                     if r["predicted_speedup"] is not None]  # None when batched
        if predicted:
            ax.plot([g for g, _ in predicted], [p for _, p in predicted], "s--",
                    label="predicted (Thm 3.8)")
        ax.set_xlabel("gamma")
        ax.set_ylabel("speedup over AR")
        ax.legend()
        fig.tight_layout()
        figs["speedup_vs_gamma.png"] = fig
    return figs


def evaluate_pair(cfg: Any, target: str, draft: str | None, prompts: list[list[int]],
                  tracker, prefix: str = "",
                  methods: list[MethodConfig] | None = None) -> list[dict]:
    """Evaluate ``methods`` (default ``cfg.method_list()``) on ``prompts`` (token ids)
    with ``cfg``'s ``models``, ``decoding`` and ``resources`` groups; log to ``tracker``.

    ``prefix`` is prepended to metric keys and artifact names (e.g. ``eval/``).
    Returns the table rows (AR first).
    """
    import ray

    from speclab.evaluation import MethodRun, Totals, format_table, summarize

    runs = list(methods) if methods is not None else cfg.method_list()
    method_runs = [MethodRun(m.name, m.params(), m.label or "") for m in runs]
    n_act = min(cfg.resources.num_actors, len(prompts))
    shards = [prompts[i::n_act] for i in range(n_act)]
    gen = cfg.decoding.model_dump()
    device = "cuda" if cfg.resources.num_gpus_per_actor > 0 else cfg.models.device
    dtype = cfg.models.dtype

    @ray.remote
    class EvalWorker:
        """Holds the target and draft; evaluates methods over a shard of prompts."""

        def __init__(self) -> None:
            from speclab.api import Decoder

            self.dec = Decoder.from_pretrained(target, draft, dtype, device)

        def run(self, shard: list[list[int]]) -> dict:
            from speclab.evaluation import interleaved_comparison

            return interleaved_comparison(self.dec, method_runs, shard, gen)

    actors = [EvalWorker.options(num_cpus=cfg.resources.num_cpus_per_actor,
                                 num_gpus=cfg.resources.num_gpus_per_actor).remote()
              for _ in range(n_act)]
    try:
        parts = ray.get([a.run.remote(s) for a, s in zip(actors, shards)])
    finally:
        for a in actors:
            ray.kill(a)

    merged: dict[str, dict] = {}
    for part in parts:
        for name, res in part.items():
            slot = merged.setdefault(name, {"totals": Totals(), "ar": Totals()})
            slot["totals"].merge(res["totals"])
            slot["ar"].merge(res["ar"])
    first = merged[method_runs[0].name]
    # outputs are in actor-shard order; the AR block of the first method is the reference
    reference = first["ar"].outputs if cfg.decoding.temperature == 0 else None
    rows = [summarize(MethodRun("ar"), first["ar"], first["ar"], reference)]
    for run in method_runs:
        m = merged[run.name]
        rows.append(summarize(run, m["totals"], m["ar"], reference))
    print(format_table(rows), flush=True)

    for run_cfg, run, row in zip([None, *runs], [MethodRun("ar"), *method_runs], rows):
        tracker.log_metrics({f"{prefix}{run.key}.{k}": v for k, v in row.items()})
        if run_cfg is not None and run_cfg.name == "chain":
            tracker.log_metrics({f"{prefix}chain.speedup": row["speedup"],
                                 f"{prefix}chain.tau": row["tau"]}, step=run_cfg.gamma)
    best = max(rows[1:], key=lambda r: r["speedup"]) if len(rows) > 1 else rows[0]
    tracker.log_metrics({f"{prefix}best_speedup": best["speedup"],
                         f"{prefix}prompts": len(prompts)})
    tracker.set_tags({f"{prefix}best_method": best["method"]})
    name = prefix.replace("/", "_")
    tracker.log_table(rows, f"{name}results")
    tracker.log_text(format_table(rows), f"{name}results.txt")
    for fname, fig in _plots(rows, runs).items():
        tracker.log_figure(fig, f"{name}{fname}")
    return rows


def evaluate_trained(cfg: Any, target: str, prompts: list[list[int]], tracker, field: str,
                     folder: str) -> list[dict]:
    """:func:`evaluate_pair` of ``cfg.method_list()`` where every method whose ``field``
    (``eagle_model``, ``medusa_model``) is ``trained`` uses the model just trained in
    ``folder``. Those keep their configured name as label, so tables and metric keys do
    not carry (and are not lengthened by) the run folder. Methods with a draft LM use
    ``models.draft``. Returns the rows, AR first."""
    from speclab.config.jobs import TRAINED
    from speclab.evaluation import MethodRun
    from speclab.models.registry import resolve_models

    methods = [m.model_copy(update={field: str(folder), "label": m.label or MethodRun(
        m.name, m.params(), "").name}) if getattr(m, field, None) == TRAINED else m
        for m in cfg.method_list()]
    draft = None
    if any(m.needs_draft_model for m in methods):
        _, draft = resolve_models(cfg.models.target, cfg.models.draft)
    return evaluate_pair(cfg, target, draft, prompts, tracker, "eval/", methods)


def tokenized_prompts(cfg: Any, target: str) -> list[list[int]]:
    """The ``data`` prompt set, tokenised with the target's tokenizer (on the driver)."""
    from speclab.api import Decoder
    from speclab.data.prompts import load_prompts

    dec = Decoder.from_pretrained(target)
    texts = load_prompts(cfg.data.prompts, cfg.data.num_prompts, cfg.data.context_chars,
                         cfg.data.path, cfg.data.seed)
    return [dec.encode(t) for t in texts]
