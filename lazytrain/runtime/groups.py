"""The optimizer's parameter groups: one per stage, in stage order, then the shared (tied) weights,
which the schedule's events call stage -1."""

from __future__ import annotations


class Groups:
    def __init__(self, stages, shared: tuple[str, ...]):
        self._names = {i: s.params for i, s in enumerate(stages)}
        self._names[-1] = shared
        self.count = len(stages)
        self.order = range(-1, self.count)  # every group's stage: the shared weights', then each stage's

    def names(self, stage: int) -> tuple[str, ...]:
        """The parameters stepped together as `stage`'s group: its own, or the shared ones (-1)."""
        return self._names[stage]

    def index(self, stage: int) -> int:
        """`stage`'s group in the optimizer: the stages' in their order, the shared weights' last."""
        return stage if stage >= 0 else self.count
