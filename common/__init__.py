"""dflash.common: what every dflash command shares, below the cache's contract.

The layer rule reads common <- shards <- {precompute, train}: this package imports no other
dflash package and no torch (numpy only where a run's arrays are written). It holds

- options.py: command-line options generated from config dataclasses, the one builder of
  every dflash command's flags;
- commands.py: the click classes every console script uses (one-line user errors, `--debug`,
  `--version`);
- files.py: atomic writes of files and folders, and the checksum manifests record;
- records.py: chat records as both stages read them (the input contract of dflash-precompute
  and of eval --online's prompts);
- fingerprint.py: the fingerprint of a target's weights, which a cache, a run and an online
  target record to tell one model from another.
"""
