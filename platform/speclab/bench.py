"""``speclab bench``: the engine benchmark on the reference pair (a command, not a test).

For each method it prints and writes as JSON: tau, target calls per token, tokens/s,
speedup over autoregressive decoding (AR re-timed right before each method, A B A B),
the predicted speedup (Leviathan Theorem 3.8 from the measured alpha and cost ratio c
for chains; the eq. 2.1 cost model otherwise) and measured/predicted. In the same run,
on the same pair and prompts: Hugging Face assisted generation and prompt lookup.
Every clock read waits for the device first (:func:`speclab.timing.now`); every row
carries ``peak_gpu_mb``, the most GPU memory PyTorch held during its block (a column of
the printed table on CUDA; NaN in the JSON and MLflow metrics on a CPU).
"""

from __future__ import annotations

import functools
import json
import platform
import statistics
from pathlib import Path

import torch

from speclab.evaluation import (
    COLUMNS,
    MethodRun,
    Totals,
    format_table,
    interleaved_comparison,
    run_prompts,
    summarize,
)
from speclab.timing import max_mb, now, peak_gpu_mb, reset_peak_gpu

# score_temperature 0.5: the reference draft is under-confident (path probabilities
# fall faster than real acceptance); sharpening the ranking softmax fixes the trees'
# shape. Measured in the closing note of the engine issue; 1.0 is the papers' setting.
DEFAULT_RUNS = [
    MethodRun("chain", {"gamma": 3}),
    MethodRun("chain", {"gamma": 5}),
    MethodRun("tree", {"tree_top_k": 2, "depth": 6, "nodes": 10, "score_temperature": 0.5}),
    MethodRun("optimal", {"nodes": 16, "batch": 4, "depth": 10, "score_temperature": 0.5}),
    MethodRun("salf", {"nodes": 16, "batch": 4, "salf_threshold": 0.2, "depth": 10}),
    MethodRun("salf", {"nodes": 16, "batch": 4, "salf_threshold": 0.2, "depth": 10,
                       "score_temperature": 0.5}),
]


def hf_generate_totals(dec, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> Totals:
    """Time ``transformers`` ``generate`` (greedy) per prompt (the clock read after the
    device finished); fills wall time, outputs and the block's ``peak_gpu_mb``."""
    model = dec.target.model
    totals = Totals()
    reset_peak_gpu(model.device)
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        t0 = now(model.device)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_new_tokens,
                                 pad_token_id=dec.eos_token_id, **kwargs)
        totals.wall_s += now(model.device) - t0
        new = out[0, len(ids):].tolist()
        totals.prompts += 1
        totals.new_tokens += len(new)
        totals.outputs.append(new)
    totals.peak_gpu_mb = peak_gpu_mb(model.device)
    return totals


def table_columns(columns: list[tuple[str, str]], device: str) -> list[tuple[str, str]]:
    """``columns`` plus peak GPU memory (MiB) when the models run on CUDA."""
    return [*columns, ("peak_gpu_mb", "{:.0f}")] if device.startswith("cuda") else columns


def reference_setup(num_prompts: int, device: str, dtype: str, compile: bool = False):
    """The reference pair (built on first use), a Decoder over it and ``num_prompts``
    held-out stdlib function-header prompts as token ids."""
    from speclab.api import Decoder
    from speclab.data.corpus import function_header_prompts
    from speclab.models.reference import ensure_reference_pair

    pair = ensure_reference_pair()
    dec = Decoder.from_pretrained(pair.target, pair.draft, dtype, device, compile=compile)
    return pair, dec, [dec.encode(p.text) for p in function_header_prompts("test", num_prompts)]


