"""Which samples each process sees at each micro-step: deterministic, layout-independent, resumable.

Epoch `e` visits a permutation of the dataset drawn from (seed, e). An optimizer step consumes the
next `world_size * batch_size * accumulation` indices of it; process `r` takes its micro-batches from
that group. So one process with accumulation 2 and two processes with accumulation 1 see the same
samples per optimizer step, and a resumed run continues at the exact position (epoch, step).
"""

from __future__ import annotations

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

    @property
    def group(self) -> int:
        return self.world_size * self.batch_size * self.accumulation

    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.group

    def dropped_per_epoch(self) -> int:
        return self.dataset_len - self.steps_per_epoch() * self.group

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(epoch))
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def micro_batches(self, epoch: int, start_step: int = 0):
        """Yield (step, micro_index, [dataset indices]) for this process, from optimizer step `start_step`."""
        order = self.order(epoch)
        per_rank_step = self.batch_size * self.accumulation
        for step in range(start_step, self.steps_per_epoch()):
            group = order[step * self.group:(step + 1) * self.group]
            mine = group[self.rank * per_rank_step:(self.rank + 1) * per_rank_step]
            for micro in range(self.accumulation):
                yield step, micro, mine[micro * self.batch_size:(micro + 1) * self.batch_size]
