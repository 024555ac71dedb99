"""torch.distributed, where attnselect uses it: whether a process group is up, and rank 0's measurement for all."""

from __future__ import annotations


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def broadcast_from_rank_zero(entry: dict | None) -> dict:
    """Rank 0's entry on every rank, as JSON bytes in a tensor (object collectives would need numpy)."""
    import json

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.tensor(list(json.dumps(entry).encode()) if rank() == 0 else [], dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.long, device=device)
    dist.broadcast(length, src=0)
    if rank() != 0:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return json.loads(bytes(data.cpu().tolist()).decode())
