"""One rank of a torch.distributed job saving and loading through DCP with atomicstore's
storage (started by tests/integrations/test_integration_torch.py).

usage: torch_worker.py PORT WORLD RANK URL OPTIONS_JSON ACTIONS_JSON OUT_JSON

WORLD > 1: ``torch.distributed`` with gloo on 127.0.0.1, a 1-D CPU ``DeviceMesh`` over the
ranks; WORLD == 1: no process group (DCP's ``no_dist``). ACTIONS is a list of steps every
rank runs in order (a step with "ranks" runs only in those); the outcome of each (ok / error
type, message, the error types inside DCP's CheckpointException) goes to OUT_JSON, rewritten
after every step (a rank that is killed leaves what it had done).

The state (see ``state``) mixes a DTensor sharded by rows (or by columns: layout "cols"),
a replicated bfloat16 DTensor, a sharded optimizer moment, and plain Python values that DCP
writes as bytes. Its values depend on ``val``.

Steps ("op"):
  save         dcp.save through AtomicStorageWriter(URL/<name>) ("overwrite", "threads")
  async_save   dcp.async_save, then waits for its future (with "leave": after leaving the
               writer's with block)
  fail_write   save, but the ranks in "bad" raise (in their planner) after their first item
               was written ("threads": 2 makes that inside one of two writer threads;
               "plain": no with block, the writer is just dropped and collected)
  kill_write   save, but this rank exits (os._exit) after its first item was written
  load         dcp.load onto the layout ("rows" / "cols"; WORLD == 1: whole tensors), checked
  load_stock   the same through the stock FileSystemReader (local disk)
  rendezvous   wait until "count" ranks (of any job) touched a file in "dir"
  barrier      torch.distributed.barrier

A save or load step with "state": "wide" uses :func:`wide` instead (issue 21 row 17).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

warnings.simplefilter("ignore")

ROWS, COLS = 64, 32


def full(val: float) -> dict:
    """The whole (unsharded) state for ``val``."""
    return {
        "model": {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * val,
                  "b": torch.full((COLS,), val, dtype=torch.bfloat16)},
        "optim": {"m": torch.arange(4 * ROWS, dtype=torch.float64) - val, "step": int(val)},
        "meta": {"lr": 0.5 * val, "tag": f"v{val}"},
    }


def state(val: float, mesh, layout: str) -> dict:
    """The state for ``val``, sharded over ``mesh`` (None: whole tensors)."""
    s = full(val)
    if mesh is None:
        return s
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.4: DTensor is only in its private module
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor

    dim = 0 if layout == "rows" else 1
    s["model"]["w"] = distribute_tensor(s["model"]["w"], mesh, [Shard(dim)])
    s["model"]["b"] = distribute_tensor(s["model"]["b"], mesh, [Replicate()])
    s["optim"]["m"] = distribute_tensor(s["optim"]["m"], mesh, [Shard(0)])
    return s


def wide(val: float, mesh, layout: str) -> dict:
    """The state of issue 21 row 17 (``"state": "wide"``): a 512 x 512 float32 DTensor
    sharded over the ranks, a replicated one and a Python value, so that DCP's dedup gives
    rank 1 a file with a bytes item before its shard of ``w`` (``__1_0.distcp``: ``w`` at
    [1261, 527126) on torch 2.13 and 2.14)."""
    w = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) * val
    s = {"step": int(val), "w": w, "b": torch.full((512,), val)}
    if mesh is None:
        return s
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.4: DTensor is only in its private module
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor

    s["w"] = distribute_tensor(w, mesh, [Shard(0 if layout == "rows" else 1)])
    s["b"] = distribute_tensor(s["b"], mesh, [Replicate()])
    return s


def check_wide(got: dict, val: float) -> list[str]:
    want = wide(val, None, "rows")
    bad = [k for k in ("w", "b") if not torch.equal(
        got[k].full_tensor() if hasattr(got[k], "full_tensor") else got[k], want[k])]
    return bad + (["step"] if got["step"] != want["step"] else [])


def zeroed(s: dict) -> dict:
    out = {}
    for k, v in s.items():
        if isinstance(v, dict):
            out[k] = zeroed(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = type(v)() if not isinstance(v, int) else -1
    return out


def check(got: dict, val: float) -> list[str]:
    """Differences between a loaded state and the expected one (whole tensors compared)."""
    want = full(val)
    bad = []
    for k in ("w", "b"):
        t = got["model"][k]
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        if not torch.equal(t, want["model"][k]):
            bad.append(f"model/{k}")
    m = got["optim"]["m"]
    m = m.full_tensor() if hasattr(m, "full_tensor") else m
    if not torch.equal(m, want["optim"]["m"]):
        bad.append("optim/m")
    if got["optim"]["step"] != want["optim"]["step"]:
        bad.append("optim/step")
    if got["meta"] != want["meta"]:
        bad.append(f"meta {got['meta']}")
    return bad


class Sabotage(DefaultSavePlanner):
    """A planner (the caller's own code, not atomicstore's) that fails or kills this
    rank once one item has been resolved and written."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.count = how, 0

    def resolve_data(self, write_item):
        self.count += 1
        if self.count == 2:
            if self.how == "kill":
                os._exit(17)
            raise RuntimeError("sabotaged write in the caller's planner")
        return super().resolve_data(write_item)


