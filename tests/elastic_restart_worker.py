"""A rank under `torchrun --max-restarts 1` (tests/test_distributed.py): it starts its process
group through offloadpp's init_from_env, all-reduces once, and in the first attempt rank 1 dies
(SIGKILL); in the second, rank 1 starts its group seconds after rank 0, so rank 0 reads the
store before rank 1 has written its address (a dead group's address, unless each attempt has
keys of its own)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from offloadpp.runtime.dp.distributed import init_from_env

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(3)
init_from_env("cpu")
t = torch.ones(1)
dist.all_reduce(t)
print(f"attempt {attempt} rank {rank} sum {t.item():.0f}", flush=True)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier() if attempt == 1 else time.sleep(30)  # (attempt 0's rank 0 is stopped by the agent)
dist.destroy_process_group()
