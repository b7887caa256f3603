"""Tiered checkpoints on the cloud link: the targets of issue 25.

A ``CheckpointManager(url, local_dir=...)`` commits each save to a local directory and
persists it to ``url`` in the background (``atomicstore/tiers.py``). This benchmark puts
the persistent tier behind the cloud link of ``benchmarks/cloud.py`` (a real SeaweedFS,
``weed mini``, reached through ``benchmarks/shaper.py``: 8 MiB/s per connection each way,
+20 ms on every request and every response) and measures, for a state of a few float32
numpy arrays (random bits):

- **stall**: how long ``save`` blocks the caller with tiers
  (``CheckpointManager(url, local_dir=tmp, async_save=False, local_keep=1)``; its second
  save, so that retention deletes the first step as in a training loop), against a local-disk
  ``atomicstore.save`` of the same state (target: at most 1.2 x) and against a direct
  ``CheckpointManager(url).save`` into the bucket (its second save too);
- **committed**: the time from ``save`` until the persistent copy is committed (``save``
  + ``wait_until_finished()``) against the direct save (target: at most 1.1 x);
- **restart, same machine**: a new manager on the same ``local_dir`` restoring the step
  (from the local tier) against a local ``atomicstore.restore`` (target: at most 1.2 x);
- **machine lost**: the local tier deleted, a new manager on an empty ``local_dir``
  restoring from the persistent tier, against a direct ``CheckpointManager(url).restore``
  through the same link (target: the cloud link's restore speed; read as at most 1.1 x);
- **memory**: the process's peak resident memory while the state is saved and uploaded
  (VmHWM, reset by writing "5" to ``/proc/self/clear_refs`` after the state was made)
  minus its resident memory before the save (the state itself is allocated before),
  against the store's in-flight budget (``max_inflight_bytes``, a driver setting) + 64 MiB.

    python benchmarks/tiers.py                           # 1 GiB, median of 3 (~5 min)
    python benchmarks/tiers.py --size 256 --repeat 1     # a quick look
    nox -s bench -- --only tiers                         # the same as the first

One SeaweedFS serves the whole run (``cloud.py``'s ``--serve`` child). Each round is one
client process, with a fresh state and its own shaper in front of the server: it saves
the state to local disk (the anchor), with tiers, and directly into the bucket; then
restores it from local disk (``atomicstore.restore`` of the local tier's copy, a plain
checkpoint), with a restarted tiered manager, directly from the bucket, and with a tiered
manager on an empty ``local_dir`` once the local tier is deleted. Odd rounds run each
group in the reverse order, so each tiered measure sits next to its anchors and a slower
machine or server for a while weighs on both alike. The stores are made and their
conformance check run before the timed region, as in ``cloud.py``; a restarted manager
is made untimed too (its opening time is reported apart). Every restore is checked
against the state saved, and the shaper's byte count shows which tier each one read.
Before each timed save to local disk an untimed one is made and deleted, and memory is
touched and freed before each timed restore (see ``_warm_disk`` and ``_warm_memory``);
``jax.monitoring`` is imported first (see ``child``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cloud  # noqa: E402  (the server, a SeaweedFS in a ``cloud.py --serve`` child, and the link's model)

MiB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: memory the upload may use beyond the in-flight budget (the issue's target)
SLACK = 64 * MiB
#: the issue's targets: (measure, anchor, most) — ``restore_lost`` is "at the cloud link's
#: restore speed", read as at most 1.1 x the direct restore
TARGETS = {"stall": ("save_local", 1.2), "committed": ("save_direct", 1.1),
           "restore_same": ("restore_local", 1.2), "restore_lost": ("restore_direct", 1.1)}


# -- in the client process ----------------------------------------------------------------
def state(total: int, leaves: int) -> dict[str, np.ndarray]:
    """``leaves`` float32 arrays of ``total / leaves`` bytes, random bits."""
    rng = np.random.default_rng(0)
    n = total // leaves // 4
    return {f"layer_{i}": rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32) for i in range(leaves)}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset VmHWM to the resident memory now; return that."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _warm_disk(tree: dict[str, np.ndarray], work: str) -> None:
    """An untimed save of the state to local disk, deleted at once: the timed save then
    gets page-cache pages the kernel just freed, as every save after a job's first does.
    (On this VM memory first touched after it was freed costs a host fault: the first
    1 GiB save of a process took 3.4 s, the next ones 1.0-1.2 s.)"""
    import atomicstore

    atomicstore.save(os.path.join(work, "warm", "step_0"), tree)
    shutil.rmtree(os.path.join(work, "warm"))


def _warm_memory(total: int) -> None:
    """Touch and free ``total`` bytes before a timed restore, which allocates its result:
    the allocation then gets pages freed just now, not pages the VM has to fault in from
    its host (0.76 GiB/s here; the multi-process section of docs/benchmarks.md)."""
    np.ones(total // 8 + MiB, dtype=np.float64)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _check(got: Any, tree: dict[str, np.ndarray]) -> None:
    if sorted(got) != sorted(tree) or not all(np.array_equal(got[k].view(np.uint32), v.view(np.uint32))
                                              for k, v in tree.items()):
        raise AssertionError("the restored state differs from the state saved")


def _manager(env: dict[str, Any], link: Any, name: str, **kw: Any) -> Any:
    from atomicstore import CheckpointManager

    opts = dict(env["options"], endpoint_url=link.endpoint)
    mgr = CheckpointManager(f"s3://{env['bucket']}/{name}", storage_options=opts, **kw)
    mgr.store.conformance()  # once per endpoint and bucket per process, before timing
    return mgr


class Run:
    """One round in one client process: the state, the link, where things go."""

    def __init__(self, env: dict[str, Any], tree: dict[str, np.ndarray], work: str, link: Any) -> None:
        self.env, self.tree, self.work, self.link = env, tree, work, link
        self.total = sum(a.nbytes for a in tree.values())
        self.local = os.path.join(work, "tier")

    def name(self, what: str) -> str:
        return f"{what}-{self.env['round']}"


def save_local(r: Run) -> dict[str, Any]:
    """The local-disk anchor: ``atomicstore.save`` (deleted afterwards)."""
    import atomicstore

    path = os.path.join(r.work, "local", "step_1")
    _warm_disk(r.tree, r.work)
    before = _reset_peak()
    t, _ = _timed(lambda: atomicstore.save(path, r.tree))
    extra = _status("VmHWM") - before
    shutil.rmtree(os.path.dirname(path))
    return {"save_local": t, "extra_local": extra}


def save_direct(r: Run) -> dict[str, Any]:
    """The bucket anchor: ``CheckpointManager(url).save`` through the link, the second
    save of the manager (retention then deletes the first, inside ``save``, as in a
    training loop); the first save's time is kept too."""
    mgr = _manager(r.env, r.link, r.name("direct"))
    first, _ = _timed(lambda: mgr.save(1, r.tree))
    before, cpu = _reset_peak(), time.process_time()
    t, _ = _timed(lambda: mgr.save(2, r.tree))
    cpu = time.process_time() - cpu
    extra = _status("VmHWM") - before
    mgr.close()
    return {"save_direct": t, "save_direct_first": first, "extra_direct": extra, "cpu_direct": cpu}


