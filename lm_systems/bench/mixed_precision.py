"""Where low precision loses accuracy, and which dtypes autocast picks: ``python -m lm_systems.bench.mixed_precision``.

Two tables:
1. ``mixed_precision_accumulation``: 0.01 added 1000 times with the accumulator and the addend in
   fp32 / fp16 / bf16 combinations; the exact answer is 10.
2. ``mixed_precision_autocast``: the dtype of every tensor of interest in a small toy model
   (Linear → ReLU → LayerNorm → Linear) and in a tiny TransformerLM under fp16 autocast, from
   parameters through loss to gradients.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_systems.bench.device import add_device_arg
from lm_systems.bench.report import argument_parser, write_results
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


def dtype_rows(model_name: str, model: nn.Module, watched: dict[str, nn.Module],
               step: Callable[[], tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> list[dict]:
    """Dtypes of the parameters, the ``watched`` modules' outputs, the output, loss and gradients of one
    fp16-autocast ``step`` (returning output and loss)."""
    seen: dict[str, str] = {}
    hooks = [module.register_forward_hook(lambda _m, _i, out, name=name: seen.update({name: _name(out.dtype)}))
             for name, module in watched.items()]  # a hook returning None leaves the output as it is
    with torch.autocast(device.type, dtype=torch.float16):
        output, loss = step()
    loss.backward()
    for hook in hooks:
        hook.remove()
    tensors = {
        "parameters": {_name(p.dtype) for p in model.parameters()},
        **{f"{name} output": {dtype} for name, dtype in seen.items()},
        "model output (logits)": {_name(output.dtype)},
        "loss": {_name(loss.dtype)},
        "gradients": {_name(p.grad.dtype) for p in model.parameters()},
    }
    return [{"model": model_name, "tensor": name, "dtype": ", ".join(sorted(d))} for name, d in tensors.items()]


def autocast_rows(device: torch.device) -> list[dict]:
    toy = ToyModel(32, 5).to(device)
    x, y = torch.randn(8, 32, device=device), torch.randint(0, 5, (8,), device=device)

    def toy_step():
        logits = toy(x)
        return logits, F.cross_entropy(logits, y)

    config = ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    lm = TransformerLM(config).to(device)
    tokens = torch.randint(0, 50, (2, 17), device=device)

    def lm_step():
        logits = lm(tokens[:, :-1])  # (B, T, V)
        return logits, F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    block = lm.blocks[0]
    lm_watched = {"embedding": lm.embedding, "RMSNorm": block.attn_norm, "attention": block.attn,
                  "SwiGLU": block.ffn, "block (residual stream)": block}
    return (dtype_rows("ToyModel", toy, {"fc1": toy.fc1, "relu": toy.relu, "ln": toy.ln}, toy_step, device)
            + dtype_rows("TransformerLM", lm, lm_watched, lm_step, device))


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    add_device_arg(parser)
    args = parser.parse_args(argv)
    write_results(
        "mixed_precision_accumulation", accumulation_rows(),
        title="Accumulating 0.01 a thousand times (exact: 10)",
        notes="`error` = result − 10. `accumulator_rounding` = result − 1000 × the addend as stored: what "
        "the accumulator's own rounding cost beyond the addend's representation error. Computed on the CPU "
        "(IEEE rounding is the same on every device).",
        out_dir=args.out_dir,
    )
    note = f"fp16 autocast on {args.device.type}"
    write_results(
        "mixed_precision_autocast", autocast_rows(args.device), title=f"Dtypes under {note}",
        notes=f"{note}. Output dtypes recorded with forward hooks during one autocast forward; the loss "
        "and backward follow it. Autocast casts matmul inputs; it leaves parameters and gradients in fp32.",
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    main()
