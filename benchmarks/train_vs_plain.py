"""The two paths ``benchmarks.train`` compares: the setup both train, the hand-written loop, and the callback that
pauses train.py's fit to time it segment by segment against that loop."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer

from benchmarks.device import allocated_gib, peak_memory_gib, reset_peak_memory, synchronize, timed
from benchmarks.train_py_command import BETAS, CLIP, LR, MIN_LR_RATIO, WARMUP_STEPS, WEIGHT_DECAY
from lm_systems.data.datamodule import LMDataModule
from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import CausalSelfAttention, TransformerLM
from lm_systems.training.optim import adamw_param_groups, make_adamw
from lm_systems.training.schedule import warmup_cosine_schedule

PRECISIONS = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}


@dataclass(frozen=True)
class Setup:
    """One configuration both paths train."""

    size: str
    context: int
    batch_size: int
    precision: str
    attention: str
    compile: bool

    @property
    def label(self) -> str:
        return (
            f"{self.size} ctx{self.context}×{self.batch_size} {self.precision} {self.attention}"
            f"{' compiled' if self.compile else ''}"
        )

    @property
    def shape_label(self) -> str:
        return f"{self.size} ctx{self.context}×{self.batch_size} {self.precision}{' compiled' if self.compile else ''}"


@dataclass
class Measurement:
    ms_per_step: float
    peak_gib: float


@dataclass
class Rounds:
    """What one setup's runs measured, segment by segment."""

    train_py: list[Measurement] = field(default_factory=list)
    plain: dict[str, list[Measurement]] = field(default_factory=dict)  # per attention


# -- the plain loop --------------------------------------------------------------------------


class PlainLoop:
    """The hand-written loop over a TransformerLM of its own: ``step()`` trains one batch."""

    def __init__(self, setup: Setup, data: LMDataModule, device: torch.device, total_steps: int) -> None:
        config = ModelConfig.from_name(
            setup.size, context_length=setup.context, attention=setup.attention, vocab_size=data.vocab_size
        )
        with torch.device(device):
            self.model = TransformerLM(config)
        if setup.compile:
            self.model.compile()  # the whole model, as one compiles a hand-written loop
        self.optimizer = make_adamw(adamw_param_groups(self.model, WEIGHT_DECAY), LR, BETAS)
        self.scheduler = warmup_cosine_schedule(self.optimizer, WARMUP_STEPS, total_steps, MIN_LR_RATIO)
        dtype = PRECISIONS[setup.precision]
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self.batches: Iterator[torch.Tensor] = iter(data.train_dataloader())
        self.device = device

    def use_attention(self, name: str) -> None:
        """Switch every block to attention ``name`` (a compiled model compiles once more per name)."""
        for module in self.model.modules():
            if isinstance(module, CausalSelfAttention):
                module.attention_name = name

    def step(self) -> None:
        batch = next(self.batches).to(self.device, non_blocking=True)  # (B, T + 1)
        with self.autocast:
            logits = self.model(batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        if self.scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


# -- the two, interleaved --------------------------------------------------------------------


class Interleave(Callback):
    """Pauses train.py's fit after step ``warmup`` and after every ``steps`` steps from there, to time the
    segment it just trained and a segment of the plain loop in each attention of ``attentions``.

    Peak memory is each path's own: the allocator's peak during its segment, less what the other path
    holds while paused (train.py's peak before the plain loop exists is read as it is).
    """

    def __init__(
        self,
        make_plain: Callable[[], PlainLoop],
        attentions: list[str],
        warmup: int,
        steps: int,
        rounds: Rounds,
        on_round: Callable[[], None],
    ) -> None:
        self._make_plain, self._attentions = make_plain, attentions
        self._warmup, self._steps = warmup, steps
        self.rounds, self._on_round = rounds, on_round
        self._plain: PlainLoop | None = None
        self._held = {"train_py": 0.0, "plain": 0.0}  # GiB each path holds while the other runs
        self._started = 0.0
        self._warmup_peak = {"train_py": float("nan"), "plain": float("nan")}  # GiB, each path's own

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        reset_peak_memory(trainer.strategy.root_device)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        step, device = trainer.global_step, trainer.strategy.root_device
        if step < self._warmup or (step - self._warmup) % self._steps:
            return
        synchronize(device)
        if self._plain is None:
            self._warmup_peak["train_py"] = peak_memory_gib(device)
            self._start_plain(device)
        else:
            ms = 1e3 * (time.perf_counter() - self._started) / self._steps
            peak = peak_memory_gib(device) - self._held["plain"]
            self.rounds.train_py.append(Measurement(ms, max(peak, self._warmup_peak["train_py"])))
            for name in self._attentions:
                self.rounds.plain.setdefault(name, []).append(self._plain_segment(name, self._steps, device))
            self._on_round()
        reset_peak_memory(device)
        self._started = time.perf_counter()

    def _start_plain(self, device: torch.device) -> None:
        """Build the plain loop and train it ``warmup`` steps in every attention."""
        self._held["train_py"] = allocated_gib(device)
        reset_peak_memory(device)
        self._plain = self._make_plain()
        warmup_peaks = [self._plain_segment(name, self._warmup, device).peak_gib for name in self._attentions]
        self._warmup_peak["plain"] = max(warmup_peaks)
        self._held["plain"] = allocated_gib(device) - self._held["train_py"]

    def _plain_segment(self, attention: str, steps: int, device: torch.device) -> Measurement:
        self._plain.use_attention(attention)
        reset_peak_memory(device)
        ms = 1e3 * timed(lambda: [self._plain.step() for _ in range(steps)], device) / steps
        peak = peak_memory_gib(device) - self._held["train_py"]
        return Measurement(ms, max(peak, self._warmup_peak["plain"]))
