"""Mixed precision written here: formats, policy, loss scaling, master-weight optimizer, fp8."""
