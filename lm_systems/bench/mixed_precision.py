"""Where low precision loses accuracy, and which dtypes autocast picks: ``python -m lm_systems.bench.mixed_precision``.

Two tables:
1. ``mixed_precision_accumulation``: 0.01 added 1000 times with the accumulator and the addend in
   fp32 / fp16 (/ bf16) combinations; the exact answer is 10.
2. ``mixed_precision_autocast``: the dtype of every tensor of interest in a small toy model
   (Linear → ReLU → LayerNorm → Linear) and in a tiny TransformerLM under fp16 autocast (bf16 where
   the device's autocast has no fp16), from parameters through loss to gradients.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_systems.bench.report import add_out_dir_arg, write_results
from lm_systems.config import ModelConfig
from lm_systems.model import TransformerLM

ADDEND, REPEATS, EXACT = 0.01, 1000, 10.0

# (accumulator dtype, addend dtype, cast the addend to the accumulator's dtype first)
VARIANTS = [
    (torch.float32, torch.float32, False),
    (torch.float16, torch.float16, False),
    (torch.float32, torch.float16, False),
    (torch.float32, torch.float16, True),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, True),
]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def accumulate(accumulator: torch.dtype, addend: torch.dtype, cast_first: bool) -> float:
    """``s += x`` ``REPEATS`` times, ``s`` starting at 0 in ``accumulator`` and ``x = ADDEND`` in ``addend``."""
    total = torch.tensor(0, dtype=accumulator)
    x = torch.tensor(ADDEND, dtype=addend)
    for _ in range(REPEATS):
        total += x.to(accumulator) if cast_first else x  # in-place add keeps total's dtype either way
    return total.item()


def accumulation_rows() -> list[dict]:
    rows = []
    for accumulator, addend, cast_first in VARIANTS:
        stored_addend = torch.tensor(ADDEND, dtype=addend).item()
        result = accumulate(accumulator, addend, cast_first)
        variant = f"{_name(addend)} {'cast to' if cast_first else 'added into'} {_name(accumulator)}"
        rows.append({
            "variant": variant if addend != accumulator else f"{_name(accumulator)} throughout",
            "accumulator": _name(accumulator),
            "addend": _name(addend),
            "addend_as_stored": f"{stored_addend:.10g}",
            "result": f"{result:.6g}",
            "error": f"{result - EXACT:+.3g}",
            # Rounding the addend alone would give REPEATS × stored value; the rest is the accumulator's rounding.
            "accumulator_rounding": f"{result - REPEATS * stored_addend:+.3g}",
        })
    return rows


class ToyModel(nn.Module):
    """The CS336 toy: Linear → ReLU → LayerNorm → Linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def autocast_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """fp16 if this device's autocast runs a Linear in fp16, else bf16; with a note saying which and why."""
    probe = nn.Linear(4, 4).to(device)
    with torch.autocast(device.type, dtype=torch.float16):
        if probe(torch.randn(2, 4, device=device)).dtype == torch.float16:
            return torch.float16, f"fp16 autocast on {device.type}"
    return torch.bfloat16, f"bf16 autocast: {device.type} autocast has no fp16, so bf16 stands in for it"


def _record_outputs(modules: dict[str, nn.Module]) -> tuple[dict[str, torch.dtype], list]:
    """Forward hooks noting each module's output dtype (a hook that returned a value would replace the output)."""
    seen: dict[str, torch.dtype] = {}

    def recorder(name: str):
        def hook(_module, _inputs, output) -> None:
            seen[name] = output.dtype

        return hook

    return seen, [module.register_forward_hook(recorder(name)) for name, module in modules.items()]


def _dtype_rows(model_name: str, model: nn.Module, watched: dict[str, nn.Module], forward, dtype, device) -> list[dict]:
    """Dtypes of parameters, watched module outputs, output, loss and gradients of one autocast step."""
    seen, hooks = _record_outputs(watched)
    with torch.autocast(device.type, dtype=dtype):
        output, loss = forward()
    loss.backward()
    for hook in hooks:
        hook.remove()
    tensors = {
        "parameters": {_name(p.dtype) for p in model.parameters()},
        **{f"{name} output": {_name(d)} for name, d in seen.items()},
        "model output (logits)": {_name(output.dtype)},
        "loss": {_name(loss.dtype)},
        "gradients": {_name(p.grad.dtype) for p in model.parameters()},
    }
    return [{"model": model_name, "tensor": name, "dtype": ", ".join(sorted(d))} for name, d in tensors.items()]


def autocast_rows(device: torch.device) -> tuple[list[dict], str]:
    dtype, note = autocast_dtype(device)
    toy = ToyModel(32, 5).to(device)
    x, y = torch.randn(8, 32, device=device), torch.randint(0, 5, (8,), device=device)

    def toy_step():
        logits = toy(x)
        return logits, F.cross_entropy(logits, y)

    rows = _dtype_rows("ToyModel", toy, {"fc1": toy.fc1, "relu": toy.relu, "ln": toy.ln}, toy_step, dtype, device)

    lm = TransformerLM(ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)).to(device)
    tokens = torch.randint(0, 50, (2, 17), device=device)

    def lm_step():
        logits = lm(tokens[:, :-1])  # (B, T, V)
        return logits, F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    block = lm.blocks[0]
    watched = {
        "embedding": lm.embedding, "RMSNorm": block.attn_norm, "attention": block.attn,
        "SwiGLU": block.ffn, "block (residual stream)": block,
    }
    rows += _dtype_rows("TransformerLM", lm, watched, lm_step, dtype, device)
    return rows, note


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lm_systems.bench.mixed_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_out_dir_arg(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible: pass --device cpu")

    write_results(
        "mixed_precision_accumulation", accumulation_rows(),
        title="Accumulating 0.01 a thousand times (exact: 10)",
        notes="`error` = result − 10. `accumulator_rounding` = result − 1000 × the addend as stored: what "
        "the accumulator's own rounding cost beyond the addend's representation error. Computed on the CPU "
        "(IEEE rounding is the same on every device).",
        out_dir=args.out_dir,
    )
    rows, note = autocast_rows(device)
    write_results(
        "mixed_precision_autocast", rows, title=f"Dtypes under {note}",
        notes=f"{note}. Output dtypes recorded with forward hooks during one autocast forward; the loss "
        "and backward follow it. Autocast casts matmul inputs; it leaves parameters and gradients in fp32.",
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    main()
