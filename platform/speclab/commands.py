"""Subcommands of ``speclab`` other than ``generate`` (bench, reference, run, submit,
recommend, serve, ui)."""

from __future__ import annotations

import argparse
import json
import sys

from speclab.api import Decoder
from speclab.bench import PAIRS, parse_batch_sizes, run_batch_bench, run_bench
from speclab.calibration import calibrate, calibration_path, format_calibration
from speclab.compat import check_model
from speclab.config import JOB_CONFIGS, ServeJob
from speclab.data.prompts import load_prompts
from speclab.decoding.sampling import SamplingParams
from speclab.evaluation import format_table
from speclab.export_cli import add_export_parser
from speclab.jobs import JOBS, job_main  # names and a lookup: imports no job module, no Ray
from speclab.method_flags import add_method_args, method_from_args, verify_params_from_args
from speclab.models.grow_drafters import widen_drafter_folder
from speclab.models.reference import check_reference_pair, ensure_reference_pair
from speclab.models.registry import resolve_models
from speclab.paths import repo_root, speclab_home
from speclab.ports import answers, check_port_free
from speclab.raylib import init_ray, project_runtime_env, quiet_ray_env
from speclab.recommend import Recommender
from speclab.reference_large import ensure_reference_large, format_cost, record_cost
from speclab.reference_xl import XLSpec
from speclab.shift import first_token_shift
from speclab.tracking import default_artifact_root, resolve_tracking_uri, ui_record

HANDLERS: dict = {}


