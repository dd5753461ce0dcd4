"""``speclab bench``: the engine benchmark on the reference pair (a command, not a test).

For each method it prints and writes as JSON: tau, target calls per token, tokens/s,
the speedup over autoregressive decoding timed in pairs (each method paired with AR
prompt by prompt over ``passes`` passes: the median paired ratio with its 95% interval,
beside the ratio of totals and a ``noisy`` flag; :mod:`speclab.paired_timing`), the
engine's own share of the wall time against the forward costs measured at the start of
the run (``modelled_s``, ``engine_overhead``; :mod:`speclab.forward_costs`), the
predicted speedup (Leviathan Theorem 3.8 from the measured alpha and cost ratio c for
chains; the eq. 2.1 cost model otherwise) and measured/predicted. In the same run, on
the same pair and prompts and paired the same way: Hugging Face assisted generation and
prompt lookup. Every clock read waits for the device first
(:func:`speclab.timing.now`); every row carries ``peak_gpu_mb``, the most GPU memory
PyTorch held during its blocks (a column of the printed table on CUDA; NaN in the JSON
and MLflow metrics on a CPU).
"""

from __future__ import annotations

import contextlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from speclab.agreement import agreement_cell, mark_agreement
from speclab.api import Decoder
from speclab.config.schema import DataConfig
from speclab.data.conversations import template_ids
from speclab.data.corpus import function_header_prompts
from speclab.data.prompts import Prompts, chat_prompts, first_turn_records
from speclab.evaluation import (
    COLUMNS,
    TIMING_PASSES,
    MethodRun,
    Totals,
    clocked,
    format_table,
    interleaved_comparison,
    merge_results,
    overhead_cell,
    overheads,
    paired_passes,
    pooled_ar,
    price,
    recorder_for,
    run_prompts,
    speedup_cell,
    summarize,
)
from speclab.families.eagle.model import is_eagle_folder
from speclab.families.medusa.model import is_medusa_folder
from speclab.forward_costs import CostModel
from speclab.models.reference import ensure_reference_pair
from speclab.paired_timing import AR_SPREAD_BOUND, speedup_figures
from speclab.pipelines.eval_plots import interval_errors
from speclab.real_pair import REAL_PAIRS, RealPair, ensure_real_pair
from speclab.reference_large import (
    ensure_reference_large,
    forward_cost,
    held_out_ids,
    run_dtype,
)
from speclab.reference_xl import (
    ReferenceXL,
    XLSpec,
    checksum_key,
    grow_reference_xl,
)
from speclab.timing import now, peak_gpu_mb, reset_peak_gpu
from speclab.tracking import MlflowTracker, resolve_tracking_uri

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

# reference-large's EAGLE row: the EAGLE drafter ranks its tree at 0.3, where it is sharpest
# (its small twin on the bench prompts, tree 4/6/16: tau 3.28 at 1.0, 4.06 at 0.5, 4.27
# at 0.3; closing note of stop 48)
EAGLE_RUN = {"tree_top_k": 4, "depth": 6, "nodes": 16, "score_temperature": 0.3}


def eagle_run(folder: str, name: str | None = None) -> MethodRun:
    """The bench's EAGLE row (:data:`EAGLE_RUN`) with the drafter in ``folder`` (a speclab
    EAGLE folder or a public checkpoint the engine loads), labelled by ``name`` (a real
    pair's registered ``models:/NAME/VERSION``: its downloaded folders all end in
    ``eagle``), else its folder name (and ``eagle3`` for a speclab EAGLE-3 folder); a
    missing folder is refused here, naming ``--eagle``."""
    if not Path(folder).is_dir():
        raise ValueError(f"--eagle: {folder} is not a folder")
    version = (json.loads((Path(folder) / "config.json").read_text()).get("version", 1)
               if is_eagle_folder(folder) else 1)
    knobs = ",".join(f"{k}={v}" for k, v in EAGLE_RUN.items())
    label = f"eagle{'3' if version == 3 else ''} {name or Path(folder).name} {knobs}"
    return MethodRun("eagle", {**EAGLE_RUN, "eagle_model": str(folder)}, label)


# the bench's Medusa row: the heads' calibrated sparse tree cut to EAGLE_RUN's 16 nodes
# (the same verification budget)
MEDUSA_RUN = {"tree": "sparse", "nodes": 16}


