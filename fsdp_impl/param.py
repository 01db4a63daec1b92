"""ShardedParam: one original parameter, sharded on dim 0 as a DTensor, and its unsharded twin.

Two nn.Parameters stand for one original parameter, and the modules that own it (two or more when
it is tied) point at one or the other:

    sharded    nn.Parameter(DTensor), Shard(0) over the shard group's DeviceMesh, the original
               dtype; what the optimizer holds, what ``named_parameters()`` and ``state_dict()``
               give between steps (under the original names), and where the reduced gradient
               lands (``sharded.grad``, a DTensor alike). Its local tensor is the first rows of
               a padded 1D buffer of c rows (``padded``; c = ceil(rows / W), zero rows after
               this rank's own), so every rank hands the all-gather the same number of elements.
    unsharded  a plain nn.Parameter of the original shape in ``param_dtype``, a view of a 1D
               buffer of W x c rows that the all-gather fills (the first rows are the
               parameter, the tail is the ranks' padding). It is the leaf autograd accumulates
               the gradient into. Made at the first unshard and kept: resharding frees its storage
               (resize to 0 bytes) and unsharding refills the same storage, so tensors that
               autograd saved in forward see the data again in backward.

[Note: another shard dimension] ``shard_dim`` d > 0 (``fully_shard(shard_placement_fn=...)``, FSDP2's
``Shard(d)``): rank r holds the slice ``[r x c, (r + 1) x c)`` of dim d, c = size(d) / W (d must divide
evenly, as FSDP2 requires), contiguous in ``padded`` (no padding rows). The all-gather and the gradient
reduction move the same W equal chunks as for dim 0; only the copy between a chunk and the full
parameter differs: the full parameter viewed as (..., W, c, ...) with the W axis moved first is the W
chunks (``by_rank``), so copy-out, the gradient's chunks and the full state dict go through that view.

[Note: why a parameter of its own storage] Each unsharded parameter is its own allocation, as
fresh as the plain model's, so the kernels that run on it (BLAS picks code paths by pointer
alignment) compute bit for bit what they compute on the plain model: world size 1 is bitwise
the plain model with no alignment rule of our own. The price is one copy out of the all-gather
buffer per unshard, as FSDP2 pays.
"""

from __future__ import annotations

import math
from enum import Enum, auto

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .sharding import chunk_rows, row_range


class ShardState(Enum):
    SHARDED = auto()  # the modules point at the sharded DTensor parameter; no unsharded storage
    UNSHARDED = auto()  # the modules point at the unsharded parameter, whose storage holds every row


class Owner:
    """One (module, attribute) that refers to a parameter; tied parameters have several owners."""

    __slots__ = ("module", "name", "fqn")

    def __init__(self, module: nn.Module, name: str, fqn: str):
        self.module, self.name, self.fqn = module, name, fqn


