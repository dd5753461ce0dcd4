"""Build the Serve application: target and draft deployments behind the HTTP ingress.

    serve run serve_apps.app:build_app config=experiments/smoke/serve.yaml method=salf
    speclab serve --config experiments/smoke/serve.yaml [key=value ...]   # same, blocking
    serve deploy serve_apps/deploy.yaml                                   # to a cluster

:func:`build_app` takes typed args (:class:`AppArgs`: an experiment config plus a few
common overrides); :func:`app_from_config` does the work. The ``models`` group gives
the target and draft (a folder, a hub id, a ``models:/name/version`` URI, or the
``tiny`` / ``reference`` pairs); ``method`` the drafting method; ``serve`` the
replicas or autoscaling range of each deployment, their resources (``num_gpus: 1`` on
both puts draft and target on separate GPUs), the batching (``max_batch``,
``batch_wait_ms``), request-state bounds, the API key and the HTTP port. The ingress
hands each request to the draft deployment, which drives its rounds and verifies on the
target; both model deployments route every call of a request to one replica
(:class:`serve_apps.router.SessionAffinityRouter`).
"""

import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.config import RequestRouterConfig

from serve_apps.colocated import ColocatedDeployment
from serve_apps.draft import DraftDeployment
from serve_apps.ingress import Ingress
from serve_apps.router import SessionAffinityRouter
from serve_apps.target import TargetDeployment
from speclab.config import ServeJob
from speclab.models.loading import resolve_source
from speclab.models.registry import resolve_models
from speclab.paths import repo_root


class AppArgs(BaseModel):
    """``serve run serve_apps.app:build_app key=value ...`` arguments."""

    model_config = ConfigDict(extra="forbid")

    config: str = "experiments/smoke/serve.yaml"
    target: str | None = None
    draft: str | None = None
    method: str | None = None
    overrides: str = ""  # more "key=value" pairs, separated by spaces


def load_config(args: AppArgs) -> ServeJob:
    """The experiment config of ``args`` (flag > yaml > default)."""
    pairs = args.overrides.split()
    pairs += [f"models.{k}={v}" for k, v in (("target", args.target), ("draft", args.draft))
              if v is not None]
    if args.method is not None:  # the method with its own defaults
        pairs.append(f"method={{name: {args.method}}}")
    path = Path(args.config)
    if not path.is_absolute() and not path.exists():  # e.g. in a Serve controller
        path = repo_root() / path
    return ServeJob.from_yaml(path, pairs)


def resolved_models(cfg: ServeJob) -> tuple[str, str | None]:
    """Local folders for the target and (if the method needs one) the draft."""
    target, draft = resolve_models(cfg.models.target, cfg.models.draft)
    target = str(resolve_source(target, "models.target"))
    if not cfg.method.needs_draft_model:
        return target, None
    if draft is None:
        raise ValueError(f"models.draft: method {cfg.method.name!r} needs a draft model")
    return target, str(resolve_source(draft, "models.draft"))


def plugin_modules(method) -> list[str]:
    """Modules a replica must import to know ``method`` (a method registered outside
    speclab's built-ins, e.g. by a test or ``$SPECLAB_METHODS``)."""
    module = type(method).__module__
    return [] if module.startswith("speclab.") else [module]


def _options(rc, name: str, routed: bool, access_log: bool) -> dict:
    opts = {"name": name, "max_ongoing_requests": rc.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": rc.num_cpus, "num_gpus": rc.num_gpus},
            "logging_config": {"enable_access_log": access_log}}
    if rc.omp_wait_policy is not None:  # read by OpenMP when the replica's process starts
        opts["ray_actor_options"]["runtime_env"] = {
            "env_vars": {"OMP_WAIT_POLICY": rc.omp_wait_policy.upper()}}
    if rc.autoscaling is not None:
        a = rc.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}
    else:
        opts["num_replicas"] = rc.replicas
    if routed:
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=SessionAffinityRouter)
    return opts


