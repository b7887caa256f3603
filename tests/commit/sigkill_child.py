"""Child process for the SIGKILL and zombie tests (run as a script).

    python sigkill_child.py save ROOT_OR_URL NAME POINT [OPTIONS_JSON]
    python sigkill_child.py zombie ROOT_OR_URL NAME [OPTIONS_JSON]
    python sigkill_child.py recover ROOT_OR_URL [OPTIONS_JSON]

``save`` saves NAME and stops at POINT, printing ``AT <point>`` and sleeping until it is
killed: ``during-write`` (after the first chunk of a large file), ``before-commit`` (just
before the rename / marker put), ``after-commit`` (just after it), ``returned`` (after
the transaction returned). It uses the real drivers; only the pause is added, by
subclassing the driver the store would use.
``zombie`` starts a save with a 1 s lease, prints ``READY``, waits for a line on stdin,
then tries to commit and prints the outcome.
``recover`` runs recovery (grace 0), then prints the committed state as JSON.
"""

from __future__ import annotations

import json
import sys
import time

import atomicstore
from atomicstore.drivers import get_driver

CHUNK = 1 << 20


def data_for(name: str) -> bytes:
    return (name.encode() * (CHUNK // len(name) + 1))[:CHUNK]


def pause(point: str) -> None:
    print(f"AT {point}", flush=True)
    time.sleep(600)


def main() -> None:
    cmd, url = sys.argv[1], sys.argv[2]
    if cmd == "save":
        name, point = sys.argv[3], sys.argv[4]
        opts = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
        base = get_driver(url, storage_options=opts)

        class Pausing(type(base)):  # type: ignore[misc]
            def rename(self, src: str, dst: str) -> None:
                if point == "before-commit":
                    pause(point)
                super().rename(src, dst)
                if point == "after-commit":
                    pause(point)

            def put(self, key: str, data: bytes, *, exclusive: bool = False,
                    if_generation: str | None = None) -> str | None:
                is_marker = key.endswith("commit_success.txt")
                if is_marker and point == "before-commit":
                    pause(point)
                gen = super().put(key, data, exclusive=exclusive, if_generation=if_generation)
                if is_marker and point == "after-commit":
                    pause(point)
                return gen

        drv = Pausing(base.fs, base.root, url=base.url)
        store = atomicstore.Store(drv, lease_ttl=1.0)
        with store.transaction(name) as txn:
            with txn.open("big.bin") as f:
                for i in range(8):
                    f.write(data_for(name))
                    if i == 0 and point == "during-write":
                        pause(point)
            txn.write_bytes("small.json", json.dumps({"name": name}).encode())
        if point == "returned":
            pause(point)
    elif cmd == "zombie":
        name = sys.argv[3]
        opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
        store = atomicstore.open_store(url, lease_ttl=1.0, **opts)
        txn = store.transaction(name)
        txn.write_bytes("big.bin", data_for("zombie"))
        print("READY", flush=True)
        sys.stdin.readline()
        try:
            txn.commit()
            print("COMMITTED", flush=True)
        except atomicstore.LeaseLostError as exc:
            print(f"LEASE-LOST {exc}", flush=True)
        except atomicstore.CommitConflictError as exc:
            print(f"CONFLICT {exc}", flush=True)
    elif cmd == "recover":
        opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        store = atomicstore.open_store(url, **opts)
        report = store.recover(grace=0)
        state = {}
        for name in store.list():
            store.verify(name)
            ckpt = store.open(name)
            state[name] = {p: len(ckpt.read_bytes(p)) for p in ckpt.files}
        again = store.recover(grace=0)
        print(json.dumps({"removed": [a.target for a in report.actions], "state": state,
                          "again": len(again.actions)}))


if __name__ == "__main__":
    main()
