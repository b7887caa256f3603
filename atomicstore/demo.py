"""``atomicstore demo``: a training run that survives SIGKILL in the middle of a save.

1. A child process trains a small model in pure JAX (linear regression, SGD; with a
   96 MiB optimizer buffer so a save takes a moment) and checkpoints every few steps with
   :class:`~atomicstore.CheckpointManager`.
2. While it is saving, the parent kills it with SIGKILL (it watches the store until an
   attempt is in flight).
3. Recovery runs: the half-written attempt is removed once the dead writer's lease
   expired; the committed checkpoints are untouched and verify.
4. Training resumes from the latest committed step; the demo proves the restored state
   is bit-identical to the state the run had at that step (recomputed from scratch: the
   run is deterministic), finishes training and checks that the loss went down.

On ``--store s3`` the store is an S3 fake (moto) started in this process on 127.0.0.1,
so the object-store path (conditional markers, multipart uploads) runs without an account.

``atomicstore demo --tiers`` (:func:`run_tiers_demo`) runs the same training with a local
tier: ``CheckpointManager(store, local_dir=<machine>/local)``, every step committed to the
machine's disk and every 20th persisted to the store in the background.

1. The run is killed with SIGKILL while step 30 is being persisted (its upload has data in
   flight in the store): the store lists step 10 only; the local tier 20 and 30.
2. Restart on the same machine (the local tier kept): the run restores step 30 from the
   local tier (the store does not have it), bit-identical, resumes the upload the dead run
   left, trains on and is killed again while persisting step 40 (the first save of a
   manager is always persisted).
3. The machine is lost: its local tier is deleted (step 40 lived only there).
   Recovery removes the dead uploads from the store once their leases expired; nothing
   partial was ever listed.
4. A new machine (an empty local tier) restores step 30 from the persistent tier,
   bit-identical, trains to the end and persists its last step; neither tier holds
   anything partial.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

STEPS, EVERY, KILL_AT = 60, 10, 40
LEASE_TTL = 2.0
BUFFER = 96 * 2**20 // 4


def _model_step(state: dict[str, Any], x: Any, y: Any) -> tuple[dict[str, Any], float]:
    import jax
    import jax.numpy as jnp

    def loss_fn(p: dict[str, Any]) -> Any:
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["params"])
    params = jax.tree_util.tree_map(lambda p, gi: p - 0.05 * gi, state["params"], g)
    return {"params": params, "step": state["step"] + 1, "buffer": state["buffer"]}, float(loss)


def _data() -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (256, 8))
    true_w = jax.random.normal(kw, (8, 1))
    return x, x @ true_w + 0.5 + 0.01 * jnp.sin(jnp.arange(256.0))[:, None]


def _init(buffer: int = BUFFER) -> dict[str, Any]:
    import jax.numpy as jnp
    import numpy as np

    return {"params": {"w": jnp.zeros((8, 1)), "b": jnp.zeros(())}, "step": 0,
            "buffer": np.full(buffer, 0.25, np.float32)}


def _train(state: dict[str, Any], until: int, on_step: Any = None) -> tuple[dict[str, Any], list[float]]:
    x, y = _data()
    losses = []
    while state["step"] < until:
        state, loss = _model_step(state, x, y)
        losses.append(loss)
        if on_step:
            on_step(state, loss)
    return state, losses


def _child(url: str, options: dict[str, Any]) -> None:
    """The training run that gets killed."""
    import atomicstore

    store = atomicstore.open_store(url, lease_ttl=LEASE_TTL, **options)
    mgr = atomicstore.CheckpointManager(url, keep=3, store=store)

    def on_step(state: dict[str, Any], loss: float) -> None:
        if state["step"] % EVERY == 0:
            print(f"SAVE {state['step']}", flush=True)
            mgr.save(state["step"], state, metrics={"loss": loss})
            print(f"SAVED {state['step']}", flush=True)

    _train(_init(), STEPS, on_step)
    print("DONE", flush=True)


#: tiers: every EVERY-th step is committed locally; a manager persists its first save and then
#: one every PERSIST_EVERY steps (10 and 30 in the first run, 40 in the restarted one)
PERSIST_EVERY = 20
#: tiers: the two kills, each while this step is being persisted
TIER_KILLS = (30, 40)
# The tiered demo imports jax before it makes a manager (JAX FIRST): the uploader thread a
# tiered manager starts to resume an upload imports ``jax.monitoring`` to record its events,
# and a first ``import jax`` on the main thread at that moment failed once with Python's
# ``_DeadlockError`` (the two imports took the package's module locks in opposite order).

#: tiers: the optimizer buffer (float32 elements): a 32 MiB state
TIER_BUFFER = 32 * 2**20 // 4
#: tiers: bytes/s an upload reads from the local tier (the upload budget): the upload of the
#: 32 MiB state takes about half a second, a window the demo kills in
UPLOAD_RATE = 64 * 2**20


def _tier_manager(url: str, local_dir: str, store: Any = None, options: dict[str, Any] | None = None) -> Any:
    import atomicstore

    return atomicstore.CheckpointManager(url, keep=3, store=store, storage_options=options, local_dir=local_dir,
                                         local_keep=2, persist_every_n_steps=PERSIST_EVERY, upload_rate=UPLOAD_RATE)


def _child_tiers(url: str, local_dir: str, options: dict[str, Any], restore: bool, wait_at: int) -> None:
    """The tiered training run that gets killed: with ``restore``, it first restores the
    newest step (and reports where from); after saving step ``wait_at`` it waits for its
    uploads (the parent kills it during that upload)."""
    import jax  # noqa: F401 - before the manager (see JAX FIRST)
    import numpy as np

    import atomicstore

    store = atomicstore.open_store(url, lease_ttl=LEASE_TTL, **options)
    persisted_before = sorted(_steps(store))
    fallbacks: list[str] = []

    class Fallbacks(logging.Handler):  # the tiered restore logs a copy it could not use
        def emit(self, record: logging.LogRecord) -> None:
            fallbacks.append(record.getMessage())

    logging.getLogger("atomicstore.tiers").addHandler(Fallbacks(logging.WARNING))
    mgr = _tier_manager(url, local_dir, store=store)
    state = _init(TIER_BUFFER)
    if restore:
        t0 = time.monotonic()
        state = mgr.restore(target=_init(TIER_BUFFER))
        dt = time.monotonic() - t0
        expected, _ = _train(_init(TIER_BUFFER), int(state["step"]))
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                   zip(_leaves(state), _leaves(expected), strict=True))
        print("RESTORED " + json.dumps({"step": int(state["step"]), "seconds": round(dt, 3), "identical": same,
                                        "persisted_before": persisted_before, "fallbacks": fallbacks}), flush=True)

    def on_step(state: dict[str, Any], loss: float) -> None:
        step = state["step"]
        if step % EVERY == 0:
            print(f"SAVE {step}", flush=True)
            mgr.save(step, state, metrics={"loss": loss})
            print(f"SAVED {step} {mgr.tier_state().get(step, '?')}", flush=True)
            if step == wait_at:
                mgr.wait_until_finished()  # (the kill comes during this upload)

    _train(state, STEPS, on_step)
    mgr.close()
    print("DONE", flush=True)


def _steps(st: Any) -> list[int]:
    """The steps committed in store ``st`` (``checkpoint_<step>``)."""
    return sorted(int(n.removeprefix("checkpoint_")) for n in st.list() if n.startswith("checkpoint_"))


def run_tiers_demo(store: str = "local", directory: str | None = None, as_json: bool = False) -> int:
    """``atomicstore demo --tiers``: see the module docstring. 0 once every check passed
    (a failed check raises)."""
    import jax  # noqa: F401 - before any tiered manager (see JAX FIRST)

    import atomicstore

    url, options, server = _start_store(store, directory)
    base = directory or (os.path.dirname(url) if server is None else tempfile.mkdtemp(prefix="atomicstore-demo-"))
    machine1, machine2 = os.path.join(base, "machine-1", "local"), os.path.join(base, "machine-2", "local")
    rows: list[tuple[str, str]] = []
    say = _reporter(rows, as_json)

    try:
        say("store", f"persistent tier {url} ({'S3 fake on 127.0.0.1' if server else 'local disk'}); "
                     f"local tier {machine1} (the machine's disk)")
        st = atomicstore.open_store(url, **options)
        local = atomicstore.open_store(machine1)
        # 1. killed while persisting step 30
        child = _start_child(url, options, tiers=(machine1, False, TIER_KILLS[0]))
        _kill_mid_upload(child, st, TIER_KILLS[0], say)
        persisted, local_steps = _steps(st), _steps(local)
        assert persisted == [10] and local_steps == [20, 30], (persisted, local_steps)
        say("tiers", f"persistent tier lists {persisted}, local tier {local_steps}: the upload of step "
                     f"{TIER_KILLS[0]} in flight is not listed")
        # 2. restart on the same machine: restored from the local tier, killed again
        def on_restored(restored: dict[str, Any]) -> None:
            assert restored["identical"] and restored["step"] == TIER_KILLS[0], restored
            # not in the persistent tier when the run restarted, and no copy failed: the local one
            assert restored["step"] not in restored["persisted_before"] and not restored["fallbacks"], restored
            say("restart", f"same machine: restored step {restored['step']} from the local tier in "
                           f"{restored['seconds']:.2f}s (the persistent tier had only {restored['persisted_before']}): "
                           f"bit-identical to the state the run had at step {restored['step']}; the upload of "
                           f"step {restored['step']} the killed run left is resumed")

        child = _start_child(url, options, tiers=(machine1, True, TIER_KILLS[1]))
        if _kill_mid_upload(child, st, TIER_KILLS[1], say, on_restored) is None:
            raise RuntimeError("the restarted run did not report its restore")
        killed_at = time.monotonic()
        listing = _ls_tiers(url, machine1, options)
        tiers = {int(r["step"]): r["tiers"] for r in listing}
        assert tiers == {10: "persisted", 30: "local+persisted", 40: "persisting"}, tiers
        say("ls", f"atomicstore ls {url} --local-dir {machine1}: "
                  + ", ".join(f"{s} {t}" for s, t in tiers.items()))
        # 3. the machine is lost
        shutil.rmtree(os.path.dirname(machine1))
        say("lost", f"machine lost: {machine1} deleted (step {TIER_KILLS[1]} was only there)")
        expected, _ = _train(_init(TIER_BUFFER), TIER_KILLS[0])  # (while the dead uploader's lease runs out)
        time.sleep(max(0.0, killed_at + LEASE_TTL + 0.5 - time.monotonic()))
        mgr = _recover_tiers(url, options, st, machine2, say)
        # 4. a new machine resumes from the persistent copy
        _resume_tiers(mgr, st, machine2, expected, say)
        _summary(rows, as_json, "demo passed: a preemption lost only the steps not yet persisted, "
                                "and a restart on the same machine lost nothing")
        return 0
    finally:
        if server is not None:
            server.stop()


def _kill_mid_upload(child: subprocess.Popen[str], st: Any, step: int, say: Callable[[str, str], None],
                     on_restored: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any] | None:
    """SIGKILL the tiered training ``child`` once the upload of ``step`` has data in flight
    in the persistent store ``st``; what the child reported of its restore (also given
    to ``on_restored`` as it comes), if it did."""
    try:
        return _watch_tiers(child, st, step, say, on_restored)
    except BaseException:
        if child.poll() is None:  # a failed check: no training child outlives the demo
            child.kill()
            child.wait(timeout=60)
        raise


def _watch_tiers(child: subprocess.Popen[str], st: Any, step: int, say: Callable[[str, str], None],
                 on_restored: Callable[[dict[str, Any]], None] | None) -> dict[str, Any] | None:
    assert child.stdout is not None
    restored, killed = None, False
    for line in child.stdout:
        word, _, rest = line.strip().partition(" ")
        if word == "RESTORED":
            restored = json.loads(rest)
            if on_restored is not None:
                on_restored(restored)
        if word == "SAVED":
            s, _, state = rest.partition(" ")
            say("train", f"step {s}: committed to the local tier ({state})")
            if int(s) == step:
                deadline = time.monotonic() + 60
                while not _data_in_flight(st, f"checkpoint_{step}"):
                    if time.monotonic() > deadline or child.poll() is not None:
                        raise RuntimeError(f"the upload of step {step} never started")
                    time.sleep(0.002)
                os.kill(child.pid, signal.SIGKILL)
                killed = True
                break
    child.wait(timeout=60)
    if not killed:
        raise RuntimeError("the training child finished before it could be killed")
    say("kill", f"SIGKILL while step {step} was being persisted, its upload in flight (exit status "
                f"{child.returncode})")
    return restored


def _ls_tiers(url: str, local_dir: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """``atomicstore ls URL --local-dir DIR --json``, run as the command: its rows."""
    opts = [x for k, v in options.items() for x in ("-o", f"{k}={json.dumps(v)}")]
    r = subprocess.run([sys.executable, "-m", "atomicstore", "ls", url, "--local-dir", local_dir, "--json", *opts],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"atomicstore ls failed ({r.returncode}): {r.stderr.strip()}")
    return list(json.loads(r.stdout)["checkpoints"])


def _recover_tiers(url: str, options: dict[str, Any], st: Any, machine: str, say: Callable[[str, str], None]) -> Any:
    """Recover the persistent tier (the dead uploads' leases expired) and check that its
    committed steps are untouched and verify; the manager of the new machine."""
    steps_before = _steps(st)
    report = st.recover(grace=0)
    removed = [f"{a.kind} {a.target}" for a in report.actions]
    say("recover", f"persistent tier: removed {len(removed)}: {'; '.join(removed) or 'nothing'}")
    steps = _steps(st)
    assert steps == steps_before == [10, 30], (steps_before, steps)
    for s in steps:
        st.verify(f"checkpoint_{s}")
    say("verify", f"persistent steps {steps}: every checksum verifies; step {TIER_KILLS[1]} never appeared there")
    return _tier_manager(url, machine, options=options)


def _resume_tiers(mgr: Any, st: Any, machine: str, expected: dict[str, Any], say: Callable[[str, str], None]) -> None:
    """The new machine: restore (from the persistent tier: its local tier is empty), prove
    it bit-identical to ``expected`` (the run's state at that step, recomputed), train to
    the end, persist, and check both tiers hold nothing partial."""
    import numpy as np

    import atomicstore

    t0 = time.monotonic()
    restored = mgr.restore(target=_init(TIER_BUFFER))
    dt = time.monotonic() - t0
    latest = int(restored["step"])
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(_leaves(restored), _leaves(expected), strict=True))
    assert same and latest == TIER_KILLS[0], "the resumed state differs from the saved one"
    say("resume", f"new machine ({machine}, empty): restored step {latest} from the persistent tier in "
                  f"{dt:.2f}s: bit-identical to the state the run had at step {latest}")
    final, losses = _train(restored, STEPS)
    mgr.save(final["step"], final, metrics={"loss": losses[-1]})
    mgr.close()  # waits for the upload of the last step
    _, first = _train(_init(TIER_BUFFER), 1)
    assert losses[-1] < first[0], "training did not make progress"
    local = atomicstore.open_store(machine)
    persisted, kept = _steps(st), _steps(local)
    assert persisted == [10, 30, STEPS] and kept == [STEPS], (persisted, kept)
    say("finish", f"trained to step {final['step']}, loss {first[0]:.3f} -> {losses[-1]:.4f}; "
                  f"persistent tier {persisted}, local tier {kept}")
    for tier, store in (("persistent", st), ("local", local)):
        rep = store.recover(dry_run=True, grace=0)
        assert not rep.actions and not rep.in_flight, (tier, rep.summary())
        for s in _steps(store):
            store.verify(f"checkpoint_{s}")
    say("check", "neither tier holds or lists anything partial; every listed step verifies in both")


def _start_store(kind: str, directory: str | None) -> tuple[str, dict[str, Any], Any]:
    if kind == "local":
        d = directory or tempfile.mkdtemp(prefix="atomicstore-demo-")
        return os.path.join(d, "run"), {}, None
    try:
        from .testing.servers import FakeS3
    except ImportError as exc:  # moto/pytest-localserver are test extras
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"--store s3 needs the S3 fake: pip install 'atomicstore[test]' ({exc})") from None
    server = FakeS3()
    bucket = server.new_bucket()
    return server.url(bucket, "run"), server.storage_options(), server


def _reporter(rows: list[tuple[str, str]], as_json: bool) -> Callable[[str, str], None]:
    """``say(stage, what)``: kept in ``rows`` (the JSON report), printed unless ``as_json``."""

    def say(stage: str, what: str) -> None:
        rows.append((stage, what))
        if not as_json:
            print(f"[{stage}] {what}", flush=True)

    return say


def run_demo(store: str = "local", directory: str | None = None, as_json: bool = False) -> int:
    import atomicstore

    url, options, server = _start_store(store, directory)
    rows: list[tuple[str, str]] = []
    say = _reporter(rows, as_json)

    try:
        say("store", f"{url} ({'S3 fake on 127.0.0.1' if server else 'local disk'})")
        child = _start_child(url, options)
        st = atomicstore.open_store(url, **options)
        killed_during = _kill_mid_save(child, st, say)
        mgr = _recover(url, options, st, killed_during, say)
        _resume(mgr, say)
        _summary(rows, as_json)
        return 0
    finally:
        if server is not None:
            server.stop()


def _start_child(url: str, options: dict[str, Any],
                 tiers: tuple[str, bool, int] | None = None) -> subprocess.Popen[str]:
    """The training run (:func:`_child`; with ``tiers`` = (local_dir, restore, wait_at),
    :func:`_child_tiers`) in a child process, its stdout piped."""
    env = dict(os.environ)
    if tiers is None:
        code = "import sys, json; from atomicstore.demo import _child; _child(sys.argv[1], json.loads(sys.argv[2]))"
        args = [url, json.dumps(options)]
    else:
        code = ("import sys, json; from atomicstore.demo import _child_tiers; "
                "_child_tiers(sys.argv[1], sys.argv[3], json.loads(sys.argv[2]), sys.argv[4] == '1', int(sys.argv[5]))")
        args = [url, json.dumps(options), tiers[0], "1" if tiers[1] else "0", str(tiers[2])]
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


def _kill_mid_save(child: subprocess.Popen[str], st: Any, say: Callable[[str, str], None]) -> int:
    """SIGKILL the training ``child`` once the save of step :data:`KILL_AT` has data in
    flight in store ``st``; that step."""
    assert child.stdout is not None
    killed_during = None
    for line in child.stdout:
        word, _, step = line.strip().partition(" ")
        if word == "SAVED":
            say("train", f"step {step}: checkpoint committed")
        if word == "SAVE" and int(step) == KILL_AT:
            deadline = time.monotonic() + 60
            while not _data_in_flight(st):
                if time.monotonic() > deadline:
                    raise RuntimeError("the save never started")
                time.sleep(0.002)
            os.kill(child.pid, signal.SIGKILL)
            killed_during = int(step)
            break
    child.wait(timeout=60)
    if killed_during is None:
        raise RuntimeError("the training child finished before it could be killed")
    say("kill", f"SIGKILL while saving step {killed_during} (exit status {child.returncode})")
    return killed_during


def _recover(url: str, options: dict[str, Any], st: Any, killed_during: int,
             say: Callable[[str, str], None]) -> Any:
    """Recover (store ``st``) once the dead writer's lease expired, and check that the
    committed steps are untouched and verify; the manager of the run."""
    import atomicstore

    mgr = atomicstore.CheckpointManager(url, keep=3, storage_options=options, recover=False)
    steps_before = mgr.all_steps()
    time.sleep(LEASE_TTL + 0.5)  # the dead writer's lease expires
    report = st.recover(grace=0)
    removed = [f"{a.kind} {a.target}" for a in report.actions]
    say("recover", f"removed {len(removed)}: {'; '.join(removed) or 'nothing'}")
    steps = mgr.all_steps()
    assert steps == steps_before and killed_during not in steps, (steps_before, steps)
    for s in steps:
        st.verify(f"checkpoint_{s}")
    say("verify", f"committed steps {steps}: every checksum verifies; step {killed_during} never appeared")
    return mgr


def _resume(mgr: Any, say: Callable[[str, str], None]) -> None:
    """Restore the latest step, prove it bit-identical to the deterministic run's state at
    that step, train to the end and check that the loss went down."""
    import numpy as np

    latest = mgr.latest_step()
    assert latest is not None, "no committed step survived"
    restored = mgr.restore(latest, target=_init())
    expected, _ = _train(_init(), int(latest))  # the deterministic run up to that step
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(_leaves(restored), _leaves(expected), strict=True))
    assert same and restored["step"] == latest, "the resumed state differs from the saved one"
    say("resume", f"restored step {latest}: bit-identical to the state the run had at step {latest}")
    final, losses = _train(restored, STEPS)
    mgr.save(final["step"], final, metrics={"loss": losses[-1]})
    _, first = _train(_init(), 1)
    assert losses[-1] < first[0], "training did not make progress"
    say("finish", f"trained to step {final['step']}, loss {first[0]:.3f} -> {losses[-1]:.4f}; "
                  f"committed steps {mgr.all_steps()}")


def _summary(rows: list[tuple[str, str]], as_json: bool,
             verdict: str = "demo passed: a preemption mid-save lost only the checkpoint in flight") -> None:
    if as_json:
        print(json.dumps({"ok": True, "stages": [{"stage": a, "result": b} for a, b in rows]}, indent=1))
        return
    print("\nsummary")
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a:{w}}  {b}")
    print(verdict)


def _data_in_flight(st: Any, name: str | None = None) -> bool:
    """True once a save (of checkpoint ``name``, or any) has written data that is not
    committed yet: staged bytes on POSIX, an open multipart upload on S3."""
    d = st.driver

    def of(key: str) -> bool:
        return name is None or f"{name}." in key or f"{name}/" in key

    if d.capabilities.multipart_uploads:
        return any(of(key) for key, _, _ in d.list_incomplete_uploads(""))
    return any(info.size > 0 and of(key) for key, info in d.find(".atomicstore/staging").items())


def _leaves(tree: Any) -> list[Any]:
    from .pytree.tree import walk_leaves

    return [v for _, v in walk_leaves(tree)]