def medusa_run(folder: str, name: str | None = None) -> MethodRun:
    """The bench's Medusa row (:data:`MEDUSA_RUN`) with the heads in ``folder`` (speclab
    heads with their calibration, ``tree.json``), labelled by ``name`` (a registered
    model) or its folder name; a folder without calibrated speclab heads is refused here,
    naming ``--medusa``."""
    if not is_medusa_folder(folder) or not (Path(folder) / "tree.json").is_file():
        raise ValueError(f"--medusa: {folder} holds no calibrated speclab Medusa heads "
                         "(config.json of kind speclab-medusa and tree.json, written by "
                         "jobs.train_medusa)")
    knobs = ",".join(f"{k}={v}" for k, v in MEDUSA_RUN.items())
    return MethodRun("medusa", {**MEDUSA_RUN, "medusa_model": str(folder)},
                     f"medusa {name or Path(folder).name} {knobs}")


# the bench's SpecDec++ row: the acceptance head's stop threshold and draft-length cap
# (experiments/specdecpp_smollm2.yaml sweeps h in {0.3, 0.6, 0.9}; 0.6 gave the most
# tokens/s on the real pair, 15.5 against 15.4 at 0.3: within the noise)
SPECDECPP_RUN = {"stop_threshold": 0.6, "max_draft": 8}


def specdecpp_run(folder: str) -> MethodRun:
    """The bench's SpecDec++ row (:data:`SPECDECPP_RUN`) with the acceptance head saved in
    ``folder`` (beside a copy of the draft it was trained on, which must be the bench's
    draft: :func:`speclab.real_pair.ensure_real_pair` checks it), labelled by its knobs
    (a registered head's folder is named ``model``, which says nothing)."""
    knobs = ",".join(f"{k}={v}" for k, v in SPECDECPP_RUN.items())
    return MethodRun("specdecpp", {**SPECDECPP_RUN, "head": str(folder)}, f"specdecpp {knobs}")


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
        totals.timed_tokens += len(new)
        totals.outputs.append(new)
    totals.peak_gpu_mb = peak_gpu_mb(model.device)
    return totals


def hf_rows(dec, baselines: dict[str, dict], prompts: list[list[int]], gen: dict,
            reference: list[list[int]] | None, costs: CostModel | None = None,
            passes: int | None = None) -> list[tuple[dict, list[list[int]]]]:
    """Hugging Face ``generate`` baselines (``{label: generate kwargs}``, e.g. assisted
    generation or prompt lookup) paired with the engine's AR prompt by prompt like every
    method (:func:`speclab.evaluation.paired_passes`, ``passes`` default
    ``gen["timing_passes"]`` or :data:`~speclab.evaluation.TIMING_PASSES`); their
    forwards priced on ``costs`` when given. Returns ``(row, outputs)`` per baseline: the
    wall-clock columns of :func:`~speclab.evaluation.summarize` (the engine's counters
    do not apply to them) and the first pass's outputs."""
    gen = dict(gen)
    passes = passes or gen.pop("timing_passes", None) or TIMING_PASSES
    gen.pop("timing_passes", None)
    max_new = gen.get("max_new_tokens", 64)
    for kwargs in baselines.values():
        hf_generate_totals(dec, prompts[:1], 8, **kwargs)  # warm-up

    def block(kwargs: dict):
        return lambda ps, first: hf_generate_totals(dec, ps, max_new, **kwargs)

    blocks = {label: block(kwargs) for label, kwargs in baselines.items()}
    recorder = recorder_for(dec) if costs is not None else None
    with recorder if recorder is not None else contextlib.nullcontext():
        res = paired_passes(blocks, lambda ps, first: run_prompts(
            dec, MethodRun("ar"), ps, gen, first), prompts, passes, False,
            recorder.take if recorder is not None else None)
    if costs is not None:
        price(res, costs)
    out = []
    for label, (tot, ar) in res.items():
        tps = tot.timed_tokens / tot.wall_s if tot.wall_s else 0.0
        ar_tps = ar.timed_tokens / ar.wall_s if ar.wall_s else 0.0
        row = {"method": label, "prompts": tot.prompts, "new_tokens": tot.new_tokens,
               "tokens_per_s": tps, "ar_tokens_per_s": ar_tps,
               **speedup_figures(tot.pairs, tps / ar_tps if ar_tps else 0.0),
               "passes": tot.passes, "wall_s": tot.wall_s, "modelled_s": tot.modelled_s,
               **overheads(tot, ar), **clocked(tot),
               "peak_gpu_mb": tot.peak_gpu_mb}
        if reference is not None:
            row["identical_to_ar"] = tot.outputs == reference
        out.append((row, tot.outputs))
    return out


def table_columns(columns: list[tuple[str, str]], device: str) -> list[tuple[str, str]]:
    """``columns`` plus peak GPU memory (MiB) when the models run on CUDA."""
    return [*columns, ("peak_gpu_mb", "{:.0f}")] if device.startswith("cuda") else columns


#: the pairs ``--pair`` names: the reference pairs and the real pairs
#: (:data:`speclab.real_pair.REAL_PAIRS`)
PAIRS = ("reference", "reference-large", "reference-xl", *REAL_PAIRS)

