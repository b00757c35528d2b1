"""The names of a cache's files and folders, spelled once (FORMAT.md, "Directory" and "The
target folder"):

    CACHE/
      manifest.json               MANIFEST
      feature_basis.safetensors   BASIS_FILE (basis codecs only)
      rejected.jsonl              REJECTED
      target/                     TARGET_DIR
        target.json               TARGET_INFO_FILE
        head.safetensors          HEAD_FILE
        (the target's config.json, tokenizer and generation_config.json, by their Hugging Face names)
      shards/                     SHARDS_DIR
        rank00000-00000.arrow     shard_name(rank, index)
        rank00000-00000.json      record_name(rank, index)
        rank00000.spec.json       spec_name(rank)
        rank00000.done.json       done_name(rank)

Names only, no I/O: the bottom of dflash.shards, so that the writer, the reader, stage one and
stage two all take them from here. The manifest records the top-level names it uses
(`rejected`, `target_dir`, each shard's and the basis' `path`); readers follow the manifest.
"""

from __future__ import annotations

MANIFEST = "manifest.json"
BASIS_FILE = "feature_basis.safetensors"
REJECTED = "rejected.jsonl"
TARGET_DIR = "target"
TARGET_INFO_FILE = "target.json"
HEAD_FILE = "head.safetensors"
SHARDS_DIR = "shards"


def shard_name(rank: int, index: int) -> str:
    """Shard `index` of `rank`, in SHARDS_DIR."""
    return f"rank{rank:05d}-{index:05d}.arrow"


def record_name(rank: int, index: int) -> str:
    """The record of shard `index` of `rank` (the shard exists only with it), in SHARDS_DIR."""
    return f"rank{rank:05d}-{index:05d}.json"


def spec_name(rank: int) -> str:
    """The spec `rank` wrote with, in SHARDS_DIR."""
    return f"rank{rank:05d}.spec.json"


def done_name(rank: int) -> str:
    """`rank` closed its writer, in SHARDS_DIR."""
    return f"rank{rank:05d}.done.json"


__all__ = ["BASIS_FILE", "HEAD_FILE", "MANIFEST", "REJECTED", "SHARDS_DIR", "TARGET_DIR", "TARGET_INFO_FILE",
           "done_name", "record_name", "shard_name", "spec_name"]