def _tiered_save(mgr: Any, step: int, tree: dict[str, np.ndarray]) -> tuple[float, float]:
    """The stall of ``save`` and the time until ``wait_until_finished`` returned."""
    t0 = time.perf_counter()
    mgr.save(step, tree)
    stall = time.perf_counter() - t0
    mgr.wait_until_finished()
    return stall, time.perf_counter() - t0


def save_tiered(r: Run) -> dict[str, Any]:
    """``CheckpointManager(url, local_dir=..., async_save=False, local_keep=1)``: the stall
    of ``save``, the time until the persistent copy is committed and the peak memory over
    both, for the second save of the manager (retention then deletes the first step from
    the local tier, inside ``save``, and from the persistent tier after the upload, as in
    a training loop); the first save's times are kept too."""
    mgr = _manager(r.env, r.link, r.name("tiered"), local_dir=r.local, async_save=False, local_keep=1)
    budget = mgr.store.driver.max_inflight_bytes
    first = _tiered_save(mgr, 1, r.tree)
    _warm_disk(r.tree, r.work)
    before, cpu = _reset_peak(), time.process_time()
    stall, committed = _tiered_save(mgr, 2, r.tree)
    cpu = time.process_time() - cpu
    extra = _status("VmHWM") - before
    states = {str(k): str(v) for k, v in mgr.tier_state().items()}
    mgr.close()
    if states != {"2": "persisted"}:
        raise AssertionError(f"after wait_until_finished the tiers say {states}")
    return {"stall": stall, "committed": committed, "upload": committed - stall, "extra_tiered": extra,
            "stall_first": first[0], "committed_first": first[1], "cpu_tiered": cpu, "budget": budget}


