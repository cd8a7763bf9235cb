"""Files on disk: written whole or not at all (``atomic_files``), cache entries named by what they depend on
(``fingerprint``), checkpoint files written atomically and checked before they are read (``checkpoint_io``),
checkpoint directories every rank writes its shards into, in the background (``checkpoint_dir``; one file from one:
``consolidate``), the room on disk checked before a checkpoint is written (``disk_space``), and the run's step and
crash checkpoints (``checkpointing``).

``atomic_files``, ``fingerprint``, ``checkpoint_dir`` and ``disk_space`` need no Lightning: the data caches and the
kernels' tuning cache use the first two too.
"""
