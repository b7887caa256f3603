"""How aiohttp sends a :class:`~atomicstore.drivers.parts.PartBody`: the caller's buffers
written to the connection as they are, from the event loop.

aiohttp sends any other file-like body (``IOBasePayload``) by reading it in 256 KiB
chunks, each read a copy made on an executor thread and handed back to the event loop: a
256 MiB part upload took 1,024 thread round trips through the one event-loop thread that
carries every request of the process. A :class:`PartPayload` writes views of the
buffers in the same 256 KiB steps, waiting for the connection to drain between them as
aiohttp's writer does, so a connection's unsent bytes stay bounded and nothing is copied
but what the kernel takes. Registered with aiohttp (its documented ``PAYLOAD_REGISTRY``)
by the drivers that upload through it, for :class:`PartBody` only (s3fs and gcsfs, via
aiobotocore's body wrapper, which proxies the type).
"""

from __future__ import annotations

from typing import Any

import aiohttp.payload

from .parts import PartBody

#: bytes handed to the connection at a time (aiohttp's own chunk for file bodies)
CHUNK = 2**18


class PartPayload(aiohttp.payload.Payload):
    """A :class:`PartBody` as an aiohttp request body, from its position when the request
    is built (botocore seeks it back to the start for a retry: each try is a new payload)."""

    def __init__(self, value: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("content_type", "application/octet-stream")
        super().__init__(value, *args, **kwargs)
        self._start: int = value.tell()
        self._left: int = value.size - self._start
        self._size = self._left
        self._autoclose = True  # holds nothing to close

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a part body is binary")

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        body = self._value
        body.seek(self._start)
        left = self._left if content_length is None else min(self._left, content_length)
        for view in body.views(left):
            for a in range(0, view.nbytes, CHUNK):
                if body.tell() >= body.size and a + CHUNK >= view.nbytes:
                    body.handed_over = True  # the last bytes: the server may now store it
                await writer.write(view[a : a + CHUNK])


_registered = False


def register() -> None:
    """Make aiohttp send every :class:`PartBody` as a :class:`PartPayload` (once)."""
    global _registered
    if not _registered:
        aiohttp.payload.PAYLOAD_REGISTRY.register(PartPayload, PartBody, order=aiohttp.payload.Order.try_first)
        _registered = True
