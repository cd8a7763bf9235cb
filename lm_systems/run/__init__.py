"""A training run as the person who starts it sees it: the command line's parts (``cli_parts``, ``config_files``,
``strategy_flags``, ``help_cache``), checks made at the door (``device_fit``, ``output_folders``, ``cpu_threads``),
the CUDA allocator's settings (``allocator``), resuming with what was typed (``resume``), and what the run writes:
its TensorBoard folder (``logger``) and its description (``description``). The run's Lightning callbacks are in
:mod:`lm_systems.run_callbacks`.

``lm_systems.cli`` assembles these into ``train.py``'s LightningCLI.
"""
