"""How aiohttp sends a part body (``atomicstore/drivers/payload.py``).

aiohttp sent ``PartBody`` as any file-like body: 256 KiB reads, each a copy made on an
executor thread and handed back to the event loop (1,024 thread round trips per 256 MiB,
through the one thread that carries every request). Now it writes views of the caller's
buffers, from the position the body is at (a retry seeks it back), never past the
length it is asked for.
"""

from __future__ import annotations

import asyncio

import aiohttp.payload
import numpy as np
import pytest
from aiobotocore._endpoint_helpers import _IOBaseWrapper

import atomicstore.drivers.s3  # noqa: F401 - registers the payload, as the S3 driver does
from atomicstore.drivers.parts import PartBody
from atomicstore.drivers.payload import CHUNK, PartPayload


class Collect:
    """An aiohttp stream writer that keeps what it is given."""

    def __init__(self) -> None:
        self.chunks: list[memoryview] = []

    async def write(self, chunk: memoryview) -> None:
        self.chunks.append(chunk)


def send(body: object, length: int | None = None) -> list[memoryview]:
    payload = aiohttp.payload.get_payload(body)
    assert isinstance(payload, PartPayload), type(payload)
    out = Collect()
    asyncio.run(payload.write_with_length(out, length))
    return out.chunks


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_part_is_sent_as_views_of_the_callers_buffers(wrapped):
    a = np.arange(3 * CHUNK // 8 + 5, dtype=np.int64)
    b = np.frombuffer(b"tail bytes", np.uint8)
    body = PartBody([memoryview(a).cast("B"), memoryview(b).cast("B")])
    chunks = send(_IOBaseWrapper(body) if wrapped else body)  # (aiobotocore wraps file bodies)
    assert b"".join(chunks) == a.tobytes() + b.tobytes()
    assert all(isinstance(c, memoryview) and c.nbytes <= CHUNK for c in chunks)
    assert all(c.obj is a or c.obj is b for c in chunks), "a chunk was copied"


def test_a_retry_sends_from_where_the_body_was_sought_and_no_more_than_asked():
    data = bytes(range(256)) * (CHUNK // 128)
    body = PartBody([memoryview(data)])
    assert b"".join(send(body)) == data
    body.seek(0)  # botocore's retry
    assert b"".join(send(body)) == data
    body.seek(100)
    assert b"".join(send(body, 1000)) == data[100:1100]
    assert aiohttp.payload.get_payload(PartBody([memoryview(data)])).size == len(data)
