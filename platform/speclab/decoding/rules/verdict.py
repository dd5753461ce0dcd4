"""The outcome every verification rule returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Verdict:
    """Outcome of verifying one tree.

    ``path``: accepted node indices from the root (always starts with 0);
    ``bonus``: the token the target contributes after the last accepted node;
    ``evaluated``: how many depths had a draft token judged (for the acceptance rate).
    """

    path: list[int]
    bonus: int
    evaluated: int

    @property
    def accepted(self) -> int:
        """Number of accepted draft tokens."""
        return len(self.path) - 1
