"""A small fake of the GCS JSON API (the part gcsfs uses) that honours preconditions.

gcp-storage-emulator ignores ``ifGenerationMatch``; this fake enforces it under a lock,
so conditional creates behave as on GCS: of two racing creators exactly one gets 200 and
the other 412. Objects carry generations and CRC32C (base64, big-endian) like GCS.

Supported: bucket get/insert; object get (metadata and ``alt=media`` with ``Range``),
list (prefix, delimiter, pageToken, maxResults), delete (with ``ifGenerationMatch``),
multipart upload, resumable upload (chunks with ``Content-Range``, cancel with DELETE).
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
from urllib.parse import parse_qs

import google_crc32c
from werkzeug.wrappers import Request, Response


@dataclass
class _Object:
    data: bytes
    generation: int
    updated: float


@dataclass
class _Upload:
    bucket: str
    name: str
    if_generation_match: str | None
    data: bytearray


class GCSFake:
    """A WSGI application serving the GCS JSON API from memory."""

    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, _Object]] = {}
        self.uploads: dict[str, _Upload] = {}
        self.finished: dict[str, bytes] = {}
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
        crc = google_crc32c.value(obj.data).to_bytes(4, "big")
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(obj.updated)) + ".000Z"
        return {
            "kind": "storage#object",
            "id": f"{bucket}/{name}/{obj.generation}",
            "name": name,
            "bucket": bucket,
            "size": str(len(obj.data)),
            "generation": str(obj.generation),
            "metageneration": "1",
            "contentType": "application/octet-stream",
            "crc32c": base64.b64encode(crc).decode(),
            "md5Hash": base64.b64encode(hashlib.md5(obj.data).digest()).decode(),
            "updated": ts,
            "timeCreated": ts,
            "storageClass": "STANDARD",
        }

    def _json(self, doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return Response(json.dumps(doc), status=status, content_type="application/json", headers=headers)

    def _store(self, bucket: str, name: str, data: bytes, if_gen: str | None) -> Response:
        with self.lock:
            objs = self.buckets.get(bucket)
            if objs is None:
                return self._error(404, f"bucket {bucket} not found")
            current = objs.get(name)
            if if_gen is not None:
                want = int(if_gen)
                have = current.generation if current else 0
                if want != have:
                    return self._error(412, "conditionNotMet: At least one of the pre-conditions you specified did not hold.")
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
        if m == "GET":
            return self._get(req, bucket, name, media=(kind == "download" or q.get("alt") == "media"))
        if m == "DELETE":
            with self.lock:
                objs = self.buckets.get(bucket, {})
                obj = objs.get(name)
                if obj is None:
                    return self._error(404, "No such object")
                if "ifGenerationMatch" in q and int(q["ifGenerationMatch"]) != obj.generation:
                    return self._error(412, "conditionNotMet")
                del objs[name]
            return Response(status=204)
        return self._error(405, "method not allowed")

    def _get(self, req: Request, bucket: str, name: str, *, media: bool) -> Response:
        with self.lock:
            obj = self.buckets.get(bucket, {}).get(name)
        if obj is None:
            return self._error(404, "No such object: " + f"{bucket}/{name}")
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
            return self._store(bucket, meta["name"], data, q.get("ifGenerationMatch"))
        if utype == "media":
            return self._store(bucket, q["name"], req.get_data(), q.get("ifGenerationMatch"))
        if utype == "resumable":
            meta = req.get_json(silent=True) or {}
            name = str(meta.get("name") or q.get("name") or "")
            uid = secrets.token_hex(12)
            with self.lock:
                if bucket not in self.buckets:
                    return self._error(404, "bucket not found")
                self.uploads[uid] = _Upload(bucket, name, q.get("ifGenerationMatch"), bytearray())
            loc = f"{req.host_url.rstrip('/')}/upload/storage/v1/b/{bucket}/o?uploadType=resumable&upload_id={uid}"
            return Response(b"", status=200, headers={"Location": loc})
        return self._error(400, f"invalid uploadType {utype}")

    def _resumable_chunk(self, req: Request, uid: str) -> Response:
        with self.lock:
            up = self.uploads.get(uid)
            done = self.finished.get(uid)
        if up is None and done is not None and req.method != "DELETE":
            return Response(done, status=200, content_type="application/json")
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
            resp = self._store(up.bucket, up.name, bytes(up.data), up.if_generation_match)
            with self.lock:
                self.uploads.pop(uid, None)
                if resp.status_code == 200:  # GCS answers a finished session with its object
                    self.finished[uid] = resp.get_data()
            return resp
        headers = {"Range": f"bytes=0-{len(up.data) - 1}"} if up.data else {}
        return Response(b"", status=308, headers=headers)


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