#: the rows on a real pair besides its EAGLE drafters' and Medusa heads' (their rows:
#: :data:`EAGLE_RUN`, :data:`MEDUSA_RUN`): chains of gamma 2 and 3 and the trees of the
#: standalone draft at the papers' ranking temperature, and prompt lookup (no drafter)
REAL_RUNS = [
    MethodRun("chain", {"gamma": 2}),
    MethodRun("chain", {"gamma": 3}),
    MethodRun("tree", {"tree_top_k": 2, "depth": 4, "nodes": 8}),
    MethodRun("optimal", {"nodes": 16, "batch": 4, "depth": 8}),
    MethodRun("salf", {"nodes": 16, "batch": 4, "salf_threshold": 0.2, "depth": 8}),
    MethodRun("pld"),
]


def bench_prompts(dec: Decoder, num_prompts: int, prompt_file: str | None = None,
                  chat_data: str | None = None) -> Prompts:
    """The bench's prompts as token ids with their categories: ``num_prompts`` held-out
    stdlib function-header prompts (category ``all``), or, with ``chat_data`` (a
    conversations file or ``sharegpt``), the first turns of its held-out conversations
    through the chat template (:func:`~speclab.data.prompts.chat_prompts`), or the first
    ``num_prompts`` of ``prompt_file`` (prompt JSONL or ``question.jsonl``, first turns;
    grouped by category: :func:`~speclab.data.prompts.first_turn_records`), each a user
    turn through the target's chat template where its tokenizer has one, else plain
    text. ``prompt_file`` wins over ``chat_data``."""
    if prompt_file is None and chat_data is not None:
        return chat_prompts(DataConfig(prompts="conversations", path=chat_data,
                                       num_prompts=num_prompts), dec.tokenizer)
    if prompt_file is None:
        return Prompts([dec.encode(p.text) for p in function_header_prompts("test", num_prompts)])
    records = first_turn_records(prompt_file, num_prompts, "--prompt-file")
    chat = bool(getattr(dec.tokenizer, "chat_template", None))
    ids = [template_ids(dec.tokenizer, [{"role": "user", "content": text}]) if chat
           else dec.encode(text) for _, text in records]
    return Prompts(ids, [cat for cat, _ in records])


def by_category(dec: Decoder, runs: list[MethodRun], prompts: Prompts, gen: dict
                ) -> dict[str, dict]:
    """:func:`interleaved_comparison` over each category's prompts (``prompts`` grouped by
    category, as :func:`bench_prompts` gives them): ``{category: results}``. The paired
    protocol is per prompt, so the merged results (:func:`merge_results`) are the whole
    set's."""
    out = {}
    for cat in dict.fromkeys(prompts.categories):
        mine = [p for p, c in zip(prompts, prompts.categories, strict=True) if c == cat]
        out[cat] = interleaved_comparison(dec, runs, mine, gen, progress=_progress)
    return out


def result_rows(dec: Decoder, prompts: list[list[int]], results: dict[str, dict]) -> list[dict]:
    """The table rows (AR first) of :func:`interleaved_comparison`'s ``results`` over
    ``prompts``, each method's outputs checked against AR's (greedy)."""
    reference = results[next(iter(results))]["ar"].outputs  # AR, each prompt alone
    ar = pooled_ar(results)
    rows = [summarize(MethodRun("ar"), ar, ar, reference)]
    for r in results.values():
        rows.append(summarize(r["run"], r["totals"], r["ar"], reference))
        mark_agreement(dec.target.model, prompts, rows[-1], r["totals"].outputs, reference)
    return rows


@dataclass(frozen=True)
class XLPair:
    """``reference-xl`` as the bench uses it: names for the JSON's meta and the grown
    models (:class:`~speclab.reference_xl.ReferenceXL`)."""

    target: str
    draft: str
    xl: ReferenceXL


