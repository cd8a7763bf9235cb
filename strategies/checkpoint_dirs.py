"""Checkpoint directories for the strategies that shard state over the ranks (zero3, zero1, fsdp2): every rank
writes its own shards at once, in the background, and a directory is read back at any world size, under any
strategy (:mod:`lm_systems.files.checkpoint_dir` has the format and the writer)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.optim import Optimizer

from lm_systems.compat.lightning import optimizer_to_device
from lm_systems.files.checkpoint_dir import (
    MODEL,
    OPTIMIZER,
    CheckpointDirWriter,
    is_checkpoint_dir,
    model_key,
    read_into,
    read_meta,
    stored_tensors,
)
from lm_systems.files.checkpointing import PublishedCheckpoints

CheckpointFormat = Literal["directory", "file"]


class CheckpointDirStrategy(PublishedCheckpoints):
    """Mixin, placed before a Lightning parallel strategy's class: with ``checkpoint_format="directory"`` (the
    default) each checkpoint is a directory every rank writes its shards into, saved in the background unless
    ``async_save`` is off (the loop waits only for the copy to host memory); ``"file"``: one file of the full state,
    gathered to rank 0, as the unsharded strategies write. Either format is read, at any world size.

    A strategy says how its tensors are laid out through three methods: ``global_view`` (a tensor of a parameter's
    local layout as DCP should see it: a DTensor over this rank's rows where it holds a shard), ``holds_state``
    (whether this rank keeps a parameter's optimizer state) and ``local_optimizer_state`` (the optimizer's state
    dict as this rank holds it, by parameter index).
    """

    def __init__(
        self,
        checkpoint_format: CheckpointFormat = "directory",
        async_save: bool = True,
        timeout: Optional[timedelta] = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        if checkpoint_format not in ("directory", "file"):
            raise ValueError(
                f"checkpoint_format must be 'directory' or 'file', got {checkpoint_format!r} "
                "(--trainer.strategy.checkpoint_format)"
            )
        super().__init__(timeout=timeout, **kwargs)
        self._checkpoint_format = checkpoint_format
        self._async_save = async_save
        self._checkpoint_timeout = timeout
        self._writer: Optional[CheckpointDirWriter] = None
        self._restored_from_directory = False
        self._first_step_pending = False

    # -- the layout: overridden by strategies that shard --------------------------------------------------------

    def global_view(self, param: Tensor, tensor: Tensor) -> Tensor:
        """``tensor``, laid out like this rank's ``param``, as DCP sees it (here: as it is, the full tensor)."""
        return tensor

    def full_shape(self, param: Tensor) -> torch.Size:
        """``param``'s shape in the model, whatever part of it this rank holds."""
        return param.shape

    def holds_state(self, optimizer: Optimizer, param: Tensor) -> bool:
        """Whether this rank keeps ``param``'s optimizer state."""
        return True

    def local_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state as this rank holds it, by parameter index, with the parameter groups."""
        return optimizer.state_dict()

    @property
    def writes_directories(self) -> bool:
        """Whether this strategy's checkpoints are directories (a strategy's own full-state methods step aside)."""
        return self._checkpoint_format == "directory"

    @property
    def restored_from_directory(self) -> bool:
        """Whether the checkpoint being restored is a directory, already read into the model and the optimizers."""
        return self._restored_from_directory

    # -- Lightning's checkpoint hooks ---------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a directory is read into the sharded model and the optimizers

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self._writer is None:
            group = dist.new_group(backend="gloo", timeout=self._checkpoint_timeout)  # every rank, from setup
            self._writer = CheckpointDirWriter(group, asynchronous=self._async_save)
        # A run that saves directories checks its disk and (saving in the background) makes its staging buffers after
        # its first optimizer step, once AdamW has created its state: not at its first save.
        self._first_step_pending = self.writes_directories and bool(trainer.checkpoint_callbacks)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._first_step_pending:
            self._first_step_pending = False
            checkpoint = {
                "state_dict": self.lightning_module_state_dict(),
                "optimizer_states": [self.optimizer_state(optimizer) for optimizer in self.optimizers],
            }
            self._writer.allocate_host_buffers(checkpoint)  # nothing without background saves
            folder = getattr(self.lightning_module.trainer.checkpoint_callback, "dirpath", None)
            if folder is not None:
                self._writer.check_room(folder, checkpoint)  # now, not after training up to the first save
        return result

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._checkpoint_format == "file":
            return super().lightning_module_state_dict()
        state = self.lightning_module.state_dict(keep_vars=True)
        return {name: self.global_view(value, value.detach()) for name, value in state.items()}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._checkpoint_format == "file":
            return super().optimizer_state(optimizer)
        optimizer = _unwrapped(optimizer)
        params = _params(optimizer)
        local = self.local_optimizer_state(optimizer)
        state = {
            index: {
                key: self.global_view(params[index], value)
                if isinstance(value, Tensor) and value.shape == params[index].shape
                else value
                for key, value in values.items()
            }
            for index, values in local["state"].items()
        }
        return {"state": state, "param_groups": local["param_groups"]}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self._checkpoint_format == "file":
            super().save_checkpoint(checkpoint, filepath, storage_options)
        else:
            self._writer.save(checkpoint, filepath)

    def when_published(self, path: str, action: Callable[[], None]) -> None:
        if self._writer is None:
            action()
        else:
            self._writer.when_published(path, action)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Once the save in flight is whole (never, if it fails): a checkpoint that a newer one replaces stays until
        the newer one can be resumed from."""
        if self._writer is None:
            self._remove_now(filepath)
        else:
            self._writer.after_pending(lambda: self._remove_now(filepath))

    def _remove_now(self, filepath: Any) -> None:
        if is_checkpoint_dir(filepath):
            if self.is_global_zero:
                shutil.rmtree(filepath)
        else:
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self._restored_from_directory = is_checkpoint_dir(checkpoint_path)
        if not self._restored_from_directory:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return self._read_directory(Path(checkpoint_path))

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._restored_from_directory:  # a directory's weights were read by load_checkpoint
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._restored_from_directory:
            super().load_optimizer_state_dict(checkpoint)

    def teardown(self) -> None:
        if self._writer is not None:
            self._writer.close()  # the save in flight, while the process groups are whole
            dist.destroy_process_group(self._writer.group)
            self._writer = None
        super().teardown()

    # -- reading a directory ------------------------------------------------------------------------------------

    def _read_directory(self, path: Path) -> dict[str, Any]:
        """Every rank reads its own part of the weights and the optimizer state, in place; the rest is returned."""
        stored = stored_tensors(path)
        module_state = self.lightning_module.state_dict(keep_vars=True)
        saved_names = {key.split("/", 1)[1] for key in stored if key.startswith(MODEL + "/")}
        missing, unexpected = sorted(module_state.keys() - saved_names), sorted(saved_names - module_state.keys())
        if self.lightning_module.strict_loading and (missing or unexpected):
            raise KeyError(
                f"checkpoint {str(path)!r} does not hold this model's weights (missing: {missing[:5]}, "
                f"unexpected: {unexpected[:5]}): it belongs to a different model"
            )
        targets = {
            model_key(name): self.global_view(value, value.detach())
            for name, value in module_state.items()
            if name in saved_names
        }
        optimizer_states = []
        for number, optimizer in enumerate(self.optimizers):
            optimizer = _unwrapped(optimizer)
            params, state = _params(optimizer), {}
            for key, stored_tensor in stored.items():
                if not key.startswith(f"{OPTIMIZER}/{number}/"):
                    continue
                _, _, index, name = key.split("/", 3)
                param = params[int(index)]
                if not self.holds_state(optimizer, param):
                    continue
                if tuple(stored_tensor.size) == tuple(self.full_shape(param)):  # shaped like its parameter
                    local = torch.zeros_like(param.detach())
                    targets[key] = self.global_view(param, local)
                else:  # a scalar such as AdamW's step
                    local = targets[key] = torch.empty(stored_tensor.size, dtype=stored_tensor.properties.dtype)
                state.setdefault(int(index), {})[name] = local
            optimizer_states.append((optimizer, state))
        read_into(path, targets, self._writer.group)
        rest = read_meta(path)
        for (optimizer, state), saved in zip(optimizer_states, rest["optimizer_states"], strict=True):
            optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
            optimizer_to_device(optimizer, self.root_device)
        return rest


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _params(optimizer: Optimizer) -> list[Tensor]:
    """The optimizer's parameters in the order its state dict numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]
