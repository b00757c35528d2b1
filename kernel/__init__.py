"""dflash.kernels: the drafter's loss, fused with the LM head (torch and triton only).

`sparse_kl_loss` is the one public function; triton is imported only when impl="triton"
runs (or impl="auto" meets a CUDA tensor), so the package imports where triton is absent.
"""

from .loss import sparse_kl_loss

__all__ = ["sparse_kl_loss"]
