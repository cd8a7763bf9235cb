"""What a train.py run did, recorded by a callback in each of its processes, and the same training replayed in one
process without Lightning or any data-parallel wrapper: the independent reference for the multi-process runs.

``--trainer.callbacks+=tests.run_record.RecordRun --trainer.callbacks.out_dir=DIR`` makes each rank write
``DIR/record_rank<R>.pt``: its starting weights, every micro-batch it trained on (in order), the validation
losses, the settings that shape an optimizer step, and its final weights. ``replay`` trains a TransformerLM with
a plain AdamW loop on those batches, every rank's micro-batches of a step joined into one global batch.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.training.optim import adamw_param_groups


def _full_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The LightningModule's whole state dict, as a checkpoint holds it (a collective under zero3 and fsdp2, whose
    checkpoint directories hold DTensors of each rank's rows: every rank asks)."""
    state = trainer.strategy.lightning_module_state_dict()
    return {name: _whole(value).detach().cpu().clone() for name, value in state.items()}


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class RecordRun(L.Callback):
    """Writes ``record_rank<global rank>.pt`` into ``out_dir`` when training ends (see the module docstring)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.record: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record = {
            "start_step": trainer.global_step,
            "initial": _full_state(trainer),
            "batches": [],
            "val_losses": [],
            "world_size": trainer.world_size,
            "accumulate": trainer.accumulate_grad_batches,
            "clip": trainer.gradient_clip_val,
            "max_steps": trainer.max_steps,
            "hparams": dict(pl_module.hparams),
            "config": asdict(pl_module.config),
        }

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.record["batches"].append(batch.detach().cpu().clone())

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self.record:
            self.record["val_losses"].append((trainer.global_step, trainer.callback_metrics["val/loss"].item()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["final"] = _full_state(trainer)
        self.record["global_step"] = trainer.global_step
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        torch.save(self.record, Path(self.out_dir) / f"record_rank{trainer.global_rank}.pt")


def load_records(out_dir: Path) -> list[dict[str, Any]]:
    """Every rank's record from ``out_dir``, by rank."""
    paths = sorted(Path(out_dir).glob("record_rank*.pt"), key=lambda p: int(p.stem.removeprefix("record_rank")))
    return [torch.load(path) for path in paths]


def replay(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Train from rank 0's starting weights on the recorded batches in one process: each optimizer step's batch is
    every rank's micro-batches of that step, concatenated; cross entropy over it, the gradient's global norm
    clipped with ``torch.nn.utils.clip_grad_norm_``, AdamW (the run's groups, rate, betas, warm-up + cosine).

    Returns the final ``state_dict`` (the LightningModule's names), the optimizer's ``state_dict`` and each step's
    gradient norm before clipping. Only for a run that started at step 0.
    """
    from schedule_reference import expected_lr_factor  # here: train.py imports this module as tests.run_record

    first = records[0]
    assert first["start_step"] == 0, "replay starts from initial weights"
    assert len(records) == first["world_size"]
    hparams, accumulate, steps = first["hparams"], first["accumulate"], first["max_steps"]
    for record in records:
        assert len(record["batches"]) == steps * accumulate, "every rank trained max_steps × accumulate micro-batches"

    # The plain path the run's options must match: every activation kept, the logits whole, their cross-entropy below.
    model = TransformerLM(ModelConfig(**{**first["config"], "activation_checkpointing": "none", "fused_loss": False}))
    model.load_state_dict({name.removeprefix("model."): value for name, value in first["initial"].items()})
    optimizer = torch.optim.AdamW(
        adamw_param_groups(model, hparams["weight_decay"]), lr=hparams["lr"], betas=tuple(hparams["betas"])
    )
    decay_steps = hparams["decay_steps"] or steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: expected_lr_factor(step, hparams["warmup_steps"], decay_steps, hparams["min_lr_ratio"])
    )
    clip = first["clip"] or float("inf")
    grad_norms = []
    for step in range(steps):
        micro = slice(step * accumulate, (step + 1) * accumulate)
        batch = torch.cat([b for record in records for b in record["batches"][micro]])  # (W·A·B, T + 1)
        logits = model(batch[:, :-1])  # (W·A·B, T, V)
        F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "state_dict": {f"model.{name}": value for name, value in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "grad_norms": grad_norms,
    }