def add_parsers(sub) -> None:
    """Register the subcommands on an argparse subparsers object."""
    p = sub.add_parser("reference", help="build the reference target/draft pair if missing")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--check", action="store_true",
                   help="measure greedy chain alpha and the target/draft cost ratio")
    p.add_argument("--large", action="store_true",
                   help="reference-large instead: the memory-bound target grown from the "
                        "pair, its draft and EAGLE drafter (with --check: measure the "
                        "forward costs again and record them in its cost.json)")
    p.add_argument("--widen", "--widen-eagle", dest="widen", default=None, metavar="SRC",
                   help="with --large: widen a drafter trained against the reference target "
                        "(a speclab EAGLE / EAGLE-3 folder or MEDUSA-1 heads) into one for "
                        "reference-large, written to --out")
    p.add_argument("--out", default=None, help="with --widen: the new drafter's folder")
    HANDLERS["reference"] = cmd_reference

    p = sub.add_parser("bench", help="engine benchmark on a reference pair or the real pair "
                                     "(table + JSON)")
    p.add_argument("--prompts", type=int, default=16, help="how many prompts")
    p.add_argument("--prompt-file", default=None, metavar="JSONL",
                   help="prompts from a file instead of stdlib function headers: prompt "
                        "JSONL (prompt, category) or MT-bench / Spec-Bench question.jsonl "
                        "(turns, category; first turn), through the target's chat template "
                        "where it has one; a table per category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default="bench_out", help="folder for bench.json")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", default=None,
                   help="default: float32 (reference), bfloat16 where native (reference-large)")
    p.add_argument("--pair", default="reference", choices=list(PAIRS),
                   help="reference (tiny, overhead-bound on CPU), reference-large "
                        "(memory-bound; adds an EAGLE row), reference-xl (GPU-scale, grown "
                        "on the device; --eagle then names drafters for the SMALL reference "
                        "target, grown with it) or smollm2-135m (the real pair: SmolLM2-135M-"
                        "Instruct with the drafters its experiments register, a missing "
                        "standalone draft built on first use; held-out ShareGPT first turns)")
    p.add_argument("--no-build", dest="build", action="store_false",
                   help="with a real --pair: refuse, naming the command that builds it, "
                        "instead of building a drafter that is not registered yet")
    p.add_argument("--xl", default="24x16", metavar="WIDENxDEPTH",
                   help="with --pair reference-xl: how far the reference target is grown "
                        "(default 24x16: 5.45B parameters)")
    p.add_argument("--xl-checksums", default=None, metavar="JSON",
                   help="with --pair reference-xl: the checksums the grown models must have "
                        "(speclab gpu-bundle writes them)")
    p.add_argument("--eagle", action="append", default=None, metavar="DIR",
                   help="an EAGLE drafter (any version) for the pair's target: adds its row "
                        "(the bench's EAGLE tree); repeat for more; on reference-large it "
                        "replaces the built-in drafter's row; with --batch-sizes a batched "
                        "row, eager or --compile")
    p.add_argument("--medusa", action="append", default=None, metavar="DIR",
                   help="Medusa heads for the pair's target (with their calibration, "
                        "tree.json): adds their row (the bench's sparse Medusa tree); repeat "
                        "for more")
    p.add_argument("--batch-sizes", default=None,
                   help="e.g. 1,4,16: the batched engine at each batch size (speedup over AR "
                        "at the same size, the crossover, batch_bench.json + a plot)")
    p.add_argument("--compile", action="store_true",
                   help="with --batch-sizes: the fast path (static cache + torch.compile); "
                        "the compile warm-up is reported apart")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --batch-sizes: interleaved repeats (timed figures: the median)")
    p.add_argument("--auto", action="store_true",
                   help="with --batch-sizes: also the auto budget (bench.BATCH_AUTO_RUNS), and "
                        "per batch size plain decoding, the best fixed run and auto side by "
                        "side (the pair is calibrated first: speclab calibrate)")
    p.add_argument("--mlflow", nargs="?", const="", default=None, metavar="TRACKING_URI",
                   help="with --batch-sizes: also log an MLflow run (default store if no URI)")
    HANDLERS["bench"] = cmd_bench

    p = sub.add_parser("gpu-bundle", help="the Ray-free GPU report for an offline machine with "
                                          "only PyTorch: one folder, one script (run.sh)")
    p.add_argument("out", help="the bundle's folder (replaced if it exists)")
    p.add_argument("--eagle", action="append", default=[], metavar="DIR",
                   help="an EAGLE / EAGLE-3 drafter trained against the reference target, "
                        "grown with reference-xl on the GPU (repeat)")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (wheels)")
    p.add_argument("--platform", default="manylinux2014_x86_64",
                   help="the GPU machine's wheel platform tag")
    p.add_argument("--xl", default="24x16", metavar="WIDENxDEPTH",
                   help="reference-xl's size on the GPU")
    p.add_argument("--budget-s", type=int, default=460,
                   help="run.sh's default time budget for its steps")
    p.add_argument("--ray", action="store_true",
                   help="the second bundle instead: the Ray / Serve / Train / Tune CUDA tests' "
                        "wheels and the checkout, in parts of at most 60 MB "
                        "(part-01/assemble.sh joins them there)")
    HANDLERS["gpu-bundle"] = cmd_gpu_bundle

    p = sub.add_parser("shift", help="first-token distribution shift of a method's rule "
                                     "against the target (total variation; table + JSON)")
    add_method_args(p)
    p.add_argument("--samples", type=int, default=200, help="seeded runs per prompt")
    p.add_argument("--prompts", default="stdlib_functions", help="data.prompts kind")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--context-chars", type=int, default=300)
    p.add_argument("--out", default="shift_out", help="folder for shift.json")
    HANDLERS["shift"] = cmd_shift

    p = sub.add_parser("check-model", help="compatibility report for a checkpoint: what it "
                                           "is, and whether every method decodes it exactly "
                                           "(exit 0; 2 with the reasons)")
    p.add_argument("--target", required=True, help="folder, hub id or models:/ URI")
    p.add_argument("--draft", default=None, help="a draft model: also checks chain, tree, salf")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--attn-implementation", default="auto", help="auto, sdpa or eager")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="folder for check_model.json (default: "
                                               "$SPECLAB_HOME/check_model/<target's name>)")
    HANDLERS["check-model"] = cmd_check_model
    p = sub.add_parser("calibrate", help="measure a pair's forward costs on this device and "
                                         "dtype and store them (the auto budget reads them)")
    p.add_argument("--target", required=True, help="folder, pair name, GGUF or models:/ URI")
    p.add_argument("--draft", default=None, help="the draft model (default: the pair's)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--attn-implementation", default="auto", help="auto, sdpa or eager")
    p.add_argument("--max-rows", type=int, default=1,
                   help="also the batched engine's curves for rows 1, 2, 4, ... up to this")
    p.add_argument("--context", type=int, default=128, help="tokens in the cache")
    p.add_argument("--repeats", type=int, default=5, help="timings per point (median)")
    p.add_argument("--json", action="store_true", help="print the stored JSON")
    HANDLERS["calibrate"] = cmd_calibrate
    add_export_parser(sub, HANDLERS)  # `speclab export` (drafter formats)
    _add_job_parsers(sub)


