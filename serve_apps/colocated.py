"""``ColocatedDeployment``: the target AND the draft side in ONE replica
(``serve.topology: colocated``), for a deployment on one device.

With ``split`` (the default) every round crosses a deployment hop: the draft replica
drives the request and calls the target replica (:mod:`serve_apps.draft`). Here the
replica holds a :class:`~serve_apps.target.TargetDeployment` as a plain object and the
draft side (:class:`~serve_apps.draft.DraftDeployment`, unchanged) calls it through
:class:`LocalHandle`, a look-alike of a Serve handle whose ``op.remote(...)`` awaits the
object's coroutine in this process. The round loop, the batching across requests (the
draft side's batch of proposals, then ONE target call for all of them), sessions and
errors are the split topology's, so both give the same outputs. The ingress reaches the
target's own calls (plain decoding, ``info``, ``end``, ``stats``) under ``target_``
names, since the draft side's share those names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from serve_apps.draft import DraftDeployment
from serve_apps.target import TargetDeployment


class _LocalMethod:
    """``remote(*args)``: the coroutine of a method of an object in this process."""

    def __init__(self, fn: Callable[..., Awaitable[object]]) -> None:
        self.fn = fn

    def remote(self, *args, **kwargs) -> Awaitable[object]:
        return self.fn(*args, **kwargs)


class LocalHandle:
    """A Serve-handle look-alike over ``obj``: ``handle.op.remote(*args)`` is
    ``obj.op(*args)``, awaited by the caller (no routing, no pickling, no hop)."""

    def __init__(self, obj: object) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._obj, name))


class ColocatedDeployment(DraftDeployment):
    """A draft side (every argument of :class:`DraftDeployment` but the target handle)
    driving a target held in this replica (``target``: its folder; ``target_options``:
    :class:`TargetDeployment`'s keyword arguments)."""

    def __init__(self, target: str, draft: str | None, method: dict, target_vocab: int,
                 dtype: str = "float32", device: str = "cpu",
                 target_options: dict | None = None, **draft_options) -> None:
        self.local_target = TargetDeployment(target, dtype, device, **(target_options or {}))
        draft_options["direct_rounds"] = False  # no socket: the target is in this process
        super().__init__(LocalHandle(self.local_target), draft, method, target_vocab, dtype,
                         device, **draft_options)

    async def target_info(self) -> dict:
        """The target's ``info`` (:meth:`TargetDeployment.info`)."""
        return await self.local_target.info()

    async def target_generate(self, key: str, rid: str, request: dict
                              ) -> AsyncIterator[dict]:
        """Plain decoding on the target (:meth:`TargetDeployment.generate`), streamed."""
        async for chunk in self.local_target.generate(key, rid, request):
            yield chunk

    async def target_end(self, key: str, rid: str) -> bool:
        """Free request ``rid``'s target row (:meth:`TargetDeployment.end`)."""
        return await self.local_target.end(key, rid)

    async def target_stats(self, probe: str = "") -> dict:
        """The target side's state (:meth:`TargetDeployment.stats`)."""
        return await self.local_target.stats(probe)