def _restore(r: Run, key: str, mgr_of: Callable[[], Any] | None, fn: Callable[[Any], Any]) -> dict[str, Any]:
    """Time ``fn(manager)`` (the manager made first by ``mgr_of``, timed apart: a
    restart's opening), after memory was warmed; check the result; count the bytes that
    came down the link."""
    t_open, mgr = _timed(mgr_of) if mgr_of is not None else (0.0, None)
    before = r.link.stats()["bytes_down"]
    _warm_memory(r.total)
    try:
        t, got = _timed(lambda: fn(mgr))
        time.sleep(0.1)  # the shaper counts a burst once its direction was idle for 10 ms
        down = (r.link.stats()["bytes_down"] - before) / MiB
        _check(got, r.tree)
        del got
    finally:
        if mgr is not None:
            mgr.close()
    return {f"restore_{key}": t, f"down_{key}": down, f"open_{key}": t_open}


def restore_local(r: Run) -> dict[str, Any]:
    """The local-disk anchor: ``atomicstore.restore`` of the local tier's copy (a plain
    checkpoint on local disk, in the page cache as after a restart on the same machine)."""
    import atomicstore

    return _restore(r, "local", None, lambda _: atomicstore.restore(os.path.join(r.local, "checkpoint_2")))


def restore_same(r: Run) -> dict[str, Any]:
    """A restart on the same machine: a new manager on the same ``local_dir``."""
    return _restore(r, "same", lambda: _manager(r.env, r.link, r.name("tiered"), local_dir=r.local),
                    lambda m: m.restore())


def restore_lost(r: Run) -> dict[str, Any]:
    """The machine lost: the local tier deleted, a new manager on an empty ``local_dir``."""
    shutil.rmtree(r.local)
    lost = os.path.join(r.work, "new-machine")
    return _restore(r, "lost", lambda: _manager(r.env, r.link, r.name("tiered"), local_dir=lost),
                    lambda m: m.restore())


def restore_direct(r: Run) -> dict[str, Any]:
    """The bucket anchor: a new ``CheckpointManager(url)``'s ``restore`` through the link."""
    return _restore(r, "direct", lambda: _manager(r.env, r.link, r.name("direct")), lambda m: m.restore())


#: a round's steps; odd rounds reverse each group (restore_lost deletes the local tier: it
#: comes after restore_local and restore_same either way)
SAVES = [(save_local, save_tiered, save_direct)]
RESTORES = [(restore_local, restore_same), (restore_direct, restore_lost)]