def cmd_calibrate(args: argparse.Namespace) -> int:
    target, draft = resolve_models(args.target, args.draft)
    dec = Decoder.from_pretrained(target, draft, args.dtype, args.device,
                                  attn_implementation=args.attn_implementation)
    cal = calibrate(dec, args.max_rows, args.context, args.repeats)
    print(json.dumps(cal.to_dict()) if args.json else format_calibration(cal))
    print(f"stored: {calibration_path(cal.key)}", file=sys.stderr)
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    if (args.widen is None) != (args.out is None):
        raise ValueError("--widen and --out: give both or neither")
    if args.widen is not None and not args.large:
        raise ValueError("--widen: only with --large")
    if args.large:
        return _reference_large(args)

    pair = ensure_reference_pair(force=args.force)
    print(f"target: {pair.target}\ndraft:  {pair.draft}")
    if args.check:
        res = check_reference_pair(pair)
        print(f"greedy chain alpha (gamma={res['gamma']}, {res['prompts']} held-out prompts): "
              f"{res['alpha']:.3f}  (required >= 0.6)")
        print(f"per-forward cost: target {res['t_target_ms']:.2f} ms, draft "
              f"{res['t_draft_ms']:.2f} ms, ratio {res['cost_ratio']:.1f}x  (required >= 5x)")
        return 0 if res["alpha"] >= 0.6 and res["cost_ratio"] >= 5 else 1
    return 0


def _reference_large(args: argparse.Namespace) -> int:
    """``speclab reference --large``: build or find reference-large, print its folders and
    its recorded forward costs (``--check``: measured again now, on this machine, and
    recorded in its ``cost.json``)."""
    large = ensure_reference_large(force=args.force)
    if args.widen is not None:
        print(widen_drafter_folder(args.widen, args.out, large)["summary"])
        return 0
    print(f"target: {large.target}\ndraft:  {large.draft}\neagle:  {large.eagle}\n"
          f"eagle for the small reference target: {large.eagle_small}")
    cost = record_cost(large) if args.check else large.cost
    print(f"forward cost ({'measured now' if args.check else 'recorded in cost.json'}):\n"
          + format_cost(cost))
    goals = cost["goals"]
    print(f"in {cost['run_dtype']}: 8 tokens <= 1.25x one: {goals['8_tokens_le_1.25x']}; "
          f"EAGLE drafter <= 1/10 of a target forward: {goals['eagle_le_0.1']}")
    return 0 if not args.check or all(goals.values()) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    if args.batch_sizes is not None:
        if args.medusa:
            raise ValueError("--medusa: not with --batch-sizes (the batched runs are "
                             "bench.BATCH_RUNS and the --eagle drafters)")

        run_batch_bench(parse_batch_sizes(args.batch_sizes), args.prompts, args.max_new_tokens,
                        args.out, device=args.device, dtype=args.dtype,
                        log_mlflow=args.mlflow is not None, tracking_uri=args.mlflow or None,
                        repeats=args.repeats, compile=args.compile, pair=args.pair,
                        prompt_file=args.prompt_file, xl=XLSpec.parse(args.xl),
                        checksums=args.xl_checksums, auto=args.auto, eagles=args.eagle,
                        build=args.build)
        return 0
    for flag, given in (("mlflow", args.mlflow is not None), ("compile", args.compile),
                        ("auto", args.auto)):
        if given:
            raise ValueError(f"{flag}: only with --batch-sizes")
    run_bench(args.prompts, args.max_new_tokens, args.out, device=args.device, dtype=args.dtype,
              pair=args.pair, eagles=args.eagle, medusas=args.medusa,
              prompt_file=args.prompt_file, xl=XLSpec.parse(args.xl), checksums=args.xl_checksums,
              build=args.build)
    return 0


