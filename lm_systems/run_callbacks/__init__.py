"""The run's own Lightning callbacks, every one that ``lm_systems`` adds to a training run: step and crash checkpoints
(``checkpoints``), the run's ``config.yaml`` (``config_file``), a dead rank reported in one line (``rank_watch``),
the closing summary (``summary``), the training sample (``training_sample``), the non-finite watch
(``nonfinite_watch``) and what a resumed run keeps and changes (``resume_settings``).

``lm_systems.cli`` wires them in by default (LitLM's ``configure_callbacks`` adds the sample, the non-finite watch
and ``ThisRunsOptimizerSettings``); the profiling callbacks a user adds with ``--trainer.callbacks+=`` live in the
top-level ``callbacks/``, which ``lm_systems`` never imports.
"""
