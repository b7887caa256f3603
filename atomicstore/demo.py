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
"""

from __future__ import annotations

import json
import os
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


def _init() -> dict[str, Any]:
    import jax.numpy as jnp
    import numpy as np

    return {"params": {"w": jnp.zeros((8, 1)), "b": jnp.zeros(())}, "step": 0,
            "buffer": np.full(BUFFER, 0.25, np.float32)}


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


def run_demo(store: str = "local", directory: str | None = None, as_json: bool = False) -> int:
    import atomicstore

    url, options, server = _start_store(store, directory)
    rows: list[tuple[str, str]] = []

    def say(stage: str, what: str) -> None:
        rows.append((stage, what))
        if not as_json:
            print(f"[{stage}] {what}", flush=True)

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


def _start_child(url: str, options: dict[str, Any]) -> subprocess.Popen[str]:
    """The training run (:func:`_child`) in a child process, its stdout piped."""
    env = dict(os.environ)
    code = "import sys, json; from atomicstore.demo import _child; _child(sys.argv[1], json.loads(sys.argv[2]))"
    return subprocess.Popen([sys.executable, "-c", code, url, json.dumps(options)],
                            stdout=subprocess.PIPE, text=True, env=env)


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


def _summary(rows: list[tuple[str, str]], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"ok": True, "stages": [{"stage": a, "result": b} for a, b in rows]}, indent=1))
        return
    print("\nsummary")
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a:{w}}  {b}")
    print("demo passed: a preemption mid-save lost only the checkpoint in flight")


def _data_in_flight(st: Any) -> bool:
    """True once a save has written data that is not committed yet: staged bytes on
    POSIX, an open multipart upload on S3."""
    d = st.driver
    if d.capabilities.multipart_uploads:
        return bool(d.list_incomplete_uploads(""))
    return any(info.size > 0 for info in d.find(".atomicstore/staging").values())


def _leaves(tree: Any) -> list[Any]:
    from .pytree.tree import walk_leaves

    return [v for _, v in walk_leaves(tree)]
