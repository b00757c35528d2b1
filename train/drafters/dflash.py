"""The DFlash drafter kind (train/model.py's DFlashDrafter): a block of the anchor and
num_drafts masks, drafted in one forward; the anchor's row predicts nothing (the anchor is
the verify's bonus token). Served by vLLM's `dflash` method, z-lab's DFlashDraftModel and
SGLang's DFLASH algorithm. Every behaviour is `DrafterKind`'s default."""

from __future__ import annotations

from dflash.train.drafters.base import DrafterKind


class DFlashKind(DrafterKind):
    name = "dflash"
    architecture = "DFlashDraftModel"
    vllm_method = "dflash"


__all__ = ["DFlashKind"]
