"""Files on disk: written whole or not at all (``atomic_files``), cache entries named by what they depend on
(``fingerprint``), checkpoint files written atomically and checked before they are read (``checkpoint_io``), and the
run's step and crash checkpoints (``checkpointing``).

``atomic_files`` and ``fingerprint`` need no Lightning: the data caches and the kernels' tuning cache use them too.
"""
