"""flash_triton's Hopper (sm_90) kernels in Gluon, warp-specialised as FlashAttention-3's: the forward at head dim
128 and the one-pass backward at 64 and 128 (``dispatch`` says when they run)."""
