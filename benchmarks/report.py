"""Shared output for every benchmark: its parser, environment header, printed table, CSV + markdown (+ PNG)."""

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
Plot = Callable[[Path], None]


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring as the help, and ``--out-dir`` (ad-hoc runs stay out of
    the committed results)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=RUNS_DIR,
        help=f"where CSV / markdown / PNG go (default {RUNS_DIR}; benchmarks/results replaces the committed result)",
    )
    return parser


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


def format_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_value(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: Sequence[dict],
    title: str,
    notes: str = "",
    columns: Sequence[str] | None = None,
    plot: Plot | None = None,
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
    body = "\n\n".join(part for part in (f"# {title}", header, notes.strip(), table) if part) + "\n"
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
    elif plot is not None:
        paths["png"] = out_dir / f"{name}.png"
        plot(paths["png"])
        body += f"\n![{title}]({paths['png'].name})\n"
    paths["md"].write_text(body)

    hardware = env["gpu"] if env["gpu"] != "none" else env["host_cpu"]
    print(f"\n{title}  ({hardware}, torch {env['torch']}, {env['date']})")
    print(table)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return paths


def line_plot(
    rows: Sequence[dict],
    x: str,
    y: str,
    series: Sequence[str] = (),
    panels: Sequence[str] = (),
    title: str = "",
    yerr: str | None = None,
    log: str = "",
) -> Plot:
    """A ``plot`` for write_results: ``y`` against ``x``, a line per value of the ``series`` columns, a panel
    per value of the ``panels`` columns; ``log`` names the log-scaled axes ("x", "y", "xy"). Rows whose ``y``
    is not a number are left out."""

    def plot(path: Path) -> None:
        plt = _pyplot()
        drawn = [r for r in rows if isinstance(r.get(y), (int, float))]
        names = list(dict.fromkeys(_key(r, panels) for r in drawn))
        fig, axes = plt.subplots(1, len(names), figsize=(1 + 4.5 * len(names), 4), squeeze=False)
        for ax, name in zip(axes[0], names, strict=True):
            in_panel = [r for r in drawn if _key(r, panels) == name]
            for label in dict.fromkeys(_key(r, series) for r in in_panel):
                line = [r for r in in_panel if _key(r, series) == label]
                ax.errorbar(
                    [r[x] for r in line],
                    [r[y] for r in line],
                    yerr=[r[yerr] for r in line] if yerr else None,
                    marker="o",
                    capsize=3,
                    label=label or None,
                )
            ax.set(
                title=name or title,
                xlabel=x,
                ylabel=y,
                xscale="log" if "x" in log else "linear",
                yscale="log" if "y" in log else "linear",
            )
            ax.grid(True, which="both", alpha=0.3)
            if series:
                ax.legend(fontsize=7)
        _save(plt, fig, path)

    return plot


def bar_plot(rows: Sequence[dict], label: str, value: str, title: str) -> Plot:
    """A ``plot`` for write_results: one horizontal bar of ``value`` per row, named by its ``label``."""

    def plot(path: Path) -> None:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(8, 1.5 + 0.35 * len(rows)))
        ax.bar_label(ax.barh([r[label] for r in rows], [r[value] for r in rows]), fmt="%.4g", fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel=value, title=title)
        _save(plt, fig, path)

    return plot


def _key(row: dict, columns: Sequence[str]) -> str:
    return " ".join(str(row[c]) for c in columns)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
