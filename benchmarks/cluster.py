"""A multi-node store under faults: atomicstore on a SeaweedFS cluster whose volume server
is killed in the middle of a save and of a restore (issue 22, acceptance 3).

The cluster (``atomicstore.testing.seaweed_cluster.SeaweedCluster``) is one master, three
volume servers, a filer and the S3 gateway on 127.0.0.1, each its own ``weed`` process; it
runs once with replication ``001`` (every volume on two servers) and once with ``002``
(on all three). The state is 16 float32 leaves (256 MiB by default, one ``state.msgpack``
object of 32 parts of 8 MiB). A volume server is SIGKILLed from the gateway's request hook
when the part upload that follows the first quarter of the bytes arrives (save), or when
the second ranged GET of the data arrives (restore), and restarted after the operation
returned. With ``--freeze`` (on by default) the ``001`` cluster also gets a volume server
stopped with SIGSTOP (a hung host: its TCP connections stay open) during a restore and a
save, then SIGCONT.

Every row checks the contract: a save commits a checkpoint that verifies and restores
bit-identical, or raises atomicstore's own error and leaves nothing visible; recovery
after the restart leaves no multipart upload, lease or stray attempt object; a restore
returns the saved bytes or raises atomicstore's own error. A violation is printed as
``VIOLATION`` in the outcome column (and the exit status is 1).

    python benchmarks/cluster.py                    # 256 MiB, both replications, freeze
    python benchmarks/cluster.py --size 64 --no-freeze
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import atomicstore
from atomicstore.testing.seaweed_cluster import SeaweedCluster

MiB = 2**20
PREFIX = "ckpts"


def make_state(total: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i:02d}": rng.standard_normal(total // 16 // 4, dtype=np.float32) for i in range(16)}


def identical(got: Any, want: dict[str, np.ndarray]) -> bool:
    return sorted(got) == sorted(want) and all(got[k].tobytes() == v.tobytes() for k, v in want.items())


class Row(dict):  # type: ignore[type-arg]
    """One line of the table."""


def timed(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, float]:
    t0 = time.perf_counter()
    try:
        return fn(), None, time.perf_counter() - t0
    except atomicstore.AtomicStoreError as exc:
        return None, exc, time.perf_counter() - t0


def err_name(exc: BaseException) -> str:
    return type(exc).__name__


class Bench:
    def __init__(self, total: int, operation_timeout: float | None) -> None:
        self.total = total
        self.operation_timeout = operation_timeout
        self.rows: list[Row] = []
        self.violations = 0

    def row(self, cluster: SeaweedCluster, scenario: str, outcome: str, seconds: float | None, notes: str = "") -> None:
        if outcome.startswith("VIOLATION"):
            self.violations += 1
        r = Row(scenario=scenario, replication=cluster.replication, outcome=outcome,
                seconds=seconds, notes=notes)
        self.rows.append(r)
        t = f"{seconds:.2f}" if seconds is not None else ""
        print(f"  {cluster.replication} | {scenario} | {outcome} | {t} | {notes}", flush=True)

    # -- pieces ------------------------------------------------------------------------------
    def kill_when(self, cluster: SeaweedCluster, victim: int, matches: Callable[[dict[str, Any]], bool],
                  after: Callable[[int, int], bool]) -> dict[str, float]:
        """Arm the hook (see tests/system/test_seaweed_cluster.py); the returned dict gets
        ``killed`` (perf_counter) and ``dropped`` (seconds until the master stopped
        counting the server) once they happen."""
        info: dict[str, float] = {}
        lock = threading.Lock()
        seen = [0, 0]

        def watch() -> None:
            info["dropped"] = cluster.wait_unregistered(victim, timeout=300)

        def hook(environ: dict[str, Any]) -> None:
            if not matches(environ):
                return
            with lock:
                if "killed" not in info and after(seen[0], seen[1]):
                    cluster.kill_volume(victim)
                    info["killed"] = time.perf_counter()
                    threading.Thread(target=watch, daemon=True).start()
                seen[0] += 1
                seen[1] += int(environ.get("CONTENT_LENGTH") or 0)

        cluster.before_request = hook
        return info

    def check_save(self, store: atomicstore.Store, name: str, state: dict[str, np.ndarray],
                   exc: BaseException | None) -> str:
        """The save's outcome, checked: committed (verify, bit-identical restore) or a
        library error with nothing visible. A check the store cannot answer yet (the
        cluster still failing) is reported as such; :meth:`recheck` repeats it later."""
        try:
            if exc is None:
                store.verify(name)
                back = atomicstore.restore(name, store=store)
                return "committed, verified, bit-identical" if identical(back, state) else "VIOLATION: restore differs"
            if name in store.list():
                return f"VIOLATION: {err_name(exc)} but {name} is listed"
            try:
                atomicstore.restore(name, store=store)
            except atomicstore.NotFoundError:
                return f"{err_name(exc)}; nothing visible"
            return f"VIOLATION: {err_name(exc)} but {name} restores"
        except atomicstore.AtomicStoreError as check:
            first = "committed" if exc is None else err_name(exc)
            return f"{first}; not checkable yet ({err_name(check)} from the store: {self.exc_note(check)})"

    def recover_and_check(self, cluster: SeaweedCluster, store: atomicstore.Store, bucket: str) -> None:
        t0 = time.perf_counter()
        idle = cluster.wait_idle(timeout=300)
        report = store.recover(now=time.time() + store.lease_ttl + store.grace + 1)
        took = time.perf_counter() - t0
        uploads = cluster.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        names = store.list()
        keep = {f"{PREFIX}/{n}/commit_success.txt" for n in names}
        prefixes = tuple(f"{PREFIX}/{n}/{store.open(n).key('manifest.json').split('/')[1]}/" for n in names)
        stray = [f for f in cluster.filer_listing(f"/buckets/{bucket}")
                 if f not in keep and not f.startswith(prefixes) and not f.startswith(f"{PREFIX}/.atomicstore/conformance/")]
        outcome = "clean" if not uploads and not stray else f"VIOLATION: {len(uploads)} uploads, stray {stray[:3]}"
        self.row(cluster, "recovery after the restart", outcome, took,
                 f"waited {idle:.1f} s for requests the client gave up on; removed: "
                 + (", ".join(f"{a.kind} ({a.keys} objects)" if a.keys else a.kind for a in report.actions) or "nothing"))

    def open_store(self, cluster: SeaweedCluster, bucket: str, *, direct: bool = False) -> atomicstore.Store:
        """A store on the cluster: through the proxy (whose hook kills the server), or
        ``direct`` to the gateway."""
        opts: dict[str, Any] = {} if self.operation_timeout is None else {"operation_timeout": self.operation_timeout}
        opts.update(cluster.storage_options())
        if direct:
            opts["endpoint_url"] = cluster.direct_endpoint
        return atomicstore.open_store(cluster.url(bucket, PREFIX), **opts)

    # -- scenarios ---------------------------------------------------------------------------
    def kills(self, replication: str) -> None:
        """SIGKILL of a volume server in the middle of a save and of a restore."""
        cluster = SeaweedCluster(replication=replication)
        try:
            bucket = cluster.new_bucket()
            store = self.open_store(cluster, bucket)
            state = make_state(self.total, 0)
            mib = self.total // MiB
            _, exc, t = timed(lambda: atomicstore.save("step_1", state, store=store))
            self.row(cluster, f"save {mib} MiB, no fault", self.check_save(store, "step_1", state, exc), t)
            data = store.open("step_1").key("state.msgpack")
            holders = cluster.holders(bucket, f"{PREFIX}/{data}")
            victim = max(holders, key=lambda i: holders[i])

            # save, a volume server killed after a quarter of the parts' bytes
            info = self.kill_when(cluster, victim, lambda e: e["REQUEST_METHOD"] == "PUT"
                                  and "partNumber=" in e.get("QUERY_STRING", ""),
                                  lambda _n, sent: sent >= self.total // 4)
            _, exc, t = timed(lambda: atomicstore.save("step_2", state, store=store))
            cluster.before_request = None
            notes = self.kill_notes(info, exc)
            self.row(cluster, f"save {mib} MiB, volume server SIGKILLed after {mib // 4} MiB of parts",
                     self.check_save(store, "step_2", state, exc), t, notes)
            t = cluster.restart_volume(victim)
            self.row(cluster, "restart of the volume server", "counted by the master", t)
            self.recover_and_check(cluster, store, bucket)
            if exc is not None:
                _, exc2, t = timed(lambda: atomicstore.save("step_2", state, store=store))
                self.row(cluster, "retry of the save", self.check_save(store, "step_2", state, exc2), t)

            # restore, killed at the second ranged GET of the data
            back, exc, t = timed(lambda: atomicstore.restore("step_1", store=store))
            self.row(cluster, f"restore {mib} MiB, no fault", self.restore_outcome(back, exc, state), t)
            holders = cluster.holders(bucket, f"{PREFIX}/{data}")
            victim = max(holders, key=lambda i: holders[i])
            info = self.kill_when(cluster, victim, lambda e: e["REQUEST_METHOD"] == "GET" and "HTTP_RANGE" in e
                                  and e.get("PATH_INFO", "").endswith(data), lambda n, _b: n >= 1)
            back, exc, t = timed(lambda: atomicstore.restore("step_1", store=store))
            cluster.before_request = None
            self.row(cluster, f"restore {mib} MiB, volume server SIGKILLed at the 2nd ranged GET",
                     self.restore_outcome(back, exc, state), t, self.kill_notes(info, exc))
            t = cluster.restart_volume(victim)
            self.row(cluster, "restart of the volume server", "counted by the master", t)
            back, exc, t = timed(lambda: atomicstore.restore("step_1", store=store))
            self.row(cluster, "restore after the restart", self.restore_outcome(back, exc, state), t, self.exc_note(exc))
        finally:
            cluster.stop()

    def freeze(self) -> None:
        """A volume server stopped with SIGSTOP: its connections stay open and the master
        learns it is gone only when its heartbeats time out. The store talks to the gateway
        directly: the proxy's pooled connections would carry what SeaweedFS does to a
        connection whose request was held (see docs/benchmarks.md) to later requests."""
        cluster = SeaweedCluster(replication="001")
        try:
            bucket = cluster.new_bucket()
            store = self.open_store(cluster, bucket, direct=True)
            state = make_state(self.total, 1)
            mib = self.total // MiB
            atomicstore.save("step_1", state, store=store)
            data = store.open("step_1").key("state.msgpack")
            holders = cluster.holders(bucket, f"{PREFIX}/{data}")
            victim = max(holders, key=lambda i: holders[i])
            info: dict[str, float] = {}

            def watch() -> None:
                info["dropped"] = cluster.wait_unregistered(victim, timeout=600)

            cluster.freeze_volume(victim)
            t_frozen = time.perf_counter()
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            back, exc, t = timed(lambda: atomicstore.restore("step_1", store=store))
            self.row(cluster, f"restore {mib} MiB, volume server frozen (SIGSTOP)",
                     self.restore_outcome(back, exc, state), t, self.exc_note(exc))
            _, exc, t = timed(lambda: atomicstore.save("step_2", state, store=store))
            saved = self.check_save(store, "step_2", state, exc)
            self.row(cluster, f"save {mib} MiB, volume server frozen (SIGSTOP)", saved, t, self.exc_note(exc))
            watcher.join()
            self.row(cluster, "master stops counting the frozen server", "dropped", info.get("dropped"),
                     "seconds after SIGSTOP")
            back, exc2, t = timed(lambda: atomicstore.restore("step_1", store=store))
            self.row(cluster, "restore once the master dropped it", self.restore_outcome(back, exc2, state), t,
                     self.exc_note(exc2))
            cluster.thaw_volume(victim)
            t = cluster.wait_registered(victim, timeout=300)
            self.row(cluster, "SIGCONT: counted by the master again", "counted", t,
                     f"frozen {time.perf_counter() - t_frozen:.0f} s in all")
            if "not checkable yet" in saved:
                self.row(cluster, "the frozen save, checked after SIGCONT", self.check_save(store, "step_2", state, exc),
                         None)
            self.recover_and_check(cluster, store, bucket)
            if "step_2" not in store.list():
                _, exc, t = timed(lambda: atomicstore.save("step_2", state, store=store))
                self.row(cluster, "retry of the save", self.check_save(store, "step_2", state, exc), t)
        finally:
            cluster.stop()

    @staticmethod
    def restore_outcome(back: Any, exc: BaseException | None, state: dict[str, np.ndarray]) -> str:
        if exc is not None:
            return f"{err_name(exc)} (library error)"
        return "bit-identical" if identical(back, state) else "VIOLATION: restore differs"

    @staticmethod
    def exc_note(exc: BaseException | None) -> str:
        return "" if exc is None else str(exc)[:300].replace("|", "/").replace("\n", " ")

    def kill_notes(self, info: dict[str, float], exc: BaseException | None) -> str:
        notes = []
        if "dropped" in info:
            notes.append(f"master dropped it {info['dropped'] * 1000:.0f} ms after the kill")
        if exc is not None:
            notes.append(self.exc_note(exc))
        return "; ".join(notes)


def cluster_table(total: int = 256 * MiB, *, replications: tuple[str, ...] = ("001", "002"), freeze: bool = True,
                  operation_timeout: float | None = None) -> list[Row]:
    """Run every scenario and print the table (Markdown); returns its rows."""
    bench = Bench(total, operation_timeout)
    t0 = time.perf_counter()
    for replication in replications:
        bench.kills(replication)
    if freeze:
        bench.freeze()
    print(f"\nSeaweedFS cluster on loopback (1 master, 3 volume servers, filer, S3 gateway), "
          f"{total // MiB} MiB state, "
          f"{'default options' if operation_timeout is None else f'operation_timeout={operation_timeout:g} s'} "
          f"(retry policy: the default); "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    print("| scenario | replication | outcome | time (s) | notes |")
    print("|---|---|---|---:|---|")
    for r in bench.rows:
        t = f"{r['seconds']:.2f}" if r["seconds"] is not None else ""
        print(f"| {r['scenario']} | {r['replication']} | {r['outcome']} | {t} | {r['notes']} |")
    if bench.violations:
        print(f"\n{bench.violations} VIOLATION(S) of the contract")
    return bench.rows


def main() -> None:
    ap = argparse.ArgumentParser(description="atomicstore on a SeaweedFS cluster with a volume server killed")
    ap.add_argument("--size", type=int, default=256, help="MiB of state (16 leaves)")
    ap.add_argument("--operation-timeout", type=float, default=None,
                    help="open_store(operation_timeout=...): seconds one request may take (default: the library's)")
    ap.add_argument("--replications", default="001,002",
                    help="clusters of the SIGKILL scenarios, comma-separated ('' for none)")
    ap.add_argument("--no-freeze", action="store_true", help="skip the SIGSTOP scenario (~3 min)")
    args = ap.parse_args()
    rows = cluster_table(args.size * MiB, replications=tuple(r for r in args.replications.split(",") if r),
                         freeze=not args.no_freeze, operation_timeout=args.operation_timeout)
    sys.exit(1 if any(str(r["outcome"]).startswith("VIOLATION") for r in rows) else 0)


if __name__ == "__main__":
    main()