def run_round(env: dict[str, Any], tree: dict[str, np.ndarray], work: str) -> dict[str, Any]:
    """Every measure of one round, in one process: each anchor next to the tiered measure
    it is compared with (alternating which goes first), so a slower machine or server
    for a while weighs on both alike."""
    from shaper import Shaper

    out: dict[str, Any] = {}
    with Shaper(env["host"], env["port"], env["mbps"], env["latency"]) as link:
        r = Run(env, tree, work, link)
        order = -1 if env["round"] % 2 else 1
        for group in SAVES + RESTORES:
            for step in group[::order]:
                out |= step(r)
    return out


def child(env: dict[str, Any], total: int, leaves: int) -> None:
    try:  # the manager records jax.monitoring events: a job's first save would import jax
        import jax.monitoring  # noqa: F401  (0.4 s, +128 MiB here), which later saves do not
    except ImportError:
        pass
    work = tempfile.mkdtemp(prefix="asbench-tiers-", dir=os.environ.get("BENCH_DIR"))
    try:
        out = run_round(env, state(total, leaves), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out), flush=True)


# -- the parent ---------------------------------------------------------------------------
def _run_round(env: dict[str, Any], total: int, leaves: int) -> dict[str, Any]:
    limit = 300 + 8 * total / (env["mbps"] * MiB)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--env", json.dumps(env),
           "--bytes", str(total), "--leaves", str(leaves)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"tiers benchmark, round {env['round']} failed:\n{out.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def measure(total: int, repeat: int, leaves: int) -> list[dict[str, Any]]:
    """``repeat`` rounds on one SeaweedFS, each in a client process of its own; each
    round's results."""
    srv = cloud._Server("s3")
    try:
        direct = srv.info["endpoint"]
        host, port = direct.rsplit("//", 1)[1].rsplit(":", 1)
        base = {"bucket": srv.info["bucket"], "options": srv.info["options"], "host": host, "port": int(port),
                "mbps": cloud.MBPS, "latency": cloud.LATENCY}
        rounds = []
        for k in range(repeat):
            res = _run_round(dict(base, round=k), total, leaves)
            _log_round(k, res)
            rounds.append(res)
    finally:
        srv.stop()
    return rounds


def _log_round(k: int, r: dict[str, Any]) -> None:
    print(f"tiers round {k}: stall {r['stall']:.2f} s (first save {r['stall_first']:.2f}) (local save {r['save_local']:.2f}, direct save "
          f"{r['save_direct']:.2f}); committed {r['committed']:.2f} s; restore same machine "
          f"{r['restore_same']:.2f} s ({r['down_same']:.1f} MiB down the link; local restore "
          f"{r['restore_local']:.2f}), machine lost {r['restore_lost']:.2f} s ({r['down_lost']:.0f} MiB; "
          f"direct {r['restore_direct']:.2f}); extra peak RSS tiered {r['extra_tiered'] / MiB:.0f} MiB, "
          f"direct {r['extra_direct'] / MiB:.0f}, local {r['extra_local'] / MiB:.0f}",
          file=sys.stderr, flush=True)