def main() -> None:
    # a worker still running after 100 s prints every thread's stack (the test gives a job
    # 120 s and shows what its workers printed): a hang names where it waits
    faulthandler.dump_traceback_later(100, exit=False)
    port, world, rank, url, opts_json, actions_json, out_path = sys.argv[1:8]
    world_n, rank_n = int(world), int(rank)
    opts = json.loads(opts_json)
    from atomicstore.integrations.torch import AtomicStorageReader, AtomicStorageWriter

    mesh = None
    if world_n > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank_n, world_size=world_n, timeout=datetime.timedelta(seconds=30))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_n,))
    done: list[dict] = []

    def record(entry: dict) -> None:
        done.append(entry)
        with open(out_path + ".tmp", "w") as f:
            json.dump({"rank": rank_n, "steps": done}, f)
        os.replace(out_path + ".tmp", out_path)

    for step in json.loads(actions_json):
        if "ranks" in step and rank_n not in step["ranks"]:
            continue
        op = step["op"]
        entry = {"op": op, "name": step.get("name")}
        t0 = time.monotonic()
        try:
            target = f"{url}/{step['name']}" if "name" in step else None
            layout = step.get("layout", "rows")
            if op in ("save", "async_save", "fail_write", "kill_write"):
                kw = {"overwrite": step.get("overwrite", False), "thread_count": step.get("threads", 1)}
                planner = None
                if op in ("fail_write", "kill_write") and rank_n in step.get("bad", [rank_n]):
                    planner = Sabotage("kill" if op == "kill_write" else "raise")
                sd = (wide if step.get("state") == "wide" else state)(step["val"], mesh, layout)
                if step.get("plain"):  # no with block: the writer is only dropped (then collected)
                    dcp.save(sd, storage_writer=AtomicStorageWriter(target, **kw, **opts), planner=planner)
                else:
                    with AtomicStorageWriter(target, **kw, **opts) as w:
                        if op == "async_save":
                            fut = dcp.async_save(sd, storage_writer=w, planner=planner)
                            if not step.get("leave"):
                                fut.result()
                        else:
                            dcp.save(sd, storage_writer=w, planner=planner)
                        if op != "async_save":
                            entry["attempt_left_open"] = w.transaction is not None
                    if op == "async_save":
                        fut.result()  # (left the with block first with "leave")
            elif op in ("load", "load_stock"):
                reader = AtomicStorageReader(target, **opts) if op == "load" else dcp.FileSystemReader(target)
                got = zeroed((wide if step.get("state") == "wide" else state)(step["val"], mesh, layout))
                dcp.load(got, storage_reader=reader)
                entry["bad"] = (check_wide if step.get("state") == "wide" else check)(got, step["val"])
            elif op == "rendezvous":
                os.makedirs(step["dir"], exist_ok=True)
                open(os.path.join(step["dir"], f"{os.getpid()}"), "w").close()
                while len(os.listdir(step["dir"])) < step["count"]:
                    time.sleep(0.01)
            elif op == "barrier":
                dist.barrier()
            else:
                raise ValueError(f"unknown op {op}")
            entry["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            entry.update(ok=False, error=type(exc).__name__, message=str(exc)[-2000:])
            if isinstance(exc, CheckpointException):
                entry["failures"] = {str(r): [type(e).__name__, str(e)[:1000]] for r, (e, _) in exc.failures.items()}
            else:
                entry["trace"] = traceback.format_exc()[-3000:]
        entry["seconds"] = time.monotonic() - t0
        if step.get("plain"):  # the failed save's writer is garbage now: collect it, then look
            gc.collect()
            import atomicstore

            st = atomicstore.open_store(url, **opts)
            entry["left_after_gc"] = sorted(k for k in st.driver.find("") if step["name"] in k)
        record(entry)
    if world_n > 1:
        # every result is on disk: leave without tearing gloo down. With torch 2.4 a rank 0
        # whose peer had exited first hung in destroy_process_group() (seen in the lowest
        # cell, both jobs' rank 0 of test_two_jobs_saving_one_step_one_commits_whole, after
        # their saves had been recorded)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
