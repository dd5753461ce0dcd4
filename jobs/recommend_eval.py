"""AtSpeed evaluation: Table 1 shape (verification x method x K) with WS@K, AS@K,
Recall@K and NDCG@K, plus WS/AS against the draft beam size N.

    python -m jobs.recommend_eval --config experiments/smoke/recommend_eval.yaml

Models come from ``rec_eval.target`` / ``rec_eval.drafts`` (folders or ``models:/``
URIs) or, when absent, are trained on the fly with Ray Train on the ``rec`` data: the
target with ``arch``/``train``, then one drafter per ``rec_eval.losses`` entry (sft,
seq_kd, word_kd, tvd_kd, atspeed_s, atspeed_r; AtSpeed losses once per value in
``rec_eval.alphas``) with ``rec_eval.draft_arch`` and ``rec_eval.draft_steps``, on
alignment data from the target's top-``align_k`` beams (each a child MLflow run,
registered when ``output.register_as`` is set). Plots: AS vs K, WS/AS vs N, WS/AS vs
alpha. Evaluation runs on the driver, methods timed one after
another per user.
"""

from __future__ import annotations

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from jobs._cli import start_job
from speclab.config import ExperimentConfig


def _plots(rows: list[dict]) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    strict = [r for r in rows if r["verify"] == "strict"]
    ns = sorted({r["N"] for r in strict})
    if len(ns) >= 2:
        k = max(r["K"] for r in strict if all(any(
            x["K"] == r["K"] and x["N"] == n for x in strict) for n in ns))
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.3))
        for name in sorted({r["method"] for r in strict}):
            sel = sorted((r for r in strict if r["method"] == name and r["K"] == k),
                         key=lambda r: r["N"])
            axes[0].plot([r["N"] for r in sel], [r["WS@K"] for r in sel], "o-", label=name)
            axes[1].plot([r["N"] for r in sel], [r["AS@K"] for r in sel], "o-", label=name)
        axes[0].set(xlabel="draft beam size N", ylabel=f"WS@{k}")
        axes[1].set(xlabel="draft beam size N", ylabel=f"AS@{k}")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        figs["ws_as_vs_n.png"] = fig
    tuned = [r for r in rows if "@" in r["method"] and r["N"] == max(x["N"] for x in rows)]
    if len({r["method"] for r in tuned}) >= 2:
        k = max(r["K"] for r in tuned)
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.3))
        for (verify, loss) in sorted({(r["verify"], r["method"].split("@")[0]) for r in tuned}):
            sel = sorted((r for r in tuned if r["verify"] == verify and r["K"] == k
                          and r["method"].split("@")[0] == loss),
                         key=lambda r: float(r["method"].split("@")[1]))
            alphas = [float(r["method"].split("@")[1]) for r in sel]
            axes[0].plot(alphas, [r["WS@K"] for r in sel], "o-", label=f"{verify}/{loss}")
            axes[1].plot(alphas, [r["AS@K"] for r in sel], "o-", label=f"{verify}/{loss}")
        axes[0].set(xlabel="alpha", ylabel=f"WS@{k}")
        axes[1].set(xlabel="alpha", ylabel=f"AS@{k}")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        figs["ws_as_vs_alpha.png"] = fig
    fig, ax = plt.subplots(figsize=(5, 3.3))
    for (verify, name) in sorted({(r["verify"], r["method"]) for r in rows}):
        sel = sorted((r for r in rows if r["verify"] == verify and r["method"] == name
                      and r["N"] == max(x["N"] for x in rows)), key=lambda r: r["K"])
        ax.plot([r["K"] for r in sel], [r["AS@K"] for r in sel], "o-", label=f"{verify}/{name}")
    ax.set(xlabel="K", ylabel="AS@K (accepted steps per user)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    figs["as_vs_k.png"] = fig
    return figs


def generate_alignment(target: str, draft: str | None, meta, prompts: list[list[int]],
                       k: int, lam: float, tasks: int) -> list[dict]:
    """Alignment rows (:func:`speclab.train.rec_align.alignment_example`) for ``prompts``,
    computed by ``tasks`` Ray tasks (0: one per cluster CPU), each loading the models
    once for its contiguous chunk; rows come back in prompt order."""
    import ray

    @ray.remote(num_cpus=1)
    def chunk(part: list[list[int]]) -> list[dict]:
        import torch

        from speclab.models.loading import load_model
        from speclab.spec.kv import ModelRunner
        from speclab.train.rec_align import alignment_example

        torch.set_num_threads(1)
        runner = ModelRunner(load_model(target, field="rec_eval.target"))
        d = ModelRunner(load_model(draft, field="rec_eval.drafts")) if draft else None
        trie = meta.trie()
        return [alignment_example(runner, trie, p, k, d, lam) for p in part]

    n = tasks or max(1, int(ray.cluster_resources().get("CPU", 1)))
    size = -(-len(prompts) // n)
    refs = [chunk.remote(prompts[i: i + size]) for i in range(0, len(prompts), size)]
    return [row for part in ray.get(refs) for row in part]


def train_drafters(cfg: ExperimentConfig, meta, examples, target: str, storage, run_name: str,
                   tracker) -> dict[str, str]:
    """One drafter per ``rec_eval.losses`` entry (per alpha for atspeed_s / atspeed_r),
    each a child run. Alignment data is generated once per kind on Ray tasks: the
    target's top-K beams, and for AtSpeed-S (``mix_lambda < 1``) the top-K beams of the
    mixture with the sft drafter, which is therefore trained first (added if absent)."""
    import time

    from jobs.train_recommender import train_model

    re, reg = cfg.rec_eval, cfg.output.register_as
    mixed = "atspeed_s" in re.losses and re.mix_lambda < 1.0
    losses = list(dict.fromkeys(["sft", *re.losses] if mixed else re.losses))
    losses.sort(key=lambda name: name != "sft")  # sft first: the mixture needs it
    prompts = [e.prompt for e in examples["train"][: re.align_examples]]
    data: dict[str, list[dict]] = {}

    def rows_for(loss: str, drafts: dict[str, str]) -> list[dict] | None:
        kind = "mix" if loss == "atspeed_s" and mixed else "target"
        if loss == "sft":
            return None
        if kind not in data:
            t0 = time.perf_counter()
            draft, lam = (drafts["sft"], re.mix_lambda) if kind == "mix" else (None, 1.0)
            data[kind] = generate_alignment(target, draft, meta, prompts, re.align_k, lam,
                                            re.align_tasks)
            secs = time.perf_counter() - t0
            tracker.log_metrics({f"align_{kind}_s": secs})
            print(f"[recommend_eval] alignment data ({kind}, lambda={lam:g}): {len(prompts)} "
                  f"histories x top-{re.align_k} in {secs:.0f}s", flush=True)
        return data[kind]

    drafts: dict[str, str] = {}
    for loss in losses:
        alphas = re.alphas if loss.startswith("atspeed") else [re.alpha]
        for alpha in alphas:
            name = f"{loss}@{alpha:g}" if loss.startswith("atspeed") else loss
            rows = rows_for(loss, drafts)
            dcfg = cfg.model_copy(update={
                "arch": re.draft_arch,
                "train": cfg.train.model_copy(update={"steps": re.draft_steps}),
                "rec_eval": re.model_copy(update={"draft_loss": loss, "alpha": alpha})})
            slug = name.replace("@", "-a")
            with tracker.child(f"{cfg.name}-draft-{slug}", dcfg.model_dump(mode="json")) as c:
                c.set_tags({"loss": loss, "alpha": str(alpha)})
                drafts[name] = str(train_model(
                    dcfg, meta, examples, storage, f"{run_name}-draft-{slug}", c,
                    f"{reg}-draft-{slug}" if reg else None,
                    task="rec" if rows is None else "rec_align",
                    extra={"align.pt": rows} if rows is not None else None))
    return drafts


def main(argv: list[str] | None = None) -> int:
    from jobs.train_recommender import prepare, train_model

    job = start_job(__doc__, argv, prepare)
    cfg, tracker, (meta, examples) = job.cfg, job.tracker, job.inputs

    from jobs._cli import run_dirs
    from speclab.evaluation import format_table
    from speclab.models.loading import load_model, resolve_source
    from speclab.raylib import init_ray
    from speclab.rec_eval import evaluate
    from speclab.recommend import Recommender
    from speclab.spec.kv import ModelRunner

    re = cfg.rec_eval
    storage, run_name = run_dirs(cfg)
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[recommend_eval] running on {where}", flush=True)
    reg = cfg.output.register_as
    with tracker as t:
        t.set_tags({"job": "recommend_eval"})
        target = re.target
        if target is None:
            with t.child(f"{cfg.name}-target", cfg.model_dump(mode="json")) as c:
                target = str(train_model(cfg, meta, examples, storage, f"{run_name}-target", c,
                                         f"{reg}-target" if reg else None))
        drafts = dict(re.drafts)
        if not drafts:
            drafts = train_drafters(cfg, meta, examples, target, storage, run_name, t)
        rec = Recommender.from_pretrained(target)
        runners = {}
        for name, path in drafts.items():
            model = load_model(resolve_source(path, f"rec_eval.drafts.{name}"),
                               field=f"rec_eval.drafts.{name}")
            rec.meta.check_model(int(model.config.vocab_size))
            runners[name] = ModelRunner(model)
        test = examples["test"][: re.test_users]
        rows = evaluate(rec, runners, test, re.ks, re.ns, re.gamma, re.verify, cfg.train.seed)
        cols = [("verify", "{}"), ("method", "{}"), ("K", "{}"), ("N", "{}"),
                ("WS@K", "{:.2f}"), ("AS@K", "{:.2f}"), ("Recall@K", "{:.3f}"),
                ("NDCG@K", "{:.3f}"), ("baseline_Recall@K", "{:.3f}")]
        text = format_table(rows, cols)
        print(text, flush=True)
        t.log_table(rows, "rec_results")
        t.log_text(text, "rec_results.txt")
        for fname, fig in _plots(rows).items():
            t.log_figure(fig, fname)
        for r in rows:
            key = f"{r['verify']}.{r['method']}.N{r['N']}"
            t.log_metrics({f"{key}.WS": r["WS@K"], f"{key}.AS": r["AS@K"],
                           f"{key}.Recall": r["Recall@K"], f"{key}.NDCG": r["NDCG@K"]},
                          step=r["K"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