def app_from_config(cfg: ServeJob):
    """The bound application for ``cfg`` (models resolved here, loaded in replicas)."""
    from transformers import AutoConfig

    sv, m = cfg.serve, cfg.models
    target, draft = resolved_models(cfg)
    vocab = int(AutoConfig.from_pretrained(target, trust_remote_code=False).vocab_size)
    rec_target = str(resolve_source(sv.rec_target, "serve.rec_target")) if sv.rec_target \
        else None
    rec_draft = str(resolve_source(sv.rec_draft, "serve.rec_draft")) if sv.rec_draft else None
    common = {"max_sessions": sv.max_sessions, "max_cached_tokens": sv.max_cached_tokens,
              "idle_timeout_s": sv.idle_timeout_s, "max_batch": sv.max_batch,
              "batch_wait_ms": sv.batch_wait_ms}
    log = sv.access_log
    i = serve.deployment(Ingress).options(**_options(sv.ingress, "ingress", False, log))
    colocated = sv.topology == "colocated"
    # target routing keys: one batched call per key (colocated: the replica's own target)
    buckets = 1 if colocated else sv.target.max_count
    settings = {"method": cfg.method.name, "model_name": sv.model_name or cfg.name,
                "max_tokens": sv.max_tokens, "target_path": target, "created": int(time.time()),
                "rec_n": sv.rec_n, "rec_gamma": sv.rec_gamma, "api_key": sv.api_key,
                "max_cached_tokens": sv.max_cached_tokens, "max_model_len": sv.max_model_len,
                "request_timeout_s": sv.request_timeout_s,
                "spec_decode_metrics": sv.spec_decode_metrics,
                "drafting": cfg.method.drafting, "draft_length": cfg.method.draft_length(),
                "target_buckets": buckets, "topology": sv.topology, "budget": sv.budget,
                "replicas": {"target": sv.target.max_count,
                             "draft": (sv.target if colocated else sv.draft).max_count}}
    common["attn_implementation"] = m.attn_implementation
    draft_options = {"rec_draft": rec_draft, "plugins": plugin_modules(cfg.method),
                     "buckets": buckets, "target_source": target,
                     "draft_ahead": sv.draft_ahead, "ahead_warmup": sv.ahead_warmup,
                     "ahead_min_hit_rate": sv.ahead_min_hit_rate, **common}
    if colocated:  # one deployment, both models, on the target's device and resources
        c = serve.deployment(ColocatedDeployment).options(
            **_options(sv.target, "colocated", True, log))
        both = c.bind(target, draft, cfg.method.model_dump(mode="json"), vocab, m.dtype,
                      cfg.device_of("target"),
                      target_options={"rec_target": rec_target,
                                      "torch_threads": sv.target.torch_threads,
                                      "prefill_chunk": sv.prefill_chunk, **common},
                      torch_threads=sv.target.torch_threads, **draft_options)
        return i.bind(both, both, settings)
    t = serve.deployment(TargetDeployment).options(**_options(sv.target, "target", True, log))
    d = serve.deployment(DraftDeployment).options(**_options(sv.draft, "draft", True, log))
    target_app = t.bind(target, m.dtype, cfg.device_of("target"), rec_target=rec_target,
                        torch_threads=sv.target.torch_threads,
                        prefill_chunk=sv.prefill_chunk, **common)
    draft_app = d.bind(target_app, draft, cfg.method.model_dump(mode="json"), vocab, m.dtype,
                       cfg.device_of("draft"), torch_threads=sv.draft.torch_threads,
                       direct_rounds=sv.direct_rounds, **draft_options)
    return i.bind(target_app, draft_app, settings)


def build_app(args: AppArgs):
    """Application builder for ``serve run`` / ``serve deploy`` (typed args; a plain
    dict is validated the same way)."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    return app_from_config(load_config(args))
