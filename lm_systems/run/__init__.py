"""A training run as the person who starts it sees it: the command line's parts (``cli_parts``, ``config_files``,
``strategy_flags``, ``help_cache``), checks made at the door (``device_fit``, ``output_folders``, ``cpu_threads``),
the CUDA allocator's settings (``allocator``), resuming with what was typed (``resume``), and what the run prints and
writes: its TensorBoard folder (``logger``), its description (``description``), its sample (``training_sample``) and
its closing summary (``summary``).

``lm_systems.cli`` assembles these into ``train.py``'s LightningCLI.
"""
