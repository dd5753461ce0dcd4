"""Stage: evaluate methods with a target/draft pair on Ray actors (evaluate, distill,
compare_losses, specdecpp_eval).

Prompts are spread over actors that hold the models; each actor runs the paired timing
protocol over its prompts (:func:`speclab.evaluation.interleaved_comparison`: every
method paired with AR prompt by prompt over ``decoding.timing_passes`` passes, its
forwards priced on the forward cost curves it measured first). The driver merges the
counters and pairs and prints the table (speedup: the median paired ratio with its 95%
interval, beside the ratio of totals and the engine's overhead; at temperature 0 the
outputs against plain decoding's, near ties told from failures on the actors that hold
the target: :func:`shard_agreement`); each method (AR included) becomes
a child run with the same metric keys (:mod:`speclab.pipelines.method_runs`), and the
active run gets the table (CSV/JSON/TXT), the per-position acceptance table, the plots
(:mod:`speclab.pipelines.eval_plots`) and ``best_*`` metrics.
"""

from __future__ import annotations

import json
from collections import deque
from typing import TYPE_CHECKING, Any

from speclab.agreement import compare_outputs, merge_agreements
from speclab.api import Decoder
from speclab.config import MethodConfig
from speclab.config.jobs import TRAINED
from speclab.data.prompts import Prompts, chat_prompts, is_chat, jsonl_records, load_prompts
from speclab.evaluation import (
    MethodRun,
    format_table,
    interleaved_comparison,
    markdown_table,
    merge_results,
    pooled_ar,
    speedup_cell,
    summarize,
)
from speclab.models.loading import load_tokenizer, resolve_source
from speclab.models.registry import resolve_models
from speclab.pipelines.eval_plots import acceptance_table, method_figures
from speclab.pipelines.method_runs import log_best, log_child_runs, method_params

if TYPE_CHECKING:
    import torch


def evaluate_pair(cfg: Any, target: str, draft: str | None, prompts: list[list[int]],
                  tracker, prefix: str = "",
                  methods: list[MethodConfig] | None = None,
                  children: bool = True) -> list[dict]:
    """Evaluate ``methods`` (default ``cfg.method_list()``) on ``prompts`` (token ids)
    with ``cfg``'s ``models``, ``decoding`` and ``resources`` groups; log to ``tracker``.

    ``prefix`` is prepended to the parent's metric keys and artifact names (e.g.
    ``eval/``). ``children=False`` leaves the per-method child runs to the caller (who
    adds columns first: :func:`log_method_children`). Returns the table rows (AR first).
    """
    import ray

    runs = list(methods) if methods is not None else cfg.method_list()
    method_runs = [MethodRun(m.name, m.params(), m.label or "") for m in runs]
    categories = getattr(prompts, "categories", None) or ["all"] * len(prompts)
    data = getattr(cfg, "data", None)
    source = f"{data.prompts}:{data.path or 'built-in'}" if data is not None else "prompts"
    tracker.log_dataset([{"category": c, "tokens": len(p), "prompt_ids": json.dumps(p)}
                         for c, p in zip(categories, prompts, strict=True)], source,
                        "evaluation")
    n_act = min(cfg.resources.num_actors, len(prompts))
    shards = [list(zip(categories[i::n_act], prompts[i::n_act], strict=True))
              for i in range(n_act)]
    gen = cfg.decoding.generate_kwargs()
    device = "cuda" if cfg.resources.num_gpus_per_actor > 0 else cfg.models.device
    dtype, attn = cfg.models.dtype, cfg.models.attn_implementation
    threads = cfg.resources.torch_threads

    @ray.remote(max_concurrency=2)  # run() in one thread, lines() answered beside it
    class EvalWorker:
        """Holds the target and draft; evaluates methods over a shard of prompts."""

        def __init__(self) -> None:
            import torch

            if threads:
                torch.set_num_threads(threads)
            self.dec = Decoder.from_pretrained(target, draft, dtype, device,
                                               attn_implementation=attn)
            # progress lines the driver has not taken yet
            self.said = deque([f"models loaded, torch threads {torch.get_num_threads()}"])

        def lines(self) -> list[str]:
            """The progress lines since the last call (the driver prints them, so every
            one comes before the table)."""
            return [self.said.popleft() for _ in range(len(self.said))]

        def run(self, shard: list[tuple[str, list[int]]]) -> dict[str, dict]:
            """``{category: interleaved_comparison's result}`` over the shard's prompts
            of each category (the paired protocol is per prompt, so splitting the shard
            by category changes no figure of the whole)."""
            def progress(line: str) -> None:
                self.said.append(line)

            out = {}
            for cat in dict.fromkeys(c for c, _ in shard):
                mine = [p for c, p in shard if c == cat]
                out[cat] = interleaved_comparison(self.dec, method_runs, mine, gen,
                                                  progress=progress)
                if gen.get("temperature", 0) == 0:  # greedy: how each method's outputs differ
                    shard_agreement(self.dec.target.model, mine, out[cat])
            return out

    actors = [EvalWorker.options(num_cpus=cfg.resources.num_cpus_per_actor,
                                 num_gpus=cfg.resources.num_gpus_per_actor).remote()
              for _ in range(n_act)]
    try:
        parts = gather_with_progress(actors, [a.run.remote(s) for a, s in zip(actors, shards)])
    finally:
        for a in actors:
            ray.kill(a)

    rows = table_rows(cfg, [out for part in parts for out in part.values()], method_runs)
    print(format_table(rows), flush=True)
    noisy = [f"{r['method']}: {r['timing_note']}" for r in rows if r.get("noisy")]
    if noisy:
        print("[evaluate] noisy timings (read those speedups with care): "
              + "; ".join(noisy), flush=True)
    log_evaluation(tracker, rows, runs, prefix, children)
    names = list(dict.fromkeys(categories))
    if names != ["all"]:
        by_cat = {c: table_rows(cfg, [p[c] for p in parts if c in p], method_runs)
                  for c in names}
        log_categories(tracker, by_cat, prefix)
    firsts = [next(iter(part.values())) for part in parts]  # each actor's first category
    costs = [c for out in firsts if (c := next(iter(out.values()), {}).get("costs"))]
    if costs:  # the forward cost curves behind modelled_s, one per actor
        tracker.log_text(json.dumps([c.to_dict() for c in costs], indent=1),
                         f"{prefix.replace('/', '_')}forward_costs.json")
    return rows


