"""The driver layer: declared capabilities, strategy choice, registration, bad URLs."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import warnings

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

import atomicstore
from atomicstore.drivers import driver_class, split_url


def test_strategy_follows_declared_capabilities(backend):
    store = backend.open()
    caps = store.driver.capabilities
    expected = {"local": "rename", "memory": "rename", "s3": "marker", "gcs": "marker"}[backend.kind]
    assert store.strategy.kind == expected
    assert caps.atomic_rename == (expected == "rename")
    assert caps.atomic_create
    assert caps.durable_fsync == (backend.kind == "local")
    assert caps.multipart_uploads == (backend.kind in ("s3", "gcs"))  # GCS: composite components
    objects = backend.kind in ("s3", "gcs")
    assert caps.native_generation_reads == objects  # conditional ranged GETs
    d = store.driver
    # object stores: as many ranged reads at once as the in-flight budget holds
    assert caps.io_threads == (max(8, d.max_inflight_bytes // d.read_chunk) if objects else 8)
    if backend.kind == "memory":
        assert caps.renames() == (True, True) and caps.replaces_directories


def test_gcs_reports_native_crc32c(gcs_server):
    store = atomicstore.open_store(gcs_server.url(gcs_server.new_bucket()), **gcs_server.storage_options())
    with store.transaction("c") as txn:
        txn.write_bytes("f", b"checksum me")
    ckpt = store.open("c")
    info = store.driver.info(ckpt.key("f"))
    assert info.crc32c == ckpt.files["f"].crc32c == atomicstore.commit.crc32c(b"checksum me")


@pytest.mark.parametrize(
    "url", ["nosuchproto://bucket/x", "s3://", "", "   ", "memory://a::s3://b", "a\x00b"]
)
def test_bad_urls_are_rejected(url):
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.open_store(url)


def test_unknown_protocol_error_type():
    with pytest.raises(atomicstore.UnknownProtocolError, match="nosuchproto"):
        atomicstore.open_store("nosuchproto://x")


def test_split_url():
    assert split_url("/tmp/x") == ("file", "/tmp/x")
    assert split_url("relative/dir") == ("file", "relative/dir")
    assert split_url("S3://b/k") == ("s3", "b/k")
    assert split_url("gs://b") == ("gs", "b")


def test_local_takes_no_storage_options(tmp_path):
    with pytest.raises(atomicstore.InvalidArgumentError, match="no storage options"):
        atomicstore.open_store(tmp_path, anon=True)


def test_bad_driver_options(tmp_path):
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.open_store(tmp_path, operation_timeout=0)
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.open_store(tmp_path, block_size=10)
    with pytest.raises(ValueError):
        atomicstore.RetryPolicy(attempts=0)


class _UnknownToUs(MemoryFileSystem):
    protocol = "notours"


def test_other_fsspec_protocol_gets_conservative_driver_and_one_warning():
    fsspec.register_implementation("notours", _UnknownToUs, clobber=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = atomicstore.open_store("notours://generic-a")
        atomicstore.open_store("notours://generic-b")
    msgs = [w for w in caught if issubclass(w.category, atomicstore.ExclusivityWarning)]
    assert len(msgs) == 1 and "exclusivity is not guaranteed" in str(msgs[0].message)
    caps = store.driver.capabilities
    assert not caps.atomic_rename and not caps.atomic_create
    assert store.strategy.kind == "marker"
    with store.transaction("g") as txn:
        txn.write_bytes("f", b"generic")
    assert store.list() == ["g"]
    assert store.read_bytes("g", "f") == b"generic"
    store.verify("g")
    with pytest.raises(atomicstore.CommitConflictError):
        store.transaction("g")
    store.delete("g")
    assert store.list() == []


def test_register_driver_at_runtime():
    from atomicstore.drivers.memory import MemoryDriver

    class Tagged(MemoryDriver):
        protocols = ("tagged",)

        @classmethod
        def from_url(cls, protocol, path, storage_options, **kw):
            return cls(MemoryFileSystem(), "/tagged/" + path, url=f"tagged://{path}", **kw)

    atomicstore.register_driver(Tagged)
    store = atomicstore.open_store("tagged://x")
    assert isinstance(store.driver, Tagged)
    with store.transaction("a") as txn:
        txn.write_bytes("f", b"1")
    assert store.list() == ["a"]
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.register_driver(object)  # type: ignore[arg-type]


def test_entry_point_registration(tmp_path):
    """A third-party package registers a driver through the ``atomicstore.drivers`` group."""
    (tmp_path / "fancy_driver.py").write_text(textwrap.dedent('''
        from fsspec.implementations.memory import MemoryFileSystem
        from atomicstore.drivers.memory import MemoryDriver

        class FancyDriver(MemoryDriver):
            protocols = ("fancy",)

            @classmethod
            def from_url(cls, protocol, path, storage_options, **kw):
                return cls(MemoryFileSystem(), "/fancy/" + path, url="fancy://" + path, **kw)
    '''))
    dist = tmp_path / "fancy_driver-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fancy-driver\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[atomicstore.drivers]\nfancy = fancy_driver:FancyDriver\n")
    code = textwrap.dedent('''
        import atomicstore
        s = atomicstore.open_store("fancy://here")
        with s.transaction("x") as t:
            t.write_bytes("f", b"ok")
        print(type(s.driver).__name__, s.list(), s.read_bytes("x", "f"))
    ''')
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "FancyDriver ['x'] b'ok'"


def test_builtin_classes_resolve():
    assert driver_class("file").__name__ == "LocalDriver"
    assert driver_class("memory").__name__ == "MemoryDriver"
    assert driver_class("s3").__name__ == "S3Driver"
    assert driver_class("gs").__name__ == "GCSDriver"


def test_commit_layer_never_imports_jax():
    code = "import sys, atomicstore, atomicstore.commit, atomicstore.drivers.s3; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_a_local_save_needs_no_fsspec(tmp_path):
    """The local driver calls the OS itself: a first local save does not pay for importing
    fsspec (its entry-point scan alone was 10-20 ms of a small save); asked for, the
    filesystem is still there."""
    code = textwrap.dedent(f"""
        import sys, numpy as np, atomicstore
        atomicstore.save({str(tmp_path / "s")!r} + "/a", {{"x": np.arange(3)}})
        assert (atomicstore.restore({str(tmp_path / "s")!r} + "/a")["x"] == np.arange(3)).all()
        print("fsspec" in sys.modules)
        st = atomicstore.open_store({str(tmp_path / "s")!r})
        print(type(st.driver.fs).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "LocalFileSystem"], out.stderr


