"""A tied embedding's gradient between the first and the last stage trainer.

With tied embeddings the LM head *is* the embedding matrix, so stage 0 (the lookup) and the last
stage (the head) both hold it, both train it and both step it with the same AdamW update: their
copies stay equal only if both get the same gradient, and the update stays the one-process update
only if that gradient is summed as one process sums it (below).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class TiedGradients:
    """A tied embedding's gradient on both ends, summed as one process sums it.

    One process adds, per micro-batch, the head's and the lookup's contributions into one
    gradient g_i (autograd sums a leaf's incoming gradients before accumulating them), then
    accumulates g_0 + g_1 + ... Here the last stage computes the head's part h_i and stage 0 the
    lookup's e_i. Summing the two ends' totals instead ((e_0 + e_1) + (h_0 + h_1)) rounds
    differently, and AdamW turns that rounding into visible differences where a gradient is
    near zero. So, per micro-batch, the last stage sends h_i as its backward makes it, stage 0
    adds it to its e_i and keeps the running sum, and at the end both hold that sum."""

    def __init__(self, embedding: torch.nn.Parameter, first: bool, last_rank: int, group: Any):
        self.embedding = embedding
        self.first = first
        self.last_rank = last_rank
        self.group = group
        self.total: torch.Tensor | None = None
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.handle = embedding.register_post_accumulate_grad_hook(self._take)

    def _take(self, parameter: torch.Tensor) -> None:
        part = parameter.grad
        assert part is not None
        parameter.grad = None  # the next micro-batch's part arrives alone
        if not self.first:
            self.sends.append((dist.isend(part, dst=0, group=self.group), part))
            return
        head = torch.empty_like(part)
        dist.recv(head, src=self.last_rank, group=self.group)
        step = head + part
        self.total = step if self.total is None else self.total.add_(step)

    def close(self) -> None:
        self.handle.remove()
        for work, _ in self.sends:
            work.wait()

    def finish(self) -> None:
        """Both ends hold the accumulated gradient."""
        total = self.total if self.first else torch.empty_like(self.embedding)
        assert total is not None, "stage 0 saw no gradient of its embedding"
        dist.broadcast(total, src=0, group=self.group)
        self.embedding.grad = total
