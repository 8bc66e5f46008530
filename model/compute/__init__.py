"""How a model runs: the device rule, the fast kernels this process confirmed, oneDNN dense layers and
reduced precision (bf16, int8)."""
