"""OverlappedStepOptimizer: the optimizer step overlapped with the tail of gradient averaging."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lm_systems.parallel.overlap import OverlappedDDP
from lm_systems.parallel.runs import cut_into_runs
from lm_systems.parallel.staged_optimizer import StagedOptimizer


class OverlappedStepOptimizer(StagedOptimizer):
    """Steps ``optimizer_cls`` in ``stages``, each over the parameters of a run of ``ddp``'s buckets, as soon
    as those buckets are averaged, while the buckets after them are still on the wire.

    When backward ends, the last buckets' all-reduces are still in flight. Waiting for all of them, then
    stepping, puts the two in series; here the step of the gradients that arrived first runs in that
    tail. The buckets, in launch order, are cut into ``stages`` runs of about equal size; ``step()``
    finishes ``ddp``'s gradient synchronisation itself (``ddp.averaged_units()``) and steps each run's
    parameters once its last bucket is averaged. So:

    - do not call ``ddp.finish_gradient_synchronization()`` yourself: ``step()`` does;
    - anything that must see averaged gradients before the update (gradient clipping, a gradient-norm
      log) cannot run between backward and ``step()``: the gradients are averaged inside it.

    The update is exactly ``optimizer_cls``'s, and ``state_dict()`` an ordinary ``optimizer_cls`` state
    dict (see ``StagedOptimizer``). A parameter not in ``ddp`` (frozen when it was built) is stepped in
    the last stage. Measured on two H200s, xl, blocks replayed as CUDA graphs: 4 stages took 1.5-2 ms
    off a 90-95 ms step at 1000 MB buckets and nothing at 25 MB
    (benchmarks/results/ddp_xl_2gpu_compiled_reduce_overhead_{overlapped_step,buckets}.md).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], ddp: OverlappedDDP,
                 optimizer_cls: type[Optimizer], stages: int = 4, **kwargs: Any) -> None:
        if not isinstance(ddp, OverlappedDDP):
            raise TypeError(f"ddp must be a container that averages during backward (DDPBucketed, "
                            f"DDPIndividualParameters), not {type(ddp).__name__}")
        if stages < 1:
            raise ValueError(f"stages must be at least 1, got {stages}")
        if not ddp.units:
            raise ValueError("ddp synchronises no parameter: there is nothing to overlap the step with")
        self._ddp = ddp
        unit_stage = cut_into_runs([sum(p.numel() for p in unit) for unit in ddp.units], stages)
        self._stage_of = {id(p): stage for unit, stage in zip(ddp.units, unit_stage) for p in unit}
        # The unit whose averaging completes each stage: its last one (a stage with none: the last unit).
        self._stage_ends: dict[int, list[int]] = {}
        for stage in range(stages):
            units = [u for u, s in enumerate(unit_stage) if s == stage]
            self._stage_ends.setdefault(units[-1] if units else len(unit_stage) - 1, []).append(stage)
        super().__init__(params, optimizer_cls, stages, **kwargs)

    def stage_params(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        last = self._num_stages - 1
        return [[p for p in params if self._stage_of.get(id(p), last) == stage] for stage in range(self._num_stages)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.prepare_step(closure)
        for unit in self._ddp.averaged_units():
            for stage in self._stage_ends.get(unit, ()):
                self._stages[stage].step()
        return loss
