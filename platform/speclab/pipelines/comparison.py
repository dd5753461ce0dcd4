"""Stage: the loss x method table of a loss comparison (compare_losses, compare_eagle):
rows, the printed table, and the plots logged to the comparison's parent run."""

from __future__ import annotations

from speclab.evaluation import ACCEPT_POSITIONS, format_table
from speclab.orderings import difference_cell, ordering_rows, speedups_cell
from speclab.pipelines.eval_plots import wrap_label
from speclab.tracking import metric_key


def comparison_rows(loss: str, rows: list[dict], key: str = "loss") -> list[dict]:
    """One table row per evaluated method of the drafter trained with ``loss`` (in column
    ``key``; ``rows``: :func:`~speclab.pipelines.actor_eval.evaluate_pair`'s, AR first),
    with each prompt's tau and speedup (``tau_per_prompt``, ``speedup_per_prompt``) for
    the paired orderings."""
    keep = ("tau", "tau_std", "target_calls_per_token", "speedup", "speedup_lo", "speedup_hi",
            "speedup_std", "tokens_per_s",
            *(f"accept_at_{k}" for k in range(1, ACCEPT_POSITIONS + 1)))
    return [{key: loss, "method": row["method"], **{k: row[k] for k in keep},
             **{k: row[k] for k in ("tau_per_prompt", "speedup_per_prompt") if k in row}}
            for row in rows[1:]]


def _tau_by_loss(table: list[dict], key: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = list(dict.fromkeys(r[key] for r in table))
    methods = list(dict.fromkeys(r["method"] for r in table))
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(losses)), 3.8))
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        cells = [next(r for r in table if r[key] == loss and r["method"] == m)
                 for loss in losses]
        ax.bar([i + j * width for i in range(len(losses))], [r["tau"] for r in cells], width,
               yerr=[r.get("tau_std") or 0.0 for r in cells], capsize=2,
               label=wrap_label(m, 36))
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(losses))], losses)
    ax.set_xlabel(key)
    ax.set_ylabel("tau (tokens per target call)")
    ax.set_title(f"tau per {key} and method (±1 sd over prompts)", fontsize=9)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def _acceptance_per_position(table: list[dict], key: str):
    """One panel per method, one line per loss: the fraction of rounds accepting at
    least ``k`` draft tokens against ``k`` (the HASS slide's per-step acceptance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in table))
    fig, axes = plt.subplots(1, len(methods), figsize=(3.6 * len(methods), 3.4),
                             squeeze=False, sharey=True)
    ks = list(range(1, ACCEPT_POSITIONS + 1))
    for ax, m in zip(axes[0], methods):
        for r in (r for r in table if r["method"] == m):
            ax.plot(ks, [r[f"accept_at_{k}"] for k in ks], "o-", label=r[key])
        ax.set_title(wrap_label(m, 40), fontsize=7)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of rounds accepting ≥ k")
    fig.suptitle(f"Per-position acceptance per {key}", fontsize=9)
    fig.tight_layout()
    return fig


def log_comparison(tracker, table: list[dict], name: str = "loss_comparison",
                   key: str = "loss") -> str:
    """Print ``table`` (rows of :func:`comparison_rows` with the same ``key``) and log it
    (CSV/JSON/TXT) with the tau-by-``key`` and the acceptance-per-position plots to
    ``tracker``'s run; where the table holds both sides of a published ordering (HASS
    above EAGLE, ...: :data:`speclab.orderings.PAPER_ORDERINGS`), the paired differences
    over prompts are printed under it (``<name>.txt``) and logged as ``orderings.csv`` /
    ``orderings.json`` with ``ordering_<above>_over_<below>_<method>`` metrics.
    Returns the printed text."""
    cols = [(key, "{}"), ("method", "{}"), ("tau", "{:.2f}"),
            ("target_calls_per_token", "{:.3f}"), ("speedup", "{:.2f}x"),
            *((f"accept_at_{k}", "{:.2f}") for k in range(1, 4))]
    text = format_table(table, cols)
    orderings = ordering_rows(table, key)
    if orderings:
        text += "\n\nthe papers' orderings, paired over prompts (median tau ratio - 1):\n"
        text += log_orderings(tracker, orderings)
    print(text, flush=True)
    tracker.log_table(table, name)
    tracker.log_text(text, f"{name}.txt")
    tracker.log_figure(_tau_by_loss(table, key), f"tau_by_{key}.png")
    tracker.log_figure(_acceptance_per_position(table, key), "acceptance_per_position.png")
    return text


def log_orderings(tracker, orderings: list[dict]) -> str:
    """Log rows of :func:`speclab.orderings.ordering_rows` or
    :func:`speclab.orderings.paired_rows` to ``tracker``'s run as ``orderings.csv`` /
    ``orderings.json`` and one ``ordering_<above>_over_<below>[_<method>]`` metric each
    (the median paired difference; names made valid MLflow keys), plus
    ``ordering_speedup_<above>_over_<below>[_<method>]`` (the median paired speedup
    ratio) where the rows carried per-prompt speedups; returns them as a printed
    table."""
    by_method = any("method" in o for o in orderings)
    tracker.log_table(orderings, "orderings")

    def key(o: dict, what: str) -> str:
        return metric_key(f"{what}_{o['above']}_over_{o['below']}"
                          + (f"_{o['method']}" if by_method else ""))

    tracker.log_metrics({key(o, "ordering"): o["difference"] for o in orderings}
                        | {key(o, "ordering_speedup"): o["speedup_ratio"] for o in orderings
                           if "speedup_ratio" in o})
    return format_table(orderings, [
        ("above", "{}"), ("below", "{}"), *((("method", "{}"),) if by_method else ()),
        ("tau_above", "{:.2f}"), ("tau_below", "{:.2f}"), ("difference", difference_cell),
        ("prompts", "{}"), ("verdict", "{}"), ("speedups", speedups_cell), ("claim", "{}")])
