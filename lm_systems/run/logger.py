"""RunLogger: TensorBoard logging of one run into a version folder no other run shares, read as a person reads it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.tensorboard.summary import hparams
from typing_extensions import override

from lm_systems.compat.lightning import VersionClaimingTensorBoardLogger, is_local_path

_RUN_CHECKPOINT = re.compile(r"^version_(\d+)$")


class RunLogger(VersionClaimingTensorBoardLogger):
    """TensorBoardLogger that claims its ``version_N`` folder, shows the hyperparameters against validation loss
    and leaves out the ``epoch`` chart.

    Lightning picks ``max(existing) + 1`` from a listing, so two runs started together in one folder
    both took ``version_0`` and overwrote each other's checkpoints and ``config.yaml``. Here the global
    rank 0 creates the folder, and the first to create it owns it; the other moves on to the next number.

    ``log_hyperparams(params)`` writes them for TensorBoard's HPARAMS tab with ``hp_metric`` as their metric:
    the tab shows that tag's latest value, as the run logs it (Lightning's ``default_hp_metric`` instead logs a
    tag ``hp_metric`` of -1 for the module to overwrite). Lightning adds ``epoch`` to every logged step; over
    ``train.py``'s endless stream of windows it would always read 0, so it is not written.

    Args:
        hp_metric: the scalar tag shown beside the hyperparameters; None: Lightning's ``default_hp_metric``.
        (the rest): as ``TensorBoardLogger``'s.
    """

    def __init__(
        self,
        save_dir: Union[str, Path],
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        hp_metric: Optional[str] = "val/loss",
        **kwargs: Any,
    ) -> None:
        if hp_metric is not None:
            kwargs["default_hp_metric"] = False
        super().__init__(save_dir, name, version, **kwargs)
        self._hp_metric = hp_metric

    @override
    def claim_version(self, version: int) -> int:
        if rank_zero_only.rank != 0 or not is_local_path(self.root_dir):
            return version  # other ranks read rank 0's folder (Lightning broadcasts it); remote stores list
        os.makedirs(self.root_dir, exist_ok=True)
        while True:
            try:
                os.mkdir(os.path.join(self.root_dir, f"version_{version}"))
                return version
            except FileExistsError:
                version += 1

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, metrics: Optional[dict[str, Any]] = None) -> None:
        super().log_hyperparams(params, metrics)  # hparams.yaml; the HPARAMS tab when metrics are given
        if metrics is None and self._hp_metric is not None:
            values = _tensorboard_values(params if isinstance(params, Mapping) else vars(params))
            for summary in hparams(values, {self._hp_metric: None}):  # the metric's value is the run's to log
                self.experiment.file_writer.add_summary(summary)

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        super().log_metrics({name: value for name, value in metrics.items() if name != "epoch"}, step)


def _tensorboard_values(params: Mapping[str, Any], prefix: str = "") -> dict[str, Union[int, float, str, bool]]:
    """``params`` flattened (``{"a": {"b": 1}}`` → ``{"a/b": 1}``) into the values TensorBoard takes; None left out,
    anything else (a bool, a tuple of betas) as its text."""
    values: dict[str, Union[int, float, str, bool]] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            values.update(_tensorboard_values(value, f"{name}/"))
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            values[name] = value
        elif value is not None:
            values[name] = str(value)  # a bool too: TensorBoard's writer would show it as 0.0 or 1.0
    return values


def log_text(logger: Optional[Logger], tag: str, text: str, step: int) -> None:
    """``text`` (markdown) into TensorBoard's TEXT tab under ``tag`` at ``step``; nothing for another logger or
    none. On ranks other than 0 Lightning's experiment does nothing."""
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_text(tag, text, step)


def run_version_of(ckpt_path: str | Path) -> Optional[tuple[str, str, int]]:
    """``(save_dir, name, N)`` of a checkpoint inside ``<save_dir>/<name>/version_N/checkpoints/``, else None."""
    path = Path(ckpt_path).resolve()
    if len(path.parents) < 4 or path.parent.name != "checkpoints":
        return None
    match = _RUN_CHECKPOINT.match(path.parents[1].name)
    if match is None:
        return None
    return str(path.parents[3]), path.parents[2].name, int(match.group(1))
