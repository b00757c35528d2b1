"""dflash.shards: the on-disk cache contract between stage one and stage two.

Depends on numpy, pyarrow, safetensors (the feature basis file) and click (the `dflash-shards`
command); transformers (the cache's tokenizer, to show tokens as text) and matplotlib
(`dflash-shards stats --plot`) are imported only where used, and optional. No torch, no
models. See FORMAT.md.
"""

from dflash.shards.codecs import topk_codec_kl
from dflash.shards.layers import default_layer_ids, hidden_state_index
from dflash.shards.reader import Cache, RawSequence, Sequence, open_cache, verify_cache
from dflash.shards.spec import FORMAT_VERSION, CacheSpec
from dflash.shards.target_info import TARGET_INFO_VERSION, TargetInfo
from dflash.shards.writer import CacheWriter, finalize_cache

__all__ = [
    "FORMAT_VERSION",
    "TARGET_INFO_VERSION",
    "Cache",
    "CacheSpec",
    "CacheWriter",
    "RawSequence",
    "Sequence",
    "TargetInfo",
    "default_layer_ids",
    "finalize_cache",
    "hidden_state_index",
    "open_cache",
    "topk_codec_kl",
    "verify_cache",
]
