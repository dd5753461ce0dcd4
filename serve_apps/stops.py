"""Text streaming with stop strings: a request's token rounds in, text deltas out.

OpenAI's ``stop`` ends the text BEFORE the first stop string; the tokens come by rounds,
and a stop string can straddle two rounds, so :class:`StopText` holds back the tail of
the text that may still become a stop string (the longest stop string's length minus
one) and any incomplete UTF-8 character (a trailing ``U+FFFD``) until the next round
shows what it is. Nothing here knows about HTTP or the deployments: the ingress feeds
it the rounds of :meth:`serve_apps.ingress.Ingress._decode` and a detokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable


class StopText:
    """Text deltas of one request, cut at its first stop string.

    After :meth:`deltas` ended, ``stopped`` says whether a stop string ended the text
    and ``tokens`` holds the tokens received up to then."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.stopped = False

    async def deltas(self, rounds: AsyncGenerator[list[int], None]) -> AsyncIterator[str]:
        """The new text of each round of ``rounds`` (the new tokens per round), stopping
        at a stop string (not included). ``rounds`` is closed when this ends early (a
        stop string, or a consumer that went away), so its request's states are freed
        at once."""
        out, sent = self.tokens, 0
        hold = max((len(s) for s in self.stops), default=1) - 1
        try:
            async for new in rounds:
                out += new
                text = self.decode(out)
                cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0),
                          default=-1)
                if cut >= 0:
                    self.stopped = True
                    if cut > sent:
                        yield text[sent:cut]
                    return
                safe = len(text) - hold
                while safe > sent and text[safe - 1] == "\ufffd":
                    safe -= 1
                if safe > sent:
                    yield text[sent:safe]
                    sent = safe
        finally:
            await rounds.aclose()
        text = self.decode(out)
        if len(text) > sent:
            yield text[sent:]
