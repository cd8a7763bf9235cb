"""What ``benchmarks.scaling`` compares: setups (``single``, or a strategy with a bucket size, init args, train.py
flags and environment variables) and configurations (context × batch, compiled or eager), parsed from its flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

STRATEGY_CLASSES = {
    "ddp": "lightning.pytorch.strategies.DDPStrategy",
    "naive_ddp": "strategies.NaiveDDPStrategy",
    "overlap_ddp": "strategies.OverlapDDPStrategy",
    "bucketed_ddp": "strategies.BucketedDDPStrategy",
    "zero1": "strategies.Zero1Strategy",
    "zero3": "strategies.Zero3Strategy",
    "fsdp2": "strategies.FSDP2Strategy",
}
BUCKET_ARGS = {"ddp": "bucket_cap_mb", "bucketed_ddp": "bucket_size_mb", "zero1": "bucket_size_mb"}


@dataclass(frozen=True)
class Setup:
    """``name[:bucket_mb][+key=value ...][@VAR=value ...]``, parsed."""

    spec: str
    name: str
    bucket_mb: str | None = None
    init_args: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, spec: str) -> "Setup":
        head, *envs = spec.split("@")
        head, *options = head.split("+")
        name, _, bucket = head.partition(":")
        if name != "single" and name not in STRATEGY_CLASSES or (name == "single" and bucket):
            raise argparse.ArgumentTypeError(
                f"unknown setup {name!r} in {spec!r}: choose single or one of {', '.join(STRATEGY_CLASSES)}"
            )
        if bucket and name not in BUCKET_ARGS:
            raise argparse.ArgumentTypeError(
                f"{name} takes no bucket size ({spec!r}); those that do: {', '.join(BUCKET_ARGS)}"
            )
        pairs = [option.split("=", 1) for option in [*options, *envs]]
        if any(len(pair) != 2 for pair in pairs):
            raise argparse.ArgumentTypeError(f"options and variables are key=value, got {spec!r}")
        return cls(
            spec,
            name,
            bucket or None,
            tuple(map(tuple, pairs[: len(options)])),
            tuple(map(tuple, pairs[len(options) :])),
        )

    def train_py_args(self, devices: int) -> list[str]:
        flags = [arg for key, value in self.init_args if key.startswith("--") for arg in (key, value)]
        init_args = [(key, value) for key, value in self.init_args if not key.startswith("--")]
        if self.name == "single":
            return ["--devices", "1", "--strategy", "auto", *flags]
        if not (self.bucket_mb or init_args):  # the registered name, as a user types it
            return ["--devices", str(devices), "--strategy", self.name, *flags]
        args = ["--devices", str(devices), "--trainer.strategy", STRATEGY_CLASSES[self.name]]
        if self.bucket_mb:
            args += [f"--trainer.strategy.{BUCKET_ARGS[self.name]}", self.bucket_mb]
        for key, value in init_args:
            args += [f"--trainer.strategy.{key}", value]
        return args + flags


@dataclass(frozen=True)
class Config:
    context: int
    batch_size: int
    compile: bool

    @classmethod
    def parse(cls, text: str) -> "Config":
        shape, _, mode = text.partition(":")
        try:
            context, batch = (int(part) for part in shape.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--configs takes CONTEXTxBATCH:compiled|eager, got {text!r}") from None
        if mode not in ("compiled", "eager") or context <= 0 or batch <= 0:
            raise argparse.ArgumentTypeError(
                f"--configs takes CONTEXTxBATCH:compiled|eager with positive sizes, got {text!r}"
            )
        return cls(context, batch, mode == "compiled")

    @property
    def label(self) -> str:
        return f"ctx{self.context}×{self.batch_size} {'compiled' if self.compile else 'eager'}"
