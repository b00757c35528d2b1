"""dflash.train: stage two, train, evaluate and export the DFlash drafter."""
