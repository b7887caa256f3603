"""An OLMo-core-style checkpointer for PyTorch training, built on atomicstore.

Model and optimizer state go through torch.distributed.checkpoint (DCP) with atomicstore's
storage writer, so each step directory is committed whole or not at all (on local disk, S3
or GCS); the trainer's own state (step, tokens seen, data-loader position) is a small JSON
file written atomically next to it with ``Store.write_file``. ``latest_checkpoint`` only
returns a step whose model, optimizer and train state are all there.

    python examples/torch_checkpointer.py [STORE]                  # one process
    torchrun --nproc-per-node 2 examples/torch_checkpointer.py [STORE]   # two ranks (gloo)

STORE is a local directory (default: a temporary one) or an s3:// / gs:// URL.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import atomicstore
from atomicstore.integrations.torch import load, save

STEP = re.compile(r"step(\d+)")


class Checkpointer:
    """Step directories ``<root>/step<N>`` (DCP, committed by atomicstore) and train
    states ``<root>/train/step<N>.json``; every rank calls every method."""

    def __init__(self, root: str, **storage_options: Any) -> None:
        self.root = root.rstrip("/")
        self.options = storage_options
        self.store = atomicstore.open_store(self.root, **storage_options)
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def save(self, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer, train_state: dict) -> None:
        model_sd, optim_sd = get_state_dict(model, optim)
        # overwrite=True: a step committed by a run that crashed before writing its train
        # state (so never returned by latest_checkpoint) is replaced, atomically
        save({"model": model_sd, "optim": optim_sd}, f"{self.root}/step{step}", overwrite=True, **self.options)
        if self.rank == 0:  # the step counts from here on (see latest_checkpoint)
            self.store.write_file(f"train/step{step}.json", json.dumps(train_state).encode())
        if dist.is_initialized():
            dist.barrier()

    def latest_checkpoint(self) -> int | None:
        """The newest step with its model, optimizer and train state all committed."""
        steps = sorted((int(m[1]) for n in self.store.list() if (m := STEP.fullmatch(n))), reverse=True)
        for step in steps:
            try:
                self.store.read_file(f"train/step{step}.json")
            except atomicstore.NotFoundError:
                continue  # crashed between the two commits: not a checkpoint yet
            return step
        return None

    def load(self, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        load(state, f"{self.root}/step{step}", **self.options)  # in place, resharded by DCP
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return json.loads(self.store.read_file(f"train/step{step}.json"))


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def main() -> None:
    warnings.filterwarnings("ignore", module="torch.distributed")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():  # started by torchrun
        dist.init_process_group("gloo")
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckpts-")
    ckpt = Checkpointer(root)

    model, optim = make(seed=0)
    for step in (10, 20):
        train(model, optim, 10)
        ckpt.save(step, model, optim, {"step": step, "tokens_seen": step * 8 * 16})

    # a new run resumes from the latest complete checkpoint
    resumed, resumed_optim = make(seed=1)
    step = ckpt.latest_checkpoint()
    assert step == 20, step
    train_state = ckpt.load(step, resumed, resumed_optim)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values(),
                                                  strict=True))
    assert same and train_state["step"] == 20
    # optimizer moments came back too: one more step gives identical weights
    train(model, optim, 1)
    train(resumed, resumed_optim, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))
    if ckpt.rank == 0:
        print(f"resumed from step {step} of {root}: model, optimizer and train state identical: OK")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
