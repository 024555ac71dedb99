"""torch.distributed where attnselect uses it (attnselect.choose.distributed): rank 0's measurement for every rank."""

from __future__ import annotations

import os

from attnselect.choose import distributed


def test_a_process_without_a_group_or_alone_in_one_is_not_distributed(tmp_path):
    import torch.distributed as dist

    assert not distributed.is_distributed()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert not distributed.is_distributed() and distributed.rank() == 0
        entry = {"chosen": "sdpa_flash padded to 24", "timings": {"sdpa_math native": [1.5, 1.0, 2.0]}}
        assert distributed.broadcast_from_rank_zero(entry) == entry  # through the tensors, as JSON
    finally:
        dist.destroy_process_group()
    assert not distributed.is_distributed()


def test_ranks_share_rank_zeros_measurement(tmp_path):
    from helpers import run_group

    reports = run_group(
        os.path.join(os.path.dirname(__file__), "_distributed_measure.py"), 2, str(tmp_path), timeout=180
    )
    assert reports[0, "choice"]["chosen"] == reports[1, "choice"]["chosen"]
