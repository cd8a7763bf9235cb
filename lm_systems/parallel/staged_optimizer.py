"""StagedOptimizer: the base of optimizers that step their parameters stage by stage, overlapped with communication."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer


class StagedOptimizer(Optimizer):
    """One ``optimizer_cls`` per stage, each over its stage's parameters, all sharing ``self.state``, so that a
    subclass can step one stage while another stage's communication is in flight.

    ``param_groups`` are the full groups (learning-rate schedulers, clipping and ``zero_grad`` see every
    parameter), showing every hyperparameter ``optimizer_cls`` fills in, so ``state_dict()`` has a plain
    ``optimizer_cls``'s layout; ``prepare_step`` copies the groups' hyperparameters into the stages, and
    ``load_state_dict`` keeps the stages sharing the loaded state.
    Subclasses set whatever ``stage_params`` needs before calling ``__init__`` (it adds the groups).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        stages: int,
        **kwargs: Any,
    ) -> None:
        self._optimizer_cls, self._optimizer_kwargs, self._num_stages = optimizer_cls, kwargs, stages
        self._stages: list[Optimizer] = []
        super().__init__(params, defaults=kwargs)

    def stage_params(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """The parameters of a new group that each stage steps here, one list per stage."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (also after construction); ``stage_params`` shares it out among the stages."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        hyperparameters = {k: v for k, v in group.items() if k != "params"}
        for stage, params in enumerate(self.stage_params(group["params"])):
            local_group = {**hyperparameters, "params": params}
            if stage < len(self._stages):
                self._stages[stage].add_param_group(local_group)
            else:
                optimizer = self._optimizer_cls([local_group], **self._optimizer_kwargs)
                optimizer.state = self.state
                self._stages.append(optimizer)
        for key, value in self._stages[0].param_groups[-1].items():  # amsgrad, foreach, ...: not given, filled in
            group.setdefault(key, value)

    def prepare_step(self, closure=None):
        """The start of ``step()``: run ``closure`` (with grad enabled), then give the stages the groups' current
        hyperparameters (a scheduler changes the full groups). Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            hyperparameters = {k: v for k, v in group.items() if k != "params"}
            for stage in self._stages:
                stage.param_groups[index].update(hyperparameters)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for optimizer in self._stages:  # Optimizer.load_state_dict replaced self.state with a new dict
            optimizer.state = self.state