def _med(rounds: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def _cell(rounds: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rounds]
    med = statistics.median(vals)
    return f"{med:.2f} ({min(vals):.2f}–{max(vals):.2f})" if len(vals) > 1 else f"{med:.2f}"


def _ratio(rounds: list[dict[str, Any]], key: str, anchor: str) -> float:
    """The median of the per-round ratios (each round's cases ran back to back)."""
    return statistics.median(r[key] / r[anchor] for r in rounds)


def tiers_table(total: int, repeat: int = 3, leaves: int = 4) -> list[dict[str, Any]]:
    """Measure and print the Markdown table of the tier targets; the rounds' results."""
    t0 = time.monotonic()
    rounds = measure(total, repeat, leaves)
    seconds = time.monotonic() - t0
    budget = rounds[0]["budget"]
    print(f"\ntiered checkpoints (issue 25): {total // MiB} MiB ({leaves} float32 leaves), persistent tier "
          f"SeaweedFS behind the cloud link ({cloud.MBPS:g} MiB/s per connection, +{cloud.LATENCY * 1000:g} ms "
          f"on every request and response), local tier and anchors on local disk; seconds, median (min–max) of "
          f"{repeat} round(s); ratio: median of the per-round ratios. {seconds:.0f} s in all.\n")
    print("| measure | with tiers | anchor | anchor time | × anchor | direct to the bucket | × direct | target | met |")
    print("|---|---:|---|---:|---:|---:|---:|---|---|")
    rows = [("caller's stall per save", "stall", "local `atomicstore.save`", "save_local", "save_direct"),
            ("persistent copy committed (save + `wait_until_finished`)", "committed", "", "", "save_direct"),
            ("restore after a restart, local tier present", "restore_same", "local `atomicstore.restore`",
             "restore_local", "restore_direct"),
            ("restore after losing the machine (local tier deleted)", "restore_lost", "", "", "restore_direct")]
    for title, key, anchor_name, anchor, direct in rows:
        target_anchor, most = TARGETS[key]
        ratio = _ratio(rounds, key, target_anchor)
        met = "yes" if ratio <= most else f"**no** ({ratio:.2f} ×)"
        target = f"≤ {most:g} × {'local' if target_anchor == anchor else 'direct'}"
        a_cell = _cell(rounds, anchor) if anchor else "–"
        a_ratio = f"{_ratio(rounds, key, anchor):.2f}" if anchor else "–"
        print(f"| {title} | {_cell(rounds, key)} | {anchor_name or '–'} | {a_cell} | {a_ratio} | "
              f"{_cell(rounds, direct)} | {_ratio(rounds, key, direct):.2f} | {target} | {met} |")
    extra = max(r["extra_tiered"] for r in rounds)
    limit = budget + SLACK
    met = "yes" if extra <= limit else f"**no** (+{(extra - limit) / MiB:.0f} MiB)"
    print(f"| extra peak RSS, save + upload (MiB, largest of the rounds) | {extra / MiB:.0f} | local save | "
          f"{max(r['extra_local'] for r in rounds) / MiB:.0f} | – | {max(r['extra_direct'] for r in rounds) / MiB:.0f} "
          f"| – | ≤ in-flight budget {budget // MiB} + 64 = {limit // MiB} | {met} |")
    print(f"\n- bytes down the link during a restore: local tier present {_med(rounds, 'down_same'):.2f} MiB, "
          f"machine lost {_med(rounds, 'down_lost'):.0f} MiB, direct {_med(rounds, 'down_direct'):.0f} MiB "
          f"(medians); the upload alone (committed − stall) {_cell(rounds, 'upload')} s")
    print(f"- opening the manager after the restart (untimed above): local tier present "
          f"{_cell(rounds, 'open_same')} s, machine lost {_cell(rounds, 'open_lost')} s, direct "
          f"{_cell(rounds, 'open_direct')} s")
    print(f"- the first save of each manager (nothing to delete yet): stall {_cell(rounds, 'stall_first')} s "
          f"({_ratio(rounds, 'stall_first', 'save_local'):.2f} × local), committed {_cell(rounds, 'committed_first')} s "
          f"({_ratio(rounds, 'committed_first', 'save_direct_first'):.2f} × the first direct save, "
          f"{_cell(rounds, 'save_direct_first')} s)")
    print(f"- CPU time of the client process (all threads): direct save {_cell(rounds, 'cpu_direct')} s, "
          f"tiered save + upload {_cell(rounds, 'cpu_tiered')} s")
    sys.stdout.flush()
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--env")
    ap.add_argument("--bytes", type=int, default=None)
    ap.add_argument("--size", type=float, default=1024, help="MiB of state (default 1024)")
    ap.add_argument("--leaves", type=int, default=4, help="float32 arrays the state is made of")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (the median is reported)")
    args = ap.parse_args()
    total = args.bytes or int(args.size * MiB)
    if args.child:
        child(json.loads(args.env), total, args.leaves)
        return
    tiers_table(total, args.repeat, args.leaves)


if __name__ == "__main__":
    main()
