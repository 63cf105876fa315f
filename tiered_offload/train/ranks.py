"""``tiered-offload train`` under torchrun: one run over the ranks.

``torchrun --nproc_per_node N -m tiered_offload train --config run.yaml`` starts N processes with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set. :class:`Ranks` reads them, joins the process group
(gloo on CPUs; NCCL for CUDA tensors, gloo for CPU ones, on GPUs) and gives the run what it needs
of the others:

* the engine shards the training state (each rank its slice in ``storage/rank-R-of-N``, weights
  all-gathered per block, gradients reduce-scattered as their mean: ``engine/sharding.py``);
* each rank trains its own micro-batches of a step: micro-batch ``m`` of step ``s`` on rank ``r`` is
  micro-batch ``(s * grad_accum + m) * N + r`` of the run's one seeded order, so a step trains the
  sequences one process would with ``grad_accum * N`` micro-batches, and the mean of the ranks'
  gradients is that process's accumulated gradient (to rounding: the ranks add in another order);
* the tokenised data is made once per machine (local rank 0; the others wait, then read the cache);
* the ranks agree when to stop (a signal on one stops every one after the same step), what a
  step's record says (their mean loss, their tokens and disk bytes added: rank 0 writes
  ``metrics.jsonl``), and split the evaluation (each held-out sequence once, every rank the same
  number of forwards, as the sharded engine needs);
* rank 0 alone writes what is not the engine's: the tokenizer beside an export, the metrics, the
  progress bars.

In one process (no ``WORLD_SIZE``, or 1) every method is the single-process answer.
"""

from __future__ import annotations

import os

import torch

from offload_core.errors import DistributedError

__all__ = ["Ranks"]


class Ranks:
    """This process's place among the run's ranks (a context: joins the process group, and leaves
    it at the end where it joined it)."""

    def __init__(self):
        import torch.distributed as dist
        joined = dist.is_available() and dist.is_initialized()  # (a caller's own group: the engine shards over it)
        self.world = dist.get_world_size() if joined else int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = (dist.get_rank() if joined else int(os.environ.get("RANK", "0"))) if self.world > 1 else 0
        self.local = int(os.environ.get("LOCAL_RANK", self.rank)) if self.world > 1 else 0
        self._joined = False

    @property
    def first(self) -> bool:
        """Rank 0: it writes what belongs to the run, not to a rank."""
        return self.rank == 0

    def __enter__(self) -> "Ranks":
        if self.world > 1:
            import torch.distributed as dist
            if not dist.is_initialized():
                if torch.cuda.is_available():  # (before NCCL's first use: each rank its own GPU, not GPU 0)
                    torch.cuda.set_device(self.local)
                dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
                self._joined = True
        return self

    def __exit__(self, *exc) -> None:
        if self._joined:
            import torch.distributed as dist
            dist.destroy_process_group()
            self._joined = False

    def _collective(self, what: str, call, *args) -> None:
        try:
            call(*args)
        except RuntimeError as e:  # (gloo's and NCCL's: a peer's connection closed)
            raise DistributedError(f"rank {self.rank} of {self.world}: {what} failed ({e}); another rank probably "
                                   f"stopped (crashed, was killed, or raised an error: see its log)") from e

    def barrier(self, what: str = "waiting for the other ranks") -> None:
        if self.world > 1:
            import torch.distributed as dist
            self._collective(what, dist.barrier)

    def once_per_machine(self, make):
        """``make()`` on local rank 0 first, then (it having written what it makes) on the others;
        where it fails on local rank 0, the others try it too (and fail alike, not waiting)."""
        if self.local == 0:
            try:
                return make()
            finally:
                self.barrier("preparing the data")
        self.barrier("preparing the data")
        return make()

    def sums(self, values: list[float]) -> list[float]:
        """Each of ``values`` added over the ranks (in float64)."""
        if self.world == 1:
            return list(values)
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.float64)
        self._collective("adding the ranks' figures", dist.all_reduce, t)
        return t.tolist()

    def micro_batch(self, step: int, micro: int, grad_accum: int) -> int:
        """The index, in the run's order of micro-batches, of this rank's micro-batch ``micro`` of ``step``."""
        return (step * grad_accum + micro) * self.world + self.rank

    def eval_rows(self, n: int, micro_batch: int):
        """``rows`` for each evaluation forward of this rank (every rank the same number; one with no
        rows left runs its forward on row 0 and counts none of it)."""
        per = micro_batch * self.world
        for a in range(0, n, per):
            start = a + self.rank * micro_batch
            yield list(range(start, min(n, start + micro_batch)))
