"""optimizer_states "bfloat16" / "int8": an optimizer's per-element state kept compact between
steps (`StateStore`), for any elementwise torch.optim optimizer, at any level and master mode.

The optimizer still computes in FP32: the chunked step (`stepper.step_in_chunks`) lifts a
chunk's kept state into FP32 workspace buffers (`lift`), the stand-ins step with views of
them as their state, and the new values are kept again (`lower`): bfloat16 rounded
stochastically (`rounding`), int8 block-wise (`quant`). What is kept: each floating state
tensor of its parameter's shape but the step count, of parameters with a dimension
("bfloat16"), and of those with at least `quant.MIN_NUMEL` elements ("int8"); everything else
stays in `optimizer.state` as the optimizer made it. A skipped (overflowed) step never
reaches here. Checkpoints carry the kept state in each parameter's entry of
`optimizer.state_dict()["state"]` (`STATES_KEY`, `state_checkpoint`). An FSDP2-sharded
parameter (a DTensor) has its state kept over the rank's local shard (int8 blocks per local
shard; which tensors are kept goes by the whole parameter, alike on every rank), and its
checkpoints carry FP32 state sharded like it (`states_sharded`). docs/optimizer_states.md.
"""
from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config.values import StatePrecision
from ..errors import ConfigError, InternalError
from .chunks import Workspace
from .dtensors import as_param, is_dtensor, local, local_part, shard_offset
from .quant import BLOCK, MIN_NUMEL, aligned, blocks, code_dtype, dequantize_, quantize_
from .rounding import rotation, round_with_, stream, thresholds_

logger = logging.getLogger("ampatch")

__all__ = ["StateStore", "Packed", "Piece", "STATES_KEY", "UNSIGNED", "kept_names", "check_keepable", "state_bytes"]

F32, BF16 = torch.float32, torch.bfloat16
STATES_KEY = "ampatch_states"  # a parameter's kept state, in its entry of optimizer.state_dict()["state"]
SEED_SALT = 0x57A7E5  # the state's rounding draws differ from the weights' of the same seed
# torch.optim's state that is never negative (second moments, accumulators): kept unsigned, with
# the sign bit as one more exponent bit; any other name is kept signed
UNSIGNED = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "acc_delta"})
_CONVERT_BLOCK = 1 << 20  # elements converted at a time when whole tensors are kept or restored


def check_keepable(optimizer: torch.optim.Optimizer, precision: StatePrecision) -> None:
    """Refuse an optimizer whose state cannot be kept at `precision` (ValueError naming it)."""
    if precision.stored and isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(f"optimizer_states={precision.value!r} keeps an optimizer's per-element state and steps it a "
                          "chunk of parameters at a time; torch.optim.LBFGS keeps a history of whole-model vectors and "
                          "re-evaluates a closure over all parameters at once. Use optimizer_states='float32' with "
                          "LBFGS.")