class ShardedParam:
    def __init__(
        self,
        param: nn.Parameter,
        owners: list[Owner],
        mesh,
        rank: int,
        world_size: int,
        param_dtype: torch.dtype | None,
        shard_dim: int = 0,
        offload=None,
    ):
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard: parameter '{owners[0].fqn}' is 0-dimensional; fsdp_impl shards "
                f"every parameter on dim 0 (view it as shape (1,) in the model)"
            )
        if not 0 <= shard_dim < param.dim() or (shard_dim and param.shape[shard_dim] % world_size):
            raise ValueError(
                f"fully_shard: parameter '{owners[0].fqn}' of shape {tuple(param.shape)} cannot be "
                f"sharded on dim {shard_dim} over {world_size} ranks (a dim other than 0 must exist "
                f"and divide evenly)"
            )
        self.dim = shard_dim  # the dimension sharded (see [Note: another shard dimension])
        self.owners = owners  # the first owner's name is the parameter's name (as named_parameters gives it)
        self.fqn = owners[0].fqn  # relative to the unit's module
        self.shape = param.shape
        # `device`: where forward and backward run (the unsharded parameter); the padded shard lives there too
        # unless `offload` (an offload.CPUOffloadPolicy) puts it in host memory
        self.dtype, self.device, self.requires_grad = param.dtype, param.device, param.requires_grad
        self.offload = offload
        self.param_dtype = param_dtype or param.dtype  # of the unsharded parameter and its gradient
        # passes without the reduction under a wider reduction dtype: their gradients summed in it (ParamGroup.hold_grads)
        self.held_grad: torch.Tensor | None = None
        self.mesh, self.rank, self.world_size = mesh, rank, world_size
        self.rows = param.shape[0]
        self.row_numel = math.prod(param.shape[1:])
        size = param.shape[shard_dim]
        self.chunk = chunk_rows(size, world_size)  # slices of dim `dim` in every rank's padded chunk
        self.start, self.end = row_range(size, world_size, rank)  # this rank's slices of dim `dim`
        self.shard_numel = self.chunk * param.numel() // max(size, 1)  # 1D length of the padded shard
        self.stride = _contiguous_stride(param.shape)
        padded = torch.zeros(self.shard_numel, dtype=self.dtype, device=param.device)
        if not param.is_meta:
            with torch.no_grad():
                padded[: self.local_numel].copy_(
                    param.detach().narrow(shard_dim, self.start, self.end - self.start).reshape(-1)
                )
        self._set_sharded(self._stored(padded))
        self._unsharded_data: torch.Tensor | None = None  # 1D, W x c rows, param_dtype
        self.unsharded: nn.Parameter | None = None
        self.state = ShardState.SHARDED
        self.set_on_modules(self.sharded)

    # -- shapes --------------------------------------------------------------------------------
    @property
    def local_numel(self) -> int:
        return self.local_shape.numel()

    @property
    def local_shape(self) -> torch.Size:
        shape = list(self.shape)
        shape[self.dim] = self.end - self.start
        return torch.Size(shape)

    def by_rank(self, full: torch.Tensor) -> torch.Tensor:
        """A view of `full` (the parameter's shape; dim 0's padded to W x c rows where it is the dim sharded) as
        its W chunks: (W, padded shard) for dim 0, (W, *local shape) for another dim."""
        if self.dim == 0:
            return full.view(self.world_size, self.shard_numel)
        shape = list(self.shape)
        shape[self.dim : self.dim + 1] = [self.world_size, self.chunk]
        return full.view(shape).movedim(self.dim, 0)

    def chunks(self, grad: torch.Tensor) -> torch.Tensor:
        """A full-shape gradient as the 2D tensor whose dim-0 chunks (``torch._chunk_cat``, W chunks) are the
        ranks' shards: (rows, row) for dim 0 (the last chunks padded), (W, shard) for another dim (a copy)."""
        if self.dim == 0:
            return grad.reshape(self.rows, self.row_numel)
        return self.by_rank(grad).reshape(self.world_size, -1)

    def assemble(self, ranks: torch.Tensor) -> torch.Tensor:
        """The full parameter (a new tensor) from its W padded shards, `ranks` (W, padded shard)."""
        if self.dim == 0:
            return ranks.reshape(-1)[: self.shape.numel()].view(self.shape).clone()
        full = torch.empty(self.shape, dtype=ranks.dtype, device=ranks.device)
        self.by_rank(full).copy_(ranks.view(self.world_size, *self.local_shape))
        return full

    # -- the sharded parameter ------------------------------------------------------------------
    def _set_sharded(self, padded: torch.Tensor) -> None:
        """Make the sharded nn.Parameter over `padded` (1D, shard_numel): its local tensor is a view
        of the first rows, so whatever the optimizer writes into it is what the next gather sends."""
        self.padded = padded
        self.sharded = nn.Parameter(
            self.to_dtensor(padded[: self.local_numel].view(self.local_shape)), requires_grad=self.requires_grad
        )
        self.sharded._fsdp_managed = True  # an ancestor's fully_shard must not take it again

    def to_dtensor(self, local: torch.Tensor) -> DTensor:
        """A local tensor of this rank's rows (the parameter's or its gradient's) as the DTensor, made as FSDP2
        makes its sharded parameters: wrapped where it is (``from_local`` would copy an offloaded shard, host
        memory under a device mesh, to the mesh's device) and without ``from_local``'s autograd function, which
        costs more than the optimizer's update of a small parameter and records nothing (no gradient flows
        through a shard or a reduced gradient)."""
        meta = TensorMeta(self.shape, self.stride, local.dtype)
        with torch.no_grad():
            return DTensor(local, DTensorSpec(self.mesh, (Shard(self.dim),), tensor_meta=meta), requires_grad=False)

    def local(self) -> torch.Tensor:
        """This rank's rows of the sharded parameter (a view of ``padded``)."""
        return self.sharded._local_tensor

    def _stored(self, padded: torch.Tensor) -> torch.Tensor:
        """`padded` where shards are kept: host memory under an offload policy, else where it is."""
        return padded if self.offload is None or padded.is_meta else self.offload.host(padded)

    def replace_padded(self, padded: torch.Tensor) -> None:
        """A new padded shard (another device, after meta init): a new sharded Parameter, set on the
        owners when they point at the sharded one. An optimizer made before holds the old one. Under an
        offload policy the shard is kept in host memory and `padded`'s device is where compute runs."""
        self.device = padded.device
        self._set_sharded(self._stored(padded))
        self._unsharded_data, self.unsharded = None, None
        if self.state is ShardState.SHARDED:
            self.set_on_modules(self.sharded)

    # -- unshard / reshard ----------------------------------------------------------------------
    def alloc_unsharded(self) -> torch.Tensor:
        """The unsharded buffer as its W chunks (``by_rank``: (W, c x row) for dim 0) for the all-gather's
        copy-out: made on first use, its storage reallocated after a reshard."""
        if self._unsharded_data is None:
            data = torch.empty(self.world_size * self.shard_numel, dtype=self.param_dtype, device=self.device)
            self._unsharded_data = data
            self.unsharded = nn.Parameter(
                torch.as_strided(data, self.shape, self.stride, 0), requires_grad=self.requires_grad
            )
            self.unsharded._fsdp_managed = True
        else:
            storage = self._unsharded_data.untyped_storage()
            nbytes = self._unsharded_data.numel() * self._unsharded_data.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        if self.dim == 0:
            return self._unsharded_data.view(self.world_size, self.shard_numel)
        return self.by_rank(self._unsharded_data.view(self.shape))

    def to_unsharded(self) -> None:
        """After the copy-out: the modules point at the unsharded parameter."""
        self.set_on_modules(self.unsharded)
        self.state = ShardState.UNSHARDED

    def to_sharded(self) -> None:
        """The modules point at the sharded parameter; the unsharded storage is freed (its gradient,
        if any, is kept: accumulation with the reduction switched off)."""
        self.set_on_modules(self.sharded)
        if self._unsharded_data is not None:
            self._unsharded_data.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    def unsharded_nbytes(self) -> int:
        """Bytes the unsharded storage holds now (0 when resharded)."""
        return 0 if self._unsharded_data is None else self._unsharded_data.untyped_storage().nbytes()

    def set_on_modules(self, param: nn.Parameter) -> None:
        for o in self.owners:
            if type(o.module).__setattr__ is nn.Module.__setattr__:
                o.module._parameters[o.name] = param  # the registered slot: no checks, no reordering
            else:
                setattr(o.module, o.name, param)

    # -- gradients ------------------------------------------------------------------------------
    def unsharded_grad(self) -> torch.Tensor | None:
        return None if self.unsharded is None else self.unsharded.grad

    def add_reduced_grad(self, padded_grad: torch.Tensor) -> None:
        """`padded_grad`: this rank's reduced chunk (1D, shard_numel, the sharded dtype). Its first
        rows become (or are added to) the sharded gradient; the padding rows are dropped."""
        local = padded_grad[: self.local_numel].view(self.local_shape)
        if local.device != self.padded.device:  # offloaded: the gradient lives beside its shard
            local = self.offload.host(local)
        grad = self.sharded.grad
        if grad is None:
            self.sharded.grad = self.to_dtensor(local)
        else:
            with torch.no_grad():
                grad._local_tensor.add_(local)

    # -- whole-parameter access -----------------------------------------------------------------
    def load_full_(self, value: torch.Tensor) -> None:
        """Copy this rank's rows of the full `value` into the sharded parameter (no collective)."""
        with torch.no_grad():
            self.local().copy_(value.detach().reshape(self.shape).narrow(self.dim, self.start, self.end - self.start))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
