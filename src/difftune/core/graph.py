"""The stage-1 / stage-2 split of a pipeline's units (pure Python, no torch).

Given the units in order with their declared reads, writes and models, the trainable models and the
names the loss reads:

* stage 2 = every unit that uses a trainable model; every unit that reads a value whose last writer
  before it is in stage 2; and every unit whose move to stage 1 (which runs entirely before stage 2)
  would reorder a read and a write, or two writes, of the same name with an earlier stage-2 unit.
  Iterated to a fixed point. Stage 1 = the rest, in order.
* the frontier (what stage 1 caches) = every name that a stage-2 unit or the loss reads whose value at
  that point was written by a stage-1 unit or came with the data. Run-time settings are excluded: each
  stage supplies them from its own arguments.

Running stage 1, storing the frontier, then running stage 2 and the loss on the stored values gives
every read the same value as running all units in order, which is why split training equals unsplit
training (docs/split_training.md has the argument and worked examples).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    stage1: tuple  # units, in pipeline order
    stage2: tuple
    frontier: tuple[str, ...]  # names stage 1 must hand to stage 2, sorted
    stage1_models: tuple[str, ...]
    stage2_models: tuple[str, ...]

    def describe(self) -> str:
        names = lambda units: ", ".join(u.name for u in units) or "(none)"  # noqa: E731
        return (f"stage 1 units: {names(self.stage1)}; stage 2 units: {names(self.stage2)}; "
                f"cached: {', '.join(self.frontier) or '(none)'}")


def _last_writer_before(units: Sequence, writes: list[set[str]], index: int, name: str) -> int | None:
    for j in range(index - 1, -1, -1):
        if name in writes[j]:
            return j
    return None


def split_units(units: Sequence, trainable_models: Iterable[str], loss_reads: Iterable[str],
                settings: Iterable[str] = (), loss_models: Iterable[str] = (), cfg: bool = False) -> Split:
    """Compute the split. `loss_models` are the models the loss itself uses (e.g. the DiT via model_fn)."""
    trainable = {m for m in trainable_models if m}
    settings = set(settings)
    reads = [set(u.reads(cfg)) for u in units]
    writes = [set(u.writes(cfg)) for u in units]
    n = len(units)
    stage2 = {i for i, u in enumerate(units) if trainable & set(u.models)}

    changed = True
    while changed:
        changed = False
        for i in range(n):
            if i in stage2:
                continue
            move = False
            # reads something whose last writer before it is in stage 2
            for name in reads[i]:
                w = _last_writer_before(units, writes, i, name)
                if w is not None and w in stage2:
                    move = True
                    break
            # moving i before every stage-2 unit s < i must not reorder conflicting accesses
            if not move:
                for s in stage2:
                    if s < i and ((reads[s] & writes[i]) or (writes[s] & reads[i]) or (writes[s] & writes[i])):
                        move = True
                        break
            if move:
                stage2.add(i)
                changed = True

    frontier: set[str] = set()
    for s in sorted(stage2):
        for name in reads[s] - settings:
            w = _last_writer_before(units, writes, s, name)
            if w is None or w not in stage2:
                frontier.add(name)
    for name in set(loss_reads) - settings:
        w = _last_writer_before(units, writes, n, name)
        if w is None or w not in stage2:
            frontier.add(name)

    stage1 = tuple(u for i, u in enumerate(units) if i not in stage2)
    stage2_units = tuple(u for i, u in enumerate(units) if i in stage2)
    s1_models = tuple(sorted({m for u in stage1 for m in u.models}))
    s2_models = tuple(sorted({m for u in stage2_units for m in u.models} | set(loss_models) | trainable))
    return Split(stage1, stage2_units, tuple(sorted(frontier)), s1_models, s2_models)
