"""Plain autoregressive decoding (``ar``): the empty drafter, one target call per token."""

from __future__ import annotations

from typing import ClassVar, Literal

from speclab.config.method import MethodSpec


class ArConfig(MethodSpec):
    """``ar``: no drafter; the baseline every speedup is measured against."""

    name: Literal["ar"] = "ar"
    needs_draft_model: ClassVar[bool] = False
    drafting: ClassVar[bool] = False

    def build(self, ctx) -> None:
        return None
