"""theory.py reproduces Leviathan et al.'s table (Figure 4 numbers) and the cost model."""

import pytest

from speclab import theory

# alpha, gamma, operations (c_hat = 0), speed (c = 0) -- from the paper's table
LEVIATHAN_TABLE = [
    (0.6, 2, 1.53, 1.96),
    (0.7, 3, 1.58, 2.53),
    (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69),
    (0.9, 2, 1.11, 2.71),
    (0.9, 10, 1.60, 6.86),
]


@pytest.mark.parametrize("alpha,gamma,ops,speed", LEVIATHAN_TABLE)
def test_leviathan_table(alpha, gamma, ops, speed):
    assert round(theory.walltime_improvement(alpha, gamma, 0.0), 2) == speed
    assert round(theory.operations_factor(alpha, gamma, 0.0), 2) == ops


def test_expected_tokens_and_limits():
    assert theory.expected_tokens(0.0, 5) == 1.0
    assert theory.expected_tokens(1.0, 5) == 6.0
    assert theory.expected_tokens(0.5, 1) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="alpha"):
        theory.expected_tokens(1.5, 3)


def test_optimal_gamma():
    # brute force over gamma agrees, and cheaper drafts / better alignment want longer drafts
    for alpha, c in [(0.6, 0.1), (0.8, 0.05), (0.9, 0.02), (0.5, 0.5)]:
        g = theory.optimal_gamma(alpha, c)
        best = max(theory.walltime_improvement(alpha, k, c) for k in range(1, 65))
        assert theory.walltime_improvement(alpha, g, c) == best
    assert theory.optimal_gamma(0.9, 0.01) > theory.optimal_gamma(0.6, 0.01)
    assert theory.optimal_gamma(0.8, 0.01) >= theory.optimal_gamma(0.8, 0.2)


def test_specdecpp_latency_matches_total_time():
    # eq. 2.3 * N == eq. 2.1 given N_draft + N_target = N + N_discarded
    t_d, t_t, n, n_target, n_disc = 0.01, 0.1, 100, 30, 40
    n_draft = n + n_disc - n_target
    lat = theory.specdecpp_latency(t_d, t_t, n_disc / n, n_target / n)
    assert lat * n == pytest.approx(theory.total_time(t_d, t_t, n_draft, n_target))
