"""Stage: the plots of an evaluation (PNG, logged to the job's parent run).

Every plot has a title that says what is shown and over how many prompts, axis labels
with units, error bars (a speedup's: its 95% interval, ``speedup_lo`` to ``speedup_hi``,
from the paired timing protocol of :mod:`speclab.paired_timing`; other figures': one
standard deviation over prompts), and method labels wrapped onto several lines instead
of cut or rotated off the axis (horizontal bars leave them room).
"""

from __future__ import annotations

import math
import textwrap

from speclab.evaluation import ACCEPT_POSITIONS

#: characters per line of a wrapped method label
LABEL_WIDTH = 30


def wrap_label(label: str, width: int = LABEL_WIDTH) -> str:
    """``label`` on lines of at most ``width`` characters, broken after commas when it
    can be (``salf(batch=4,depth=10,...)`` keeps its parameters whole)."""
    if len(label) <= width:
        return label
    spaced = label.replace(",", ", ").replace("(", "( ")
    lines = textwrap.wrap(spaced, width, break_long_words=True, break_on_hyphens=False)
    return "\n".join(line.replace(", ", ",").replace("( ", "(") for line in lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)


def interval_errors(rows: list[dict], metric: str, values: list[float]
                    ) -> list[list[float]] | None:
    """``[[below], [above]]`` error bars from ``<metric>_lo`` / ``<metric>_hi`` (the 95%
    interval) where any row has them (0 for a row without), else None."""
    if not any(_finite(r.get(f"{metric}_lo")) and _finite(r.get(f"{metric}_hi"))
               for r in rows):
        return None
    below, above = [], []
    for r, v in zip(rows, values):
        lo, hi = r.get(f"{metric}_lo"), r.get(f"{metric}_hi")
        ok = _finite(lo) and _finite(hi)
        below.append(max(v - lo, 0.0) if ok else 0.0)
        above.append(max(hi - v, 0.0) if ok else 0.0)
    return [below, above]


def bar_figure(rows: list[dict], metric: str, title: str, xlabel: str,
               reference: float | None = None):
    """Horizontal bars of ``metric`` per row (``row["method"]`` labels, top to bottom),
    with error bars: the 95% interval ``<metric>_lo`` .. ``<metric>_hi`` where the rows
    have it, else ``<metric>_std``; ``reference`` draws a dashed vertical line (1x for a
    speedup)."""
    plt = _pyplot()
    labels = [wrap_label(str(r["method"])) for r in rows]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.28 * lines + 0.12 * len(rows)))
    values = [float(r.get(metric) or 0.0) for r in rows]
    interval = interval_errors(rows, metric, values)
    errs = [r.get(f"{metric}_std") for r in rows]
    has_err = interval is not None or any(e is not None for e in errs)
    xerr = interval if interval is not None else (
        [e or 0.0 for e in errs] if has_err else None)
    ax.barh(range(len(rows)), values, xerr=xerr, capsize=3, color="tab:blue", alpha=0.85)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    for i, v in enumerate(values):  # the value inside the bar's base, clear of whiskers
        ax.annotate(f"{v:.2f}", (0, i), xytext=(3, -3), textcoords="offset points",
                    fontsize=7, color="white", fontweight="bold")
    if reference is not None:
        ax.axvline(reference, color="gray", ls="--", lw=1)
    if interval is not None:
        what = "\nbars: median paired ratio; whiskers: its 95% interval"
    else:
        what = "\nbars: all prompts pooled; whiskers: ±1 sd of per-prompt values"
    ax.set_xlabel(xlabel + (what if has_err else ""))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def acceptance_figure(rows: list[dict], title: str):
    """Per-position acceptance: for each row (method) the fraction of rounds that
    accepted at least ``k`` draft tokens, against ``k`` = 1..ACCEPT_POSITIONS; one
    line per method, labelled in a legend beside the axes."""
    plt = _pyplot()
    ks = list(range(1, ACCEPT_POSITIONS + 1))
    fig, ax = plt.subplots(figsize=(8.5, 4.0))
    for r in rows:
        ax.plot(ks, [r[f"accept_at_{k}"] for k in ks], "o-", ms=3,
                label=wrap_label(str(r["method"]), 36))
    ax.set_xticks(ks)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("fraction of rounds accepting ≥ k draft tokens")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def acceptance_table(rows: list[dict]) -> list[dict]:
    """The per-position acceptance of every drafting row (AR, which drafts nothing, is
    left out): ``{"method", "accept_at_1", ..., "accept_at_<ACCEPT_POSITIONS>"}``."""
    keys = [f"accept_at_{k}" for k in range(1, ACCEPT_POSITIONS + 1)]
    return [{"method": r["method"], **{k: r[k] for k in keys}} for r in rows
            if r["method"] != "ar" and all(k in r for k in keys)]


def method_figures(rows: list[dict], chain_gammas: list[int | None]) -> dict:
    """The evaluation plots of :func:`~speclab.pipelines.actor_eval.evaluate_pair`'s
    rows (AR first): tau, tokens/s and speedup per method, per-position acceptance,
    and speedup against gamma when two or more chain methods ran (``chain_gammas[i]``:
    row ``i + 1``'s gamma, None for other methods). Returns ``{file name: figure}``."""
    n = rows[0].get("prompts", 0) if rows else 0
    over = f"{n} prompts"
    figs = {
        "tau_per_method.png": bar_figure(
            rows, "tau", f"Tokens committed per target call (tau), over {over}",
            "tau (tokens per target call)"),
        "tokens_per_s.png": bar_figure(
            rows, "tokens_per_s", f"Decoding throughput, over {over}",
            "generated tokens per second"),
        "speedup_per_method.png": bar_figure(
            rows[1:], "speedup", f"Wall-clock speedup over AR timed in pairs, over {over}",
            "speedup (x AR tokens/s)", reference=1.0),
    }
    drafting = acceptance_table(rows)
    if drafting:
        figs["acceptance_per_position.png"] = acceptance_figure(
            drafting, f"Per-position acceptance, over {over}")
    chain = sorted((g, r) for g, r in zip(chain_gammas, rows[1:]) if g is not None)
    if len(chain) >= 2:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        values = [r["speedup"] for _, r in chain]
        interval = interval_errors([r for _, r in chain], "speedup", values)
        ax.errorbar([g for g, _ in chain], values,
                    yerr=interval if interval is not None else
                    [r.get("speedup_std") or 0.0 for _, r in chain], fmt="o-", capsize=3,
                    label="measured: median paired ratio (95% interval)" if interval
                    is not None else "measured (±1 sd over prompts)")
        predicted = [(g, r["predicted_speedup"]) for g, r in chain
                     if r["predicted_speedup"] is not None]  # None when batched
        if predicted:
            ax.plot([g for g, _ in predicted], [p for _, p in predicted], "s--",
                    label="predicted (Leviathan Thm 3.8)")
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        ax.set_xticks([g for g, _ in chain])
        ax.set_xlabel("draft length gamma (tokens)")
        ax.set_ylabel("speedup (x AR tokens/s)")
        ax.set_title(f"Chain speculative sampling: speedup against gamma, over {over}",
                     fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        figs["speedup_vs_gamma.png"] = fig
    return figs
