"""A tiny LightningModule, data and a recording callback for the strategy tests, at module level so that
Lightning's spawn launcher can pickle them into its worker processes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (registers the strategy names in worker processes too)
from lm_systems.parallel import ShardedOptimizer, sharded_unit
from lm_systems.parallel.collectives import GradientAverager
from strategies import BucketedDDPStrategy, Zero1Strategy

VOCAB, DIM, SEQ = 23, 11, 6
MICRO_BATCH, ACCUMULATE, WORLD = 3, 2, 2
STEPS_PER_EPOCH, EPOCHS = 2, 2
# Above every gradient norm of these runs (0.86-1.18 on the global batch, twice that if a strategy summed
# instead of averaging), so clipping never engages on correct gradients and the final weights keep the
# gradient's scale; gradients left scaled by a GradScaler (x65536) would be clipped and fail the comparison.
CLIP = 5.0
# Below every gradient norm of these runs, so every step clips: the tests of containers that shard gradients
# (zero3, zero1 reducing to owners) clip at it, and end where one process does only if the norm is over all ranks'.
ENGAGED_CLIP = 0.3
COMMUNICATING = [
    (dist, name) for name in ("all_reduce", "broadcast", "batch_isend_irecv", "all_gather", "reduce_scatter")
]
COMMUNICATING.append((GradientAverager, "start"))  # the containers' gradient all-reduces bypass dist.all_reduce
COMMUNICATING.append((GradientAverager, "start_to_owners"))  # and zero1's reduces to owners dist.reduce
COMMUNICATING.append((sharded_unit, "_reduce_scatter_grads"))  # zero3's gradient reduce-scatters
CHECKPOINTED = ("zero1", "zero3")  # keep their end-of-epoch checkpoints, then resume from epoch 0's


def load_ranks(out_dir, tag: str, ranks: int = 2) -> list[dict]:
    """What each rank's Recorder saved for the run ``tag``."""
    return [torch.load(Path(out_dir) / f"{tag}_rank{r}.pt") for r in range(ranks)]


def token_windows(seed: int, count: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))


