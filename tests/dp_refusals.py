"""One rank of a run offloadpp must refuse (tests/test_distributed.py): prints the refusal.

python dp_refusals.py nodes      # ranks that say their nodes run different numbers of ranks
torchrun ... dp_refusals.py plans NVME   # ranks given different settings
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    import torch.distributed as dist

    from offloadpp.runtime.dp.distributed import DataParallel, DistributedError, init_from_env

    mode = sys.argv[1]
    try:
        if mode == "nodes":
            init_from_env("cpu")
            DataParallel()
        else:
            from dp_common import tiny_gpt2

            from offloadpp.assemble import assemble_engine
            from offloadpp.planner import Settings
            from offloadpp.runtime import RuntimeConfig

            rank = int(os.environ["RANK"])
            settings = Settings(prefetch_depth=1 + rank)  # the ranks disagree
            cfg = RuntimeConfig(nvme_paths=[sys.argv[2]], settings=settings, device="cpu", ssd_read_gbps=2.0,
                                ssd_write_gbps=2.0, log_every=0)  # fmt: skip
            assemble_engine(tiny_gpt2(), cfg).close()
    except DistributedError as e:
        print(f"REFUSED: {e}", flush=True)
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print("NOT REFUSED", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
