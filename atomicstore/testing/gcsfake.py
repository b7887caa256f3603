"""A small fake of the GCS JSON API (the part gcsfs uses) that honours preconditions.

gcp-storage-emulator ignores ``ifGenerationMatch``; this fake enforces it under a lock,
so conditional creates behave as on GCS: of two racing creators exactly one gets 200 and
the other 412. Objects carry generations and CRC32C (base64, big-endian) like GCS.

Preconditions (``ifGenerationMatch``, ``ifGenerationNotMatch``, ``ifMetagenerationMatch``,
``ifMetagenerationNotMatch``; 412 ``conditionNotMet`` when one does not hold) are checked on
every write path: simple (``media``) and ``multipart`` uploads, the final chunk of a
resumable upload (against the preconditions given when the session was started, which its
session URL repeats, as GCS's does), delete, and metadata or media GET.
``ifGenerationMatch=0`` means "no live object". The metageneration of every object is 1
(the fake has no metadata updates).

Supported: bucket get/insert; object get (metadata and ``alt=media`` with ``Range``),
list (prefix, delimiter, pageToken, maxResults), delete, multipart upload, resumable upload
(chunks with ``Content-Range``, cancel with DELETE; a finished session answers a repeated
final chunk with the answer it gave, success or failure), and ``compose`` (1 to 32
``sourceObjects``, each optionally at a ``generation`` and with
``objectPreconditions.ifGenerationMatch``: 404 for a missing source, 412 when a source's
precondition fails; the destination's preconditions as on any write; the destination
resource's ``contentType`` and custom ``metadata`` are kept). A composed object has
``componentCount`` (the sum over its sources, a plain object counting 1) and a ``crc32c``
but no ``md5Hash``, as on GCS.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import google_crc32c
from werkzeug.wrappers import Request, Response


@dataclass
class _Object:
    data: bytes
    generation: int
    updated: float
    #: custom metadata (``metadata`` of the object resource)
    metadata: dict[str, str] | None = None
    #: composite objects: how many components (GCS reports no MD5 for them)
    component_count: int | None = None
    #: CRC32C and MD5 (base64), computed once
    crc: int | None = None
    md5: str | None = None


#: the preconditions GCS accepts on object requests
PRECONDITIONS = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch",
                 "ifMetagenerationNotMatch")
#: the metageneration of every object (the fake has no metadata updates)
METAGENERATION = 1


def precondition_failure(obj: _Object | None, conditions: dict[str, str]) -> str | None:
    """The first of ``conditions`` that does not hold for ``obj`` (None: all hold).

    As GCS documents them: ``ifGenerationMatch=0`` holds only when there is no live
    object; ``ifGenerationNotMatch`` and the metageneration conditions fail when there is
    no live object.
    """
    for name in PRECONDITIONS:
        if name not in conditions:
            continue
        try:
            want = int(conditions[name])
        except ValueError:
            return f"{name}={conditions[name]!r} is not a number"
        if name == "ifGenerationMatch":
            holds = (obj.generation if obj is not None else 0) == want
        elif name == "ifGenerationNotMatch":
            holds = obj is not None and obj.generation != want
        elif name == "ifMetagenerationMatch":
            holds = obj is not None and want == METAGENERATION
        else:
            holds = obj is not None and want != METAGENERATION
        if not holds:
            return name
    return None


@dataclass
class _Upload:
    bucket: str
    name: str
    conditions: dict[str, str]
    data: bytearray


class GCSFake:
    """A WSGI application serving the GCS JSON API from memory."""

    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, _Object]] = {}
        self.uploads: dict[str, _Upload] = {}
        #: answers of finished resumable sessions: (status, JSON body)
        self.finished: dict[str, tuple[int, bytes]] = {}
        self.lock = threading.Lock()
        self._gen = itertools.count(int(time.time() * 1e6))

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _error(code: int, message: str) -> Response:
        return Response(
            json.dumps({"error": {"code": code, "message": message, "errors": [{"message": message}]}}),
            status=code,
            content_type="application/json",
        )

    def _meta(self, bucket: str, name: str, obj: _Object) -> dict[str, Any]:
        if obj.crc is None:
            obj.crc = google_crc32c.value(obj.data)
        # milliseconds, as GCS reports them (a fake of whole seconds made a lease look up
        # to a second older than it is: a claim took it over before its writer's own
        # clock said it expired, with a grace under a second)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(obj.updated)) + f".{int(obj.updated * 1000) % 1000:03d}Z"
        doc: dict[str, Any] = {
            "kind": "storage#object",
            "id": f"{bucket}/{name}/{obj.generation}",
            "name": name,
            "bucket": bucket,
            "size": str(len(obj.data)),
            "generation": str(obj.generation),
            "metageneration": str(METAGENERATION),
            "contentType": "application/octet-stream",
            "crc32c": base64.b64encode(obj.crc.to_bytes(4, "big")).decode(),
            "updated": ts,
            "timeCreated": ts,
            "storageClass": "STANDARD",
        }
        if obj.component_count is None:  # GCS has no MD5 of a composite object
            if obj.md5 is None:
                obj.md5 = base64.b64encode(hashlib.md5(obj.data).digest()).decode()
            doc["md5Hash"] = obj.md5
        else:
            doc["componentCount"] = obj.component_count
        if obj.metadata:
            doc["metadata"] = dict(obj.metadata)
        return doc

    def _json(self, doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return Response(json.dumps(doc), status=status, content_type="application/json", headers=headers)

    def _not_met(self, failed: str) -> Response:
        return self._error(412, f"conditionNotMet: At least one of the pre-conditions you specified did not hold ({failed}).")

    def _store(self, bucket: str, name: str, data: bytes, conditions: dict[str, str]) -> Response:
        with self.lock:
            objs = self.buckets.get(bucket)
            if objs is None:
                return self._error(404, f"bucket {bucket} not found")
            failed = precondition_failure(objs.get(name), conditions)
            if failed:
                return self._not_met(failed)
            obj = _Object(bytes(data), next(self._gen), time.time())
            objs[name] = obj
            return self._json(self._meta(bucket, name, obj))

    # -- WSGI ---------------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        req = Request(environ)
        try:
            resp = self.dispatch(req)
        except Exception as exc:  # noqa: BLE001 - a fake answers 500 like the real thing
            resp = self._error(500, f"fake error: {exc!r}")
        return resp(environ, start_response)

    def dispatch(self, req: Request) -> Response:
        path = req.path
        q = {k: v[-1] for k, v in parse_qs(req.query_string.decode(), keep_blank_values=True).items()}
        m = req.method
        for base in ("/upload/storage/v1/b/", "/download/storage/v1/b/", "/storage/v1/b/"):
            if path.startswith(base):
                rest = path[len(base):]
                kind = base.split("/")[1]
                break
        else:
            if path.rstrip("/") == "/storage/v1/b" and m == "POST":
                name = str((req.get_json(silent=True) or {}).get("name") or q.get("name") or "")
                with self.lock:
                    self.buckets.setdefault(name, {})
                return self._json({"kind": "storage#bucket", "name": name})
            return self._error(404, f"no route {m} {path}")
        bucket, _, tail = rest.partition("/")
        if kind == "upload":
            return self._upload(req, bucket, q)
        if not tail:
            if m == "GET":
                if bucket not in self.buckets:
                    return self._error(404, "bucket not found")
                return self._json({"kind": "storage#bucket", "name": bucket, "id": bucket})
            return self._error(405, "method not allowed")
        if tail == "o" and m == "GET":
            return self._list(bucket, q)
        if not tail.startswith("o/"):
            return self._error(404, f"no route {m} {path}")
        name = tail[2:]
        if m == "POST" and name.endswith("/compose"):
            return self._compose(req, bucket, name[: -len("/compose")], q)
        if m == "GET":
            return self._get(req, bucket, name, q, media=(kind == "download" or q.get("alt") == "media"))
        if m == "DELETE":
            return self._delete(bucket, name, q)
        return self._error(405, "method not allowed")

    def _delete(self, bucket: str, name: str, q: dict[str, str]) -> Response:
        with self.lock:
            objs = self.buckets.get(bucket, {})
            obj = objs.get(name)
            if obj is None:
                return self._error(404, "No such object")
            failed = precondition_failure(obj, q)
            if failed:
                return self._not_met(failed)
            del objs[name]
        return Response(status=204)

    def _get(self, req: Request, bucket: str, name: str, q: dict[str, str], *, media: bool) -> Response:
        with self.lock:
            obj = self.buckets.get(bucket, {}).get(name)
        if obj is None:
            return self._error(404, "No such object: " + f"{bucket}/{name}")
        failed = precondition_failure(obj, q)
        if failed:
            return self._not_met(failed)
        if not media:
            return self._json(self._meta(bucket, name, obj))
        data = obj.data
        rng = req.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else 0
            end = int(b) + 1 if b else len(data)
            if start >= len(data) and len(data):
                return self._error(416, "Requested range not satisfiable")
            part = data[start:end]
            return Response(part, status=206, content_type="application/octet-stream",
                            headers={"Content-Range": f"bytes {start}-{start + len(part) - 1}/{len(data)}"})
        return Response(data, status=200, content_type="application/octet-stream")

    def _list(self, bucket: str, q: dict[str, str]) -> Response:
        with self.lock:
            if bucket not in self.buckets:
                return self._error(404, "bucket not found")
            names = sorted(self.buckets[bucket])
            objs = dict(self.buckets[bucket])
        prefix = q.get("prefix", "")
        delim = q.get("delimiter", "")
        start_offset = q.get("startOffset", "")
        token = q.get("pageToken", "")
        limit = int(q.get("maxResults") or 1000)
        items, prefixes = [], []
        seen: set[str] = set()
        entries: list[tuple[str, bool]] = []
        for n in names:
            if not n.startswith(prefix) or (start_offset and n < start_offset):
                continue
            if delim:
                cut = n.find(delim, len(prefix))
                if cut >= 0:
                    p = n[: cut + len(delim)]
                    if p not in seen:
                        seen.add(p)
                        entries.append((p, True))
                    continue
            entries.append((n, False))
        entries = [e for e in entries if e[0] > token] if token else entries
        page, more = entries[:limit], len(entries) > limit
        for n, is_prefix in page:
            if is_prefix:
                prefixes.append(n)
            else:
                items.append(self._meta(bucket, n, objs[n]))
        doc: dict[str, Any] = {"kind": "storage#objects", "items": items, "prefixes": prefixes}
        if more:
            doc["nextPageToken"] = page[-1][0]
        return self._json(doc)

    def _compose(self, req: Request, bucket: str, name: str, q: dict[str, str]) -> Response:
        doc = req.get_json(silent=True) or {}
        sources = doc.get("sourceObjects")
        if not isinstance(sources, list) or not 1 <= len(sources) <= 32:
            return self._error(400, "compose takes 1 to 32 sourceObjects")
        dest = doc.get("destination") or {}
        with self.lock:
            objs = self.buckets.get(bucket)
            if objs is None:
                return self._error(404, f"bucket {bucket} not found")
            parts = []
            count = 0
            for src in sources:
                obj = objs.get(str(src.get("name", "")))
                if obj is None or ("generation" in src and int(src["generation"]) != obj.generation):
                    return self._error(404, f"No such object: {bucket}/{src.get('name')}")
                pre = (src.get("objectPreconditions") or {}).get("ifGenerationMatch")
                if pre is not None and int(pre) != obj.generation:
                    return self._not_met("ifGenerationMatch (source)")
                parts.append(obj.data)
                count += obj.component_count or 1
            failed = precondition_failure(objs.get(name), _conditions(q))
            if failed:
                return self._not_met(failed)
            meta = dest.get("metadata")
            obj = _Object(b"".join(parts), next(self._gen), time.time(),
                          {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else None, count)
            objs[name] = obj
            return self._json(self._meta(bucket, name, obj))

    def _upload(self, req: Request, bucket: str, q: dict[str, str]) -> Response:
        if q.get("upload_id"):
            return self._resumable_chunk(req, q["upload_id"])
        if req.method != "POST":
            return self._error(405, "method not allowed")
        utype = q.get("uploadType")
        if utype == "multipart":
            body = req.get_data()
            ctype = req.headers.get("Content-Type", "")
            boundary = ctype.split("boundary=", 1)[-1].strip('"')
            meta, data = _parse_multipart(body, boundary.encode())
            return self._store(bucket, meta["name"], data, _conditions(q))
        if utype == "media":
            return self._store(bucket, q["name"], req.get_data(), _conditions(q))
        if utype == "resumable":
            meta = req.get_json(silent=True) or {}
            name = str(meta.get("name") or q.get("name") or "")
            uid = secrets.token_hex(12)
            conditions = _conditions(q)
            with self.lock:
                if bucket not in self.buckets:
                    return self._error(404, "bucket not found")
                self.uploads[uid] = _Upload(bucket, name, conditions, bytearray())
            # GCS's session URL repeats the request's parameters (gcsfs strips
            # "&ifGenerationMatch=0" from it to cancel); the session keeps the conditions
            # it was started with, whatever a chunk's URL says
            params = urlencode({"uploadType": "resumable", "name": name, **conditions}, quote_via=quote)
            loc = f"{req.host_url.rstrip('/')}/upload/storage/v1/b/{bucket}/o?{params}&upload_id={uid}"
            return Response(b"", status=200, headers={"Location": loc})
        return self._error(400, f"invalid uploadType {utype}")

    def _resumable_chunk(self, req: Request, uid: str) -> Response:
        with self.lock:
            up = self.uploads.get(uid)
            done = self.finished.get(uid)
        if up is None and done is not None and req.method != "DELETE":
            return Response(done[1], status=done[0], content_type="application/json")
        if up is None:
            return self._error(404, "upload session not found")
        if req.method == "DELETE":
            with self.lock:
                self.uploads.pop(uid, None)
            return Response(b"", status=499)
        data = req.get_data()
        crange = req.headers.get("Content-Range", "")
        spec, _, total = crange.removeprefix("bytes ").partition("/")
        if spec != "*":
            a, _, b = spec.partition("-")
            start = int(a)
            if start > len(up.data):
                return self._error(400, f"chunk starts at {start}, have {len(up.data)}")
            del up.data[start:]  # a re-sent chunk replaces what it covers
            up.data += data
            if int(b) + 1 != len(up.data):
                return self._error(400, "Content-Range does not match the body")
        if total != "*" and int(total) == len(up.data):
            resp = self._store(up.bucket, up.name, bytes(up.data), up.conditions)
            with self.lock:
                self.uploads.pop(uid, None)
                # a finished session answers a repeated final chunk as it did (its object)
                self.finished[uid] = (resp.status_code, resp.get_data())
            return resp
        headers = {"Range": f"bytes=0-{len(up.data) - 1}"} if up.data else {}
        return Response(b"", status=308, headers=headers)


def _conditions(q: dict[str, str]) -> dict[str, str]:
    return {k: q[k] for k in PRECONDITIONS if k in q}


def _parse_multipart(body: bytes, boundary: bytes) -> tuple[dict[str, Any], bytes]:
    """Split gcsfs's multipart/related upload into (metadata, data)."""
    delim = b"--" + boundary
    first = body.index(delim) + len(delim)
    meta_start = body.index(b"\n\n", first) + 2
    meta_end = body.index(b"\n" + delim, meta_start)
    meta = json.loads(body[meta_start:meta_end])
    data_hdr = meta_end + 1 + len(delim)
    data_start = body.index(b"\n\n", data_hdr) + 2
    data_end = body.rindex(b"\n" + delim + b"--")
    return meta, body[data_start:data_end]
