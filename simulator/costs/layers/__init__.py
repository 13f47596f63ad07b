"""The ops of a block's layers, as simulator/costs/ops.py assembles them into one block: the Linears, norms,
dropout and residual joins (linear), the attention core (attention), multi-head latent attention's projections
(latent), a mixture of experts' router and experts (moe) and fp8's casts and copies (fp8). Torch-free."""
