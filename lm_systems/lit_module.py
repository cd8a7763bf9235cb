"""LitLM: the LightningModule that trains a TransformerLM (loss, metrics, optimizer, schedule, sample)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Optional

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric

from lm_systems.attention import resolve_attention_name
from lm_systems.config import ModelConfig
from lm_systems.generate import sample_text
from lm_systems.model import RMSNorm, TransformerLM
from lm_systems.schedule import warmup_cosine


class LitLM(L.LightningModule):
    """Next-token training of a TransformerLM with AdamW and a warm-up + cosine schedule.

    Args:
        size: named model size (tiny, small, medium, large, xl, 2.7b).
        vocab_size: rows of the embedding and LM head; None takes the data's tokenizer vocabulary.
        context_length: longest sequence; None takes the size's default. The data windows follow it.
        d_model: override the size's model width.
        num_layers: override the size's depth.
        num_heads: override the size's head count.
        d_ff: override the size's feed-forward width.
        attention: attention implementation (auto, naive, sdpa, flash_torch, flash_triton).
        lr: peak learning rate, reached after warm-up.
        min_lr_ratio: the cosine decays to lr × min_lr_ratio.
        warmup_steps: optimizer steps of linear warm-up.
        decay_steps: step at which the cosine reaches its floor; None means trainer.max_steps.
        weight_decay: AdamW weight decay on matrices (never on norms or embeddings).
        betas: AdamW betas.
        compile: torch.compile each Transformer block in place (data-parallel strategies keep overlapping
            the gradient all-reduces with backward, which a whole compiled model would not let them).
        sample_prompt: prompt of the sample printed after training ('' skips it).
        sample_tokens: length of that sample.
    """

    def __init__(
        self,
        size: str = "tiny",
        vocab_size: Optional[int] = None,
        context_length: Optional[int] = None,
        d_model: Optional[int] = None,
        num_layers: Optional[int] = None,
        num_heads: Optional[int] = None,
        d_ff: Optional[int] = None,
        attention: str = "auto",
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 30,
        decay_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        compile: bool = False,
        sample_prompt: str = "Once upon a time",
        sample_tokens: int = 48,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if lr <= 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0:
            raise ValueError(
                "need model.lr > 0, 0 <= model.min_lr_ratio <= 1 and model.warmup_steps >= 0, got "
                f"{lr}, {min_lr_ratio}, {warmup_steps}"
            )
        resolve_attention_name(attention)
        # Validates the size and every override now, even while the vocabulary is still unknown.
        self._config = ModelConfig.from_name(
            size, context_length=context_length, d_model=d_model, num_layers=num_layers,
            num_heads=num_heads, d_ff=d_ff, attention=attention, vocab_size=vocab_size,
        )
        self.model: TransformerLM | None = TransformerLM(self._config) if vocab_size is not None else None
        self.flops_per_batch: float | None = None
        self.val_loss = MeanMetric()
        self._last_step_time: float | None = None
        self._compiled = False

    @property
    def context_length(self) -> int:
        return self._config.context_length

    # -- setup -------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        data_vocab = getattr(datamodule, "vocab_size", None)
        data_context = getattr(datamodule, "context_length", None)
        if self.model is None:
            if data_vocab is None:
                raise ValueError("model.vocab_size is unset and the datamodule has no tokenizer to take it from")
            self._config = ModelConfig(**{**asdict(self._config), "vocab_size": data_vocab})
            self.hparams["vocab_size"] = data_vocab  # checkpoints record the resolved value
            self.model = TransformerLM(self._config)
        if data_vocab is not None and data_vocab > self._config.vocab_size:
            raise ValueError(
                f"the tokenizer has {data_vocab} tokens but model.vocab_size is {self._config.vocab_size}: "
                "raise --model.vocab_size (or leave it unset to follow the tokenizer)"
            )
        if data_context is not None and data_context > self._config.context_length:
            raise ValueError(
                f"data windows of {data_context} tokens exceed the model's context_length "
                f"{self._config.context_length}: set --model.context_length to at least {data_context}"
            )
        if data_context is not None and getattr(datamodule, "batch_size", None):
            tokens = datamodule.batch_size * data_context
            self.flops_per_batch = self.model.flops_per_token(data_context) * tokens
        if self.hparams.compile and not self._compiled:  # setup runs once per stage (fit, validate, …)
            self.model.compile_blocks()
            self._compiled = True
        rank_zero_info(
            f"TransformerLM {self.hparams.size}: {self.model.num_parameters() / 1e6:.2f}M parameters, "
            f"{self.model.flops_per_token(data_context) / 1e6:.1f} MFLOP/token (training), "
            f"attention={resolve_attention_name(self._config.attention, self.device)}"
        )

    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for module in self.model.modules():
            for param in module.parameters(recurse=False):
                if not param.requires_grad:
                    continue
                is_norm_or_embedding = isinstance(module, (RMSNorm, torch.nn.Embedding))
                (no_decay if is_norm_or_embedding or param.ndim < 2 else decay).append(param)
        on_cuda = all(p.is_cuda for p in decay + no_decay)
        # Fused AdamW unscales inside step(), so with a GradScaler (16-mixed) clipping would see scaled grads.
        uses_grad_scaler = str(self.trainer.precision).startswith("16")
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=tuple(self.hparams.betas),
            fused=on_cuda and not uses_grad_scaler,
        )
        decay_steps = self.hparams.decay_steps or self.trainer.max_steps
        if decay_steps is None or decay_steps <= 0:
            raise ValueError("the cosine schedule needs a length: set --max_steps (or --model.decay_steps)")
        warmup, min_ratio = self.hparams.warmup_steps, self.hparams.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, decay_steps, min_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- steps -------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        logits = self.model(inputs)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/perplexity", loss.detach().exp())
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_step_time is not None:
            tokens = batch.shape[0] * (batch.shape[1] - 1) * self.trainer.world_size
            self.log("train/tokens_per_s", tokens / (now - self._last_step_time), prog_bar=True)
        self._last_step_time = now

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            self.log("train/grad_norm", torch.nn.utils.get_total_norm(grads))

    def on_validation_epoch_start(self) -> None:
        # Fresh state in this loop's grad mode: a state made under inference_mode (trainer.validate)
        # cannot be updated in place later under no_grad (validation inside fit), nor the reverse.
        self.val_loss.reset()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch), weight=batch.shape[0])

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # averaged over every rank's windows
        # Already equal on every rank; sync_dist only tells Lightning so (one tiny all-reduce per validation).
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/perplexity", loss.exp(), sync_dist=True)
        self._last_step_time = None  # validation time is not training throughput

    # -- checkpoints and the closing sample --------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["model_config"] = asdict(self.model.config)
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        if tokenizer is not None:
            checkpoint["tokenizer"] = tokenizer.to_str()

    def on_fit_end(self) -> None:
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None)
        if self.hparams.sample_prompt and tokenizer is not None and self.trainer.is_global_zero:
            text = sample_text(
                self.model, tokenizer, self.hparams.sample_prompt, max_new_tokens=self.hparams.sample_tokens,
                generator=torch.Generator().manual_seed(0),
            )
            print(f"\nSample after {self.trainer.global_step} steps:\n{text}\n", flush=True)
