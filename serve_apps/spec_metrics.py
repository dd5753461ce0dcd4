"""A request's speculative-decoding statistics in vLLM's per-request schema.

vLLM (``--per-request-spec-decode-metrics summary|detailed``, vllm-project/vllm#48915)
returns them in the top-level ``metrics`` object of an OpenAI response, under
``speculative_decoding``; AIPerf and SPEED-Bench read them there. speclab returns the
same object (``serve.spec_decode_metrics``, default ``summary``) beside its own
``speclab`` field, on completions and chat, in the reply and, streamed, in the final
usage chunk::

    {"mean_acceptance_length": 1 + accepted / steps,
     "draft_acceptance_rate": accepted / drafted,
     "acceptance_histogram": [steps that accepted exactly j draft tokens, j = 0..k],
     "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
     "num_draft_tokens": drafted, "num_spec_tokens": k}

plus, with ``detailed``, ``per_step_accepted`` and ``per_step_drafted`` (one entry per
verification step). A step is one speclab round (one target verification) that verified
at least one draft token (a round with none, e.g. the last one when ``max_tokens`` left
no room to draft, or a lookup that found nothing, is plain decoding there); accepted
draft tokens exclude the bonus token and are counted before any cut at EOS or
``max_tokens`` (vLLM's counters are too); drafted tokens are every proposed draft token,
so a tree's are its nodes (its acceptance rate is lower than a chain's by design); ``k``
is the method's draft length (:meth:`~speclab.config.method.MethodSpec.draft_length`: a
chain's gamma, a tree's depth), or the longest accepted draft where no knob fixes it.
A method that does not draft gives ``null``.
"""

from __future__ import annotations

#: the levels of ``serve.spec_decode_metrics`` (vLLM's ``--per-request-spec-decode-metrics``)
LEVELS = ("none", "summary", "detailed")


def spec_decode_metrics(stats: dict, draft_length: int | None, level: str,
                        drafting: bool = True) -> dict | None:
    """The ``metrics.speculative_decoding`` object of a request whose statistics are
    ``stats`` (:class:`~speclab.decoding.loop.GenerationStats` as a dict: its per-round
    lists ``round_accepted`` and ``round_drafted``), for a method drafting at most
    ``draft_length`` tokens a round (None: unknown) at ``level`` (``summary`` or
    ``detailed``); None for a method that does not draft."""
    if level not in LEVELS[1:]:
        raise ValueError(f"spec_decode_metrics: level must be one of {list(LEVELS[1:])}, "
                         f"got {level!r}")
    if not drafting:
        return None
    accepted = [int(a) for a in stats.get("round_accepted", [])]
    drafted = [int(d) for d in stats.get("round_drafted", [])]
    if len(drafted) != len(accepted):
        raise ValueError(f"spec_decode_metrics: {len(accepted)} rounds accepted but "
                         f"{len(drafted)} drafted")
    spec = [(a, d) for a, d in zip(accepted, drafted, strict=True) if d > 0]
    accepted, drafted = [a for a, _ in spec], [d for _, d in spec]
    k = max([draft_length or 0, *accepted])  # never shorter than what was accepted
    steps, n_acc, n_draft = len(accepted), sum(accepted), sum(drafted)
    out = {"mean_acceptance_length": 1.0 + n_acc / steps if steps else 1.0,
           "draft_acceptance_rate": n_acc / n_draft if n_draft else 0.0,
           "acceptance_histogram": [accepted.count(j) for j in range(k + 1)],
           "num_spec_steps": steps, "num_accepted_draft_tokens": n_acc,
           "num_draft_tokens": n_draft, "num_spec_tokens": k}
    if level == "detailed":
        out["per_step_accepted"] = accepted
        out["per_step_drafted"] = drafted
    return out
