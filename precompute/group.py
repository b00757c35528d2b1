"""The ranks of one stage-one run, and the collective check after each of its steps.

`Group.step` runs a function on every rank and gathers the (small) results; `Group.local`
keeps a big result (a model, a writer) in the process; both make one rank's failure an error
on every rank instead of a hang. run.py makes the group; pipeline.py's `RankRun` holds it and
basis.py uses it; it imports nothing of stage one, so that none of them imports run.py.
torch.distributed is imported only when there is more than one rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any


class Group:
    """The ranks of this run; `step` runs a function on every rank and checks them all."""

    def __init__(self, rank: int, world_size: int, init_method: str | None, timeout_s: float):
        self.rank, self.world_size = rank, world_size
        if world_size > 1:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=timeout_s)
            if init_method is not None and init_method.startswith("store://"):  # hosted by run.py's _spawn
                host, port = init_method.removeprefix("store://").rsplit(":", 1)
                store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
            else:
                dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                        timeout=timeout)

    def step(self, what: str, fn: Callable[[], Any]) -> list[Any]:
        """Run `fn` here, then gather every rank's result (keep it small: it is pickled). If any
        rank raised, every rank raises: the failing rank its own exception, the others a
        ValueError naming it."""
        return self._run(what, fn, share=True)[1]

    def local(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` here and check that every rank succeeded, as `step`; returns this rank's
        result, which never leaves the process (a model, a writer, kept rows)."""
        return self._run(what, fn, share=False)[0]

    def _run(self, what: str, fn: Callable[[], Any], *, share: bool) -> tuple[Any, list[Any]]:
        error: BaseException | None = None
        result = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
            error = e
        if self.world_size == 1:
            if error is not None:
                raise error
            return result, [result]
        import torch.distributed as dist

        report = None if error is None else f"{type(error).__name__}: {error}"
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (report, result if share and error is None else None))
        if error is not None:
            raise error
        for rank, (failure, _) in enumerate(gathered):
            if failure is not None:
                raise ValueError(f"rank {rank} failed while {what}: {failure}")
        return result, [payload for _, payload in gathered]

    def close(self, *, together: bool) -> None:
        """together (every rank finished): leave at a barrier first, so that no rank tears
        down its connections while another still waits on them. After a failure no barrier: a
        rank that died would make the others wait for the whole timeout. The rendezvous store
        lives outside the ranks (torchrun's agent, or the process that spawned them), so it
        outlasts every rank's teardown."""
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_initialized():  # vLLM's engine may have destroyed it (run.py)
            import gc

            if together:
                dist.barrier()
            gc.collect()  # a process group kept alive by a reference cycle would be torn down at exit
            dist.destroy_process_group()


__all__ = ["Group"]
