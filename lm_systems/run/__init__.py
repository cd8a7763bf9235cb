"""A training run as the person who starts it sees it: ``lm_systems.cli``'s parts (``door_checks``, ``resume``,
``strategy_flags``, ``help_cache``, ``cpu_threads``) and what every run sets or writes (``allocator``, ``logger``,
``description``). The run's Lightning callbacks are in :mod:`lm_systems.run_callbacks`."""
