"""Retrieval drafting evaluation: AASD Table 2 (MAL, tokens/s, speedup) and Tables 4/5
(accuracy and ablations) on tasks that reward context reuse.

    python -m jobs.retrieval_eval --config experiments/retrieval.yaml

For every ``retrieval.tasks`` entry (code completion over stdlib files, docstring QA,
docstring summaries; :mod:`speclab.data.tasks`) the ``methods`` (e.g. ar, rest, pld,
aasd and AASD without alignment sampling / without conditional verification) decode
the same prompts in ONE Ray actor, each paired with the AR baseline prompt by prompt
over ``decoding.timing_passes`` passes (:func:`speclab.evaluation.interleaved_comparison`);
Hugging Face prompt lookup is timed too, paired the same way
(``retrieval.hf_prompt_lookup`` tokens). Per task x method: MAL (mean accepted length
= tokens per target forward), tokens/s, speedup over AR (the median paired ratio with
its 95% interval, beside the ratio of totals), the engine's overhead against the
measured forward costs, and the task's accuracy (Edit Sim, token F1 or ROUGE-L against
the reference) next to AR's. Logged as one
MLflow table and text on the job's run, with ``<task>/best_*`` metrics; every task x
method is a child run (``method.*`` params, ``method.task``) with the same metric keys.
"""

from __future__ import annotations

import time

from speclab.api import Decoder
from speclab.bench import hf_rows
from speclab.config import RetrievalEvalJob
from speclab.data.tasks import load_task
from speclab.evaluation import (
    MethodRun,
    format_table,
    interleaved_comparison,
    overhead_cell,
    pooled_ar,
    speedup_cell,
    summarize,
)
from speclab.models.loading import resolve_source
from speclab.models.registry import resolve_models
from speclab.pipelines.cli import start_job
from speclab.pipelines.method_runs import log_best, log_child_runs, method_params
from speclab.raylib import init_ray
from speclab.text_metrics import METRICS


def prepare(cfg: RetrievalEvalJob):
    """(target folder, {task: [TaskExample]}); ValueError on bad input."""
    needs_draft = [m.name for m in cfg.method_list() if m.needs_draft_model]
    if needs_draft:
        raise ValueError(f"methods: retrieval_eval runs model-free methods only, got "
                         f"{needs_draft}")
    target, _ = resolve_models(cfg.models.target, None)
    r = cfg.retrieval
    tasks = {t: load_task(t, r.num_prompts, r.context_chars, r.reference_chars)
             for t in r.tasks}
    return resolve_source(target, "models.target"), tasks


def run_tasks(cfg: RetrievalEvalJob, target: str, tasks: dict) -> list[dict]:
    """Decode every task with every method in one actor; returns table rows."""
    import ray

    runs = [MethodRun(m.name, m.params(), m.label or "") for m in cfg.method_list()]
    gen = cfg.decoding.generate_kwargs()
    hf_n = cfg.retrieval.hf_prompt_lookup
    payload = {t: [(ex.prompt, ex.reference, ex.metric) for ex in exs]
               for t, exs in tasks.items()}

    @ray.remote
    def work() -> list[dict]:
        dec = Decoder.from_pretrained(target, None, cfg.models.dtype, cfg.models.device)
        rows = []
        for task, exs in payload.items():
            prompts = [dec.encode(p) for p, _, _ in exs]
            metric = METRICS[exs[0][2]]

            def acc(outputs: list[list[int]], exs=exs, metric=metric) -> float:
                texts = [dec.tokenizer.decode(o) for o in outputs]
                return sum(metric(t, ref) for t, (_, ref, _) in zip(texts, exs)) / len(exs)

            res = interleaved_comparison(dec, runs, prompts, gen)
            first = res[runs[0].name]["ar"]
            ar = pooled_ar(res)
            ar_row = summarize(MethodRun("ar"), ar, ar, first.outputs)
            rows.append({"task": task, **ar_row, "accuracy": acc(first.outputs)})
            for run in runs:
                m = res[run.name]
                row = summarize(run, m["totals"], m["ar"], first.outputs)
                rows.append({"task": task, **row, "accuracy": acc(m["totals"].outputs)})
            if hf_n:
                for row, outputs in hf_rows(
                        dec, {f"hf_prompt_lookup({hf_n})": {"prompt_lookup_num_tokens": hf_n}},
                        prompts, gen, first.outputs, res[runs[0].name]["costs"]):
                    rows.append({"task": task, **row, "accuracy": acc(outputs)})
        return rows

    cpus = cfg.resources.num_cpus_per_actor
    return ray.get(work.options(num_cpus=cpus).remote())


def log_children(cfg: RetrievalEvalJob, rows: list[dict], tracker) -> None:
    """One child run per task x method row, and ``<task>/best_*`` on the job's run."""
    known = {"ar": method_params("ar", "ar", {})}
    for m in cfg.method_list():
        label = MethodRun(m.name, m.params(), m.label or "").name
        known[label] = method_params(label, m.name, m.params())
    params = []
    for r in rows:  # the Hugging Face baseline is named "hf_prompt_lookup(<tokens>)"
        p = known.get(r["method"]) or method_params(r["method"], r["method"].split("(")[0], {})
        params.append({**p, "label": f"{r['task']}/{r['method']}", "task": r["task"]})
    log_child_runs(tracker, rows, params)
    for task in dict.fromkeys(r["task"] for r in rows):
        log_best(tracker, [r for r in rows if r["task"] == task and r["method"] != "ar"],
                 f"{task}/", ("speedup", "tau", "tokens_per_s", "accuracy"))


def main(argv: list[str] | None = None) -> int:
    job = start_job("retrieval_eval", __doc__, argv, prepare)
    cfg, tracker, (target, tasks) = job.cfg, job.tracker, job.inputs

    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[retrieval_eval] running on {where}; tasks {list(tasks)}", flush=True)
    with tracker as t:
        t.set_tags({"job": "retrieval_eval", "target": target})
        t0 = time.perf_counter()
        rows = run_tasks(cfg, target, tasks)
        cols = [("task", "{}"), ("method", "{}"), ("tau", "{:.2f}"),
                ("tokens_per_s", "{:.1f}"), ("speedup", speedup_cell),
                ("speedup_totals", "{:.2f}x"), ("engine_overhead", overhead_cell),
                ("accuracy", "{:.3f}"), ("noisy", "{}"), ("identical_to_ar", "{}")]
        text = format_table(rows, cols).replace(" tau ", " MAL ", 1)
        print(text, flush=True)
        t.log_table(rows, "retrieval_results")
        t.log_text(text, "retrieval_results.txt")
        log_children(cfg, rows, t)
        t.log_metrics({"wall_s": time.perf_counter() - t0})
    return 0
