"""The sample a training run writes: its prompt continued at each validation and at the end, logged as text
(TensorBoard's TEXT tab) and printed once training ends."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lm_systems.run.logger import log_text
from lm_systems.training.sampling import sample_text


class TrainingSample(L.Callback):
    """Continues ``prompt`` by ``tokens`` tokens with the same draws each time, so that samples differ by the weights
    alone ('' takes none), through the LightningModule's forward (tokens → logits) and ``config.context_length``."""

    def __init__(self, prompt: str, tokens: int) -> None:
        self._prompt = prompt
        self._tokens = tokens
        self._last: Optional[tuple[int, str]] = None  # (global step, text) of the last sample taken

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._take(pl_module, trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Sample unless the last validation did at this step, and print it on rank zero. Here, not at the fit's end:
        the model is still on the training device (Lightning moves it to the CPU before on_fit_end, where the Triton
        kernels cannot run)."""
        if self._last is None or self._last[0] != trainer.global_step:
            self._take(pl_module, trainer)
        if self._last is not None and trainer.is_global_zero:
            print(f"\nSample after {trainer.global_step} steps:\n{self._last[1]}\n", flush=True)

    def _take(self, model: torch.nn.Module, trainer: L.Trainer) -> None:
        """Sample now and log it as text at the step the run's metrics are logged at now."""
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if not self._prompt or tokenizer is None:
            return
        # Every rank samples the same tokens, so a sharding container's gathers find all ranks; a compiled model runs
        # eagerly, as each new length would recompile it.
        with torch.compiler.set_stance("force_eager"):
            text = sample_text(
                model, tokenizer, self._prompt, max_new_tokens=self._tokens, generator=torch.Generator().manual_seed(0)
            )
        self._last = (trainer.global_step, text)
        shown = f"**{self._prompt}**{text[len(self._prompt) :]}" if text.startswith(self._prompt) else text
        # Lightning logs a step's metrics at its 0-based index: the last finished step's is global_step - 1.
        log_text(trainer.logger, "sample", shown, trainer.global_step - 1)