def gather_with_progress(actors: list, refs: list, every_s: float = 2.0) -> list:
    """``ray.get(refs)`` (``refs[i]``: a call on ``actors[i]``, whose ``lines()`` returns
    its new progress lines), printing each actor's lines as they come, tagged with the
    actor's number when there are several: every line is printed before this returns."""
    import ray
    from ray.exceptions import RayActorError

    tag = len(actors) > 1
    left = list(refs)
    while True:
        ready, left = ray.wait(left, num_returns=len(left), timeout=every_s)
        for i, actor in enumerate(actors):
            try:
                got = ray.get(actor.lines.remote())
            except RayActorError:  # it died: ray.get below raises its own error
                continue
            for line in got:
                print(f"[evaluate]{f' actor {i + 1}:' if tag else ''} {line}", flush=True)
        if not left:
            return ray.get(list(refs))
        ray.get(ready)  # each call once, as it finishes: one that raised raises at once


#: the figures of each method logged per category (besides the whole table in JSON)
CATEGORY_METRICS = ("tau", "target_calls_per_token", "speedup", "speedup_lo", "speedup_hi",
                    "tokens_per_s", "accept_at_1", "accept_at_2", "accept_at_3", "accept_at_4")


def table_rows(cfg: Any, parts: list[dict], method_runs: list[MethodRun]) -> list[dict]:
    """The table rows (AR first) of :func:`interleaved_comparison` results over disjoint
    prompt sets (actors' shards, categories), merged."""
    merged = merge_results(parts)
    first = merged[method_runs[0].name]
    # outputs are in part order; the AR block of the first method is the reference
    reference = first["ar"].outputs if cfg.decoding.temperature == 0 else None
    ar = pooled_ar(merged)  # the AR row: every method's AR timings
    rows = [summarize(MethodRun("ar"), ar, ar, reference)]
    for run in method_runs:
        m = merged[run.name]
        rows.append(summarize(run, m["totals"], m["ar"], reference))
        agreed = [part[run.name].get("agreement") for part in parts]
        if rows[-1].get("identical_to_ar") is False and None not in agreed:
            rows[-1].update(merge_agreements(agreed))
    return rows


def log_categories(tracker, by_cat: dict[str, list[dict]], prefix: str = "") -> None:
    """Print one table per category and log each method's :data:`CATEGORY_METRICS` as
    ``<prefix>category/<category>/<method>/<metric>`` (names made valid MLflow keys:
    ``chain(gamma=2)`` -> ``chain_gamma_2``) and every row as
    ``<prefix>categories.json``."""
    import math

    from speclab.tracking import metric_key

    metrics = {}
    for cat, rows in by_cat.items():
        print(f"[evaluate] category {cat} ({rows[0]['prompts']} prompts)", flush=True)
        print(format_table(rows), flush=True)
        for row in rows:
            key = f"{prefix}category/{metric_key(cat)}/{metric_key(row['method'])}"
            for m in CATEGORY_METRICS:
                v = row.get(m)
                if isinstance(v, int | float) and not math.isnan(v):
                    metrics[f"{key}/{m}"] = float(v)
    tracker.log_metrics(metrics)
    tracker.log_text(json.dumps(by_cat, indent=1, default=str),
                     f"{prefix.replace('/', '_')}categories.json")


def shard_agreement(model: torch.nn.Module, prompts: list[list[int]],
                    results: dict[str, dict]) -> None:
    """On an actor, after :func:`speclab.evaluation.interleaved_comparison` over its
    ``prompts``: each method's outputs against the first method's AR outputs (plain
    decoding, the reference), as ``results[name]["agreement"]``
    (:func:`speclab.agreement.compare_outputs`: identical, near ties, differing; a target
    forward only at a prompt whose outputs differ). The driver merges the shards'
    (:func:`speclab.agreement.merge_agreements`) into the rows whose outputs differ, so
    the table reads ``ties k/n`` for a low-precision rounding tie, as bench's does."""
    reference = next(iter(results.values()))["ar"].outputs
    for res in results.values():
        res["agreement"] = compare_outputs(model, prompts, res["totals"].outputs, reference)


