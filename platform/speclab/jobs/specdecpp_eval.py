"""SpecDec++ comparison: fixed draft length vs acceptance heads x thresholds (Figure 4).

    python -m jobs.specdecpp_eval --config experiments/specdecpp.yaml

Heads come from ``adaptive.heads`` (name -> folder or ``models:/`` URI) or, when that is
empty, are trained on the fly (:mod:`speclab.families.specdecpp.stages`) once per
``adaptive.depths`` x ``adaptive.w_rejs``, sharing one generated data set, each a child
MLflow run. Then,
on the ``data`` prompts and with the usual timing protocol (AR re-run before every
method, one actor), the chain drafter at every ``adaptive.gammas`` and the SpecDec++
drafter for every head x ``adaptive.thresholds``. Per method: discard rate
N_discarded/N, verification rate N_target/N, measured tokens/s and speedup, and
tokens/s from eq. 2.3 with t_draft / t_target measured in this run. The greedy oracle
of Lemma 2.1 is computed on the same prompts. Artifacts: the table, the Pareto plot of
the two rates, and how many fixed-gamma points some SpecDec++ point dominates. Each
evaluated method (each fixed gamma, each head x threshold, and AR) is a child run with
``method.*`` params and the same metric keys, the eq. 2.3 figures among them.
"""

from __future__ import annotations

from speclab.api import Decoder
from speclab.config import SpecdecppEvalJob
from speclab.config.method import parse_method
from speclab.evaluation import format_table, greedy_oracle, pareto_dominated
from speclab.families.specdecpp.stages import prepare_head, train_head
from speclab.models.loading import resolve_source
from speclab.models.registry import resolve_models
from speclab.pipelines.actor_eval import evaluate_pair, log_method_children, tokenized_prompts
from speclab.pipelines.cli import run_dirs, start_job
from speclab.raylib import init_ray
from speclab.theory import specdecpp_latency


def prepare(cfg: SpecdecppEvalJob):
    """(target folder, draft folder, corpus inputs for head training or None)."""
    if cfg.decoding.temperature != 0:
        raise ValueError("decoding.temperature: the comparison and its oracle are greedy (0)")
    if not cfg.adaptive.heads:
        prep, draft = prepare_head(cfg)
        return prep.target, draft, prep
    target, draft = resolve_models(cfg.models.target, cfg.models.draft)
    if not draft:
        raise ValueError("models.draft: the comparison needs a drafter")
    return resolve_source(target, "models.target"), resolve_source(draft, "models.draft"), None


