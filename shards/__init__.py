"""dflash.shards: the on-disk cache contract between stage one and stage two.

Depends on pyarrow, numpy and zstandard only: no torch, no models. See FORMAT.md.
"""

from dflash.shards.layers import default_layer_ids, hidden_state_index

__all__ = ["default_layer_ids", "hidden_state_index"]
