"""Which samples each process sees at each micro-step: deterministic, layout-independent, resumable, bucketed.

Epoch `e` visits a permutation of the dataset drawn from (seed, e). Samples are grouped into buckets by
the shape they will have (their `keys`: samples batched together must agree on it). Each bucket's samples,
in permutation order, are cut into optimizer steps of `world_size * batch_size * accumulation` samples; a
bucket's last step may hold fewer (a smaller final batch: nothing is dropped or repeated). The steps of all
buckets are then put in an order drawn from (seed, e) (with one bucket: their natural order). Process `r`
takes its micro-batches from each step's group.

Because a step never mixes buckets, every layout of processes x batch x accumulation sees the same samples
in the same steps: one process with accumulation 2 and two processes with batch 1 and one process with batch
2 train alike, and a resumed run continues at the exact position (epoch, step). Micro-batches of a partial
step can be unequal (or empty); `micro_batches` says the step's size so the loop can weight them so the step's
gradient is the mean over its samples whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class EpochPlan:
    dataset_len: int
    seed: int
    world_size: int = 1
    rank: int = 0
    batch_size: int = 1
    accumulation: int = 1
    shuffle: bool = True
    keys: Sequence | None = None  # bucket key per dataset index (None: one bucket)

    @property
    def group(self) -> int:
        return self.world_size * self.batch_size * self.accumulation

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(epoch))
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def buckets(self, order: list[int] | None = None) -> dict:
        """{key: dataset indices in `order`}, buckets in the order their first sample appears."""
        order = list(range(self.dataset_len)) if order is None else order
        out: dict = {}
        for i in order:
            out.setdefault(None if self.keys is None else self.keys[i], []).append(i)
        return out

    def steps(self, epoch: int) -> list[list[int]]:
        """Every optimizer step of the epoch: the dataset indices it trains on (one bucket each)."""
        chunks = [members[k:k + self.group] for members in self.buckets(self.order(epoch)).values()
                  for k in range(0, len(members), self.group)]
        if self.shuffle and len(chunks) > 1 and self.keys is not None and len(set(self.keys)) > 1:
            g = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(epoch) + 7_777_777)
            chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]
        return chunks

    def steps_per_epoch(self) -> int:
        """The same every epoch: each bucket gives ceil(size / group) steps."""
        return sum(-(-len(m) // self.group) for m in self.buckets().values())

    def partial_steps_per_epoch(self) -> int:
        return sum(1 for m in self.buckets().values() if len(m) % self.group)

    def describe(self) -> str:
        sizes = [len(m) for m in self.buckets().values()]
        return (f"{self.dataset_len} samples in {len(sizes)} bucket(s) -> {self.steps_per_epoch()} optimizer "
                f"step(s) of up to {self.group} per epoch ({self.partial_steps_per_epoch()} partial)")

    def micro_batches(self, epoch: int, start_step: int = 0):
        """Yield (step, micro_index, [dataset indices], samples in the step) for this process, from optimizer
        step `start_step`. A process yields `accumulation` micro-batches per step, some maybe empty."""
        per_rank_step = self.batch_size * self.accumulation
        for step, group in enumerate(self.steps(epoch)):
            if step < start_step:
                continue
            mine = group[self.rank * per_rank_step:(self.rank + 1) * per_rank_step]
            for micro in range(self.accumulation):
                yield step, micro, mine[micro * self.batch_size:(micro + 1) * self.batch_size], len(group)
