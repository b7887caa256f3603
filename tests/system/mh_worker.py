"""One JAX process of a multi-host test of the native layout (started by tests/system/test_multihost.py).

usage: mh_worker.py PORT NPROC PID URL OPTIONS_JSON ACTIONS_JSON OUT_JSON

Each process has 2 CPU devices (gloo collectives). ACTIONS is a list of steps every
process runs in order (a step with "pids" runs only in those processes); the result of
each (ok / error type and message / seconds / what it checked) goes to OUT_JSON, which is
rewritten after every step (a process that is killed leaves what it had done).

The tree (see ``expected``) mixes an array sharded over a 1-D mesh (P("x")), an array
sharded over a 2-D mesh (P("a", "b")), an int32 array replicated on every device (P()),
a plain numpy leaf and Python scalars. Its values depend on ``val``.

Steps ("op"):
  mgr        CheckpointManager(URL, **kwargs) (storage options from OPTIONS_JSON; "fast_retry")
  save       mgr.save(step, tree(val)); with "mutate", then changes its numpy leaf in place
  restore    mgr.restore(step, target) (step None: the latest, collective) with the
             target's shardings "same" (as saved) or "alt" (other meshes / PartitionSpecs),
             checked against tree(val) shard by shard
  save_fn    atomicstore.save(URL/<name>, tree(val)) (no manager)
  restore_fn atomicstore.restore(URL/<name>, target) with a "layout" as for restore, checked
  subtree    atomicstore.restore(URL/<name>, target, subtree="params"), checked
  partial    mgr.restore(step, target with only some leaves), checked
  numpy      mgr.restore(step) with no target: whole numpy arrays in every process, checked
  wait       mgr.wait_until_finished()
  close      mgr.close()
  delete     mgr.delete(step)
  steps      record mgr.all_steps()
  sleep      time.sleep(seconds)
  die_after  a timer thread calls os._exit(17) after "seconds"
  rendezvous wait until "count" processes (of any job) touched a file in "dir"
  barrier    a barrier of jax's coordination service (all processes)
  attempt    record mgr.metadata(step)["attempt"]
  gate       this process's first storage read of a key under "name"/ touches "ready", then
             waits until "go" exists (the test puts another job's action in between)
  arm        this process's next wait on the coordination service touches "path" (in a
             multi-host restore, process 0 waits there once it has read all it reads)
  touch      create the file "path"
  fork_restore  fork; the child (alone, no coordination) restores URL/<name> as numpy and
             checks it against tree(val); its outcome ("ok" or the error) is the value
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROWS = 64
SHARDED = ("params/w", "params/m", "opt/r", "opt/step")  # arrays that no process holds whole


def expected(val: float) -> dict:
    """The tree saved with ``val``, as numpy / Python values (what a restore must give)."""
    return {
        "params": {
            "w": np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8) + np.float32(val),  # P("x")
            "m": (np.arange(48, dtype=np.float32).reshape(8, 6) * np.float32(val)),  # P("a", "b")
            "b": np.arange(5, dtype=np.float64) - val,  # plain numpy
        },
        "opt": {
            "r": np.full((4, 5), int(val * 10), np.int32),  # P(): replicated on every device
            "step": np.array(int(val * 7), np.int32),  # 0-d, replicated (a TrainState's step)
            "count": int(val * 100),  # Python scalars
            "lr": val / 8,
        },
    }


def distinct_array_bytes() -> int:
    e = expected(1.0)
    return e["params"]["w"].nbytes + e["params"]["m"].nbytes + e["opt"]["r"].nbytes + e["opt"]["step"].nbytes


def get(tree: dict, key: str) -> object:
    for k in key.split("/"):
        tree = tree[k]
    return tree


class Layouts:
    def __init__(self, nproc: int) -> None:
        devs = np.array(jax.devices())
        self.m1 = Mesh(devs, ("x",))
        self.m2 = Mesh(devs.reshape(nproc, 2), ("a", "b"))
        # as saved
        self.same = {"params/w": NamedSharding(self.m1, P("x")), "params/m": NamedSharding(self.m2, P("a", "b")),
                     "opt/r": NamedSharding(self.m1, P()), "opt/step": NamedSharding(self.m1, P())}
        # other meshes and PartitionSpecs: every process needs parts of several saved shards
        self.alt = {"params/w": NamedSharding(self.m2, P("b", "a")), "params/m": NamedSharding(self.m1, P("x")),
                    "opt/r": NamedSharding(self.m2, P("b", None)), "opt/step": NamedSharding(self.m2, P())}

    def tree(self, val: float) -> dict:
        e = expected(val)
        out: dict = {"params": {}, "opt": {}}
        for key in SHARDED:
            arr = get(e, key)
            sh = self.same[key]
            a, b = key.split("/")
            out[a][b] = jax.make_array_from_callback(arr.shape, sh, lambda i, arr=arr: arr[i])
        out["params"]["b"] = e["params"]["b"]
        out["opt"]["count"], out["opt"]["lr"] = e["opt"]["count"], e["opt"]["lr"]
        return out

    def target(self, layout: str) -> dict:
        """A target whose sharded leaves are jax.Arrays ("same", values that must be
        replaced) or ShapeDtypeStructs ("alt")."""
        if layout == "same":
            return self.tree(-3.0)
        e = expected(0.0)
        out = {"params": {"b": np.zeros(5), "w": None, "m": None},
               "opt": {"count": 0, "lr": 0.0, "r": None, "step": None}}
        for key in SHARDED:
            arr = get(e, key)
            a, b = key.split("/")
            out[a][b] = jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=self.alt[key])
        return out


def check(got: dict, val: float, target: dict, prefix: str = "") -> int:
    """Compare a restored (sub)tree with ``expected(val)``; the number of device shards checked."""
    e = expected(val)
    n = 0
    for key in ("params/w", "params/m", "params/b", "opt/r", "opt/step", "opt/count", "opt/lr"):
        if prefix and not key.startswith(prefix):
            continue
        rel = key[len(prefix):] if prefix else key
        try:
            t = get(target, rel)
        except (KeyError, TypeError):
            continue  # a partial target
        g, want = get(got, rel), get(e, key)
        if key in SHARDED:
            assert isinstance(g, jax.Array), (key, type(g))
            assert g.sharding == t.sharding, (key, g.sharding, t.sharding)
            assert g.shape == want.shape and g.dtype == want.dtype, (key, g.shape, g.dtype)
            for sh in g.addressable_shards:
                assert np.array_equal(np.asarray(sh.data), want[sh.index]), (key, sh.index)
                n += 1
        elif isinstance(want, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == want.dtype and np.array_equal(g, want), (key, g)
        else:
            assert type(g) is type(want) and g == want, (key, g, want)
    return n


def check_numpy(got: dict, val: float) -> None:
    e = expected(val)
    for key in ("params/w", "params/m", "params/b", "opt/r", "opt/step"):
        g, want = get(got, key), get(e, key)
        assert isinstance(g, np.ndarray) and g.dtype == want.dtype and np.array_equal(g, want), key
    assert get(got, "opt/count") == e["opt"]["count"] and get(got, "opt/lr") == e["opt"]["lr"]


def wait_for(path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def touch(path: str) -> None:
    open(path, "w").close()


def gate_reads(driver_cls: type, name: str, ready: str, go: str) -> None:
    """The first read (of any thread) of a key under ``name/`` by a driver of this class
    touches ``ready`` and waits for ``go``; later reads pass."""
    fired = threading.Event()
    for meth in ("read", "read_into", "iter_read", "read_if"):
        orig = getattr(driver_cls, meth, None)
        if orig is None:
            continue

        def hooked(self, key, *args, _orig=orig, **kwargs):
            if key.startswith(f"{name}/") and not fired.is_set():
                fired.set()
                touch(ready)
                wait_for(go)
            return _orig(self, key, *args, **kwargs)

        setattr(driver_cls, meth, hooked)


def touch_on_next_wait(path: str) -> None:
    """The next blocking get on jax's coordination service touches ``path`` (then the
    client is put back as it was)."""
    from jax._src import distributed

    inner = distributed.global_state.client

    class Spy:
        def __getattr__(self, attr):
            return getattr(inner, attr)

        def blocking_key_value_get(self, *args, **kwargs):
            distributed.global_state.client = inner
            touch(path)
            return inner.blocking_key_value_get(*args, **kwargs)

    distributed.global_state.client = Spy()


def fork_restore(url: str, opts: dict, name: str, val: float, out: str) -> str:
    import atomicstore

    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a hang fails the step, never the suite
        try:
            check_numpy(atomicstore.restore(f"{url}/{name}", **opts), val)
            res = "ok"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            res = f"{type(exc).__name__}: {exc}"
        with open(out, "w") as f:
            f.write(res)
        os._exit(0)
    os.waitpid(pid, 0)
    with open(out) as f:
        return f.read()


def main() -> None:
    port, nproc, pid, url, opts, actions, out = sys.argv[1:8]
    nproc_i, pid_i = int(nproc), int(pid)
    # (here, not at import: the test process imports this module too, and jax 0.4.30 then
    # fails to start its CPU backend with gloo collectives and no distributed client)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    extra = {"heartbeat_timeout_seconds": 60}  # (jax 0.4.30, the lowest supported, lacks it)
    extra = {k: v for k, v in extra.items() if k in inspect.signature(jax.distributed.initialize).parameters}
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc_i, process_id=pid_i,
                               initialization_timeout=60, **extra)
    import atomicstore

    opts_d = json.loads(opts)
    lay = Layouts(nproc_i)
    mgr = None
    results: list[dict] = []
    hard_exit = False

    def dump() -> None:
        with open(out + ".tmp", "w") as f:
            json.dump({"pid": pid_i, "steps": results}, f)
        os.replace(out + ".tmp", out)

    for act in json.loads(actions):
        if "pids" in act and pid_i not in act["pids"]:
            continue
        op = act["op"]
        rec: dict = {"op": op, "step": act.get("step")}
        results.append(rec)
        t0 = time.monotonic()
        try:
            if op == "mgr":
                kw = dict(act.get("kwargs", {}))
                so = dict(opts_d)
                if act.get("fast_retry"):
                    so["retry"] = atomicstore.RetryPolicy(attempts=3, initial_wait=0.05, max_wait=0.2, deadline=10)
                mgr = atomicstore.CheckpointManager(url, storage_options=so, **kw)
            elif op == "save":
                tree = lay.tree(act["val"])
                if act.get("spec") == "cols":  # this process shards params/w by columns instead
                    w = expected(act["val"])["params"]["w"]
                    tree["params"]["w"] = jax.make_array_from_callback(
                        w.shape, NamedSharding(lay.m1, P(None, "x")), lambda i, w=w: w[i])
                mgr.save(act["step"], tree)
                if act.get("mutate"):  # after an async save returned: must not reach the checkpoint
                    tree["params"]["b"] += 1000.0
            elif op == "restore":
                target = lay.target(act.get("layout", "same"))
                got = mgr.restore(act.get("step"), target=target)
                rec["checked"] = check(got, act["val"], target)
            elif op == "save_fn":
                atomicstore.save(f"{url}/{act['name']}", lay.tree(act["val"]), timeout=60, **opts_d)
            elif op == "restore_fn":
                target = lay.target(act.get("layout", "same"))
                got = atomicstore.restore(f"{url}/{act['name']}", target, **opts_d)
                rec["checked"] = check(got, act["val"], target)
            elif op == "subtree":
                t = lay.target(act.get("layout", "same"))["params"]
                got = atomicstore.restore(f"{url}/checkpoint_{act['step']}", t, subtree="params", **opts_d)
                assert set(got) == {"w", "m", "b"}, sorted(got)
                rec["checked"] = check(got, act["val"], t, prefix="params/")
            elif op == "partial":
                full = lay.target(act.get("layout", "alt"))
                t = {"params": {"w": full["params"]["w"]}, "opt": {"r": full["opt"]["r"], "lr": 0.0}}
                got = mgr.restore(act["step"], target=t)
                assert set(got) == {"params", "opt"} and set(got["params"]) == {"w"}, got
                assert set(got["opt"]) == {"r", "lr"}, got["opt"]
                rec["checked"] = check(got, act["val"], t)
            elif op == "numpy":
                check_numpy(mgr.restore(act["step"]), act["val"])
            elif op == "wait":
                mgr.wait_until_finished()
            elif op == "close":
                mgr.close()
            elif op == "delete":
                mgr.delete(act["step"])
            elif op == "steps":
                rec["value"] = mgr.all_steps()
            elif op == "attempt":
                rec["value"] = mgr.metadata(act["step"])["attempt"]
            elif op == "sleep":
                time.sleep(act["seconds"])
            elif op == "pause_self":  # a paused VM: SIGSTOP now, SIGCONT ``seconds`` later
                subprocess.Popen(["sh", "-c", f"sleep 0.2; kill -STOP {os.getpid()}; sleep {act['seconds']}; "
                                  f"kill -CONT {os.getpid()}"])
                time.sleep(1.0)  # stopped in here
            elif op == "die_after":
                threading.Timer(act["seconds"], os._exit, (17,)).start()
                hard_exit = True
            elif op == "hard_exit":
                hard_exit = True
            elif op == "rendezvous":
                d = act["dir"]
                os.makedirs(d, exist_ok=True)
                open(os.path.join(d, f"{act.get('job', 0)}-{pid_i}"), "w").close()
                while len(os.listdir(d)) < act["count"]:
                    time.sleep(0.01)
            elif op == "gate":
                from atomicstore.drivers import get_driver

                gate_reads(type(get_driver(url, storage_options=opts_d)), act["name"], act["ready"], act["go"])
            elif op == "arm":
                touch_on_next_wait(act["path"])
            elif op == "touch":
                touch(act["path"])
            elif op == "fork_restore":
                rec["value"] = fork_restore(url, opts_d, act["name"], act["val"], act["out"])
            elif op == "barrier":
                # the coordination service's barrier, not a collective over the devices
                # (sync_global_devices): jaxlib 0.4.30's gloo collectives deadlock in context
                # set-up with 4 processes of 2 CPU devices each and abort every process
                from jax._src import distributed

                distributed.global_state.client.wait_at_barrier(f"mh_worker/{act.get('name', 'b')}", 120_000)
            else:
                raise ValueError(f"unknown op {op}")
            rec["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported to the test
            rec["ok"] = False
            rec["error"] = type(exc).__name__
            rec["message"] = str(exc)[:2000]
            cause = exc.__cause__
            rec["cause"] = type(cause).__name__ if cause is not None else None
            rec["trace"] = traceback.format_exc()[-3000:]
        rec["seconds"] = time.monotonic() - t0
        dump()
    dump()
    sys.stdout.flush()
    if hard_exit:
        os._exit(0)  # a peer is lost: do not wait for it at shutdown
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
