"""Training one model over several processes: a 2-D device mesh (dp x cp), FSDP2 over every rank, and each rank's
part of every global batch.

    world = distributed.World.create(dp=2, cp=2, device=device)   # torch.distributed already initialised
    distributed.shard(model, world, device, dtype)                 # fully_shard per block, then the root
    tokens_r = world.part(tokens, m, micro_batch)                  # rank's rows of micro-batch m, its sequence part

The ranks are laid out row-major on the mesh: rank = dp_rank * cp + cp_rank. The cp ranks of one dp group read
the same rows and hold two mirrored chunks of each sequence (:func:`nsa.context_parallel.shard`); the dp groups
read disjoint rows of the global batch. FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter over
all dp x cp ranks (a cp rank's gradient is that of its part of the sequence: the reduce-scatter sums them, as
torchtitan shards over dp and cp together). On a GPU in bfloat16 the mixed-precision policy keeps bfloat16
parameters for compute and reduces gradients in float32.

The loss each rank backpropagates (:func:`loss_scale`) is its summed cross-entropy over the target count of the
whole global batch, times the world size, so that FSDP's average over the ranks is the single process's mean; a
selection loss (identical on the cp ranks of one dp group, whose gather carries its gradient to every rank) is
divided by the micro-batches only (docs/training.md "Several GPUs").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nsa import context_parallel as cpar


@dataclass
class World:
    """This process's place on the dp x cp mesh."""

    dp: int
    cp: int
    rank: int
    dp_rank: int
    cp_rank: int
    cp_group: Any          # the cp ranks of this rank's dp group (a ProcessGroup)
    mesh: Any              # the 1-D mesh of every rank, FSDP's

    @property
    def size(self) -> int:
        return self.dp * self.cp

    @classmethod
    def create(cls, dp: int, cp: int, device: torch.device) -> World:
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != dp * cp:
            raise ValueError(f"parallel.dp={dp} parallel.cp={cp}: dp x cp = {dp * cp} must equal the world size "
                             f"{dist.get_world_size()}")
        grid = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        flat = init_device_mesh(device.type, (dp * cp,), mesh_dim_names=("dp_cp",))
        return cls(dp, cp, dist.get_rank(), grid.get_local_rank("dp"), grid.get_local_rank("cp"),
                   grid.get_group("cp"), flat)

    @property
    def group(self):
        """The cp group where this world splits sequences, else None (the model's ``cp_group``)."""
        return self.cp_group if self.cp > 1 else None

    def rows(self, m: int, micro: int) -> slice:
        """This rank's rows of micro-batch ``m`` (``micro`` rows a rank) of a global batch: the global batch is
        dp x grad_accum x micro rows, dp group d reading the d-th share, micro-batch by micro-batch."""
        per = self.dp * micro
        return slice(m * per + self.dp_rank * micro, m * per + (self.dp_rank + 1) * micro)

    def part(self, x: torch.Tensor, m: int, micro: int) -> torch.Tensor:
        """``x [B,T,..]`` (a global batch) -> this rank's rows of micro-batch m, its part of each sequence."""
        x = x[self.rows(m, micro)]
        return cpar.shard(x, self.cp_rank, self.cp) if self.cp > 1 else x

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over every rank, in place (and returned)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def same(self, value):
        """Rank 0's ``value`` on every rank (a decision the ranks must share: a time limit, a resumed step)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def each(self, value: float, device) -> list[float]:
        """Every rank's ``value``, in rank order."""
        t = torch.zeros(self.size, dtype=torch.float64, device=device)
        t[self.rank] = value
        return self.all_sum(t).tolist()


def blocks(model) -> list[torch.nn.Module]:
    """The model's repeated blocks, one FSDP unit each: ``LM.blocks``, or a transformers model's decoder layers."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return list(model.hf.base_model.layers)


def shard(model, world: World, device: torch.device, dtype: torch.dtype) -> None:
    """FSDP2 over ``world.mesh``: ``fully_shard`` each block, then the root (the embedding, its tied head, the last
    norm). On CUDA in bfloat16: bfloat16 parameters in compute, gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if device.type == "cuda" and dtype == torch.bfloat16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks(model):
        fully_shard(block, mesh=world.mesh, mp_policy=policy)
    fully_shard(model, mesh=world.mesh, mp_policy=policy)


def loss_scale(world: World | None, n_targets: int) -> float:
    """The factor of a rank's summed cross-entropy (module docstring): world size over the global batch's targets."""
    return (world.size if world is not None else 1) / max(1, n_targets)


def full(t):
    """A DTensor's whole value on this rank (a plain tensor as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
