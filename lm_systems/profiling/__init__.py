"""What profiling reads from the library: NVTX ranges around its work (``nvtx``), off unless switched on, and the
GPUs' dense peak FLOP/s that every MFU figure divides by (``hardware``). The Lightning side, the callbacks that switch
them on and report, lives in ``callbacks/``; plain torch here, so the model and the kernels can use it."""
