"""dflash.kernels: the drafter's loss, fused with the LM head (torch and triton only)."""
