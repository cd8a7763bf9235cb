"""LitLM: the LightningModule that trains a TransformerLM (loss, metrics, optimizer, schedule, sample)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Literal, Optional, Union

import lightning.pytorch as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric

from lm_systems.attention import describe_attention
from lm_systems.compat.lightning import attached_trainer, logs_this_step
from lm_systems.compat.torch import can_scale_in_step, scale_in_step, skip_step_on_device, unscales_in_step
from lm_systems.config import ModelConfig
from lm_systems.data.tokenizer import tokenizer_mismatch
from lm_systems.errors import InputError
from lm_systems.model import TransformerLM
from lm_systems.nonfinite import (NonFiniteGuard, NonFinitePolicy, NonFiniteWeightsError, divergence_advice,
                                  weights_are_finite)
from lm_systems.optim import adamw_param_groups, make_adamw
from lm_systems.run_logger import log_text
from lm_systems.sampling import sample_text
from lm_systems.schedule import warmup_cosine


class LitLM(L.LightningModule):
    """Next-token training of a TransformerLM with AdamW and a warm-up + cosine schedule.

    The model's shape is given as flat arguments (a named size, then any field overridden) and resolved into
    ``config``; the TransformerLM itself (``model``) is built in ``configure_model``, which the Trainer calls
    after ``setup`` inside the strategy's ``tensor_init_context`` (weights created on the training device) and
    ``load_from_checkpoint`` calls before loading the weights. Outside both, call ``configure_model()`` yourself.

    Args:
        size: named model size (tiny, small, medium, large, xl, 2.7b, 8b).
        vocab_size: rows of the embedding and LM head; None takes the data's tokenizer vocabulary.
        context_length: longest sequence; None takes the size's default. The data windows follow it.
        d_model: override the size's model width.
        num_layers: override the size's depth.
        num_heads: override the size's head count.
        d_ff: override the size's feed-forward width.
        rope_theta: override the RoPE base (10,000 by default).
        attention: attention implementation (auto, naive, sdpa, flash_torch, flash_triton).
        activation_checkpointing: what backward recomputes instead of keeping: "none"; "blocks" (each Transformer
            block's input only, the block run again in backward: the least memory, one more forward);
            "keep_attention" (as blocks, each block's attention output kept too: its recompute is the costliest at
            long context); "selective" (matmul and attention outputs kept, the elementwise work recomputed).
        fused_loss: the LM head and cross-entropy over chunks of tokens, never holding every position's logits
            (at vocabulary V and N tokens the plain loss holds N × V float32 logits and their gradient).
        lr: peak learning rate, reached after warm-up.
        min_lr_ratio: the cosine decays to lr × min_lr_ratio.
        warmup_steps: optimizer steps of linear warm-up.
        decay_steps: step at which the cosine reaches its floor; None means trainer.max_steps.
        weight_decay: AdamW weight decay on matrices (never on norms or embeddings).
        betas: AdamW betas.
        compile: torch.compile the model in place. true: whole in one process; each Transformer block on its
            own across processes, where the data-parallel strategies overlap each block's gradient communication
            with the rest of backward (a whole compiled model hands every gradient over at its end). "blocks"
            or "model" choose either everywhere ("blocks" compiles one block's graph: faster to start).
            "buckets" (bucketed_ddp, zero1): one graph per run of blocks whose gradients share a bucket, fewer
            graph boundaries than "blocks" and no bucket launched later.
        sample_prompt: prompt of the sample printed after training, and logged as text (TensorBoard's TEXT tab)
            then and at each validation ('' skips them).
        sample_tokens: length of those samples.
        on_nonfinite: what a non-finite loss or gradient norm does: "stop" ends the run with an error (the
            weights are no longer usable; no checkpoint of them is written), "skip" drops that step's update.
            Checked without a host sync, every ``log_every_n_steps`` and before each checkpoint.
        max_consecutive_skips: under "skip", stop once this many steps in a row were non-finite.
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
        rope_theta: Optional[float] = None,
        attention: str = "auto",
        activation_checkpointing: Literal["none", "blocks", "keep_attention", "selective"] = "none",
        fused_loss: bool = True,
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 30,
        decay_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        compile: Union[bool, Literal["blocks", "model", "buckets"]] = False,
        sample_prompt: str = "Once upon a time",
        sample_tokens: int = 48,
        on_nonfinite: NonFinitePolicy = "stop",
        max_consecutive_skips: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)  # logged in on_fit_start, resolved and with the run's shape
        if lr <= 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0:
            raise ValueError(
                "need model.lr > 0, 0 <= model.min_lr_ratio <= 1 and model.warmup_steps >= 0, got "
                f"{lr}, {min_lr_ratio}, {warmup_steps}"
            )
        # Validates the size and every override (the attention's name included) now, even while the vocabulary is
        # still unknown.
        self._config = ModelConfig.from_name(
            size, context_length=context_length, d_model=d_model, num_layers=num_layers,
            num_heads=num_heads, d_ff=d_ff, rope_theta=rope_theta, attention=attention, vocab_size=vocab_size,
            activation_checkpointing=activation_checkpointing, fused_loss=fused_loss,
        )
        self.model: TransformerLM | None = None
        self.flops_per_batch: float | None = None
        self._data_shape: tuple[Optional[int], Optional[int]] | None = None  # (batch size, context), from setup
        self.val_loss = MeanMetric()
        self._nonfinite = NonFiniteGuard(on_nonfinite, max_consecutive_skips)
        self._last_loss: torch.Tensor | None = None
        self._optimizer_settings: list[dict[str, Any]] | None = None  # from configure_optimizers
        self._sample: tuple[int, str] | None = None  # (global step, text) of the last sample taken
        self._num_parameters: int | None = None  # counted in configure_model

    @property
    def config(self) -> ModelConfig:
        """The model's configuration: the named size with this module's overrides and the resolved vocabulary."""
        if self.hparams.vocab_size is None:
            raise RuntimeError(
                "the model's vocabulary is not known yet: it is the datamodule's tokenizer's, taken when a Trainer "
                "sets this module up (or set --model.vocab_size)"
            )
        return self._config

    @property
    def context_length(self) -> int:
        return self._config.context_length

    # -- setup -------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Take the vocabulary from the datamodule's tokenizer where it is unset; check that the data fits the model."""
        datamodule = getattr(self.trainer, "datamodule", None)
        data_vocab = getattr(datamodule, "vocab_size", None)
        data_context = getattr(datamodule, "context_length", None)
        if self.hparams.vocab_size is None:
            if data_vocab is None:
                raise ValueError("model.vocab_size is unset and the datamodule has no tokenizer to take it from")
            self._config = replace(self._config, vocab_size=data_vocab)
            self.hparams["vocab_size"] = data_vocab  # checkpoints record the resolved value
        if data_vocab is not None and data_vocab > self.config.vocab_size:
            raise InputError(
                f"the tokenizer has {data_vocab} tokens but model.vocab_size is {self.config.vocab_size}: raise "
                "--model.vocab_size (or leave it unset to follow the tokenizer); resuming from a checkpoint, use the "
                "--data.corpus, --data.vocab_size and --data.tokenizer it was trained with"
            )
        if data_context is not None and data_context > self.config.context_length:
            raise InputError(
                f"data windows of {data_context} tokens exceed the model's context_length "
                f"{self.config.context_length}: set --model.context_length to at least {data_context}"
            )
        self._data_shape = (getattr(datamodule, "batch_size", None), data_context)

    def configure_model(self) -> None:
        """Build the TransformerLM (and compile it) once: Lightning calls this hook at every fit, validate,
        test and predict, and ``load_from_checkpoint`` calls it too. After a Trainer's ``setup``, also count
        ``flops_per_batch`` for the data's batches (ThroughputMonitor and MFUMonitor read it) and log the size."""
        if self.model is None:
            self.model = TransformerLM(self.config)
            if self.hparams.compile:
                self._compile_model()
        if self._data_shape is None:
            return
        batch_size, data_context = self._data_shape
        if batch_size and data_context:
            self.flops_per_batch = self.model.flops_per_token(data_context) * batch_size * data_context
        self._num_parameters = self.model.num_parameters()  # whole: a sharding strategy has not split them yet
        rank_zero_info(
            f"TransformerLM {self.hparams.size}: {self._num_parameters / 1e6:.2f}M parameters at vocab "
            f"{self.config.vocab_size}, {self.model.flops_per_token(data_context) / 1e6:.1f} MFLOP/token (training), "
            f"attention={describe_attention(self.config.attention, self.hparams.compile)}; training on "
            f"{_devices(self.trainer)} in {self.trainer.precision}"
        )

    def _compile_model(self) -> None:
        """Per block where gradients are reduced across processes, so that each block's are ready as its backward
        ends; else the whole model, whose one graph launches its kernels with less host work per step (unless
        ``compile`` names one of the two). "buckets": per run of blocks that the strategy's ``block_runs`` gives."""
        trainer = attached_trainer(self)
        across_processes = trainer is not None and trainer.world_size > 1
        if self.hparams.compile == "buckets":
            block_runs = getattr(trainer.strategy, "block_runs", None) if trainer is not None else None
            if block_runs is None:
                strategy = type(trainer.strategy).__name__ if trainer is not None else "no trainer"
                raise InputError(f"--model.compile buckets compiles the blocks whose gradients share a bucket as one "
                                 f"graph: it needs a bucketing strategy (--strategy bucketed_ddp or zero1), got "
                                 f"{strategy}; use --model.compile true")
            runs = block_runs(self, self.model.blocks)
            self.model.compile_blocks(runs=runs)
            rank_zero_info(f"--model.compile buckets: the {len(self.model.blocks)} blocks compiled in {len(runs)} runs "
                           f"of {', '.join(map(str, runs))} (one graph a run, whose gradients share a bucket)")
        elif self.hparams.compile == "blocks" or (self.hparams.compile is True and across_processes):
            self.model.compile_blocks()
        else:
            self.model.compile()

    def on_fit_start(self) -> None:
        if self.logger is not None:
            self.logger.log_hyperparams(self._run_hyperparameters())

    def _run_hyperparameters(self) -> dict[str, Any]:
        """What TensorBoard's HPARAMS tab compares runs by: this module's training settings with the model's shape
        resolved (the vocabulary the tokenizer gave), its size, and the batches and steps it trains on."""
        trainer, (batch_size, context) = self.trainer, self._data_shape or (None, None)
        # Not LightningCLI's _instantiator, nor the sample's settings, which change nothing trained.
        settings = {k: v for k, v in self.hparams.items() if not k.startswith(("_", "sample_"))}
        per_batch = batch_size * context if batch_size and context else None
        tokens = per_batch * trainer.world_size * trainer.accumulate_grad_batches if per_batch else None
        return {
            **settings, **asdict(self.config), "parameters": self._num_parameters, "batch_size": batch_size,
            "tokens_per_step": tokens, "max_steps": trainer.max_steps, "precision": trainer.precision,
            "devices": trainer.world_size, "strategy": type(trainer.strategy).__name__,
        }

    def configure_optimizers(self) -> dict[str, Any]:
        # Fused AdamW on CUDA, in every precision: configure_gradient_clipping unscales for it under 16-mixed.
        optimizer = make_adamw(adamw_param_groups(self.model, self.hparams.weight_decay), self.hparams.lr,
                               self.hparams.betas)
        decay_steps = self.hparams.decay_steps or self.trainer.max_steps
        if decay_steps is None or decay_steps <= 0:
            raise InputError("the cosine schedule needs a length: set --max_steps (or --model.decay_steps)")
        # This run's settings, before the scheduler adds its own: a resumed run restores the checkpoint's over them.
        self._optimizer_settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        warmup, min_ratio = self.hparams.warmup_steps, self.hparams.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, decay_steps, min_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path is not None and self._optimizer_settings is not None:
            self._take_this_runs_optimizer_settings()

    def _take_this_runs_optimizer_settings(self) -> None:
        """Lightning restores the optimizer's and the schedule's state with the settings they were saved with (peak
        learning rate, betas, weight decay); a resumed run trains with its own, at the schedule's current step."""
        optimizer = self.trainer.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        for group, settings in zip(optimizer.param_groups, self._optimizer_settings):
            group.update(settings, initial_lr=settings["lr"])
        scheduler.base_lrs = [settings["lr"] for settings in self._optimizer_settings]
        for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(scheduler.last_epoch)

    # -- steps -------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        return self.model(inputs, targets)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._last_loss = loss.detach()
        # Only on logging steps, and not as a progress-bar value: Lightning reads those back to the host after
        # every batch, which makes each step wait for the GPU. The bar shows the logged value instead.
        if self._logs_this_step():
            self.log("train/loss", loss)
            self.log("train/perplexity", loss.detach().exp())
            # One rate: both parameter groups follow the same schedule (LearningRateMonitor drew a curve for each).
            # The optimizer's, which this step trains with: a resumed run's scheduler still holds the checkpoint's.
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def _logs_this_step(self) -> bool:
        """Whether Lightning logs the optimizer step now running (every ``log_every_n_steps``, and the last);
        the same answer from ``training_step`` through ``on_train_batch_end``."""
        return logs_this_step(self.trainer)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip by the global gradient norm, watch for non-finite values, and log the norm.

        Done here rather than by Lightning's precision plugin, which refuses to clip for an optimizer that
        unscales inside ``step()`` (fused AdamW), even under bf16-mixed where nothing is scaled.
        """
        if gradient_clip_val and gradient_clip_algorithm not in (None, "norm"):
            given = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)  # Lightning passes its enum
            raise InputError(f"only clipping by norm is supported, got --trainer.gradient_clip_algorithm {given}")
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        log_now = self._logs_this_step()
        needs_norm = bool(gradient_clip_val) or log_now or self._nonfinite.policy == "skip"
        if scaler is not None and unscales_in_step(optimizer):
            # 16-mixed: the optimizer would unscale in step(); the norm needs it now, and a sharding scaler
            # agrees on overflow across ranks only in unscale_.
            scaler.unscale_(optimizer)
        # Else fused AdamW can clip inside its step.
        clips_in_step = scaler is None and can_scale_in_step(optimizer)
        grad_norm = divisor = None
        if needs_norm:
            grad_norm, divisor = self._clip_grad_norm(gradient_clip_val or float("inf"), clips_in_step)
        if clips_in_step:
            scale_in_step(optimizer, divisor)  # set, or cleared, every step: none keeps another's
        # Under a GradScaler, overflowing gradients are the scaler's to skip; the loss is still ours to watch.
        bad = self._nonfinite.observe(self.trainer.global_step, self._last_loss,
                                      grad_norm if scaler is None else None)
        if self._nonfinite.policy == "skip" and scaler is None:
            self._skip_update_if(bad, optimizer)
        if log_now and grad_norm is not None:
            self.log("train/grad_norm", grad_norm)
            if self._nonfinite.policy == "skip":  # under "stop" it would always read 0: the run stops instead
                self.log("train/skipped_steps", self._nonfinite.skipped_steps.float())

    def _clip_grad_norm(self, max_norm: float, in_step: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Scale the gradients to a global norm of at most ``max_norm``: the norm before clipping, and None.

        ``in_step`` (the optimizer ``can_scale_in_step``): the gradients are left as they are, and the divisor
        ``max(1, norm / max_norm)`` is returned for the step to apply inside the update's own pass over them (one
        read and write of every gradient fewer than scaling them first).
        """
        wrapper = self.trainer.strategy.model  # a sharding container knows the norm over every rank
        if not in_step:
            clip = getattr(wrapper, "clip_grad_norm_", None)
            if clip is not None:
                return clip(max_norm), None
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm), None
        norm = getattr(wrapper, "grad_norm", None)
        total = norm() if norm is not None else torch.nn.utils.get_total_norm(
            [p.grad for p in self.model.parameters() if p.grad is not None])
        # torch's clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)): the same, as a divisor.
        return total, ((total.float() + 1e-6) / max_norm).clamp_(min=1.0)

    @staticmethod
    def _skip_update_if(bad: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        if unscales_in_step(optimizer):
            skip_step_on_device(optimizer, bad)  # fused AdamW skips its update on the device: no host sync
        elif bad:  # other optimizers: one host sync; parameters without gradients are not updated
            optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Free the gradients now: Lightning zeroes them only after the next step's forward, which would then
        # run with a full fp32 copy of the parameters' size still allocated.
        optimizer.zero_grad(set_to_none=True)

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        # On a logged step Lightning reads the logged values now anyway; under "skip", also when the limit may be met.
        if self._logs_this_step() or self._nonfinite.check_due():
            self._nonfinite.check(self._nonfinite_advice())

    def _nonfinite_advice(self) -> str:
        return divergence_advice(self.hparams.lr)

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
        if self.trainer.state.fn == TrainerFn.FITTING and not self.trainer.sanity_checking:
            self._take_sample()

    # -- checkpoints and the closing sample --------------------------------------------------

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A run resumed by a Trainer must tokenize its data as the checkpoint's run did."""
        tokenizer = getattr(getattr(attached_trainer(self), "datamodule", None), "tokenizer", None)
        mismatch = tokenizer_mismatch(checkpoint.get("tokenizer"), tokenizer.to_str() if tokenizer else None)
        if mismatch is not None:
            raise InputError(mismatch)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Every checkpoint passes here, on every rank, before it is written: none is written of weights that went
        non-finite (the ranks agree, so that all of them stop together, none waiting in the save's collectives)."""
        self._nonfinite.check(self._nonfinite_advice())
        if not self.trainer.strategy.reduce_boolean_decision(weights_are_finite(self.parameters()), all=True):
            raise NonFiniteWeightsError(self.trainer.global_step)
        checkpoint["model_config"] = asdict(self.config)
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        if tokenizer is not None:
            checkpoint["tokenizer"] = tokenizer.to_str()

    def on_train_end(self) -> None:
        self._nonfinite.check(self._nonfinite_advice())
        # Here, not in on_fit_end: the model is still on the training device (Lightning moves it to the CPU
        # before on_fit_end, where the Triton kernels cannot run).
        if self._sample is None or self._sample[0] != self.trainer.global_step:  # else the last validation's
            self._take_sample()
        if self._sample is not None and self.trainer.is_global_zero:
            print(f"\nSample after {self.trainer.global_step} steps:\n{self._sample[1]}\n", flush=True)

    def _take_sample(self) -> None:
        """Continue ``sample_prompt`` (the same draws each time, so samples differ by the weights alone) and log
        it as text at the step the run's metrics are logged at now."""
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None)
        if not self.hparams.sample_prompt or tokenizer is None:
            return
        # Every rank samples the same tokens, so a sharding container's gathers find all ranks; a compiled model
        # runs eagerly, as each new length would recompile it.
        with torch.compiler.set_stance("force_eager"):
            text = sample_text(
                self.model, tokenizer, self.hparams.sample_prompt, max_new_tokens=self.hparams.sample_tokens,
                generator=torch.Generator().manual_seed(0),
            )
        self._sample = (self.trainer.global_step, text)
        prompt = self.hparams.sample_prompt
        shown = f"**{prompt}**{text[len(prompt):]}" if text.startswith(prompt) else text
        # Lightning logs a step's metrics at its 0-based index: the last finished step's is global_step - 1.
        log_text(self.logger, "sample", shown, self.trainer.global_step - 1)


def _devices(trainer: L.Trainer) -> str:
    """Where ``trainer`` runs, as "cpu" or "2 × NVIDIA H100 80GB HBM3"."""
    device = trainer.strategy.root_device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{trainer.world_size} × {name}" if trainer.world_size > 1 else name
