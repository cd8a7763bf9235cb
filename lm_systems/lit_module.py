"""LitLM: the LightningModule that trains a TransformerLM (loss, metrics, optimizer and schedule, their logging)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Optional

import lightning.pytorch as L
import torch
from torchmetrics import MeanMetric

from lm_systems.compat.lightning import attached_trainer, logs_this_step
from lm_systems.model.config import ModelConfig
from lm_systems.model.shape import ModelShape
from lm_systems.model.transformer import TransformerLM
from lm_systems.run.description import describe_model, run_hyperparameters
from lm_systems.run_callbacks.nonfinite_watch import NonFiniteWatch
from lm_systems.run_callbacks.resume_settings import ThisRunsOptimizerSettings
from lm_systems.run_callbacks.training_sample import TrainingSample
from lm_systems.training.checkpoint_record import check_resumed_tokenizer, record_run, refuse_nonfinite
from lm_systems.training.clipping import GradientClipping, clip_grad_norm, global_grad_norm
from lm_systems.training.compile_policy import CompileChoice, compile_model
from lm_systems.training.nonfinite import NonFiniteGuard, NonFinitePolicy, divergence_advice
from lm_systems.training.optim import adamw_param_groups, make_adamw
from lm_systems.training.out_of_memory import RunTerms, named_out_of_memory, strategy_name
from lm_systems.training.recompute_budget import recompute_plan
from lm_systems.training.schedule import check_schedule, warmup_cosine_schedule


class LitLM(L.LightningModule):
    """Next-token training of a TransformerLM with AdamW and a warm-up + cosine schedule.

    The model's options (``--model.size``, ``--model.attention``, ...) are :class:`ModelConfig`'s fields, taken as
    keyword arguments (``model_options``) into one ``ModelConfig``, ``config``, which the model reads; the arguments
    here are the training's.

    Args:
        lr: peak learning rate, reached after warm-up.
        min_lr_ratio: the cosine decays to lr × min_lr_ratio.
        warmup_steps: optimizer steps of linear warm-up.
        decay_steps: step at which the cosine reaches its floor; None means trainer.max_steps.
        weight_decay: AdamW weight decay on matrices (never on norms or embeddings).
        betas: AdamW betas.
        compile: torch.compile the model in place. true: whole in one process; per Transformer block across processes,
            where the data-parallel strategies overlap each block's gradient communication with the rest of backward (a
            whole compiled model hands every gradient over at its end). "blocks" or "model": either everywhere ("blocks"
            compiles one block's graph: faster to start). "buckets" (bucketed_ddp, zero1): one graph per run of blocks
            whose gradients share a bucket: fewer graph boundaries, no bucket launched later.
        sample_prompt: prompt of the sample printed after training, and logged as text (TensorBoard's TEXT tab) then and
            at each validation ('' skips them).
        sample_tokens: length of those samples.
        on_nonfinite: what a non-finite loss or gradient norm does: "stop" ends the run with an error (no checkpoint of
            the unusable weights is written), "skip" drops that step's update. Checked without a host sync, every
            ``log_every_n_steps`` and before each checkpoint.
        max_consecutive_skips: under "skip", stop once this many steps in a row were non-finite.
    """

    def __init__(
        self,
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 30,
        decay_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        compile: CompileChoice = False,
        sample_prompt: str = "Once upon a time",
        sample_tokens: int = 48,
        on_nonfinite: NonFinitePolicy = "stop",
        max_consecutive_skips: int = 10,
        **model_options: Any,
    ) -> None:
        super().__init__()
        config = ModelConfig(**model_options)
        # The options as given (unset ones None), beside the training's: logged in on_fit_start, resolved and with the
        # run's shape; a checkpoint's are the keyword arguments load_from_checkpoint builds its LitLM from.
        self.save_hyperparameters(ignore="model_options", logger=False)
        self.hparams.update({**{f.name: f.default for f in fields(ModelConfig)}, **model_options})
        self._shape = ModelShape(config, vocab_known=self.hparams["vocab_size"] is not None)
        check_schedule(lr, min_lr_ratio, warmup_steps)
        self.model: TransformerLM | None = None
        self.flops_per_batch: float | None = None
        self.val_loss = MeanMetric()
        self._nonfinite = NonFiniteGuard(on_nonfinite, max_consecutive_skips)
        self._clipping = GradientClipping(self._nonfinite)
        self._num_parameters: int | None = None  # counted in configure_model

    @property
    def config(self) -> ModelConfig:
        """The model's options, resolved: the named size's shape where unset, the data's vocabulary where unset."""
        return self._shape.config

    def sharding_units(self) -> tuple[torch.nn.Module, Sequence[torch.nn.Module]]:
        """The model and its Transformer blocks, which zero3 and fsdp2 shard one by one (``ShardingUnits``)."""
        return self.model, list(self.model.blocks)

    def setup(self, stage: str) -> None:
        """Take the vocabulary from the tokenizer where unset (checkpoints record it); check that the data fits."""
        self.hparams["vocab_size"] = self._shape.fit_to_data(getattr(self.trainer, "datamodule", None))

    def configure_model(self) -> None:
        """Build the TransformerLM (``model``) and compile it, once (the Trainer calls this after ``setup``, in the
        strategy's tensor_init_context; load_from_checkpoint too). With data: count flops_per_batch, log the size."""
        if self.model is None:
            batch_size = (self._shape.data_shape or (None, None))[0]
            plan = recompute_plan(self.config, batch_size, attached_trainer(self), bool(self.hparams.compile))
            self.model = TransformerLM(self.config, plan.block_recompute if plan is not None else None)
            if self.hparams.compile:
                compile_model(self.model, self.hparams.compile, attached_trainer(self), self)
        if self._shape.data_shape is not None:
            self.flops_per_batch, self._num_parameters = describe_model(
                self.model, self.hparams.size, self.hparams.compile, self._shape.data_shape, self.trainer
            )

    def configure_callbacks(self) -> list[L.Callback]:
        """The non-finite watch, the sample and, on resume, this run's optimizer settings (Lightning adds them)."""
        return [
            NonFiniteWatch(self._nonfinite, divergence_advice(self.hparams.lr)),
            TrainingSample(self.hparams.sample_prompt, self.hparams.sample_tokens),
            ThisRunsOptimizerSettings(),
        ]

    def on_fit_start(self) -> None:
        if self.logger is not None:
            shape = self._shape.data_shape or (None, None)
            self.logger.log_hyperparams(
                run_hyperparameters(self.hparams, self.config, self.trainer, shape, self._num_parameters)
            )

    def configure_optimizers(self) -> dict[str, Any]:
        # Fused AdamW on CUDA, in every precision: configure_gradient_clipping unscales for it under 16-mixed.
        hp = self.hparams
        optimizer = make_adamw(adamw_param_groups(self.model, hp.weight_decay), hp.lr, hp.betas)
        decay_steps = hp.decay_steps or self.trainer.max_steps
        scheduler = warmup_cosine_schedule(optimizer, hp.warmup_steps, decay_steps, hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        return self.model(inputs, targets)

    def _out_of_memory_named(self, where: str, weights_whole: bool = True) -> Any:
        """Out of memory inside the block ends the run in one line saying ``where`` (:mod:`.training.out_of_memory`)."""
        return named_out_of_memory(where, self._run_terms, lambda: self.device, weights_whole)

    def _run_terms(self) -> RunTerms:
        batch_size, context = self._shape.data_shape or (None, None)
        return RunTerms(
            batch_size=batch_size,
            context_length=context or self.config.context_length,
            activation_checkpointing=self.config.activation_checkpointing,
            memory_budget=self.config.memory_budget,
            strategy=strategy_name(self.trainer.strategy),
            rank=self.trainer.global_rank,
            world_size=self.trainer.world_size,
            step=self.trainer.global_step,
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        with self._out_of_memory_named("the training step's forward"):
            loss = self._loss(batch)
        self._clipping.last_loss = loss.detach()
        # Only on logging steps, not as a progress-bar value: Lightning reads those back to the host after every
        # batch, a wait for the GPU each step (the bar shows the logged value instead).
        if logs_this_step(self.trainer):
            self.log("train/loss", loss)
            self.log("train/perplexity", loss.detach().exp())
            # One rate: both parameter groups follow the same schedule (LearningRateMonitor drew a curve for each).
            # The optimizer's, which this step trains with: a resumed run's scheduler still holds the checkpoint's.
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip by the global gradient norm, watch for non-finite values (:mod:`lm_systems.training.clipping`); log the
        norm."""
        clip_val, algorithm = gradient_clip_val, gradient_clip_algorithm
        for name, value in self._clipping(self.trainer, optimizer, clip_val, algorithm, self._clip_grad_norm).items():
            self.log(name, value)

    def _clip_grad_norm(self, max_norm: float, in_step: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return clip_grad_norm(global_grad_norm(self.trainer, self.model), max_norm, in_step)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with self._out_of_memory_named("the training step's backward"):
            super().backward(loss, *args, **kwargs)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        # The forward and backward run inside (the closure), named there; what is left is clipping and the update.
        with self._out_of_memory_named("the optimizer's step", weights_whole=False):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Free the gradients now: Lightning zeroes them only after the next step's forward, which would then
        # run with a full fp32 copy of the parameters' size still allocated.
        optimizer.zero_grad(set_to_none=True)

    def on_validation_epoch_start(self) -> None:
        # Fresh state in this loop's grad mode: a state made under inference_mode (trainer.validate)
        # cannot be updated in place later under no_grad (validation inside fit), nor the reverse.
        self.val_loss.reset()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        with self._out_of_memory_named("validation"):
            self.val_loss.update(self._loss(batch), weight=batch.shape[0])

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # averaged over every rank's windows
        # Already equal on every rank; sync_dist only tells Lightning so (one tiny all-reduce per validation).
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/perplexity", loss.exp(), sync_dist=True)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_resumed_tokenizer(checkpoint, attached_trainer(self))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Every checkpoint passes here, on every rank, before it is written: none is written of non-finite weights."""
        refuse_nonfinite(self, self.trainer, self._nonfinite, divergence_advice(self.hparams.lr))
        record_run(checkpoint, self.config, self.trainer)
