"""`apex.parallel.multiproc`: Apex's old one-process-per-GPU launcher
(`python -m apex.parallel.multiproc script.py`). Not provided: `torchrun` is PyTorch's launcher,
and `main()` (or running the module) says so instead of launching anything."""
from __future__ import annotations

from ampatch.errors import NotSupportedError

__all__ = ["main"]

_MESSAGE = ("apex.parallel.multiproc is Apex's old launcher and is not provided by ampatch; launch with PyTorch's: "
            "torchrun --nproc_per_node=N script.py (it sets RANK, LOCAL_RANK and WORLD_SIZE).")


def main() -> None:
    """Raise: use `torchrun --nproc_per_node=N script.py`."""
    raise NotSupportedError(_MESSAGE)


if __name__ == "__main__":
    main()
