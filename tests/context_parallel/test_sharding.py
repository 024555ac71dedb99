"""shard() and unshard(): the load-balanced layout, its round trip, and clear errors; cp_group's own checks."""

import pytest
import torch

import attnselect
from attnselect.context_parallel import shard, unshard
from attnselect.context_parallel.ring import thd_halves


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_dense_shards_hold_chunks_r_and_2n_minus_1_minus_r(layout, n):
    s, axis = 4 * n, {"bshd": 1, "sbhd": 0, "bhsd": 2}[layout]
    view = [1, 1, 1, 1]
    view[axis] = s
    full = torch.arange(s, dtype=torch.float64).view(view).expand([s if i == axis else 2 for i in range(4)])
    shards = []
    for rank in range(n):
        local, cu = shard(full, cp_size=n, rank=rank, layout=layout)
        chunk = s // (2 * n)
        first, second = rank * chunk, (2 * n - 1 - rank) * chunk
        expected = [*range(first, first + chunk), *range(second, second + chunk)]
        assert cu is None and local.movedim(axis, 0)[:, 0, 0, 0].tolist() == expected
        shards.append(local)
    assert torch.equal(unshard(shards, layout=layout), full)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_thd_shards_cut_every_sequence_and_divide_cu_seqlens(n):
    lengths = [2 * n, 6 * n, 0, 4 * n]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    full = torch.arange(cu[-1].item(), dtype=torch.float64)[:, None, None].expand(-1, 2, 3).contiguous()
    shards = []
    for rank in range(n):
        local, local_cu = shard(full, cp_size=n, rank=rank, layout="thd", cu_seqlens=cu)
        assert local_cu.tolist() == [b // n for b in cu.tolist()] and local_cu.dtype == torch.int32
        expected = []
        for start, length in zip(cu.tolist(), lengths):
            c = length // (2 * n)
            expected += [*range(start + rank * c, start + (rank + 1) * c)]
            expected += [*range(start + (2 * n - 1 - rank) * c, start + (2 * n - rank) * c)]
        assert local[:, 0, 0].long().tolist() == expected
        shards.append(local)
    assert torch.equal(unshard(shards, layout="thd", cu_seqlens=cu), full)


def test_thd_halves_find_both_chunks_of_every_sequence_on_the_device():
    local_cu = torch.tensor([0, 2, 8, 8, 12], dtype=torch.int32)
    halves = thd_halves(local_cu, 12)
    assert halves.index[0].tolist() == [0, 2, 3, 4, 8, 9]
    assert halves.index[1].tolist() == [1, 5, 6, 7, 10, 11]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, cu: shard(x, cp_size=2, rank=0), "x.shape: got sequence length (axis 1) 6, expected a multiple"),
        (lambda x, cu: shard(x, cp_size=0, rank=0), "cp_size: got 0, expected an integer >= 1"),
        (lambda x, cu: shard(x, cp_size=3, rank=3), "rank: got 3, expected an integer in [0, 3)"),
        (lambda x, cu: shard(x, cp_size=3, rank=True), "rank: got True"),
        (lambda x, cu: shard(x, cp_size=3, rank=0, layout="bhds"), "layout: got 'bhds'"),
        (lambda x, cu: shard(x, cp_size=3, rank=0, cu_seqlens=cu), "cu_seqlens: got a tensor, expected None"),
        (lambda x, cu: shard(x[0], cp_size=2, rank=0, layout="thd"), "cu_seqlens: got None"),
        (lambda x, cu: shard(x[0], cp_size=2, rank=0, layout="thd", cu_seqlens=cu), "every sequence length 2"),
        (lambda x, cu: shard(None, cp_size=2, rank=0, layout="thd", cu_seqlens=cu), "x: got None, expected a (T, H"),
        (lambda x, cu: shard([1], cp_size=2, rank=0, layout="thd", cu_seqlens=cu), "x: got [1], expected a (T, H"),
        (
            lambda x, cu: shard(x[0], cp_size=1, rank=0, layout="thd", cu_seqlens=cu.to("meta")),
            "cu_seqlens: got tensor(dtype=torch.int32, shape=(3,)) on the meta device, expected",
        ),
        (lambda x, cu: unshard(x), "shards: got Tensor, expected a list of tensors"),
        (lambda x, cu: unshard([x, x[:, :2]]), "shards[1].shape"),
        (lambda x, cu: unshard([x, x.double()]), "shards[1].dtype: got torch.float64, expected shards[0]'s"),
        (lambda x, cu: unshard([x, x.to("meta")]), "shards[1].device: got meta, expected shards[0]'s cpu"),
        (
            lambda x, cu: unshard(
                [x[0, :3], x[0, :3, :1]], layout="thd", cu_seqlens=torch.tensor([0, 4, 6], dtype=torch.int32)
            ),
            "shards[1].shape: got (3, 1, 4), expected shards[0]'s heads",
        ),  # fmt: skip
    ],
)
def test_bad_arguments_name_the_argument(call, message):
    x = torch.zeros(1, 6, 2, 4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(attnselect.InvalidInputError) as err:
        call(x, cu)
    assert message in str(err.value)


def test_cp_group_is_refused_under_torch_compile():
    from attnselect.ops import traced_attention
    from attnselect.spec.options import CallOptions

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(attnselect.InvalidInputError, match="cp_group: got a process group under torch.compile"):
        traced_attention(q, q, q, CallOptions(cp_group=object()))
