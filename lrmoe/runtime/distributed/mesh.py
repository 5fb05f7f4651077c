"""The expert-parallel x data-parallel device mesh (DESIGN.md §3.10): dims ``("dp", "ep")``, EP inside a node.

The world's W ranks form W/EP expert-parallel groups of EP consecutive ranks (rank = dp index x EP + ep index).
Each EP group is one copy of the model's experts: its ranks hold the slots, the placement, the optimizer shards,
and every exchange of the layer (counts all-gather, dispatch and combine all-to-alls, replica-gradient sync,
collection, redistribution) stays inside it. EP rank n of every group owns the same shard of every expert, so the
DP group of rank n (the ranks of equal ep index) sums the collected gradient shards
(:meth:`~lrmoe.runtime.distributed.replica.ReplicaStore.collect_grad_shards`), and the copies' Adam steps stay
identical. Dense parameters are reduced over the whole world, as without a mesh.

Consecutive ranks share a node (torchrun numbers them so), so an EP size that divides the ranks per node keeps
every all-to-all inside a node, where Megatron-Core, torchtitan and DeepSpeed keep it; EP = W (one group, no data
parallelism) is the layout without a mesh. What a node is comes from ``LOCAL_WORLD_SIZE`` (torchrun), else the
world is one node (the fork launcher's one machine).

:func:`process_group_count` states how many process groups a rank creates: two per rank (its EP and DP groups,
W/EP + EP in the world), where a process group per range of consecutive ranks made N(N-1)/2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from lrmoe.runtime.distributed.replica import RangeGroups

__all__ = ["Mesh", "build_mesh", "ep_problem", "ep_ranks_per_node", "local_ranks_per_node", "process_group_count",
           "resolve_ep_size"]

MESH_DIMS = ("dp", "ep")


def local_ranks_per_node(world_size: int) -> int:
    """The ranks that share this rank's node: torchrun's ``LOCAL_WORLD_SIZE``, else ``world_size`` (one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else world_size


def resolve_ep_size(ep_size: int | None, world_size: int, ranks_per_node: int) -> int:
    """The EP size a run uses: ``ep_size`` as given, else the ranks per node (the world when it fits a node)."""
    if ep_size is not None:
        return ep_size
    return world_size if world_size <= ranks_per_node else ranks_per_node


def ep_problem(ep_size: int, world_size: int, ranks_per_node: int) -> str | None:
    """Why ``ep_size`` cannot split a world of ``world_size`` ranks on nodes of ``ranks_per_node`` (None: it can).
    An EP group is one node's share (EP divides the ranks per node) or whole nodes (the ranks per node divide EP);
    anything else would give groups of different shapes."""
    if not 1 <= ep_size <= world_size or world_size % ep_size:
        return f"--ep-size {ep_size} must divide the world of {world_size} ranks"
    if world_size % ranks_per_node:
        return f"the world of {world_size} ranks is not a whole number of nodes of {ranks_per_node} ranks"
    if ranks_per_node % ep_size and ep_size % ranks_per_node:
        return (f"--ep-size {ep_size} would split nodes of {ranks_per_node} ranks unevenly: take a divisor or a "
                f"multiple of {ranks_per_node}")
    return None


def ep_ranks_per_node(ep_size: int, ranks_per_node: int) -> int:
    """The consecutive ranks of one EP group that share a node: what the planner's and cost model's
    ``ranks_per_node`` mean for the EP group's N = ``ep_size`` ranks."""
    return min(ep_size, ranks_per_node)


def process_group_count(world_size: int, ep_size: int) -> int:
    """The process groups the mesh creates in a world of ``world_size`` ranks: one per EP group and one per DP
    group (each rank belongs to one of each), none when EP is the world; the replica-gradient sync creates none."""
    return 0 if ep_size == world_size else world_size // ep_size + ep_size


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the device mesh: its EP and DP groups and the node size (see the module doc)."""

    device_mesh: object  # torch.distributed.device_mesh.DeviceMesh, dims MESH_DIMS (None: EP = the world)
    ep_size: int
    dp_size: int
    ranks_per_node: int
    groups: RangeGroups  # the layers' shared groups: the EP group and the DP group

    @property
    def ep_group(self):
        return self.groups.ep_group

    @property
    def dp_group(self):
        return self.groups.dp_group

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp_group is None else dist.get_rank(self.dp_group)

    @property
    def ep_ranks_per_node(self) -> int:
        return ep_ranks_per_node(self.ep_size, self.ranks_per_node)


def build_mesh(ep_size: int | None = None, ranks_per_node: int | None = None) -> Mesh:
    """The ``("dp", "ep")`` device mesh of the initialised world (collective: every rank calls it), EP of
    ``ep_size`` (default :func:`resolve_ep_size`) on nodes of ``ranks_per_node`` (default
    :func:`local_ranks_per_node`). ValueError when the sizes do not fit (:func:`ep_problem`)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("build_mesh needs an initialised default process group")
    world = dist.get_world_size()
    rpn = local_ranks_per_node(world) if ranks_per_node is None else ranks_per_node
    ep = resolve_ep_size(ep_size, world, rpn)
    if problem := ep_problem(ep, world, rpn):
        raise ValueError(problem)
    if ep == world:  # one EP group, no data parallelism: the world's own group, no mesh to build
        return Mesh(None, ep, 1, rpn, RangeGroups())
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=MESH_DIMS)
    return Mesh(device_mesh, ep, world // ep, rpn, RangeGroups(device_mesh.get_group("ep"),
                                                               device_mesh.get_group("dp")))