def run_bench(num_prompts: int = 16, max_new_tokens: int = 64, out_dir: str = "bench_out",
              runs: list[MethodRun] | None = None, device: str = "cpu",
              dtype: str = "float32") -> list[dict]:
    """Run the benchmark, print the table, write ``bench.json``; returns the rows."""
    pair, dec, prompts = reference_setup(num_prompts, device, dtype)
    gen = {"max_new_tokens": max_new_tokens}
    runs = runs or DEFAULT_RUNS
    results = interleaved_comparison(dec, runs, prompts, gen)
    reference = run_prompts(dec, MethodRun("ar"), prompts, gen).outputs
    ar_row = summarize(MethodRun("ar"), results[runs[0].name]["ar"], results[runs[0].name]["ar"],
                       reference)
    rows = [ar_row]
    for r in results.values():
        rows.append(summarize(r["run"], r["totals"], r["ar"], reference))
    # Hugging Face baselines on the same pair and prompts, AR re-timed before each
    draft_model = dec.draft.model
    for label, kwargs in (("hf_assisted", {"assistant_model": draft_model}),
                          ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 3})):
        hf_generate_totals(dec, prompts[:1], 8, **kwargs)  # warm-up
        ar = run_prompts(dec, MethodRun("ar"), prompts, gen)
        tot = hf_generate_totals(dec, prompts, max_new_tokens, **kwargs)
        tps = tot.new_tokens / tot.wall_s
        ar_tps = ar.new_tokens / ar.wall_s
        rows.append({"method": label, "prompts": tot.prompts, "new_tokens": tot.new_tokens,
                     "tokens_per_s": tps, "ar_tokens_per_s": ar_tps, "speedup": tps / ar_tps,
                     "wall_s": tot.wall_s, "peak_gpu_mb": tot.peak_gpu_mb,
                     "identical_to_ar": tot.outputs == reference})
    print(format_table(rows, table_columns(COLUMNS, device)))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": pair.target, "draft": pair.draft, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "torch_threads": torch.get_num_threads(),
            "machine": platform.platform(), "temperature": 0.0, "device": device,
            "dtype": dtype, "gpu": torch.cuda.get_device_name() if device.startswith("cuda")
            else None}
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out / 'bench.json'}")
    return rows


# chain at its two best lengths and SALF with the sharpened ranking (see DEFAULT_RUNS)
BATCH_RUNS = [
    MethodRun("chain", {"gamma": 2}),
    MethodRun("chain", {"gamma": 3}),
    MethodRun("salf", {"nodes": 16, "batch": 4, "salf_threshold": 0.2, "depth": 10,
                       "score_temperature": 0.5}),
]


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (ValueError naming ``batch_sizes``)."""
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"batch_sizes: expected comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"batch_sizes: need integers >= 1, got {text!r}")
    return sorted(set(sizes))


def crossover(rows: list[dict]) -> dict[str, int | None]:
    """Per method: the smallest batch size at which it is no faster than AR at that batch
    size (``speedup <= 1``); None when it pays at every size measured."""
    out: dict[str, int | None] = {}
    for r in sorted(rows, key=lambda r: r["batch_size"]):
        if r["method"] == "ar":
            continue
        out.setdefault(r["method"], None)
        if out[r["method"]] is None and r["speedup"] <= 1.0:
            out[r["method"]] = r["batch_size"]
    return out


def batch_plot(rows: list[dict]):
    """Speedup over AR (same batch size) against batch size, one line per method, and AR's
    tokens/s; a matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    methods = sorted({r["method"] for r in rows if r["method"] != "ar"})
    for m in methods:
        pts = sorted((r["batch_size"], r["speedup"]) for r in rows if r["method"] == m)
        ax.plot([b for b, _ in pts], [s for _, s in pts], "o-", label=m)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("speedup over AR at the same batch size (x)")
    ax.set_title("Where speculation stops paying (greedy, reference pair)")
    ax.legend(fontsize=7, loc="best")
    ar = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if r["method"] == "ar")
    ax2.plot([b for b, _ in ar], [t for _, t in ar], "o-")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("AR tokens/s (all rows)")
    ax2.set_title("Autoregressive throughput")
    fig.tight_layout()
    return fig


BATCH_COLUMNS = [
    ("batch_size", "{}"), ("method", "{}"), ("tau", "{:.2f}"),
    ("target_calls_per_token", "{:.3f}"), ("target_forwards_per_token", "{:.3f}"),
    ("tokens_per_s", "{:.1f}"), ("speedup", "{:.2f}x"), ("ar_scaling", "{:.2f}x"),
    ("measured_over_predicted", "{:.2f}"), ("identical_to_alone", "{}"),
]


