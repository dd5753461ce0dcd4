"""Closed forms: Leviathan et al. (section 3) and the SpecDec++ cost model (eq. 2.1-2.3).

alpha: per-token acceptance rate; gamma: draft length; c: draft/target time per forward;
c_hat: draft/target arithmetic operations per token.
"""

from __future__ import annotations


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per round ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (Leviathan eq. 1)."""
    _check_alpha(alpha)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup ``(1 - a^(g+1)) / ((1 - a)(g c + 1))`` (Theorem 3.8)."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def operations_factor(alpha: float, gamma: int, c_hat: float) -> float:
    """Expected increase in operations ``(1-a)(c_hat g + g + 1) / (1 - a^(g+1))`` (Thm 3.11)."""
    return (c_hat * gamma + gamma + 1.0) / expected_tokens(alpha, gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The integer gamma in [1, max_gamma] maximising :func:`walltime_improvement`."""
    return max(range(1, max_gamma + 1), key=lambda g: walltime_improvement(alpha, g, c))


def total_time(t_draft: float, t_target: float, n_draft: int, n_target: int) -> float:
    """SpecDec++ eq. 2.1: ``T = t_draft N_draft + t_target N_target``."""
    return t_draft * n_draft + t_target * n_target


def specdecpp_latency(
    t_draft: float, t_target: float, discard_rate: float, verification_rate: float
) -> float:
    """SpecDec++ eq. 2.3: seconds per generated token.

    ``t_draft + t_draft * N_discarded/N + (t_target - t_draft) * N_target/N``.
    """
    return t_draft + t_draft * discard_rate + (t_target - t_draft) * verification_rate
