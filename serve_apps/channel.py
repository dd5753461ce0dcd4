"""A direct same-node channel for the per-round calls of a draft replica to a target
replica on the SAME node.

A Serve handle call costs a few milliseconds of CPU on both ends (routing, the
replica's request bookkeeping, metrics), about as much as the target's forward for one
request on a small CPU model. The round exchange is the hot path, so a target replica
also answers its round calls (``start_rows``, ``verify_rows``, ``end``) on a Unix socket
in a private folder (mode 0700, so only processes of the same user can connect). The
draft replica learns its path and a per-replica secret through an ordinary, routed
Serve call (``channel``) and uses the socket only when both replicas share a node;
otherwise (another node) it keeps the Serve handle calls. Routing,
batching and failures are unchanged: a dead target replica closes its sockets, so the
requests it held fail with a connection error (503) and the next request asks Serve
again and reaches a live replica.

Frames are a 4-byte big-endian length and a body. A connection first sends the secret
(raw bytes, compared in constant time); only then are bodies unpickled, so nothing
reaches :mod:`pickle` from a process that did not get the secret from Serve.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable

_LEN = struct.Struct("!I")
SECRET_BYTES = 32


async def _read(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if limit is not None and n > limit:
        raise ConnectionError(f"frame of {n} bytes, at most {limit} expected")
    return await reader.readexactly(n)


def _frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


class ChannelServer:
    """The target side: ``handler(op, args)`` answers every call of a caller that sent
    the secret first."""

    def __init__(self, handler: Callable[[str, tuple], Awaitable[object]]) -> None:
        self.handler = handler
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.path: str | None = None
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Lock | None = None

    async def address(self) -> dict:
        """Start listening (once, even for concurrent callers); ``{"path", "secret"}``."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._server is None:
                folder = tempfile.mkdtemp(prefix="speclab-channel-")  # mode 0700
                self.path = os.path.join(folder, "target.sock")
                self._server = await asyncio.start_unix_server(self._serve, self.path)
        return {"path": self.path, "secret": self.secret}

    async def close(self) -> None:
        """Stop listening and remove the socket's folder."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.remove()

    def remove(self) -> None:
        """Remove the socket's folder (the replica is going away)."""
        if self.path is not None:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not secrets.compare_digest(await _read(reader, SECRET_BYTES), self.secret):
                return
            while True:
                op, args = pickle.loads(await _read(reader))
                try:
                    reply = (True, await self.handler(op, args))
                except Exception as exc:  # the caller raises it as a ValueError or not
                    reply = (False, (isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"))
                writer.write(_frame(pickle.dumps(reply)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller went away
        finally:
            writer.close()


class ChannelError(ConnectionError):
    """The target replica behind a channel failed or went away."""


class ChannelClient:
    """The draft side: connections to one target replica, one per concurrent call."""

    def __init__(self, path: str, secret: bytes) -> None:
        self.path, self.secret = path, secret
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def call(self, op: str, *args) -> object:
        """``op(*args)`` on the target replica; ValueError for the caller's mistakes,
        :class:`ChannelError` for everything else."""
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            try:
                reader, writer = await asyncio.open_unix_connection(self.path)
            except OSError as exc:
                raise ChannelError(f"target replica unreachable: {exc}") from None
            writer.write(_frame(self.secret))
        try:
            writer.write(_frame(pickle.dumps((op, args))))
            await writer.drain()
            ok, reply = pickle.loads(await _read(reader))
        except (asyncio.IncompleteReadError, OSError) as exc:
            writer.close()
            raise ChannelError(f"target replica went away: {type(exc).__name__}") from None
        self._idle.append((reader, writer))
        if ok:
            return reply
        caller_fault, text = reply
        raise ValueError(text) if caller_fault else ChannelError(text)

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