def cmd_gpu_bundle(args: argparse.Namespace) -> int:
    """Write the offline GPU bundle (:mod:`speclab.gpu_bundle`)."""
    from pathlib import Path

    from speclab.gpu_bundle import build_bundle, build_ray_parts

    if args.ray:
        if args.eagle:
            raise ValueError("--eagle: not with --ray (the Ray part carries no drafters)")
        build_ray_parts(Path(args.out), args.python)
        return 0
    build_bundle(Path(args.out), args.eagle, args.python, args.platform, XLSpec.parse(args.xl),
                 args.budget_s)
    return 0


def cmd_shift(args: argparse.Namespace) -> int:
    """Print the per-prompt TV table and write ``<out>/shift.json``."""
    import json
    from pathlib import Path

    cfg = method_from_args(args)
    args.target, args.draft = resolve_models(args.target, args.draft)  # a pair's name
    if cfg.needs_draft_model and not args.draft:
        raise ValueError(f"draft: method {args.method!r} needs --draft")
    dec = Decoder.from_pretrained(args.target, args.draft if cfg.needs_draft_model else None,
                                  args.dtype, args.device)
    params = SamplingParams(args.temperature, args.sample_top_k, args.top_p)
    prompts = [dec.encode(t) for t in load_prompts(args.prompts, args.num_prompts,
                                                   args.context_chars)]
    verify_params = verify_params_from_args(args)
    rows = first_token_shift(dec, prompts, cfg, args.samples, params, args.verify,
                             verify_params)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "prompt"}
    cols = [("prompt", "{}"), ("tv_method", "{:.3f}"), ("tv_ar", "{:.3f}"),
            ("p_top_target", "{:.3f}"), ("p_top_method", "{:.3f}")]
    print(format_table([*rows, {"prompt": "mean", **mean}], cols))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shift.json").write_text(json.dumps({
        "method": cfg.model_dump(mode="json"), "verify": args.verify,
        "verify_params": verify_params, "temperature": args.temperature,
        "samples": args.samples, "rows": rows, "mean": mean}, indent=2, default=str))
    print(f"[shift] wrote {out / 'shift.json'}")
    return 0


