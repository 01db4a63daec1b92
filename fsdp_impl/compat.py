"""FSDP2's arguments to ``fully_shard``, in fsdp_impl's terms.

mesh              a 1-D DeviceMesh: shard over its group, the parameters DTensors on that very mesh; a
                  2-D (replicate, shard) mesh (FSDP2's HSDP, dim 0 replicates, dim 1 shards): shard over
                  dim 1's group, replicate across dim 0's (the layout ``hybrid_groups`` makes)
mp_policy         FSDP2's MixedPrecisionPolicy: its param_dtype and reduce_dtype (None: fsdp_impl's default,
                  one step wider than the gradient, where FSDP2 reduces in param_dtype)
offload_policy    FSDP2's OffloadPolicy() (no offload) or CPUOffloadPolicy(pin_memory)
ignored_params,   refused where they would change anything (a ValueError naming them)
dp_mesh_dims
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .mixed_precision import MixedPrecisionPolicy
from .offload import CPUOffloadPolicy


def groups_from_mesh(mesh) -> tuple[object, object, DeviceMesh | None]:
    """(shard group, replicate group or None, the DeviceMesh to place the DTensors on or None: one made
    from the shard group) for FSDP2's `mesh`."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard: mesh must be a DeviceMesh, not {type(mesh).__name__}")
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        # DTensor places this rank's rows by its mesh coordinate, fsdp_impl and the collectives by its group rank
        coordinate = mesh.get_coordinate()
        if coordinate is None or coordinate[0] != dist.get_rank(group):
            raise ValueError(
                f"fully_shard: this rank sits at position {coordinate} of the mesh but is rank "
                f"{dist.get_rank(group)} of its process group; give a mesh in its group's rank order"
            )
        return group, None, mesh
    if mesh.ndim == 2:  # FSDP2's HSDP: (replicate, shard), whatever the dims are named
        return mesh.get_group(1), mesh.get_group(0), None
    raise ValueError(f"fully_shard: mesh must be 1-D (FSDP) or 2-D (replicate, shard: HSDP), not {mesh.ndim}-D")


def as_mp_policy(policy) -> MixedPrecisionPolicy | None:
    """fsdp_impl's policy for ours or FSDP2's (``torch.distributed.fsdp.MixedPrecisionPolicy``)."""
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if not isinstance(policy, TorchPolicy):
        raise ValueError(
            f"fully_shard: mp_policy must be a MixedPrecisionPolicy (fsdp_impl's or FSDP2's), not {policy!r}"
        )
    if policy.output_dtype is not None:
        raise ValueError(
            "fully_shard: MixedPrecisionPolicy.output_dtype is not supported by fsdp_impl "
            "(cast the output in the model)"
        )
    if not policy.cast_forward_inputs and policy.param_dtype is not None:
        raise ValueError(
            "fully_shard: MixedPrecisionPolicy(cast_forward_inputs=False) is not supported by "
            "fsdp_impl (a unit casts its floating inputs to param_dtype)"
        )
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)


def as_offload_policy(policy) -> CPUOffloadPolicy | None:
    """fsdp_impl's offload policy (or None) for ours or FSDP2's (``OffloadPolicy()``: none;
    ``CPUOffloadPolicy(pin_memory)``)."""
    if policy is None or isinstance(policy, CPUOffloadPolicy):
        return policy
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPU
    from torch.distributed.fsdp import OffloadPolicy

    if isinstance(policy, TorchCPU):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if type(policy) is OffloadPolicy:
        return None
    raise ValueError(
        f"fully_shard: offload_policy must be a CPUOffloadPolicy (fsdp_impl's or FSDP2's) or None, not {policy!r}"
    )


def refuse_unsupported(module, ignored_params, dp_mesh_dims) -> None:
    """A ValueError for FSDP2's arguments fsdp_impl has no counterpart of."""
    if isinstance(module, (list, tuple)):
        raise ValueError(
            "fully_shard: fsdp_impl shards one module per call, not a list of modules "
            "(FSDP2's grouping of several modules into one unit is not supported)"
        )
    if ignored_params:
        raise ValueError(
            "fully_shard: ignored_params is not supported by fsdp_impl (every parameter of a unit "
            "is sharded; a frozen one, requires_grad_(False), is gathered with the rest and never "
            "reduced)"
        )
    if dp_mesh_dims is not None:
        raise ValueError(
            "fully_shard: dp_mesh_dims (an SPMD mesh) is not supported by fsdp_impl; pass its "
            "data-parallel mesh (1-D, or 2-D replicate x shard)"
        )