def grow_xl(device: str, dtype: str, eagles: list[str] | None, xl: XLSpec | None,
            checksums: str | None) -> XLPair:
    """``reference-xl`` grown on ``device`` (:func:`~speclab.reference_xl.grow_reference_xl`)
    from the reference pair and the small EAGLE drafters ``eagles``, checked against the
    checksums in the JSON file ``checksums`` (``speclab gpu-bundle`` writes it) when
    given (``{checksum_key: {model: checksum}}``), with its forward cost measured
    (``xl.meta["cost"]``, with the first drafter)."""
    spec = xl or XLSpec()
    expected = None
    if checksums:
        recorded = json.loads(Path(checksums).read_text())
        key = checksum_key(spec, dtype)
        if key not in recorded:
            raise ValueError(f"--xl-checksums: {checksums} holds {sorted(recorded)}, not {key}")
        expected = recorded[key]
    pair = ensure_reference_pair()
    grown = grow_reference_xl(pair.target, pair.draft, eagles, spec, device, dtype, expected,
                              log=_progress)
    first = next(iter(grown.drafters.values()), None)
    grown.meta["cost"] = forward_cost(grown.target, held_out_ids(pair.target, 160),
                                      eagle=first)
    cost = grown.meta["cost"]
    _progress("forward cost at batch 1 (ms): " + ", ".join(
        f"{n} tokens {ms:.2f} ({cost['target_ratio'][n]:.2f}x)"
        for n, ms in cost["target_ms"].items())
              + (f"; EAGLE drafter {cost['eagle_vs_target']:.3f} of a target forward"
                 if "eagle_ms" in cost else ""))
    return XLPair(f"reference-xl {spec.name} grown from {pair.target}", pair.draft, grown)


def reference_setup(num_prompts: int, device: str, dtype: str | None, compile: bool = False,
                    pair: str = "reference", prompt_file: str | None = None,
                    eagles: list[str] | None = None, xl: XLSpec | None = None,
                    checksums: str | None = None, build: bool = True):
    """A reference pair (``reference``, or ``reference-large``, the memory-bound target,
    built on first use; or ``reference-xl``, the GPU-scale target grown on ``device``,
    :func:`grow_xl`, with ``eagles``, ``xl`` and ``checksums``) or a real pair
    (:func:`~speclab.real_pair.ensure_real_pair`, its drafters fetched from the registry
    or, ``build``, built on first use; its prompts held-out ShareGPT first turns), a
    Decoder over it and its prompts (:func:`bench_prompts`). ``dtype`` None: float32 for
    ``reference``, bfloat16 where it is native for the others (:func:`run_dtype`)."""
    if pair not in PAIRS:
        raise ValueError(f"pair: must be one of {list(PAIRS)}, got {pair!r}")
    if pair in REAL_PAIRS:
        found = ensure_real_pair(pair, build, log=_progress)
        dec = Decoder.from_pretrained(found.target, found.draft, dtype or run_dtype(device),
                                      device, compile=compile)
        return found, dec, bench_prompts(dec, num_prompts, prompt_file, chat_data="sharegpt")
    if pair == "reference-xl":
        found = grow_xl(device, dtype or run_dtype(device), eagles, xl, checksums)
        dec = Decoder(found.xl.target, found.xl.draft, found.xl.tokenizer, compile=compile)
        return found, dec, bench_prompts(dec, num_prompts, prompt_file)
    if pair == "reference-large":
        found = ensure_reference_large()
        dtype = dtype or run_dtype(device)
    else:
        found, dtype = ensure_reference_pair(), dtype or "float32"
    pair = found
    dec = Decoder.from_pretrained(pair.target, pair.draft, dtype, device, compile=compile)
    return pair, dec, bench_prompts(dec, num_prompts, prompt_file)


#: the rows on ``reference-xl`` besides its EAGLE drafters': the chains and the tree of
#: the standalone draft (optimal and SALF with the standalone draft are left to the
#: reference pairs: the GPU run's minutes go to the EAGLE rows)
XL_RUNS = DEFAULT_RUNS[:3]
#: each EAGLE drafter on ``reference-xl`` also drafts optimal trees (EAGLE-3 on the
#: reference target: tau 4.32 at 16 nodes, batch 4, ranking at 0.3; distill_eagle3.yaml)
EAGLE_OPTIMAL_RUN = {"builder": "optimal", "nodes": 16, "batch": 4, "depth": 10,
                     "score_temperature": 0.3}


def xl_eagle_runs(xl: ReferenceXL) -> list[MethodRun]:
    """The EAGLE rows on ``reference-xl``: each grown drafter under :data:`EAGLE_RUN`'s
    tree and :data:`EAGLE_OPTIMAL_RUN`, labelled by its source folder's name."""
    runs = []
    for name, model in xl.drafters.items():
        version = "3" if model.meta.version == 3 else ""
        for knobs in (EAGLE_RUN, EAGLE_OPTIMAL_RUN):
            inner = ",".join(f"{k}={v}" for k, v in knobs.items())
            runs.append(MethodRun("eagle", {**knobs, "eagle_model": model},
                                  f"eagle{version} {name} {inner}"))
    return runs