def cmd_check_model(args: argparse.Namespace) -> int:
    """Print the report (:mod:`speclab.compat`), write ``<out>/check_model.json``; 2 when
    the model is refused or a method's output differs."""
    import json
    import re
    from pathlib import Path

    import torch

    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
    name = re.sub(r"[^\w.-]+", "_", args.target.rstrip("/").rsplit("/", 1)[-1]) or "model"
    out = Path(args.out) if args.out else speclab_home() / "check_model" / name
    try:
        target, draft = resolve_models(args.target, args.draft)  # a pair's name: both
        dec = Decoder.from_pretrained(target, draft, args.dtype, args.device,
                                      attn_implementation=args.attn_implementation)
    except (ValueError, OSError) as exc:  # refused or unloadable: the reason, status 2
        print(f"[check-model] REFUSED: {exc}")
        return 2
    if dec.tokenizer is not None:
        prompts = [dec.encode(t) for t in load_prompts("stdlib_functions", args.num_prompts)]
    else:  # no tokenizer: random token ids of a few lengths
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, dec.target.vocab_size, (8 + 7 * i,), generator=g).tolist()
                   for i in range(args.num_prompts)]
    report = check_model(dec, prompts, args.max_new_tokens)
    for side in ("target", "draft"):
        if report[side]:
            print(f"{side}: " + ", ".join(f"{k}={v}" for k, v in report[side].items()))
    cols = [("method", "{}"), ("mode", "{}"), ("against", "{}"), ("prompts", "{}"),
            ("identical", "{}"), ("near_ties", "{}"), ("differing", "{}"), ("tau", "{:.2f}"),
            ("tokens_per_s", "{:.1f}")]
    print(format_table(report["rows"], cols))
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_model.json").write_text(json.dumps(report, indent=2))
    print(f"[check-model] wrote {out / 'check_model.json'}")
    for problem in report["problems"]:
        print(f"[check-model] PROBLEM: {problem}")
    return 2 if report["problems"] else 0


