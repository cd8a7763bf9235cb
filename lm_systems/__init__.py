"""lm_systems: GPT-style Transformer LMs with home-made attention kernels and data parallelism."""