def run_bench(num_prompts: int = 16, max_new_tokens: int = 64, out_dir: str = "bench_out",
              runs: list[MethodRun] | None = None, device: str = "cpu",
              dtype: str | None = None, passes: int | None = None,
              pair: str = "reference", eagles: list[str] | None = None,
              medusas: list[str] | None = None, prompt_file: str | None = None,
              xl: XLSpec | None = None, checksums: str | None = None,
              build: bool = True) -> list[dict]:
    """Run the benchmark (``passes`` timed passes of the paired protocol, default
    :data:`~speclab.evaluation.TIMING_PASSES`) on ``pair``, print the table, write
    ``bench.json``; returns the rows. Without ``runs``: :data:`DEFAULT_RUNS`, an EAGLE
    row (:data:`EAGLE_RUN`) per drafter folder of ``eagles`` (none given: on
    ``reference-large``, its own EAGLE drafter's) and a Medusa row (:data:`MEDUSA_RUN`)
    per heads folder of ``medusas``. ``prompt_file`` (:func:`bench_prompts`) with more
    than one category adds a table per category (printed, and ``categories`` in the
    JSON: ``{category: rows}``). On ``reference-xl`` (``xl``, ``checksums``:
    :func:`grow_xl`) ``eagles`` are drafters for the SMALL reference target, grown with
    it, and the rows are :data:`XL_RUNS` and :func:`xl_eagle_runs`. On a real pair
    (``build``: :func:`reference_setup`) the rows are :data:`REAL_RUNS` and a row per
    registered EAGLE drafter, Medusa heads and SpecDec++ head (:data:`SPECDECPP_RUN`) of
    the pair, besides ``eagles`` and ``medusas``."""
    name = pair
    # refused before any model is loaded
    extra = [eagle_run(d) for d in eagles or []]
    medusa = [medusa_run(d) for d in medusas or []]
    if name == "reference-xl" and medusa:
        raise ValueError("--medusa: not on reference-xl (only EAGLE drafters are grown)")
    pair, dec, prompts = reference_setup(num_prompts, device, dtype, pair=name,
                                         prompt_file=prompt_file, eagles=eagles, xl=xl,
                                         checksums=checksums, build=build)
    if isinstance(pair, RealPair):
        extra += [eagle_run(d, uri) for d, uri in pair.named("eagle")]
        medusa += [medusa_run(d, uri) for d, uri in pair.named("medusa")]
        runs = runs or REAL_RUNS + extra + medusa + [specdecpp_run(d) for d in pair.heads]
    passes = passes or TIMING_PASSES
    gen = {"max_new_tokens": max_new_tokens, "timing_passes": passes}
    if not extra and name == "reference-large":
        extra = [eagle_run(pair.eagle)]
    if name == "reference-xl":
        runs = runs or XL_RUNS + xl_eagle_runs(pair.xl)
    runs = runs or DEFAULT_RUNS + extra + medusa
    parts = by_category(dec, runs, prompts, gen)
    results = merge_results(list(parts.values()))
    costs = results[runs[0].name]["costs"]
    reference = results[runs[0].name]["ar"].outputs  # AR, each prompt alone
    rows = result_rows(dec, prompts, results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": pair.target, "draft": pair.draft, "prompts": len(prompts),
            "prompt_file": prompt_file, "max_new_tokens": max_new_tokens,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.platform(), "temperature": 0.0, "device": device,
            "dtype": str(dec.target.dtype).removeprefix("torch."),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda")
            else None, **protocol_meta(passes),
            **({"reference_xl": pair.xl.meta} if isinstance(pair, XLPair) else {}),
            **({"drafters": pair.sources} if isinstance(pair, RealPair) else {})}

    def write(partial: bool, categories: dict) -> None:
        """bench.json; ``partial``: the engine's rows before the Hugging Face baselines
        (a run stopped during those keeps its figures)."""
        (out / "bench.json").write_text(json.dumps(
            {"meta": {**meta, "partial": partial}, "rows": rows,
             **({"categories": categories} if categories else {}),
             "forward_costs_s": costs.to_dict() if costs is not None else None}, indent=2))

    write(True, {})
    # Hugging Face baselines on the same pair and prompts, paired with AR the same way
    for row, outputs in hf_rows(
            dec, {"hf_assisted": {"assistant_model": dec.draft.model},
                  "hf_prompt_lookup": {"prompt_lookup_num_tokens": 3}},
            prompts, gen, reference, costs):
        rows.append(mark_agreement(dec.target.model, prompts, row, outputs, reference))
    categories = {}
    if len(parts) > 1:
        for cat, part in parts.items():
            mine = [p for p, c in zip(prompts, prompts.categories, strict=True) if c == cat]
            categories[cat] = result_rows(dec, mine, part)
            print(f"\ncategory {cat} ({len(mine)} prompts)")
            print(format_table(categories[cat], table_columns(COLUMNS, device)))
        print("\nall categories")
    print(format_table(rows, table_columns(COLUMNS, device)))
    _print_noisy(rows)
    write(False, categories)
    print(f"\nwrote {out / 'bench.json'}")
    return rows


