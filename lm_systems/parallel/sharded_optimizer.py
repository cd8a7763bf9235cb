"""ShardedOptimizer (ZeRO stage 1): optimizer state split across ranks, updated parameters exchanged after each step."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lm_systems.parallel.collectives import require_process_group
from lm_systems.parallel.staged_optimizer import StagedOptimizer
from lm_systems.parallel.stages import cut_into_stages

Exchange = Literal["p2p", "broadcast"]

# Parameters per batched send/recv launch: bounds the size of one NCCL group call.
_P2P_PARAMS_PER_BATCH = 128


class ShardedOptimizer(StagedOptimizer):
    """Each rank keeps ``optimizer_cls`` state only for its shard of the parameters and steps only that shard.

    Parameters are assigned whole to ranks, largest first, each to the rank with the fewest elements so
    far, so shards are balanced by size. After the local step every rank's updated parameters reach
    every other rank, by batched point-to-point sends (``exchange="p2p"``: each rank sends its shard to
    each peer, all links busy at once, no copies) or by one broadcast per parameter from its owner
    (``exchange="broadcast"``). Gradients must already be averaged over ranks (any data-parallel container).

    By default the whole shard is stepped, then exchanged, on the default group. With ``exchange_stages``
    k > 1 the two are pipelined: every rank's shard (per parameter group) is cut into k runs of about
    equal size, and stage i's parameters start travelling as soon as stage i is stepped, while stage
    i+1 is being stepped. Stages overlap only with the exchange on a high-priority stream
    (``process_group=gradient_process_group()``, all ranks): the multi-tensor update fills every SM, and
    a normal-priority NCCL kernel waits for its blocks to be dispatched. The zero1 strategy uses both
    (docs/data_parallel.md).

    ``param_groups`` are the full groups (see ``StagedOptimizer``, whose stages here hold only this rank's
    parameters); ``state`` holds this rank's shard of the state. ``consolidate_state_dict(to)`` (a collective)
    gathers a plain ``optimizer_cls`` state dict over all parameters on rank ``to``; ``load_state_dict`` takes that
    format on any world size.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        exchange: Exchange = "p2p",
        exchange_stages: int = 1,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        require_process_group("ShardedOptimizer")
        if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
            raise ValueError("process_group must hold every rank: parameters are exchanged among all of them")
        if exchange not in ("p2p", "broadcast"):
            raise ValueError(f"exchange must be 'p2p' or 'broadcast', got {exchange!r}")
        if exchange_stages < 1:
            raise ValueError(f"exchange_stages must be at least 1, got {exchange_stages}")
        self._exchange = exchange
        self._group = process_group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._owner: dict[int, int] = {}  # id(param) → owning rank
        self._stage_of: dict[int, int] = {}  # id(param) → pipeline stage
        self._load = [0] * self.world_size  # elements owned per rank
        # Every rank's parameters of each stage, in param_groups order (the exchange's order on every rank).
        self._stage_params: list[list[torch.Tensor]] = [[] for _ in range(exchange_stages)]
        self._consolidated: dict[str, Any] | None = None
        self._closed = False
        super().__init__(params, optimizer_cls, exchange_stages, **kwargs)

    def __enter__(self) -> ShardedOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the process group, so that nothing of it outlives the optimizer's use once the caller destroys it; a
        later ``step`` raises. ``state_dict``, ``load_state_dict`` and the stepped parameters stay as they are."""
        self._group = None
        self._closed = True

    # -- sharding ----------------------------------------------------------------------------

    def stage_params(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """A new group's parameters are shared out among the ranks (largest first, each to the least loaded),
        each rank's cut into the stages; this rank steps its own."""
        for param in sorted(params, key=lambda p: p.numel(), reverse=True):
            rank = min(range(self.world_size), key=lambda r: self._load[r])
            self._owner[id(param)] = rank
            self._load[rank] += param.numel()
        for rank in range(self.world_size):
            shard = [p for p in params if self._owner[id(p)] == rank]
            for param, stage in zip(shard, cut_into_stages([p.numel() for p in shard], self._num_stages), strict=True):
                self._stage_of[id(param)] = stage
        for param in params:
            self._stage_params[self._stage_of[id(param)]].append(param)
        return [self._owned_in_stage(params, stage) for stage in range(self._num_stages)]

    def owner(self, param: torch.Tensor) -> int:
        """The rank that holds ``param``'s optimizer state and updates it."""
        if id(param) not in self._owner:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in this optimizer's param_groups")
        return self._owner[id(param)]

    def owned(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The subset of ``params`` this rank updates, in the given order."""
        return [p for p in params if self._owner[id(p)] == self.rank]

    def _owned_in_stage(self, params: Iterable[torch.Tensor], stage: int) -> list[torch.Tensor]:
        return [p for p in self.owned(params) if self._stage_of[id(p)] == stage]

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # -- stepping ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError("this ShardedOptimizer was closed (its process group dropped): build a new one to step")
        loss = self.prepare_step(closure)
        works: list[dist.Work] = []
        for stage, optimizer in enumerate(self._stages):
            optimizer.step()
            works += self._start_exchange(self._stage_params[stage])  # runs while the next stage steps
        for work in works:
            work.wait()
        self._consolidated = None
        return loss

    def _start_exchange(self, params: list[torch.Tensor]) -> list[dist.Work]:
        """Start sending this rank's updated ``params`` to every peer and receiving the peers' ones."""
        if self.world_size == 1 or not params:
            return []
        if self._exchange == "broadcast":
            return [dist.broadcast(p.detach(), src=self.owner(p), group=self._group, async_op=True) for p in params]
        works = []
        for start in range(0, len(params), _P2P_PARAMS_PER_BATCH):
            ops = []
            for p in params[start : start + _P2P_PARAMS_PER_BATCH]:
                owner = self.owner(p)
                if owner == self.rank:
                    ops += [
                        dist.P2POp(dist.isend, p.detach(), peer, self._group)
                        for peer in range(self.world_size)
                        if peer != owner
                    ]
                else:
                    ops.append(dist.P2POp(dist.irecv, p.detach(), owner, self._group))
            works += dist.batch_isend_irecv(ops)
        return works

    # -- checkpoints -------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather the full state on rank ``to``, as ``optimizer_cls`` would hold it unsharded."""
        params = self._all_params()
        shard = {
            i: _to_cpu(self.state[p])
            for i, p in enumerate(params)
            if self._owner[id(p)] == self.rank and p in self.state
        }
        index = {id(p): i for i, p in enumerate(params)}
        gathered: list[dict | None] | None = [None] * self.world_size if self.rank == to else None
        dist.gather_object(shard, gathered, dst=to)
        if self.rank != to:
            self._consolidated = None
            return
        state = {i: s for part in gathered for i, s in part.items()}
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": self._indexed_groups(index)}

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's share: the state of the parameters it steps, by their index over every parameter (as in the
        consolidated state), with the full parameter groups. Not a collective; the tensors are the live state."""
        params = self._all_params()
        state = {
            i: dict(self.state[p]) for i, p in enumerate(params) if self._owner[id(p)] == self.rank and p in self.state
        }
        return {"state": state, "param_groups": self._indexed_groups({id(p): i for i, p in enumerate(params)})}

    def _indexed_groups(self, index: dict[int, int]) -> list[dict[str, Any]]:
        """The parameter groups with each parameter replaced by its index, as ``Optimizer.state_dict`` has them."""
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in group["params"]]}
            for group in self.param_groups
        ]

    def state_dict(self) -> dict[str, Any]:
        """The consolidated full state; only on the rank ``consolidate_state_dict(to=...)`` named, since the last
        step."""
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
        stages = range(len(self._stages))
        stage_states: list[dict[int, Any]] = [{} for _ in stages]
        stage_groups: list[list[dict[str, Any]]] = [[] for _ in stages]
        counts = [0 for _ in stages]  # each stage optimizer numbers its parameters 0, 1, ... over its groups
        for group, saved in zip(self.param_groups, groups, strict=True):
            hyperparameters = {k: v for k, v in saved.items() if k != "params"}
            group.update(hyperparameters)
            indices: list[list[int]] = [[] for _ in stages]
            for p, i in zip(group["params"], saved["params"], strict=True):
                if self._owner[id(p)] != self.rank:
                    continue
                stage = self._stage_of[id(p)]
                if i in state_dict["state"]:
                    stage_states[stage][counts[stage]] = state_dict["state"][i]
                indices[stage].append(counts[stage])
                counts[stage] += 1
            for stage in stages:
                stage_groups[stage].append({**hyperparameters, "params": indices[stage]})
        # Optimizer.load_state_dict replaces an optimizer's state dict object; keep the one ``self.state``
        # (and any wrapper that copied the attribute, like Lightning's LightningOptimizer) refers to.
        self.state.clear()
        for optimizer, state, param_groups in zip(self._stages, stage_states, stage_groups, strict=True):
            optimizer.load_state_dict({"state": state, "param_groups": param_groups})
            self.state.update(optimizer.state)
            optimizer.state = self.state
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