def run_batch_bench(batch_sizes: list[int], num_prompts: int = 16, max_new_tokens: int = 64,
                    out_dir: str = "bench_out", runs: list[MethodRun] | None = None,
                    device: str = "cpu", dtype: str = "float32", log_mlflow: bool = False,
                    tracking_uri: str | None = None, repeats: int = 1,
                    compile: bool = False) -> list[dict]:
    """The batched engine at each batch size: AR, then each method with AR re-timed right
    before it at the SAME batch size, ``repeats`` times (timed figures: the median).
    Prints the table, writes ``batch_bench.json`` and ``batch_scaling.png``; with
    ``log_mlflow`` also an MLflow run at ``tracking_uri`` (default: the embedded store)
    in experiment ``speclab-bench``, with every figure as a metric whose step is the
    batch size, and the plot. ``compile``: the static, compiled fast path; its warm-up
    (the forwards that compiled a shape and, on CUDA, captured its CUDA graph: all in the
    untimed warm-up passes; any later one is taken out of the timed figures of the pass
    it fell in, see :class:`speclab.api.Decoder`) is reported apart as
    ``compile_warmup_s``. Returns the rows."""
    if num_prompts < max(batch_sizes):
        raise ValueError(f"batch_sizes: the largest ({max(batch_sizes)}) exceeds the number "
                         f"of prompts ({num_prompts})")
    pair, dec, prompts = reference_setup(num_prompts, device, dtype, compile)
    runs = runs or BATCH_RUNS
    if compile:  # compile every shape before anything is timed (full-length warm-up)
        t0 = now(device)
        for bs in batch_sizes:
            for run in [MethodRun("ar"), *runs]:
                run_prompts(dec, run, prompts, {"max_new_tokens": max_new_tokens,
                                                "batch_size": bs})
        warm = now(device) - t0
        print(f"compile warm-up: {dec.warmup_s:.1f} s compiling, {warm:.1f} s for the "
              f"untimed warm-up passes")
    reference = run_prompts(dec, MethodRun("ar"), prompts, {"max_new_tokens": max_new_tokens}
                            ).outputs  # each prompt decoded alone
    rows: list[dict] = []
    for bs in batch_sizes:
        gen = {"max_new_tokens": max_new_tokens, "batch_size": bs}
        blocks = []
        for _ in range(repeats):  # each repeat: AR, method, AR, method, ... (A B A B)
            results = interleaved_comparison(dec, runs, prompts, gen, warmup=not blocks)
            first = results[runs[0].name]["ar"]
            blocks.append([summarize(MethodRun("ar"), first, first, reference)]
                          + [summarize(r["run"], r["totals"], r["ar"], reference)
                             for r in results.values()])
        for i, row in enumerate(blocks[0]):  # timed figures: the median over repeats
            for k in ("tokens_per_s", "ar_tokens_per_s", "speedup", "wall_s"):
                row[k] = statistics.median(b[i][k] for b in blocks)
            row["speedup_repeats"] = [b[i]["speedup"] for b in blocks]
            row["peak_gpu_mb"] = functools.reduce(max_mb, (b[i]["peak_gpu_mb"] for b in blocks))
            row["identical_to_alone"] = all(b[i].pop("identical_to_ar") for b in blocks)
            row["batch_size"] = bs
            row.pop("identical_to_ar", None)
        rows += blocks[0]
    ar_first = next(r["tokens_per_s"] for r in rows if r["method"] == "ar")
    for row in rows:  # AR tokens/s over AR's at the smallest batch size measured
        row["ar_scaling"] = row["tokens_per_s"] / ar_first if row["method"] == "ar" else None
    print(format_table(rows, table_columns(BATCH_COLUMNS, device)))
    cross = crossover(rows)
    print("\ncrossover batch size (speculation no faster than AR from here; '-': pays at "
          "every size measured):")
    for m, b in cross.items():
        print(f"  {m}: {b if b is not None else '-'}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": pair.target, "draft": pair.draft, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "batch_sizes": batch_sizes, "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "machine": platform.platform(),
            "device": device, "dtype": dtype, "temperature": 0.0, "compile": compile,
            "compile_warmup_s": dec.warmup_s}
    (out / "batch_bench.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "crossover": cross}, indent=2))
    fig = batch_plot(rows)
    fig.savefig(out / "batch_scaling.png", dpi=110)
    print(f"\nwrote {out / 'batch_bench.json'} and {out / 'batch_scaling.png'}")
    if log_mlflow:
        log_batch_bench(tracking_uri, meta, rows, cross, fig)
    return rows


def log_batch_bench(uri: str | None, meta: dict, rows: list[dict], cross: dict, fig) -> None:
    """One MLflow run in ``speclab-bench``: ``<method>.<figure>`` metrics with the batch
    size as step, ``crossover.<method>``, the table and the plot."""
    from speclab.evaluation import MethodRun
    from speclab.tracking import MlflowTracker, resolve_tracking_uri

    with MlflowTracker(resolve_tracking_uri(uri), "speclab-bench", "batch-bench", meta) as t:
        for r in rows:
            key = MethodRun(r["method"]).key
            t.log_metrics({f"{key}.{k}": v for k, v in r.items()
                           if k not in ("method", "batch_size")}, step=r["batch_size"])
        t.log_metrics({f"crossover.{MethodRun(m).key}": b for m, b in cross.items()
                       if b is not None})
        t.log_table(rows, "batch_bench")
        t.log_figure(fig, "batch_scaling.png")