def test_local_abort_waits_for_a_background_fsync(tmp_path, monkeypatch):
    """A file closed with ``wait=False`` is fsynced in a background thread; aborting it
    meanwhile must not close the descriptor under that fsync (a reused descriptor number
    would then be fsynced and closed instead) and must remove the file."""
    import threading

    from atomicstore.drivers.local import LocalDriver

    d = LocalDriver.from_url("file", str(tmp_path), {})
    w = d.open_writer("f.bin")
    w.write(b"x" * 100)
    entered, go = threading.Event(), threading.Event()
    real_fsync, fds = os.fsync, []

    def slow_fsync(fd):  # the scheduler: holds the background fsync until told
        fds.append(fd)
        entered.set()
        assert go.wait(30)
        real_fsync(fd)  # raises EBADF if the descriptor was closed meanwhile

    monkeypatch.setattr(os, "fsync", slow_fsync)
    fut = w.close_async()
    assert entered.wait(30)
    aborted = threading.Thread(target=w.abort)
    aborted.start()
    aborted.join(0.3)
    assert aborted.is_alive(), "abort returned while the fsync was still running"
    go.set()
    aborted.join(30)
    assert fut.result(timeout=30) is None  # the fsync itself succeeded on its own descriptor
    assert not (tmp_path / "f.bin").exists()


