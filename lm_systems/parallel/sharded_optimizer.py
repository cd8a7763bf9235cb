"""ShardedOptimizer (ZeRO stage 1): optimizer state split across ranks, updated parameters exchanged after each step."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lm_systems.parallel.collectives import require_process_group

Exchange = Literal["p2p", "broadcast"]

# Parameters per batched send/recv launch: bounds the size of one NCCL group call.
_P2P_PARAMS_PER_BATCH = 128


class ShardedOptimizer(Optimizer):
    """Each rank keeps ``optimizer_cls`` state only for its shard of the parameters and steps only that shard.

    Parameters are assigned whole to ranks, largest first, each to the rank with the fewest elements so
    far, so shards are balanced by size. After the local step every rank's updated parameters reach
    every other rank, by batched point-to-point sends (``exchange="p2p"``: each rank sends its shard to
    each peer, all links busy at once, no copies) or by one broadcast per parameter from its owner
    (``exchange="broadcast"``). Gradients must already be averaged over ranks (any data-parallel container).

    ``param_groups`` are the full groups (learning-rate schedulers, clipping and ``zero_grad`` see every
    parameter); their hyperparameters are copied into the local optimizer before each step.
    ``consolidate_state_dict(to)`` (a collective) gathers a plain ``optimizer_cls`` state dict over all
    parameters on rank ``to``; ``load_state_dict`` takes that format on any world size.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        exchange: Exchange = "p2p",
        **kwargs: Any,
    ) -> None:
        require_process_group("ShardedOptimizer")
        if exchange not in ("p2p", "broadcast"):
            raise ValueError(f"exchange must be 'p2p' or 'broadcast', got {exchange!r}")
        self._optimizer_cls = optimizer_cls
        self._optimizer_kwargs = kwargs
        self._exchange = exchange
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._owner: dict[int, int] = {}  # id(param) → owning rank
        self._load = [0] * self.world_size  # elements owned per rank
        self._local: Optimizer | None = None
        self._consolidated: dict[str, Any] | None = None
        super().__init__(params, defaults=kwargs)

    # -- sharding ----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (also after construction); its parameters are shared out among the ranks."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = min(range(self.world_size), key=lambda r: self._load[r])
            self._owner[id(param)] = rank
            self._load[rank] += param.numel()
        local_group = {**group, "params": self.owned(group["params"])}
        if self._local is None:
            self._local = self._optimizer_cls([local_group], **self._optimizer_kwargs)
            self.state = self._local.state
        else:
            self._local.add_param_group(local_group)

    def owner(self, param: torch.Tensor) -> int:
        """The rank that holds ``param``'s optimizer state and updates it."""
        if id(param) not in self._owner:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in this optimizer's param_groups")
        return self._owner[id(param)]

    def owned(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The subset of ``params`` this rank updates, in the given order."""
        return [p for p in params if self._owner[id(p)] == self.rank]

    @property
    def local_optimizer(self) -> Optimizer:
        """The ``optimizer_cls`` instance over this rank's shard."""
        return self._local

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # -- stepping ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local_group in zip(self.param_groups, self._local.param_groups):
            local_group.update({k: v for k, v in group.items() if k != "params"})
        self._local.step()
        self._exchange_parameters()
        self._consolidated = None
        return loss

    def _exchange_parameters(self) -> None:
        if self.world_size == 1:
            return
        params = self._all_params()
        if self._exchange == "broadcast":
            works = [dist.broadcast(p.detach(), src=self.owner(p), async_op=True) for p in params]
        else:
            works = []
            for start in range(0, len(params), _P2P_PARAMS_PER_BATCH):
                ops = []
                for p in params[start : start + _P2P_PARAMS_PER_BATCH]:
                    owner = self.owner(p)
                    if owner == self.rank:
                        ops += [dist.P2POp(dist.isend, p.detach(), peer) for peer in range(self.world_size) if peer != owner]
                    else:
                        ops.append(dist.P2POp(dist.irecv, p.detach(), owner))
                works += dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()

    # -- checkpoints -------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather the full state on rank ``to``, as ``optimizer_cls`` would hold it unsharded."""
        index = {id(p): i for i, p in enumerate(self._all_params())}
        local = self._local.state_dict()
        local_params = [p for group in self._local.param_groups for p in group["params"]]
        shard = {index[id(local_params[i])]: _to_cpu(state) for i, state in local["state"].items()}
        gathered: list[dict | None] | None = [None] * self.world_size if self.rank == to else None
        dist.gather_object(shard, gathered, dst=to)
        if self.rank != to:
            self._consolidated = None
            return
        state = {i: s for part in gathered for i, s in part.items()}
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in group["params"]]}
            for group in self.param_groups
        ]
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}

    def state_dict(self) -> dict[str, Any]:
        """The consolidated full state; only on the rank ``consolidate_state_dict(to=...)`` named, since the last step."""
        if self._consolidated is None:
            raise RuntimeError(
                f"rank {self.rank} holds only its shard of the optimizer state: call consolidate_state_dict(to=...) "
                "on every rank after the last step, then state_dict() on the rank it named"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (consolidated or unsharded ``optimizer_cls``) state dict; this rank keeps its shard."""
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in groups] != sizes:
            raise ValueError(
                f"optimizer state has parameter groups of sizes {[len(g['params']) for g in groups]}, "
                f"this optimizer has {sizes}: the checkpoint belongs to a different model or optimizer setup"
            )
        local_groups, local_state, next_local = [], {}, 0
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            owned_indices = []
            for p, i in zip(group["params"], saved["params"]):
                if self._owner[id(p)] != self.rank:
                    continue
                if i in state_dict["state"]:
                    local_state[next_local] = state_dict["state"][i]
                owned_indices.append(next_local)
                next_local += 1
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": owned_indices})
        self._local.load_state_dict({"state": local_state, "param_groups": local_groups})
        # Optimizer.load_state_dict replaces the state dict object; keep the one ``self.state`` (and any
        # wrapper that copied the attribute, like Lightning's LightningOptimizer) already refers to.
        self.state.clear()
        self.state.update(self._local.state)
        self._local.state = self.state
        self._consolidated = None


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def optimizer_init_kwargs(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` limited to what its class's constructor accepts (AdamW stores extra keys)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
