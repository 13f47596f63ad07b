"""What the GPU's kernels reach: efficiency tables by shape (efficiency.py), the GEMM model by (m, n, k) and SMs
(gemm_model.py), fused attention's published rates (attention_rates.py) and the achieved fractions of the
datasheet (achieved.py). Torch-free."""