class Packed:
    """One kept state tensor: bfloat16 values of its parameter's shape; or int8 (signed) / uint8
    codes, flat, with the largest magnitude of each block of `quant.BLOCK` in `absmax` (FP32)."""

    __slots__ = ("values", "absmax")

    def __init__(self, values: torch.Tensor, absmax: torch.Tensor | None = None) -> None:
        self.values, self.absmax = values, absmax

    @property
    def signed(self) -> bool:
        return self.values.dtype != torch.uint8

    @property
    def precision(self) -> StatePrecision:
        return StatePrecision.BFLOAT16 if self.absmax is None else StatePrecision.INT8

    def block_maxima(self, a: int, b: int) -> torch.Tensor:
        """The `absmax` of the blocks holding elements a..b (a on a block): int8 state only."""
        if self.absmax is None:
            raise InternalError("ampatch: internal error: bfloat16 optimizer state has no block maxima.")
        return self.absmax[a // BLOCK:(b - 1) // BLOCK + 1]

    def nbytes(self) -> int:
        extra = 0 if self.absmax is None else self.absmax.numel() * self.absmax.element_size()
        return self.values.numel() * self.values.element_size() + extra

    def read(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Elements a..b (flat; a on a block) as FP32 into `out` (a stand-alone read: `StateStore.lift`
        reads a chunk at once)."""
        if self.absmax is None:
            return out.copy_(self.values.view(-1)[a:b])
        n = b - a
        codes = torch.zeros(aligned(n), dtype=torch.int32, device=out.device)
        codes[:n].copy_(self.values[a:b])
        full = torch.empty(aligned(n), dtype=F32, device=out.device)
        dequantize_(full, codes, self.absmax[a // BLOCK:a // BLOCK + blocks(n)], self.signed, torch.empty_like(codes))
        return out.copy_(full[:n])

    def to_float(self, shape: torch.Size) -> torch.Tensor:
        """The whole tensor in FP32, of `shape`, read a part at a time."""
        out = torch.empty(shape, dtype=F32, device=self.values.device)
        flat = out.view(-1)
        for a in range(0, flat.numel(), _CONVERT_BLOCK):
            b = min(a + _CONVERT_BLOCK, flat.numel())
            self.read(a, b, flat[a:b])
        return out


def _draws(name: str) -> int:
    """The shift of the rounding draws of the state `name` (each name its own, the same in every process)."""
    return zlib.crc32(name.encode()) & 0xFFFF


def kept_names(entries: dict, shape: torch.Size) -> list[str]:
    """The names of `entries` (a parameter's state) that are floating tensors of `shape` but the step count."""
    return [k for k, v in entries.items() if k != "step" and torch.is_tensor(v) and v.is_floating_point()
            and v.shape == shape]


@dataclass
class Piece:
    """A part (elements a..b, flat) of a kept parameter's state lifted into one chunk's buffers."""

    kept: dict[str, Packed]
    a: int
    b: int
    ordinal: int  # the parameter's place: its stream of rounding draws
    origin: int = 0  # the index, in the whole parameter, of the kept tensor's first element (a shard's)
    offset: int = 0  # where it starts in the chunk's buffers


class _Chunk:
    """One chunk's kept state on one device: per name and signedness, one FP32 buffer holding
    every piece's part (int8: each part starting on a block), and the pieces it holds."""

    def __init__(self, device: torch.device, pieces: list[Piece], align: int) -> None:
        self.device, self.pieces = device, pieces
        o = 0
        for p in pieces:
            p.offset = o
            o += -(-(p.b - p.a) // align) * align
        self.n = o
        self.slots: dict[tuple[str, bool], list[Piece]] = {}  # (name, signed) -> the pieces keeping it
        for p in pieces:
            for name, packed in p.kept.items():
                self.slots.setdefault((name, packed.signed), []).append(p)


class StateStore:
    """The kept state of one optimizer (see the module docstring); `precision` FLOAT32 keeps
    nothing (the optimizer's own state), but still reads a checkpoint's kept state back into it.
    `seed`: of the bfloat16 stochastic rounding (default: from `torch.initial_seed()`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: StatePrecision, seed: int | None = None) -> None:
        check_keepable(optimizer, precision)
        self.optimizer, self.precision = optimizer, precision
        self.kept: dict[int, dict[str, Packed]] = {}  # id(the tensor optimizer.state is keyed by) -> name -> Packed
        self.seed = (torch.initial_seed() ^ SEED_SALT) % (1 << 63) if seed is None else int(seed)
        self.rounds = 0  # steps that kept state: the stochastic rounding's shift (`rounding.rotation`)
        self.chunk_numel: int | None = None  # elements per chunk of a step; None: by device (`chunks.chunk_numel`)
        self.workspace = Workspace()  # the step's FP32 buffers (the low-memory masters bring their own)
        self.origins: dict[int, int] = {}  # id(a sharded key) -> where its local shard starts (`origin`)

    @property
    def active(self) -> bool:
        return self.precision.stored

    def names(self, key: torch.Tensor) -> list[str]:
        return list(self.kept.get(id(key), ()))

    def origin(self, key: torch.Tensor) -> int:
        """The index, in the whole of `key` flattened, of the first element this rank keeps: 0, or
        where a sharded parameter's local shard starts (its rounding draws are its elements' own)."""
        if not is_dtensor(key):
            return 0
        found = self.origins.get(id(key))
        if found is None:
            found = self.origins[id(key)] = shard_offset(key)
        return found

    def keeps(self, key: torch.Tensor, name: str) -> bool:
        """Whether a per-element state tensor `name` of the parameter `key` is kept here."""
        if not self.active or name == "step" or key.dim() == 0 or key.dtype not in (F32, BF16, torch.float16):
            return False
        return self.precision is StatePrecision.BFLOAT16 or key.numel() >= MIN_NUMEL

    def budget(self, budget: int) -> int:
        """A chunk size the kept state can be cut at: whole blocks (int8)."""
        if self.precision is StatePrecision.INT8:
            return max(BLOCK, budget // BLOCK * BLOCK)
        return budget

    def nbytes(self) -> int:
        return sum(p.nbytes() for kept in self.kept.values() for p in kept.values())

    def underflow(self) -> tuple[int, int]:
        """(elements at the bottom of their block's range, elements) of the int8 state's blocks
        that hold something: zero (signed), zero or the smallest code (unsigned): values a block
        could not hold beside its largest, or zero to begin with. `report()`'s
        `optimizer_state_underflow`, what tune names when int8 state fails."""
        zero = total = 0
        for kept in self.kept.values():
            for p in kept.values():
                if p.absmax is None or not p.values.numel():
                    continue
                held = (p.values == 0) | (p.values == -128) if p.signed else p.values <= 1  # -128: a negative zero
                n = p.values.numel()
                pad = torch.zeros(aligned(n) - n, dtype=torch.bool, device=held.device)
                per_block = torch.cat([held, pad]).view(-1, BLOCK).sum(1)
                live = p.absmax > 0
                zero += int(per_block[live].sum())
                total += int(live.sum()) * BLOCK - (aligned(n) - n if bool(live[-1]) else 0)
        return zero, total

    # ------------------------------------------------------------------ the chunked step
    def reserve(self, workspace: Workspace, chunks: Iterable[dict[torch.device, list[Piece]]]) -> None:
        """Size the workspace's buffers once for a step whose chunks hold `chunks`' pieces."""
        need: dict[torch.device, tuple[int, int]] = {}
        for chunk in chunks:
            for device, pieces in chunk.items():
                c = _Chunk(device, pieces, self._align())
                n, k = need.get(device, (0, 0))
                need[device] = (max(n, c.n), max(k, len(c.slots)))
        for device, (n, k) in need.items():
            for j in range(k):
                workspace.buffer(device, f"state{j}", n)
            workspace.buffer(device, "codes", n, torch.int32)
            workspace.buffer(device, "scratch", n, torch.int32)
            workspace.buffer(device, "absmax", n // BLOCK)

    def _align(self) -> int:
        return BLOCK if self.precision is StatePrecision.INT8 else 1

    def lift(self, device: torch.device, pieces: list[Piece], workspace: Workspace) -> tuple[_Chunk, list[dict]]:
        """The kept state of `pieces` (one chunk, on `device`) in FP32 workspace buffers; returns
        the chunk (for `lower`) and, per piece, name -> its FP32 view (flat)."""
        chunk = _Chunk(device, pieces, self._align())
        views: list[dict[str, torch.Tensor]] = [{} for _ in pieces]
        where = {id(p): i for i, p in enumerate(pieces)}
        for j, ((name, signed), members) in enumerate(chunk.slots.items()):
            buf = workspace.buffer(device, f"state{j}", chunk.n)
            parts = [buf[p.offset:p.offset + p.b - p.a] for p in members]
            kept = [p.kept[name].values.view(-1)[p.a:p.b] for p in members]
            if self.precision is StatePrecision.INT8:
                codes = workspace.buffer(device, "codes", chunk.n, torch.int32)
                absmax = workspace.buffer(device, "absmax", chunk.n // BLOCK)
                torch._foreach_copy_([codes[p.offset:p.offset + p.b - p.a] for p in members], kept)
                pads = [codes[p.offset + p.b - p.a:p.offset + aligned(p.b - p.a)] for p in members
                        if (p.b - p.a) % BLOCK]
                if pads:
                    torch._foreach_zero_(pads)  # a block's unused end is 0: it never raises the block's largest
                torch._foreach_copy_(
                    [absmax[p.offset // BLOCK:(p.offset + p.b - p.a - 1) // BLOCK + 1] for p in members],
                    [p.kept[name].block_maxima(p.a, p.b) for p in members])
                dequantize_(buf, codes, absmax, signed, workspace.buffer(device, "scratch", chunk.n, torch.int32))
            else:
                torch._foreach_copy_(parts, kept)
            for p, part in zip(members, parts):
                views[where[id(p)]][name] = part
        return chunk, views

    def lower(self, chunk: _Chunk, workspace: Workspace) -> None:
        """The chunk's FP32 state (as the step left it in the buffers) kept again."""
        if not chunk.slots:
            return
        n, device = chunk.n, chunk.device
        codes = workspace.buffer(device, "codes", n, torch.int32)
        scratch = workspace.buffer(device, "scratch", n, torch.int32)
        shifted = 0
        if self.precision is StatePrecision.BFLOAT16:
            thresholds_(codes, scratch, [(p.b - p.a, stream(self.seed, p.ordinal), p.origin + p.a)
                                         for p in chunk.pieces], rotation(self.rounds))
        for j, ((name, signed), members) in enumerate(chunk.slots.items()):
            buf = workspace.buffer(device, f"state{j}", n)
            if self.precision is StatePrecision.BFLOAT16:
                codes.add_((_draws(name) - shifted) & 0xFFFF).bitwise_and_(0xFFFF)  # each name its own draws
                shifted = _draws(name)
                round_with_(buf, codes)
                torch._foreach_copy_([p.kept[name].values.view(-1)[p.a:p.b] for p in members],
                                     [buf[p.offset:p.offset + p.b - p.a] for p in members])
                continue
            absmax = workspace.buffer(device, "absmax", n // BLOCK)
            quantized = quantize_(buf, absmax, signed, scratch)
            torch._foreach_copy_([p.kept[name].values[p.a:p.b] for p in members],
                                 [quantized[p.offset:p.offset + p.b - p.a] for p in members])
            torch._foreach_copy_([p.kept[name].block_maxima(p.a, p.b) for p in members],
                                 [absmax[p.offset // BLOCK:(p.offset + p.b - p.a - 1) // BLOCK + 1] for p in members])

    def write(self, key: torch.Tensor, name: str, a: int, b: int, value: torch.Tensor, ordinal: int) -> None:
        """Elements a..b (of its local shard, if sharded) of the state `name` of `key`, which the
        optimizer has just made (`value`, FP32), kept: the first time, the kept tensor of the
        whole parameter (its local shard) is made (zeros)."""
        kept = self.kept.setdefault(id(key), {})
        packed = kept.get(name)
        if packed is None:
            packed = kept[name] = self._empty(key, signed=name not in UNSIGNED or bool((value < 0).any()))
        piece = Piece({name: packed}, a, b, ordinal, self.origin(key))
        chunk = _Chunk(value.device, [piece], self._align())
        scratch = Workspace()  # buffers of this write's own: an optimizer makes its state once
        scratch.buffer(value.device, "state0", chunk.n).zero_()[:b - a].copy_(value.reshape(-1))
        self.lower(chunk, scratch)

    def _empty(self, key: torch.Tensor, signed: bool) -> Packed:
        mine = local(key)  # a sharded parameter's state is kept over its local shard
        if self.precision is StatePrecision.BFLOAT16:
            return Packed(torch.zeros(mine.shape, dtype=BF16, device=mine.device))
        return Packed(torch.zeros(mine.numel(), dtype=code_dtype(signed), device=mine.device),
                      torch.zeros(blocks(mine.numel()), dtype=F32, device=mine.device))

    # ------------------------------------------------------------------ whole tensors in and out
    def take_state(self, keys: Sequence[torch.Tensor], ordinals: dict[int, int]) -> None:
        """The optimizer's own per-element state of `keys` that this store keeps, kept now (at
        `initialize`, after a checkpoint loaded FP32 state), a part at a time."""
        if not self.active:
            return
        state = self.optimizer.state
        for key in keys:
            entries = state.get(key)
            if not entries:
                continue
            for name in kept_names(entries, key.shape):
                if self.keeps(key, name):
                    self.keep(key, name, entries.pop(name), ordinals.get(id(key), 0))

    def keep(self, key: torch.Tensor, name: str, value: torch.Tensor, ordinal: int) -> None:
        """The whole state tensor `name` of `key` (`value`: of its shape; a sharded one's, placed
        like it or whole), kept now in place of what was kept, a part at a time."""
        value = value.detach()
        if is_dtensor(key) or is_dtensor(value):
            value = local_part(value, key, self.origin(key))
        flat = value.reshape(-1)
        kept = self.kept.setdefault(id(key), {})
        kept[name] = self._empty(key, signed=name not in UNSIGNED or bool((flat < 0).any()))
        for a in range(0, flat.numel(), _CONVERT_BLOCK):
            b = min(a + _CONVERT_BLOCK, flat.numel())
            self.write(key, name, a, b, flat[a:b].to(F32), ordinal)

    def restore(self, keys: Iterable[torch.Tensor]) -> None:
        """Every kept tensor back into `optimizer.state` as FP32 of its parameter's shape (what
        the optimizer made; sharded like it, for a DTensor), one at a time; nothing is kept
        after (`deinitialize`)."""
        for key in keys:
            kept = self.kept.pop(id(key), None)
            if not kept:
                continue
            entries = self.optimizer.state.setdefault(key, {})
            for name in list(kept):
                entries[name] = self.as_float(key, kept.pop(name))  # each kept copy goes as its FP32 one comes
        self.kept.clear()

    def as_float(self, key: torch.Tensor, packed: Packed) -> torch.Tensor:
        """`packed` (a state tensor of `key`, as kept) in FP32 of `key`'s shape, placed like it."""
        return as_param(key, packed.to_float(local(key).shape))

    def adopt(self, key: torch.Tensor, kept: dict[str, Packed], ordinal: int) -> None:
        """A parameter's kept state from a checkpoint (checked): kept as it is where it is in this
        store's precision, else read back to FP32 (into the optimizer's state) and kept anew."""
        if self.active and all(p.precision is self.precision for p in kept.values()) and not is_dtensor(key):
            self.kept[id(key)] = kept
            return
        entries = self.optimizer.state.setdefault(key, {})  # (a sharded one's: whole, kept by its local part)
        for name, packed in kept.items():
            entries[name] = packed.to_float(key.shape)
        self.take_state([key], {id(key): ordinal})

    def entry_of(self, key: torch.Tensor) -> dict[str, Any] | None:
        """What `optimizer.state_dict()` carries of `key`'s kept state (`STATES_KEY`), aliased."""
        kept = self.kept.get(id(key))
        if not kept:
            return None
        tensors: dict[str, Any] = {}
        for name, p in kept.items():
            tensors[name] = ({"values": p.values.detach()} if p.absmax is None
                             else {"codes": p.values.detach(), "absmax": p.absmax.detach(), "signed": p.signed})
        return {"seed": self.seed, "rounds": self.rounds, "tensors": tensors}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of `optimizer`'s state tensors on this rank (a sharded DTensor's local shard): with
    `Masters.footprint`, what training holds per parameter (`Report.training_bytes_per_param`)."""
    total = 0
    for state in optimizer.state.values():
        for t in state.values():
            if torch.is_tensor(t):
                mine = local(t)  # FSDP2: the state is sharded too
                total += mine.numel() * mine.element_size()
    return total
