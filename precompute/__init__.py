"""dflash.precompute: stage one, run the target once and write the cache."""
