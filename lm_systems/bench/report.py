"""Shared output for every benchmark: environment header, printed table, CSV + markdown (+ PNG) files."""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import importlib.util
import os
import platform
from pathlib import Path
from typing import Callable, Sequence

import torch

RUNS_DIR = Path("runs/bench")  # git-ignored; the committed results are benchmarks/results/


def add_out_dir_arg(parser: argparse.ArgumentParser) -> None:
    """``--out-dir``: where every benchmark writes; ad-hoc runs stay out of the committed results."""
    parser.add_argument("--out-dir", type=Path, default=RUNS_DIR,
                        help=f"where CSV / markdown / PNG go (default {RUNS_DIR}; benchmarks/results replaces the "
                             "committed result)")


def environment() -> dict[str, str]:
    """Hardware, library versions and date: the header every result file carries."""
    info = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host_cpu": _cpu_name(),
        "cpu_count": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["gpu"] = f"{len(names)} × {names[0]}" if len(set(names)) == 1 else ", ".join(names)
        info["cuda"] = str(torch.version.cuda)
    else:
        info["gpu"] = "none"
    for package in ("triton", "lightning"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = "not installed"
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: Sequence[dict],
    title: str,
    notes: str = "",
    columns: Sequence[str] | None = None,
    plot: Callable[[Path], None] | None = None,
    out_dir: Path | str = RUNS_DIR,
) -> dict[str, Path]:
    """Print ``rows`` as a table and write ``<name>.csv``, ``<name>.md`` (and ``<name>.png`` via ``plot``).

    The CSV is long-format (one row per measurement) with the environment repeated in each row, so
    results from several machines concatenate cleanly; the markdown carries it once as a header.
    """
    if not rows:
        raise ValueError(f"benchmark {name!r} produced no rows")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    columns = list(columns or dict.fromkeys(k for row in rows for k in row))
    paths = {"csv": out_dir / f"{name}.csv", "md": out_dir / f"{name}.md"}

    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, *env], extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**{c: row.get(c, "") for c in columns}, **env})

    table = markdown_table(rows, columns)
    header = "\n".join(f"- {k}: {v}" for k, v in env.items())
    body = f"# {title}\n\n{header}\n\n{notes.strip()}\n\n{table}\n" if notes else f"# {title}\n\n{header}\n\n{table}\n"
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
        plot = None
    if plot is not None:
        paths["png"] = out_dir / f"{name}.png"
        plot(paths["png"])
        body += f"\n![{title}]({paths['png'].name})\n"
    paths["md"].write_text(body)

    print(f"\n{title}  ({env['gpu'] if env['gpu'] != 'none' else env['host_cpu']}, torch {env['torch']}, {env['date']})")
    print(table)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return paths
