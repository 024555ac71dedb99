"""Context parallelism: one long sequence, or a long pack, split over a process group.

``attnselect.attention(q, k, v, cp_group=group)`` takes this rank's shard in the load-balanced layout
(:mod:`attnselect.context_parallel.sharding`) and returns this rank's shard of the output; the p2p ring in
:mod:`attnselect.context_parallel.ring` runs each chunk pair on attnselect's own choice. :func:`shard` and
:func:`unshard` go between full tensors and shards. docs/context_parallel.md has the design and its cost model.
"""

from attnselect.context_parallel.sharding import shard, unshard

__all__ = ["shard", "unshard"]