def _progress(line: str) -> None:
    print(f"[bench] {line}", flush=True)


def _print_noisy(rows: list[dict]) -> None:
    """Name the rows whose timings the protocol flagged (``noisy``) and why."""
    noisy = [f"{r['method']}: {r['timing_note']}" for r in rows if r.get("noisy")]
    if noisy:
        print("\nnoisy timings (read those speedups with care):\n  " + "\n  ".join(noisy))


def protocol_meta(passes: int) -> dict:
    """The timing protocol's settings, for a JSON's meta (and an MLflow run's params)."""
    return {"timing_passes": passes, "ar_spread_bound": AR_SPREAD_BOUND,
            "speedup": "median of paired ratios (AR and the method on the same work, one "
                       "after the other), 95% order-statistic interval; speedup_totals: "
                       "ratio of totals"}


# chain at its two best lengths and SALF with the sharpened ranking (see DEFAULT_RUNS)
# gamma=1 first: at 16 rows on 2 cores a forward of 2 tokens per row costs about one
# token's, 4 per row 1.27x (reference-large; closing note of stop 48), so the shortest
# chain is the one that pays there
BATCH_RUNS = [
    MethodRun("chain", {"gamma": 1}),
    MethodRun("chain", {"gamma": 2}),
    MethodRun("chain", {"gamma": 3}),
    MethodRun("salf", {"nodes": 16, "batch": 4, "salf_threshold": 0.2, "depth": 10,
                       "score_temperature": 0.5}),
]


# the auto budget over the same methods: each round's depth (0: plain decoding) chosen up
# to the method's own length (decoding/budget.py)
BATCH_AUTO_RUNS = [
    MethodRun("chain", {"gamma": 4, "budget": "auto"}, label="chain auto (gamma<=4)"),
    MethodRun("salf", {"nodes": 16, "batch": 4, "salf_threshold": 0.2, "depth": 10,
                       "score_temperature": 0.5, "budget": "auto"}, label="salf auto"),
]


def auto_sweep(rows: list[dict], auto_names: list[str]) -> list[dict]:
    """Per batch size: plain decoding's tokens/s, the best fixed run (the highest median
    speedup among the runs that are neither AR nor auto) and each auto run, with their
    speedups over AR at that size (95% intervals) and auto's over the best fixed run's
    (a ratio of the two median speedups)."""
    out = []
    for bs in sorted({r["batch_size"] for r in rows}):
        mine = [r for r in rows if r["batch_size"] == bs]
        ar = next(r for r in mine if r["method"] == "ar")
        fixed = [r for r in mine if r["method"] not in ("ar", *auto_names)]
        best = max(fixed, key=lambda r: r["speedup"]) if fixed else None
        for r in mine:
            if r["method"] not in auto_names:
                continue
            out.append({
                "batch_size": bs, "ar_tokens_per_s": ar["tokens_per_s"],
                "best_fixed": best["method"] if best else None,
                "best_fixed_speedup": best["speedup"] if best else None,
                "best_fixed_interval": ([best.get("speedup_lo"), best.get("speedup_hi")]
                                        if best else None),
                "auto": r["method"], "auto_speedup": r["speedup"],
                "auto_interval": [r.get("speedup_lo"), r.get("speedup_hi")],
                "auto_over_best_fixed": (r["speedup"] / best["speedup"]
                                         if best and best["speedup"] else None),
                "auto_budget_mean": r.get("budget_mean"),
                "auto_budget_histogram": r.get("budget_histogram")})
    return out


def format_sweep(sweep: list[dict]) -> str:
    """The auto sweep as a table (speedups over AR at the same batch size)."""
    def x(v, lo_hi=None) -> str:
        if v is None:
            return "-"
        cell = f"{v:.2f}x"
        if lo_hi and None not in lo_hi:
            cell += f" [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]"
        return cell

    lines = ["batch | AR tok/s | best fixed | its speedup | auto | auto speedup | "
             "auto / best fixed | mean budget"]
    for r in sweep:
        lines.append(f"{r['batch_size']:>5} | {r['ar_tokens_per_s']:8.1f} | {r['best_fixed']} | "
                     f"{x(r['best_fixed_speedup'], r['best_fixed_interval'])} | {r['auto']} | "
                     f"{x(r['auto_speedup'], r['auto_interval'])} | "
                     f"{x(r['auto_over_best_fixed'])} | {r['auto_budget_mean']:.2f}")
    return "\n".join(lines)


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


def format_crossover(cross: dict[str, int | None]) -> str:
    """:func:`crossover` as lines: a title, then each method's batch size ('-': none)."""
    return ("crossover batch size (speculation no faster than AR from here; '-': pays at "
            "every size measured):\n" + "\n".join(
                f"  {m}: {b if b is not None else '-'}" for m, b in cross.items()))


