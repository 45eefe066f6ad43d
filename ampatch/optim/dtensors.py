"""FSDP2's DTensors as one rank sees them: a parameter's (or its optimizer state's) local
shard, a local tensor placed like a parameter again, and where a shard starts in its whole
parameter. Shared by the sharded low-memory masters (`lowmem_sharded`), the chunked step
(`stepper`) and the kept optimizer state (`states`, `states_sharded`).

`torch.distributed.tensor` is never imported here: where no sharded model imported it, no
tensor is a DTensor and every helper hands its argument back as it is.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, PlatformError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["dtensor_class", "is_dtensor", "local", "as_param", "shard_offset", "local_part"]

CHUNKED = ("the chunked step (master_weights 'stochastic'/'kahan', optimizer_states 'bfloat16'/'int8')",
           "use master_weights=True and optimizer_states='float32'")


def dtensor_class() -> type[DTensor] | None:
    """DTensor, where torch.distributed.tensor was imported already (a sharded model)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """A DTensor's local shard (a view: writing it writes the DTensor); anything else as it is."""
    return t.to_local() if is_dtensor(t) else t


def as_param(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (`p`'s local shape) as a tensor placed like `p` (a DTensor over its mesh), no copy."""
    cls = dtensor_class()
    if cls is None or not isinstance(p, cls):
        return values
    return cls.from_local(values, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def shard_offset(p: torch.Tensor, what: tuple[str, str] = CHUNKED) -> int:
    """The index, in `p` flattened, of its local shard's first element: FSDP2 shards dim 0 as
    `torch.chunk` does (each mesh coordinate a run of whole rows); replicated mesh dims hold
    the same rows. Raises for any other placement (`what`: who needs whole rows, and the fix)."""
    cls = dtensor_class()
    if cls is None or not isinstance(p, cls):
        return 0
    coordinate: Sequence[int] = p.device_mesh.get_coordinate() or ()
    rows, start, sharded = (p.shape[0] if p.dim() else 1), 0, False
    for dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard(dim=0) or sharded:
            raise ConfigError(f"{what[0]} steps FSDP2 shards of whole rows (Shard(0), replicated or not); a parameter "
                              f"of shape {tuple(p.shape)} is placed {p.placements}: {what[1]}.")
        sharded = True
        size = p.device_mesh.size(dim)
        start = coordinate[dim] * -(-rows // size)
    mine = local(p)
    if mine.numel() and mine.shape[0] != min(rows, start + mine.shape[0]) - start:
        raise PlatformError(f"ampatch: the local shard of a parameter of shape {tuple(p.shape)} is not the rows FSDP2 "
                            "gives it (torch.chunk on dim 0); this torch shards otherwise.")
    return min(start, rows) * (p.numel() // rows if rows else 0)


def local_part(value: torch.Tensor, p: torch.Tensor, offset: int) -> torch.Tensor:
    """The part of a saved tensor of `p`'s (global) shape that lines up with `p`'s local shard:
    a DTensor's local shard where it is placed like `p`, else the rows from `offset` of the
    whole (a DTensor placed otherwise is gathered first: a collective, as every rank loads)."""
    cls = dtensor_class()
    mine = local(p)
    if cls is not None and isinstance(value, cls):
        if isinstance(p, cls) and value.placements == p.placements and value.device_mesh == p.device_mesh:
            return value.to_local().to(mine.device)
        value = value.full_tensor()
    return value.reshape(-1)[offset:offset + mine.numel()].view(mine.shape).to(mine.device)
