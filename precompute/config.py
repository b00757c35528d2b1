"""Stage one's configuration: `PrecomputeConfig`, everything `dflash-precompute` does as one
validated value. Its fields' docstrings are the command's `--help` (dflash.common.options).

It sits below run.py, pipeline.py and basis.py, which all take it, so that none of them imports
another for its type."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash.common.options import METAVAR, NONE_WORD, PATH, RESUMABLE, SEPARATOR, apply_none_words, check_choices
from dflash.shards.layout import BASIS_FILE
from dflash.shards.spec import BASIS_CODECS, FeatureCodec, TopkCodec


@dataclass(kw_only=True)
class PrecomputeConfig:
    """Everything `dflash-precompute` does, as one validated value."""

    target: Path
    """Hugging Face causal-LM directory."""
    data: list[Path]
    """JSONL (.jsonl.zst too), JSON, Parquet or datasets directory, read in this order; repeat for several."""
    out: Path
    """Cache directory to write."""
    top_k: int = 32
    """Next-token candidates cached per position."""
    feature_layers: list[int] | None = field(default=None, metadata={NONE_WORD: "auto", SEPARATOR: ",",
                                                                     METAVAR: "auto|IDS"})
    """Decoder-layer ids to cache, comma-separated (e.g. 1,9,17); auto (None) lets the DFlash rule pick
    num_feature_layers."""
    num_feature_layers: int = 5
    """Layers the DFlash rule picks when feature_layers is auto."""
    feature_codec: FeatureCodec = "bf16"
    """Feature storage: bf16, fp8, or r coefficients per token in a basis fitted on the run's first tokens:
    basis-bf16, basis-fp8."""
    feature_rank: int | None = None
    """Basis codecs: coefficients per token (default: the target's hidden size H)."""
    basis_sample_tokens: int = 65536
    """Basis codecs: tokens of the first records (in input order, prompts and replies) the basis is fitted
    on before any row is written."""
    feature_basis: Path | None = None
    """Basis codecs: encode with this basis (another cache's folder or its feature_basis.safetensors)
    instead of fitting one, so that `fit` can train on both caches (it refuses caches of different
    bases)."""
    topk_codec: TopkCodec = "packed"
    """Top-k storage: packed (about 1e-3 nat) or raw (lossless)."""
    max_length: int = 3072
    """Longer renderings are cut to this many tokens (and counted)."""
    batch_tokens: int = 16384
    """Padded tokens per planned batch (count x longest): per generate call, and per target
    forward unless --forward-batch-tokens is smaller."""
    forward_batch_tokens: int = 0
    """Padded tokens per target forward, at most --batch-tokens; 0: --batch-tokens on a GPU, 2048
    on a CPU, where large forwards run slower (bench/RESULTS.md). The rows are the same either way."""
    engine: Literal["transformers", "vllm"] = "transformers"
    """What runs the target: transformers (one device per rank), or vllm (vLLM's prefill, with tensor
    parallelism for targets larger than one GPU; install it first: pip install vllm). The cache is the
    same format either way."""
    tensor_parallel_size: int = 1
    """--engine vllm: GPUs each rank's engine splits the target over; ranks x this GPUs in all."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto, cpu or cuda (one GPU per process, by local rank)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16 or float32."""
    limit: int | None = None
    """Read at most this many records in total (all inputs together)."""
    regenerate: bool = False
    """Replace the assistant replies by the target's own (prompt-only records get one)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """JSON object passed to the chat template, e.g. '{"enable_thinking": false}'; kept in the manifest."""
    chat_template: Path | None = field(default=None, metadata={PATH: "file"})
    """Jinja chat template file to use instead of the tokenizer's; its text is kept in the manifest."""
    max_new_tokens: int = 512
    """Longest regenerated reply, in tokens."""
    temperature: float = 0.0
    """Regeneration temperature: 0 is greedy, > 0 samples (seeded by seed)."""
    seed: int = 0
    """Seed of sampled regeneration."""
    nproc: int = field(default=1, metadata={RESUMABLE: True})
    """Local worker processes to spawn (one per GPU); 1 under torchrun."""
    strict: bool = False
    """Make the first rejected record an error."""
    overwrite: bool = field(default=False, metadata={RESUMABLE: True})
    """Replace an existing cache at --out (only a directory that is a dflash cache)."""
    trust_remote_code: bool = False
    """Let transformers run the target repository's own code."""
    shard_max_rows: int = 1024
    """Sequences per shard."""
    dist_timeout_s: float = field(default=6 * 3600.0, metadata={RESUMABLE: True})
    """How long a rank waits for the others at a collective before it fails."""
    progress: bool = field(default=True, metadata={RESUMABLE: True})
    """Progress bar on stderr (rank 0)."""
    shard_checksum: Literal["xxh3-128", "sha256"] = field(default="xxh3-128", metadata={RESUMABLE: True})
    """Each shard's checksum in the manifest: xxh3-128 (the default: about 7x less CPU per byte than
    sha256, so that one core keeps up with a fast GPU; it detects damage, not tampering; the manifest
    is format version 3, which readers before it refuse), or sha256 (a cryptographic hash, readable by
    older readers). The shards are the same bytes either way; a resumed cache keeps its shards' own
    checksums, so it may mix the two."""
    writer_thread: Literal["auto", "on", "off"] = field(default="auto", metadata={RESUMABLE: True})
    """Write shards in a background thread while the target computes the next batch: auto (on a GPU;
    on a CPU the thread would compete with the forward for the cores), on or off. The shards are the
    same bytes either way."""

    def __post_init__(self) -> None:
        apply_none_words(self)
        check_choices(self)
        self.target, self.out = Path(self.target), Path(self.out)
        self.data = [Path(p) for p in ([self.data] if isinstance(self.data, (str, Path)) else self.data)]
        if not self.data:
            raise ValueError("give at least one --data input")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"--chat-template-kwargs must be a JSON object, got {self.chat_template_kwargs!r}")
        if self.chat_template is not None:
            self.chat_template = Path(self.chat_template)
            if not self.chat_template.is_file():
                raise ValueError(f"--chat-template {self.chat_template}: no such file")
        if self.feature_basis is not None:
            self.feature_basis = Path(self.feature_basis)
            if self.feature_basis.is_dir():  # another cache's folder: its basis file
                self.feature_basis = self.feature_basis / BASIS_FILE
        checks = [
            (self.top_k >= 1, f"--top-k must be >= 1, got {self.top_k}"),
            (self.num_feature_layers >= 1, f"--num-feature-layers must be >= 1, got {self.num_feature_layers}"),
            (self.feature_rank is None or (self.feature_rank >= 1 and self.feature_codec in BASIS_CODECS),
             f"--feature-rank must be >= 1 and goes with a basis codec, got {self.feature_rank} with "
             f"{self.feature_codec}"),
            (self.basis_sample_tokens >= 1, f"--basis-sample-tokens must be >= 1, got {self.basis_sample_tokens}"),
            (self.feature_basis is None or self.feature_codec in BASIS_CODECS,
             f"--feature-basis goes with a basis codec ({', '.join(BASIS_CODECS)}), got {self.feature_codec}"),
            (self.feature_basis is None or Path(self.feature_basis).is_file(),
             f"--feature-basis {self.feature_basis}: no such file (give another cache's feature_basis.safetensors)"),
            (self.max_length >= 2, f"--max-length must be >= 2, got {self.max_length}"),
            (self.batch_tokens >= 1, f"--batch-tokens must be >= 1, got {self.batch_tokens}"),
            (self.forward_batch_tokens >= 0,
             f"--forward-batch-tokens must be >= 0 (0: automatic), got {self.forward_batch_tokens}"),
            (self.limit is None or self.limit >= 1, f"--limit must be >= 1, got {self.limit}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}"),
            (self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}"),
            (self.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"),
            (self.tensor_parallel_size == 1 or self.engine == "vllm",
             f"--tensor-parallel-size {self.tensor_parallel_size} needs --engine vllm (transformers runs one "
             "device per rank)"),
            (self.shard_max_rows >= 1, f"shard_max_rows must be >= 1, got {self.shard_max_rows}"),
            (self.dist_timeout_s > 0, f"dist_timeout_s must be > 0, got {self.dist_timeout_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.feature_layers is not None:
            if not self.feature_layers or len(set(self.feature_layers)) != len(self.feature_layers):
                raise ValueError(f"--feature-layers must list distinct layer ids, got {self.feature_layers}")
            if self.feature_layers != sorted(self.feature_layers):
                # Serving engines (vLLM, SGLang) sort target_layer_ids before feeding the drafter,
                # so fc's column blocks would meet the wrong layers, silently.
                raise ValueError(f"--feature-layers must be ascending (serving engines sort target_layer_ids, "
                                 f"so the drafter would meet the wrong layers): give "
                                 f"{','.join(map(str, sorted(self.feature_layers)))}")


__all__ = ["PrecomputeConfig"]