class TinyData(L.LightningDataModule):
    """Rank r reads windows r, r + W, ...: with W ranks, one micro-batch step covers the same windows as one
    single-process micro-batch W times larger (Lightning's own distributed sampler would shuffle)."""

    def _loader(self, windows: torch.Tensor) -> DataLoader:
        world_size, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(TensorDataset(windows[rank::world_size]), batch_size=MICRO_BATCH * (WORLD // world_size))

    def train_dataloader(self) -> DataLoader:
        # One epoch is STEPS_PER_EPOCH optimizer steps.
        return self._loader(token_windows(0, WORLD * MICRO_BATCH * ACCUMULATE * STEPS_PER_EPOCH))

    def val_dataloader(self) -> DataLoader:
        return self._loader(token_windows(1, WORLD * MICRO_BATCH * 2))


class TinyLM(L.LightningModule):
    """Tied embedding/head, a frozen layer; re-initialised per rank in ``setup`` so the ranks start apart.
    With ``compile_hidden`` the hidden layer is torch.compiled: its gradients come out of a compiled backward."""

    def __init__(self, compile_hidden: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        if compile_hidden:
            self.hidden.compile()
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1000 + self.global_rank)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def loss(self, batch) -> torch.Tensor:
        (tokens,) = batch
        x = self.embed(tokens[:, :-1])  # (B, T, D)
        logits = self.head(torch.tanh(self.hidden(x)) + self.frozen(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(torch.nn.utils.get_total_norm(grads).item())
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        # A large eps keeps AdamW sensitive to the gradient scale, so a wrong average shows.
        optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=0.05, eps=0.1, weight_decay=0.1
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Recorder(Callback):
    """Counts collectives per training batch and saves what the tests compare, one file per rank."""

    def __init__(self, out_dir: str, tag: str) -> None:
        self.out_dir, self.tag = out_dir, tag
        self.calls = 0
        self.per_batch: list[tuple[int, int]] = []
        self._originals: dict = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        for owner, name in COMMUNICATING:
            original = self._originals[owner, name] = getattr(owner, name)

            def counting(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(owner, name, counting)

    def on_train_start(self, trainer, pl_module) -> None:
        self.wrapper = type(trainer.strategy.model).__name__
        self.launch_thread = getattr(trainer.strategy.model, "_launcher", None) is not None
        self.bucket_size_mb = getattr(trainer.strategy.model, "bucket_size_mb", None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._calls_at_start = self.calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.per_batch.append((batch_idx, self.calls - self._calls_at_start))

    def on_fit_end(self, trainer, pl_module) -> None:
        """Runs after the strategy's teardown, so it also sees whether hooks were left behind."""
        record = {
            "final": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "grad_norms": pl_module.grad_norms,
            "lrs": pl_module.lrs,
            "collectives_per_batch": self.per_batch,
            "val_loss": trainer.callback_metrics["val_loss"].item(),
            "wrapper": self.wrapper,
            "launch_thread": self.launch_thread,
            "bucket_size_mb": self.bucket_size_mb,
            "unwrapped": trainer.strategy.model is pl_module,
            "hooks_left": sum(bool(p._post_accumulate_grad_hooks) for p in pl_module.parameters()),
            "module_hooks_left": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pl_module.modules()),
            "launch_threads_alive": sum(t.name == "lm_systems-launch" for t in threading.enumerate()),
        }
        optimizer = trainer.optimizers[0]
        if isinstance(optimizer, ShardedOptimizer):
            named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
            record["owned"] = [n for n, p in named if optimizer.owner(p) == trainer.global_rank]
            record["state_keys"] = [n for n, p in named if p in optimizer.state]
        torch.save(record, Path(self.out_dir) / f"{self.tag}_rank{trainer.global_rank}.pt")
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)


def make_strategy(name: str):
    """A registered name, ``bucketed_ddp+bf16`` (bucketed_ddp sending its gradients in bf16),
    ``bucketed_ddp+no_thread`` (launching its all-reduces from the gradient hooks themselves) or
    ``zero1+stages1`` (zero1 stepping its whole shard, then exchanging, on the default group), or
    ``bucketed_ddp+compiled`` (bucketed_ddp training a TinyLM with a compiled layer), or ``zero1+all_reduce``
    (zero1 leaving every rank all the averaged gradients, where by default each goes only to the rank that steps it)."""
    if name == "bucketed_ddp+bf16":
        return BucketedDDPStrategy(grad_comm_dtype="bf16")
    if name == "zero1+stages1":
        return Zero1Strategy(exchange_stages=1, comm_high_priority=False)
    if name == "bucketed_ddp+compiled":
        return "bucketed_ddp"
    if name == "zero1+all_reduce":
        return Zero1Strategy(grad_reduce="all_reduce")
    if name == "bucketed_ddp+no_thread":
        return BucketedDDPStrategy(launch_thread=False)
    return name


def make_trainer(
    strategy, devices: int, out_dir: str, tag: str, accelerator: str = "cpu", clip: float = CLIP, **kwargs
) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=STEPS_PER_EPOCH * EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=clip,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(out_dir, tag), *kwargs.pop("callbacks", [])],
        default_root_dir=out_dir,
        use_distributed_sampler=False,
        **kwargs,
    )


def single_process_reference(out_dir, clip: float = CLIP) -> dict:
    """What the two-process runs are compared with: one process, the whole global batch per micro-batch, the
    default (non-distributed) strategy; its record."""
    trainer = make_trainer("auto", 1, str(out_dir), "reference", clip=clip, enable_checkpointing=False)
    trainer.fit(TinyLM(), datamodule=TinyData())
    return torch.load(Path(out_dir) / "reference_rank0.pt")


def join_as_launched_process(rank: int, world_size: int, port: int) -> None:
    """Make this process look started by an external launcher (as torchrun would): Lightning's popen
    launcher then starts nothing, and every Trainer in the process joins (and reuses) one process group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), NODE_RANK="0"
    )


def run_cpu_strategies(
    rank: int, world_size: int, port: int, out_dir: str, names: list[str], clip: float = CLIP
) -> None:
    """Each strategy once; the CHECKPOINTED ones keep their end-of-epoch checkpoints and are then resumed
    from epoch 0's."""
    join_as_launched_process(rank, world_size, port)
    try:
        for name in names:
            if name in CHECKPOINTED:
                checkpoint = ModelCheckpoint(
                    dirpath=Path(out_dir) / f"{name}_ckpt",
                    every_n_epochs=1,
                    save_top_k=-1,
                    save_on_train_epoch_end=True,
                )
                trainer = make_trainer(name, world_size, out_dir, name, clip=clip, callbacks=[checkpoint])
            else:
                trainer = make_trainer(
                    make_strategy(name), world_size, out_dir, name, clip=clip, enable_checkpointing=False
                )
            trainer.fit(TinyLM(), datamodule=TinyData())
        for name in CHECKPOINTED:
            if name in names:
                trainer = make_trainer(
                    name, world_size, out_dir, f"{name}_resumed", clip=clip, enable_checkpointing=False
                )
                trainer.fit(TinyLM(), datamodule=TinyData(), ckpt_path=str(epoch0_checkpoint(out_dir, name)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def epoch0_checkpoint(out_dir, name: str) -> Path:
    return Path(out_dir) / f"{name}_ckpt" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"


def zero1_epoch0_checkpoint(out_dir) -> Path:
    return epoch0_checkpoint(out_dir, "zero1")


class LossAndWeights(Callback):
    """For train.py runs: each rank's training losses and, after the strategy's teardown, its full weights."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def on_fit_end(self, trainer, pl_module) -> None:
        record = {"losses": self.losses, "final": {k: v.detach().clone() for k, v in pl_module.state_dict().items()}}
        torch.save(record, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def run_gpu_strategies(
    rank: int, world_size: int, port: int, out_dir: str, names: list[str], precisions: list[str]
) -> None:
    """Every (strategy, precision) on one GPU per process; checkpoints on, so zero1 consolidates over NCCL."""
    join_as_launched_process(rank, world_size, port)
    try:
        for precision in precisions:
            for name in names:
                trainer = make_trainer(
                    make_strategy(name),
                    world_size,
                    out_dir,
                    f"{name}_{precision}",
                    accelerator="gpu",
                    precision=precision,
                )
                trainer.fit(TinyLM(compile_hidden=name.endswith("+compiled")), datamodule=TinyData())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