def batch_plot(rows: list[dict], what: str = "greedy, reference pair"):
    """Speedup over AR (same batch size) against batch size, one line per method, and AR's
    tokens/s; a matplotlib figure (``what``: the run, in the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    methods = sorted({r["method"] for r in rows if r["method"] != "ar"})
    for m in methods:  # whiskers: the 95% interval of the median paired ratio
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["batch_size"])
        values = [r["speedup"] for r in mine]
        ax.errorbar([r["batch_size"] for r in mine], values,
                    yerr=interval_errors(mine, "speedup", values), fmt="o-", capsize=3,
                    label=m)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("speedup over AR at the same batch size (x)\n(median paired ratio, 95% "
                  "interval)")
    ax.set_title(f"Where speculation stops paying ({what})")
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
    ("tokens_per_s", "{:.1f}"), ("speedup", speedup_cell), ("speedup_totals", "{:.2f}x"),
    ("ar_scaling", "{:.2f}x"), ("engine_overhead", overhead_cell),
    ("engine_clocked", "{:.0%}"), ("measured_over_predicted", "{:.2f}"), ("noisy", "{}"),
    ("identical_to_alone", agreement_cell("identical_to_alone")),
]


def run_batch_bench(batch_sizes: list[int], num_prompts: int = 16, max_new_tokens: int = 64,
                    out_dir: str = "bench_out", runs: list[MethodRun] | None = None,
                    device: str = "cpu", dtype: str | None = None, log_mlflow: bool = False,
                    tracking_uri: str | None = None, repeats: int = 1,
                    compile: bool = False, passes: int | None = None,
                    pair: str = "reference", prompt_file: str | None = None,
                    xl: XLSpec | None = None, checksums: str | None = None,
                    auto: bool = False, eagles: list[str] | None = None,
                    build: bool = True) -> list[dict]:
    """The batched engine at each batch size: each method paired with AR at the SAME
    batch size, one pair per pass over the whole batch, over ``passes`` x ``repeats``
    passes (``passes`` default :data:`~speclab.evaluation.TIMING_PASSES`): the median
    paired ratio with its interval (few pairs: the interval is their range and
    ``speedup_coverage`` says how much it covers). Prints the table, writes
    ``batch_bench.json`` and ``batch_scaling.png``; with
    ``log_mlflow`` also an MLflow run at ``tracking_uri`` (default: the embedded store)
    in experiment ``speclab-bench``, with every figure as a metric whose step is the
    batch size, and the plot. ``compile``: the static, compiled fast path; its warm-up
    (the forwards that compiled a shape and, on CUDA, captured its CUDA graph: all in the
    untimed warm-up passes; any later one is taken out of the timed figures of the pass
    it fell in, see :class:`speclab.api.Decoder`) is reported apart as
    ``compile_warmup_s``. ``prompt_file``: :func:`bench_prompts` (no table per category
    here). ``xl``, ``checksums``: ``reference-xl``'s (:func:`grow_xl`). ``auto``: also
    :data:`BATCH_AUTO_RUNS` (the pair calibrated first, up to the largest batch size), and
    :func:`auto_sweep` printed and written as ``auto_sweep``. ``eagles``: an EAGLE row
    (:data:`EAGLE_RUN`'s tree) per drafter folder, eager or compiled (on ``reference-xl``
    drafters for the small reference target, grown with it; on a real pair, ``build``,
    its registered EAGLE drafters too). Returns the rows."""
    if auto and compile:
        raise ValueError("auto: the auto budget reads eager calibrated costs; not with "
                         "--compile")
    if num_prompts < max(batch_sizes):
        raise ValueError(f"batch_sizes: the largest ({max(batch_sizes)}) exceeds the number "
                         f"of prompts ({num_prompts})")
    eagle_rows = [eagle_run(d) for d in eagles or []]  # a bad folder refused first
    pair, dec, prompts = reference_setup(num_prompts, device, dtype, compile, pair,
                                         prompt_file, eagles=eagles, xl=xl,
                                         checksums=checksums, build=build)
    if isinstance(pair, RealPair):
        eagle_rows += [eagle_run(d, uri) for d, uri in pair.named("eagle")]
    if isinstance(pair, XLPair):  # the grown drafters, under the same tree
        eagle_rows = [r for r in xl_eagle_runs(pair.xl)
                      if r.params.get("builder") != "optimal"]
    runs = (runs or BATCH_RUNS) + eagle_rows + (BATCH_AUTO_RUNS if auto else [])
    if auto:  # measured (or read from the store) before anything is timed
        from speclab.calibration import format_calibration

        print(format_calibration(dec.calibration(max(batch_sizes))))
    if compile:  # compile every shape before anything is timed (full-length warm-up)
        t0 = now(device)
        for bs in batch_sizes:
            # the EAGLE rows first: their target step returns the features, and the
            # others then reuse it (the reverse would compile the target's shapes twice)
            for run in [*eagle_rows, MethodRun("ar"),
                        *[r for r in runs if r not in eagle_rows]]:
                run_prompts(dec, run, prompts, {"max_new_tokens": max_new_tokens,
                                                "batch_size": bs})
        warm = now(device) - t0
        print(f"compile warm-up: {dec.warmup_s:.1f} s compiling, {warm:.1f} s for the "
              f"untimed warm-up passes")
    reference = run_prompts(dec, MethodRun("ar"), prompts, {"max_new_tokens": max_new_tokens}
                            ).outputs  # each prompt decoded alone
    rows: list[dict] = []
    passes = (passes or TIMING_PASSES) * max(repeats, 1)
    costs_by_size = {}
    for bs in batch_sizes:
        gen = {"max_new_tokens": max_new_tokens, "batch_size": bs, "timing_passes": passes}
        results = interleaved_comparison(dec, runs, prompts, gen, warmup=not compile,
                                         progress=_progress)
        costs_by_size[bs] = results[runs[0].name]["costs"]
        ar = pooled_ar(results)
        block = [(summarize(MethodRun("ar"), ar, ar, reference), ar.outputs)] + [
            (summarize(r["run"], r["totals"], r["ar"], reference), r["totals"].outputs)
            for r in results.values()]
        for row, outputs in block:
            row["identical_to_alone"] = row.pop("identical_to_ar")
            row["batch_size"] = bs
            rows.append(mark_agreement(dec.target.model, prompts, row, outputs, reference,
                                       "identical_to_alone"))
    ar_first = next(r["tokens_per_s"] for r in rows if r["method"] == "ar")
    for row in rows:  # AR tokens/s over AR's at the smallest batch size measured
        row["ar_scaling"] = row["tokens_per_s"] / ar_first if row["method"] == "ar" else None
    print(format_table(rows, table_columns(BATCH_COLUMNS, device)))
    _print_noisy(rows)
    cross = crossover(rows)
    print("\n" + format_crossover(cross))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": pair.target, "draft": pair.draft, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "batch_sizes": batch_sizes, "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "machine": platform.platform(),
            "device": device, "dtype": str(dec.target.dtype).removeprefix("torch."),
            "temperature": 0.0, "compile": compile,
            "compile_warmup_s": dec.warmup_s, **protocol_meta(passes),
            **({"reference_xl": pair.xl.meta} if isinstance(pair, XLPair) else {}),
            **({"drafters": pair.sources} if isinstance(pair, RealPair) else {})}
    costs = {bs: c.to_dict() if c is not None else None for bs, c in costs_by_size.items()}
    sweep = auto_sweep(rows, [r.name for r in BATCH_AUTO_RUNS]) if auto else None
    if sweep:
        print("\nper batch size: plain decoding, the best fixed run, auto (speedups over AR "
              "at that size, 95% intervals)")
        print(format_sweep(sweep))
    (out / "batch_bench.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "crossover": cross, "forward_costs_s": costs,
         **({"auto_sweep": sweep} if sweep else {})}, indent=2))
    try:
        fig = batch_plot(rows)
    except ModuleNotFoundError as err:  # an offline GPU machine (speclab gpu-bundle)
        if err.name != "matplotlib":
            raise
        print(f"\nwrote {out / 'batch_bench.json'} (no batch_scaling.png: matplotlib is "
              "not installed here; the JSON holds every figure)")
        return rows
    fig.savefig(out / "batch_scaling.png", dpi=110)
    print(f"\nwrote {out / 'batch_bench.json'} and {out / 'batch_scaling.png'}")
    if log_mlflow:
        log_batch_bench(tracking_uri, meta, rows, cross, fig)
    return rows


def log_batch_bench(uri: str | None, meta: dict, rows: list[dict], cross: dict, fig) -> None:
    """One MLflow run in ``speclab-bench``: ``<method>.<figure>`` metrics with the batch
    size as step, ``crossover.<method>``, the table and the plot."""
    with MlflowTracker(resolve_tracking_uri(uri), "speclab-bench", "batch-bench", meta) as t:
        for r in rows:
            key = MethodRun(r["method"]).key
            t.log_metrics({f"{key}.{k}": float(v) if isinstance(v, bool) else v
                           for k, v in r.items() if k not in ("method", "batch_size")},
                          step=r["batch_size"])
        t.log_metrics({f"crossover.{MethodRun(m).key}": b for m, b in cross.items()
                       if b is not None})
        t.log_table(rows, "batch_bench")
        t.log_figure(fig, "batch_scaling.png")