def test_local_saves_work_in_a_forked_child(tmp_path):
    """The background threads (fsync pool, renameat2 probe) of the parent do not exist in
    a forked child: a save there must make its own instead of waiting forever."""
    code = textwrap.dedent(f"""
        import os, sys, numpy as np, atomicstore
        root = {str(tmp_path)!r}
        atomicstore.save(root + "/p/a", {{"x": np.arange(3)}})  # the pool exists now
        st = atomicstore.open_store(root + "/q")  # a store opened right before the fork
        pid = os.fork()
        if pid == 0:
            try:
                atomicstore.save(root + "/p/b", {{"x": np.arange(4)}})
                atomicstore.save(root + "/q/b", {{"x": np.arange(5)}}, store=st)
                os._exit(0)
            except BaseException as exc:
                print(repr(exc), flush=True)
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1:] == ["0"], out.stdout + out.stderr
    assert atomicstore.restore(str(tmp_path / "p" / "b"))["x"].tolist() == [0, 1, 2, 3]
    assert atomicstore.restore(str(tmp_path / "q" / "b"))["x"].tolist() == [0, 1, 2, 3, 4]


def test_the_s3_clients_socket_timeout_never_cuts_a_request_before_operation_timeout(s3_server):
    # s3fs sets botocore's read_timeout to 15 s: a request the server held longer was cut
    # and retried every 15 s, so a stalled save gave up after operation_timeout + 15 s (and
    # a slow ranged read could end early). Our operation_timeout is the one deadline.
    for timeout in (20.0, 300.0):
        store = atomicstore.open_store(s3_server.url(s3_server.new_bucket()), **s3_server.storage_options(),
                                       operation_timeout=timeout)
        store.list()  # (the client exists after the first request)
        assert store.driver.fs.s3.meta.config.read_timeout > timeout


@pytest.mark.parametrize("value", [
    "Fri, 27 Nov 2026 12:43:17 GMT",  # a Last-Modified header
    "Thu, 01 Jan 1970 00:00:00 GMT",
    "Fri, 27 Nov 2026 12:43:17 -0000",  # (RFC 2822: zone unknown)
    # forms close to S3's that email.utils read otherwise (found by an attacker: with "-05"
    # read as 5 minutes, recovery judged a live lease 5 hours old and removed its attempt)
    "Fri, 27 Nov 2026 09:00:00 -05",
    "Fri, 27 Nov 2026 09:00:00 +05",
    "Fri, 27 Nov 2026 09:00:00 -1",
    "Fri, 27 Nov 2026 09:00:00 EST",
    "Fri, 27 Nov 2026 09:00:00 PDT",
    "Fri, 27 Nov 2026 09:00:00 +0530",
    "Fri, 27 Nov 2026 09:00:00 +530",
    "Tue, 15 Nov 70 09:00:00 GMT",
    "Tuesday, 15-Nov-70 09:00:00 GMT",
    "tue, 15 nov 2025 09:00:00 gmt",
    "Fri, 31 Feb 2026 09:00:00 GMT",
    "Fri, 27 Nov 2026 24:00:00 GMT",
    "2025-W46-6T09:00:00Z",
    "2026-11-27T09:00:00+05:30:15",
    "2026-11-27T09:00:00+05",
    "2026-11-27T09:00:00.123456789Z",
    "2026-11-27t09:00:00z",
    "20261127T090000Z",
    "Fri, \u0662\u0667 Nov 2026 09:00:00 GMT",  # other scripts' digits (int() reads them)
    "\uff12\uff10\uff12\uff16-11-27T09:00:00Z",
    "Fri, 27 Nov 2026 09:00:00 GMT\n",
    "Fri, 27 Nov 0070 12:43:17 GMT",  # (dateutil: 2070; found by an attacker: 70 AD)
    "Fri, 27 Nov 0001 12:43:17 GMT",
    "Fri, 27 Nov 0999 12:43:17 GMT",
    "0070-11-27T12:43:17Z",
    "0999-11-27T12:43:17.000Z",
    "1000-11-27T12:43:17Z",
    "2026-11-27T12:43:17.000Z",  # a listing's LastModified
    "2026-11-27T12:43:17Z",
    "2026-11-27T12:43:17.123456+00:00",
    "2026-11-27T13:43:17+01:00",
    "2026-11-27T12:43:17",  # no zone
    "1795783933",
    "1795783933.5",
    1795783933,
    "",
    "not a time",
])
def test_the_s3_clients_timestamps_are_the_instants_botocore_parses(value):
    # The S3 driver's clients parse timestamps with the standard library (dateutil's
    # generic parser was a fifth of a ranged GET's client CPU): same instant, same zone
    # awareness, same error as botocore's own parser for anything
    import botocore.utils

    from atomicstore.drivers.s3session import parse_timestamp

    try:
        want = botocore.utils.parse_timestamp(value)
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        with pytest.raises(type(exc)):
            parse_timestamp(value)
        return
    got = parse_timestamp(value)
    assert (got.tzinfo is None) == (want.tzinfo is None)
    assert got.timestamp() == want.timestamp()


_TIMES = st.datetimes(min_value=datetime.datetime(1971, 1, 1), max_value=datetime.datetime(2099, 12, 31),
                      timezones=st.sampled_from([datetime.UTC] + [
                          datetime.timezone(datetime.timedelta(minutes=m)) for m in (-720, -330, -60, 60, 345, 840)]))


@settings(max_examples=300, deadline=None)
@given(when=_TIMES, form=st.sampled_from(["http", "iso-z", "iso-ms-z", "iso-offset", "iso-us", "rfc2822-offset"]))
def test_the_s3_clients_timestamps_agree_with_botocore_on_any_instant(when, form):
    import email.utils

    import botocore.utils

    from atomicstore.drivers.s3session import parse_timestamp

    utc = when.astimezone(datetime.UTC)
    value = {
        "http": email.utils.format_datetime(utc.replace(microsecond=0), usegmt=True),
        "iso-z": utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "iso-ms-z": utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z",
        "iso-offset": when.replace(microsecond=0).isoformat(),
        "iso-us": when.isoformat(),
        "rfc2822-offset": email.utils.format_datetime(when.replace(microsecond=0)),
    }[form]
    want, got = botocore.utils.parse_timestamp(value), parse_timestamp(value)
    assert got == want and got.utcoffset() is not None, (value, got, want)


def test_modification_times_are_the_servers(object_backend):
    # info() and listings read Last-Modified (S3: an HTTP date) and LastModified (ISO
    # 8601) through the driver's timestamp parser: both are the time of the write
    import time

    store = object_backend.open()
    before = time.time()
    store.driver.put("t/a", b"x")
    after = time.time()
    headed = store.driver.info("t/a").mtime
    (listed,) = [i.mtime for k, i in store.driver.find("t").items() if k.endswith("a")]
    assert headed is not None and before - 2 <= headed <= after + 2
    assert listed is not None and abs(listed - headed) <= 1, (listed, headed)


def test_stores_opened_on_s3_parse_the_service_model_once(s3_server):
    # Each store's client comes from a session of its own; parsing S3's service model
    # (about 1 MB of JSON) for each was 27.6 % of a sampled test worker's CPU. The sessions the
    # driver makes share one data loader, which keeps what it parsed.
    import botocore.loaders

    url, opts = s3_server.url(s3_server.new_bucket()), s3_server.storage_options()
    first = atomicstore.open_store(url, **opts, check_conformance=False)
    first.list()
    parsed: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file

    def counting(self, file_path, *args, **kwargs):
        parsed.append(str(file_path))
        return real(self, file_path, *args, **kwargs)

    botocore.loaders.JSONFileLoader.load_file = counting
    try:
        stores = [atomicstore.open_store(url, **opts, check_conformance=False) for _ in range(3)]
        for store in stores:
            store.driver.put("k", b"v")
            assert store.driver.read("k") == b"v"
            assert store.list() == []
    finally:
        botocore.loaders.JSONFileLoader.load_file = real
    assert parsed == [], parsed
    loaders = {id(s.driver.fs.session.get_component("data_loader")) for s in [first, *stores]}
    assert len(loaders) == 1


def test_a_store_with_a_data_path_or_session_options_of_its_own_keeps_its_own_loader(
        s3_server, tmp_path, monkeypatch):
    # Only sessions configured alike share the loader: botocore's handlers edit a loaded
    # model in place, and a data path (AWS_DATA_PATH: relative, or naming a variable) is
    # read when its loader is made. A store of a custom S3 model (here: without
    # ListObjectsV2) must neither lend it to another store nor borrow botocore's.
    import json

    import aiobotocore.session
    import botocore.loaders

    model = botocore.loaders.create_loader().load_service_model("s3", "service-2")
    del model["operations"]["ListObjectsV2"]
    version = model["metadata"]["apiVersion"]
    (tmp_path / "models" / "s3" / version).mkdir(parents=True)
    (tmp_path / "models" / "s3" / version / "service-2.json").write_text(json.dumps(model))
    url, opts = s3_server.url(s3_server.new_bucket()), s3_server.storage_options()
    plain = atomicstore.open_store(url, **opts, check_conformance=False)
    shared = plain.driver.fs.session.get_component("data_loader")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_DATA_PATH", "models")  # relative: to the directory of the moment
    custom = atomicstore.open_store(url, **opts, check_conformance=False)
    assert custom.driver.fs.session.get_component("data_loader") is not shared
    with pytest.raises(atomicstore.StorageError):
        custom.list()  # its own model: no ListObjectsV2
    monkeypatch.delenv("AWS_DATA_PATH")
    again = atomicstore.open_store(url, **opts, check_conformance=False)
    assert again.driver.fs.session.get_component("data_loader") is shared
    assert again.list() == [] and plain.list() == []
    # session options other than a profile (here: no built-in handlers) keep their own
    bare = atomicstore.open_store(url, **opts, include_builtin_handlers=False, check_conformance=False)
    assert bare.driver.fs.session.get_component("data_loader") is not shared
    # and a session the caller made is left alone
    mine = aiobotocore.session.AioSession()
    own = atomicstore.open_store(url, **opts, session=mine, check_conformance=False)
    assert own.driver.fs.session is mine
    assert own.driver.fs.session.get_component("data_loader") is not shared
    assert own.list() == []