def log_method_children(tracker, rows: list[dict], runs: list[MethodConfig],
                        skip: tuple[str, ...] = ()) -> None:
    """One child run per row of :func:`evaluate_pair` (AR first, then ``runs``), with
    ``method.*`` params and identical metric keys."""
    params = [method_params("ar", "ar", {})]
    for m, row in zip(runs, rows[1:]):
        params.append(method_params(row["method"], m.name, m.params()))
    log_child_runs(tracker, rows, params, skip=skip)


def log_evaluation(tracker, rows: list[dict], runs: list[MethodConfig], prefix: str = "",
                   children: bool = True) -> None:
    """Log :func:`evaluate_pair`'s ``rows`` (AR first, then ``runs``): a child run per
    method (unless ``children`` is False), and on ``tracker``'s run the table, the
    per-position acceptance table, the plots and ``{prefix}best_*`` metrics."""
    if children:
        log_method_children(tracker, rows, runs)
    log_best(tracker, rows[1:] or rows, prefix)
    tracker.log_metrics({f"{prefix}prompts": rows[0]["prompts"], f"{prefix}methods": len(runs)})
    name = prefix.replace("/", "_")
    tracker.log_table(rows, f"{name}results")
    tracker.log_text(format_table(rows), f"{name}results.txt")
    if not prefix:  # the run's description on its MLflow page: the summary at a glance
        best = max(rows[1:] or rows, key=lambda r: r.get("speedup") or 0.0)
        tracker.set_tags({"mlflow.note.content": (
            f"**Best speedup {speedup_cell(best)}** ({best['method']}, tau "
            f"{best.get('tau') or 0.0:.2f}) over {rows[0]['prompts']} prompts.\n\n"
            f"{markdown_table(rows)}\n\nPlots: `speedup_per_method.png`, "
            "`tau_per_method.png`, `acceptance_per_position.png` (Artifacts).")})
    accept = acceptance_table(rows)
    if accept:
        tracker.log_table(accept, f"{name}acceptance_per_position")
    gammas = [m.gamma if m.name == "chain" else None for m in runs]
    for fname, fig in method_figures(rows, gammas).items():
        tracker.log_figure(fig, f"{name}{fname}")


def evaluate_trained(cfg: Any, target: str, prompts: list[list[int]], tracker, field: str,
                     folder: str) -> list[dict]:
    """:func:`evaluate_pair` of ``cfg.method_list()`` where every method whose ``field``
    (``eagle_model``, ``medusa_model``) is ``trained`` uses the model just trained in
    ``folder``. Those keep their configured name as label, so tables and metric keys do
    not carry (and are not lengthened by) the run folder. Methods with a draft LM use
    ``models.draft``. Returns the rows, AR first."""
    methods = [m.model_copy(update={field: str(folder), "label": m.label or MethodRun(
        m.name, m.params(), "").name}) if getattr(m, field, None) == TRAINED else m
        for m in cfg.method_list()]
    draft = None
    if any(m.needs_draft_model for m in methods):
        _, draft = resolve_models(cfg.models.target, cfg.models.draft)
    return evaluate_pair(cfg, target, draft, prompts, tracker, "eval/", methods)


def tokenized_prompts(cfg: Any, target: str | None = None, tokenizer=None) -> Prompts:
    """The ``data`` prompt set, tokenised with the target's tokenizer (on the driver):
    ``tokenizer`` when already loaded, else the one in ``target``'s folder (a model
    folder), with each prompt's category. Chat kinds go through the chat template; their
    second turns (``data.turns: 2``) follow the target's own greedy answer to the first
    (``decoding.max_new_tokens`` tokens)."""
    data = cfg.data
    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_source(target, "models.target"), "models.target")
        if tokenizer is None:
            raise ValueError("models.target: no tokenizer next to the target to encode the "
                             "data prompts")
    if is_chat(data):
        dec: list[Decoder] = []

        def answer(ids: list[int]) -> str:
            if not dec:
                dec.append(Decoder.from_pretrained(target, None, cfg.models.dtype))
            res = dec[0].generate(prompt_ids=ids, method="ar",
                                  max_new_tokens=cfg.decoding.max_new_tokens)
            kept = [t for t in res.token_ids if t != dec[0].eos_token_id]
            return tokenizer.decode(kept, skip_special_tokens=True).strip()

        return chat_prompts(data, tokenizer, answer if target else None)
    if data.prompts == "jsonl":
        cats, texts = zip(*jsonl_records(data.path, data.num_prompts), strict=True)
    else:
        texts = load_prompts(data.prompts, data.num_prompts, data.context_chars, data.path,
                             data.seed)
        cats = None
    return Prompts([tokenizer.encode(t, add_special_tokens=False) for t in texts], cats)