def _figure(rows: list[dict], oracle: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["family"], []).append(r)
    for fam, rs in groups.items():
        style = "o-" if fam == "fixed gamma" else "s--"
        ax.plot([r["discard_rate"] for r in rs], [r["verification_rate"] for r in rs], style,
                label=fam, markersize=4)
    ax.plot([oracle[0]], [oracle[1]], "k*", markersize=10, label="oracle (Lemma 2.1)")
    ax.set_xlabel("discard rate N_discarded / N")
    ax.set_ylabel("verification rate N_target / N")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def compare(cfg: SpecdecppEvalJob, target: str, draft: str, heads: dict[str, str],
            tracker) -> list[dict]:
    """Evaluate fixed gamma and heads x thresholds; log table, plot and summary."""
    a = cfg.adaptive
    methods = [parse_method({"name": "chain", "gamma": g, "label": f"gamma={g}"})
               for g in a.gammas]
    families = ["fixed gamma"] * len(methods)
    for name, path in heads.items():
        for h in a.thresholds:
            methods.append(parse_method({"name": "specdecpp", "head": path,
                                        "stop_threshold": h, "max_draft": a.max_draft,
                                        "label": f"{name}@h={h:g}"}))
            families.append(f"SpecDec++ {name}")
    prompts = tokenized_prompts(cfg, target)
    rows = evaluate_pair(cfg, target, draft, prompts, tracker, "eval/", methods,
                         children=False)
    ar = rows[0]
    t_target = 1.0 / ar["tokens_per_s"]  # one target forward per AR token
    t_draft = t_target * sum(r["c"] for r in rows[1:len(a.gammas) + 1]) / len(a.gammas)

    dec = Decoder.from_pretrained(target, draft, cfg.models.dtype, cfg.models.device)
    counts = [greedy_oracle(dec, p, cfg.decoding.max_new_tokens) for p in prompts]
    n = sum(c[0] for c in counts)
    oracle = (0.0, sum(c[1] + 1 for c in counts) / n)
    table = []
    for fam, r in zip(families, rows[1:]):
        lat = specdecpp_latency(t_draft, t_target, r["discard_rate"],
                                r["target_calls_per_token"])
        table.append({"method": r["method"], "family": fam, "discard_rate": r["discard_rate"],
                      "verification_rate": r["target_calls_per_token"], "tau": r["tau"],
                      "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"],
                      "eq23_tokens_per_s": 1.0 / lat,
                      "identical_to_ar": r.get("identical_to_ar")})
    # one child run per method, with the cost model's figures beside the measured ones
    log_method_children(tracker, [rows[0], *({**r, **x} for r, x in zip(rows[1:], table))],
                        methods, skip=("family",))
    oracle_tps = 1.0 / specdecpp_latency(t_draft, t_target, *oracle)
    table.append({"method": "oracle", "family": "oracle", "discard_rate": oracle[0],
                  "verification_rate": oracle[1], "eq23_tokens_per_s": oracle_tps})
    cols = [("method", "{}"), ("discard_rate", "{:.3f}"), ("verification_rate", "{:.3f}"),
            ("tau", "{:.2f}"), ("tokens_per_s", "{:.1f}"), ("speedup", "{:.2f}x"),
            ("eq23_tokens_per_s", "{:.1f}"), ("identical_to_ar", "{}")]
    text = format_table(table, cols)
    fixed = [r for r in table if r["family"] == "fixed gamma"]
    adaptive = [r for r in table if r["family"].startswith("SpecDec++")]
    pts = [(r["discard_rate"], r["verification_rate"]) for r in adaptive]
    dominated = sum(pareto_dominated((r["discard_rate"], r["verification_rate"]), pts)
                    for r in fixed)
    best_fixed = max(fixed, key=lambda r: r["tokens_per_s"])
    summary = {"t_draft_s": t_draft, "t_target_s": t_target, "oracle_verification_rate":
               oracle[1], "oracle_eq23_tokens_per_s": oracle_tps,
               "fixed_points_dominated": dominated, "fixed_points": len(fixed),
               "best_fixed_tokens_per_s": best_fixed["tokens_per_s"],
               "best_fixed_eq23_tokens_per_s": max(r["eq23_tokens_per_s"] for r in fixed)}
    if adaptive:
        best = max(adaptive, key=lambda r: r["tokens_per_s"])
        summary.update({"best_specdecpp_tokens_per_s": best["tokens_per_s"],
                        "best_specdecpp_eq23_tokens_per_s":
                            max(r["eq23_tokens_per_s"] for r in adaptive)})
        tracker.set_tags({"best_specdecpp": best["method"], "best_fixed": best_fixed["method"]})
    text += "\n\n" + "\n".join(f"{k}: {v:.4g}" for k, v in summary.items())
    print(text, flush=True)
    tracker.log_metrics(summary)
    tracker.log_table(table, "specdecpp_comparison")
    tracker.log_text(text, "specdecpp_comparison.txt")
    tracker.log_figure(_figure(table[:-1], oracle), "pareto_discard_vs_verification.png")
    return table


def main(argv: list[str] | None = None) -> int:
    job = start_job("specdecpp_eval", __doc__, argv, prepare)
    cfg, tracker, (target, draft, prep) = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[specdecpp_eval] running on {where}", flush=True)
    with tracker as t:
        t.set_tags({"job": "specdecpp_eval", "target": target, "draft": draft})
        heads = dict(cfg.adaptive.heads)
        if not heads:
            data_dir = storage / run_name / "data"  # one data set for every head
            reg = cfg.output.register_as
            for depth in cfg.adaptive.depths:
                for w_rej in cfg.adaptive.w_rejs:
                    name = f"D{depth}-w{w_rej:g}"
                    h = cfg.head.model_copy(update={"depth": depth, "w_rej": w_rej})
                    params = {**cfg.model_dump(mode="json"), "head": h.model_dump(mode="json")}
                    with t.child(f"{cfg.name}-head-{name}", params) as c:
                        heads[name] = str(train_head(
                            cfg, prep, draft, storage, f"{run_name}-head-{name}", c,
                            f"{reg}-{name}" if reg else None, data_dir, h))
        compare(cfg, target, draft, heads, t)
    return 0