def _add_job_parsers(sub) -> None:
    p = sub.add_parser("run", help="run a job here (embedded Ray unless RAY_ADDRESS is set)")
    p.add_argument("job", choices=JOBS)
    p.add_argument("--config", required=True)
    p.add_argument("--address")
    p.add_argument("overrides", nargs="*")
    HANDLERS["run"] = cmd_run

    p = sub.add_parser("submit", help="submit a job to a Ray cluster through the Jobs API")
    p.add_argument("job", choices=JOBS)
    p.add_argument("--config", required=True)
    p.add_argument("--address", help="Ray dashboard address (default $RAY_ADDRESS or "
                                     "http://127.0.0.1:8265)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument("overrides", nargs="*")
    HANDLERS["submit"] = cmd_submit

    p = sub.add_parser("recommend", help="top-K items for a history (AtSpeed beam / beam SD)")
    p.add_argument("--target", required=True, help="recommender folder or models:/ URI")
    p.add_argument("--draft", help="drafter folder or models:/ URI (for --method sd)")
    p.add_argument("--history", required=True, help="comma-separated dataset item ids")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--method", choices=["beam", "sd"], default="beam")
    p.add_argument("--n", type=int, default=40, help="draft beam size")
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--verify", choices=["strict", "relaxed"], default="strict")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    HANDLERS["recommend"] = cmd_recommend

    p = sub.add_parser("serve", help="serve target + draft deployments over HTTP (Ray Serve)")
    p.add_argument("--config", required=True, help="experiment config with a serve group")
    p.add_argument("--address", help="Ray cluster (default: $RAY_ADDRESS or embedded)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (serve.api_key)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    HANDLERS["serve"] = cmd_serve

    p = sub.add_parser("ui", help="open the MLflow UI on 127.0.0.1 over speclab's store")
    p.add_argument("--port", type=int, default=5000)
    HANDLERS["ui"] = cmd_ui


def _validate_job_config(job: str, config: str, overrides: list[str]) -> None:
    """Fail before submitting anything when the config is invalid for ``job``."""
    JOB_CONFIGS[job].from_yaml(config, overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    """Deploy ``serve_apps`` on local (or ``--address``) Ray; block until SIGINT/SIGTERM."""
    import json
    import os
    import signal
    import threading

    key = [f"serve.api_key={json.dumps(args.api_key)}"] if args.api_key is not None else []
    cfg = ServeJob.from_yaml(args.config, [*args.overrides, *key])  # validated with the key
    sys.path.insert(0, str(repo_root()))  # serve_apps lives next to the package
    from serve_apps.app import app_from_config

    sv = cfg.serve
    check_port_free("serve.port", sv.host, sv.port)
    if sv.metrics_port and not (args.address or os.environ.get("RAY_ADDRESS")):
        check_port_free("serve.metrics_port", sv.host, sv.metrics_port)
    app = app_from_config(cfg)  # resolves the models and checks them before Ray starts
    where = init_ray(args.address, cfg.ray.num_cpus)
    forwarder, metrics = None, ""
    if sv.metrics_port and where == "embedded local Ray":  # on serve.host, not Ray's bind
        from speclab.metrics_forward import MetricsForwarder, ray_exporter_port

        forwarder = MetricsForwarder(sv.host, sv.metrics_port, ray_exporter_port())
        metrics = f"; Prometheus metrics on http://{sv.host}:{sv.metrics_port}/metrics"
    from ray import serve

    serve.start(http_options={"host": sv.host, "port": sv.port})
    serve.run(app, name=sv.app_name, route_prefix="/")
    print(f"[serve] {cfg.method.name} on {where}: http://{sv.host}:{sv.port} "
          f"(/v1/completions, /v1/chat/completions, /v1/models, /generate, /recommend, "
          f"/health, /openapi.json){metrics}; stop with Ctrl-C", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    gone = _watch(stop, sv.host, sv.port)
    if gone:  # Ray died under us: exit, not sleep on a port that answers nothing
        print(f"[serve] error: {gone}; exiting so a supervisor can restart it",
              file=sys.stderr, flush=True)
        _shutdown_ray(timeout_s=20)
        os._exit(1)  # Ray's own exit hooks would wait on a dead cluster
    print("[serve] shutting down", flush=True)
    if forwarder is not None:
        forwarder.close()
    serve.shutdown()
    return 0


def _watch(stop, host: str, port: int, every_s: float = 2.0, misses: int = 3) -> str | None:
    """Wait for ``stop`` (then None) while the app lives; what died, once a process of
    this command's embedded Ray exited (raylet, GCS, ...) or the app's HTTP port refused
    ``misses`` connections in a row (a cluster joined with ``--address`` went away)."""
    import ray._private.worker as ray_worker

    missed = 0
    while not stop.wait(every_s):
        node = getattr(ray_worker, "_global_node", None)
        dead = sorted({kind for kind, _ in node.dead_processes()}) if node is not None else []
        if dead:
            return f"its embedded Ray lost its {', '.join(dead)} process"
        missed = 0 if answers(host, port) else missed + 1
        if missed >= misses:
            return f"the app stopped answering on {host}:{port} (its Ray cluster is gone?)"
    return None


def _shutdown_ray(timeout_s: float) -> None:
    """``ray.shutdown()`` (stops the embedded cluster's processes), given up after
    ``timeout_s`` if it hangs on a dead cluster."""
    import threading

    import ray

    t = threading.Thread(target=ray.shutdown, daemon=True)
    t.start()
    t.join(timeout_s)


def cmd_run(args: argparse.Namespace) -> int:
    """Run the job in this process: ``speclab.jobs.<job>.main`` (works from an
    installed package; no checkout needed)."""
    argv = ["--config", args.config, *(["--address", args.address] if args.address else []),
            *args.overrides]
    return job_main(args.job)(argv)


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit ``python -m jobs.<job>`` with the project as runtime_env; follow the logs."""
    import asyncio
    import os
    import shlex
    import sys

    _validate_job_config(args.job, args.config, args.overrides)
    quiet_ray_env()
    from ray.job_submission import JobStatus, JobSubmissionClient

    address = args.address or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265"
    if not address.startswith("http"):
        address = "http://" + address
    try:
        client = JobSubmissionClient(address)
    except Exception as exc:  # nothing (or no Ray job server) answers there
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"address: no Ray job server answers at {address} ({first[:200]})"
                         ) from None
    entry = " ".join(shlex.quote(a) for a in
                     ["python", "-m", f"jobs.{args.job}", "--config", args.config,
                      *args.overrides])
    job_id = client.submit_job(entrypoint=entry, runtime_env=project_runtime_env())
    print(f"submitted job {job_id} to {address}", flush=True)
    if args.no_wait:
        return 0

    async def follow() -> None:
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(follow())
    status = client.get_job_status(job_id)
    print(f"job {job_id} finished: {status}", flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1


#: the UI's query parameter that opens MLflow 3 on its machine-learning pages (runs,
#: metrics, charts) instead of the GenAI landing page (for that page only: the UI does
#: not keep it when a link drops it)
ML_WORKFLOW = "workflowType=machine_learning"


def ui_pages(uri: str, base: str) -> list[str]:
    """The lines naming the UI pages to open: the experiments list, and each
    experiment's runs table (newest first), all on MLflow's machine-learning view."""
    from mlflow.tracking import MlflowClient

    lines = [f"  experiments: {base}/#/experiments?{ML_WORKFLOW}"]
    try:
        exps = MlflowClient(uri).search_experiments(order_by=["last_update_time DESC"])
    except Exception as exc:  # an empty or new store: the list page is still right
        return lines + [f"  (could not list the experiments: {type(exc).__name__})"]
    for exp in exps[:10]:
        if exp.name != "Default":
            lines.append(f"  {exp.name}: {base}/#/experiments/{exp.experiment_id}/runs"
                         f"?{ML_WORKFLOW}")
    return lines


def cmd_ui(args: argparse.Namespace) -> int:
    """Run ``mlflow server`` (light mode) on 127.0.0.1 over the store jobs write to; its
    port is recorded (:func:`speclab.tracking.ui_record`) while it runs."""
    import json
    import os
    import signal
    import subprocess
    import sys

    uri = resolve_tracking_uri()
    if uri.startswith("http"):
        print(f"tracking server already at {uri}: open it in a browser")
        return 0
    check_port_free("port", "127.0.0.1", args.port)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
           "--default-artifact-root", default_artifact_root(), "--host", "127.0.0.1",
           "--port", str(args.port), "--workers", "1"]
    print(f"MLflow UI on http://127.0.0.1:{args.port} over {uri} (Ctrl-C to stop)", flush=True)
    for line in ui_pages(uri, f"http://127.0.0.1:{args.port}"):
        print(line, flush=True)
    # `mlflow server` runs uvicorn as a child: give them a process group of their own and
    # stop that group on Ctrl-C or SIGTERM, so nothing outlives this command
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    record = ui_record()  # jobs print run links on this port while it runs (the newest
    # UI's; removed by the UI that wrote it)

    stopping = []

    def stop_server(sig: int = signal.SIGTERM) -> None:
        stopping.append(sig)
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, lambda *_: stop_server())
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        part = record.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps({"port": args.port, "pid": os.getpid(), "uri": uri}))
        part.replace(record)
        rc = server.wait()
        return 0 if stopping else rc
    except KeyboardInterrupt:
        stop_server()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_server(signal.SIGKILL)
            server.wait()
        return 0
    finally:
        try:
            if json.loads(record.read_text()).get("pid") == os.getpid():
                record.unlink()
        except (OSError, ValueError):
            pass


def cmd_recommend(args: argparse.Namespace) -> int:
    """Print the K recommended item ids (rank order) with scores (+ SD stats)."""
    import json

    try:
        history = [int(h) for h in args.history.split(",") if h.strip()]
    except ValueError:
        raise ValueError(
            f"history: expected comma-separated item ids, got {args.history!r}") from None
    rec = Recommender.from_pretrained(args.target, args.draft if args.method == "sd" else None)
    out = rec.recommend(history, args.k, args.method, args.n, args.gamma, args.verify,
                        args.seed)
    if args.json:
        print(json.dumps(out))
    else:
        for rank, (item, score) in enumerate(zip(out["items"], out["scores"]), start=1):
            print(f"{rank:3d}. item {item}  (log p = {score:.3f})")
        if "stats" in out:
            print(f"accepted steps {out['stats']['accepted_steps']}, target calls "
                  f"{out['stats']['target_calls']}")
    return 0
