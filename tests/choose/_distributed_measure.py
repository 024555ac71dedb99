"""Run by tests/choose/test_distributed.py: two gloo ranks tune one problem; only rank 0 may measure; each prints its
choice (a JSON line, as tests/helpers.run_group reads it)."""

import json
import os
import sys

import torch
import torch.distributed as dist

import attnselect
from attnselect.choose import measure


def main(rank: int, world: int, port: str, cache: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, ATTNSELECT_CACHE_DIR=f"{cache}/rank{rank}")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank != 0:
        measure.measure = lambda *a, **k: (_ for _ in ()).throw(AssertionError(f"rank {rank} measured"))
    p = attnselect.AttentionProblem(2, 64, 64, 4, 4, 24, 16, torch.float32, mask="causal")
    chosen = str(attnselect.select(p, target=attnselect.Target.current("cpu"), policy="measure").chosen)
    print(json.dumps({"rank": rank, "case": "choice", "chosen": chosen}), flush=True)
    dist.barrier()  # both ranks done before either tears gloo down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
