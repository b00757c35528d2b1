"""The target model in stage one: loading with early checks, the capturing forward with a
chunked top-k, batched generation, and the `CACHE/target/` folder stage two reads.

Forward. Forward hooks on the chosen decoder layers keep only those layers' outputs (never
`output_hidden_states`, which holds every layer alive). The base model's last hidden state
goes through the LM head one chunk of positions at a time: logits in the model's dtype,
then log-softmax in fp32 and `torch.topk`, so neither a [batch, T, V] logits tensor nor an
fp32 copy of it ever exists, and only real (non-padding) positions are computed. Whether
the LM head applied to the base model's output reproduces the model's own logits is
checked once at load on a short probe (a model with logit soft-capping or scaling fails
it); such a model falls back to its own full forward, still with the fp32 work chunked.

Encoding. With `feature_codec` "bf16" or "fp8" on CUDA the features are encoded on the
device, in the batch (`device_codecs`), and only the stored bytes cross to the host, into
pinned memory on a side stream; the outputs carry `ready`, which waits for that copy, so the
caller can hand them on and launch the next forward while the bytes travel. On a CPU the
writer's numpy encoders are faster than torch's, so features leave the forward raw there.

Batches are right-padded with an attention mask: a sequence's positions attend only to
earlier real positions and start at position 0, so its values do not depend on its batch
mates (up to the reduction order of the matmuls). Generation left-pads, as decoding needs.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.common.files import atomic_dir
from dflash.common.fingerprint import target_fingerprint
from dflash.precompute.device_codecs import DEVICE_CODECS, encode_features
from dflash.precompute.topk import chunked_topk
from dflash.shards import TargetInfo, default_layer_ids
from dflash.shards.layout import HEAD_FILE

# Feature values encoded per chunk on the device: bounds the encoder's float32 temporaries.
ENCODE_CHUNK_VALUES = 2**26
# Device types whose forward encodes the features. On a CPU the host is the device, and the
# numpy encoders (run by the writer) are faster than the torch ones (bench/RESULTS.md stage_one).
ENCODE_ON_DEVICE_TYPES = ("cuda",)

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)


@dataclass
class TargetOutput:
    """What the target computed for one sequence of T tokens."""

    features: np.ndarray
    """[T, L, H] float32, or uint16 bf16 bit patterns when the target runs in bf16; when
    `encoded`, the stored values of the feature codec (int16 bf16 bits, or uint8 fp8 codes)."""
    topk_ids: np.ndarray
    """[T, k] int32: the k most likely next tokens at each position, most likely first."""
    topk_logprobs: np.ndarray
    """[T, k] float32: their full-vocabulary log-probabilities."""
    encoded: bool = False
    """The features were encoded on the device (`Target.forward`'s feature_codec)."""
    feature_scales: np.ndarray | None = None
    """[T, L] float32: fp8's per-token-layer scales when encoded."""
    ready: Callable[[], Any] | None = None
    """Waits until the arrays hold their values (their copy from the device has finished);
    None when they already do."""


@dataclass
class Generated:
    """One generated reply."""

    token_ids: list[int]
    """The new tokens, without the end-of-sequence token."""
    finished: bool
    """True when the model ended the reply itself; False when cut at its token budget."""

    @classmethod
    def cut(cls, token_ids: list[int], eos_ids: list[int]) -> Generated:
        """The reply of generated `token_ids`, cut before the first of `eos_ids` (finished) if any."""
        end = next((j for j, tok in enumerate(token_ids) if tok in eos_ids), None)
        return cls(token_ids=token_ids if end is None else token_ids[:end], finished=end is not None)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """"auto" -> cuda:local_rank when CUDA is available, else cpu (`device`: one of
    PrecomputeConfig.device's choices, checked there)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available: use --device cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): "
            "start at most one process per GPU"
        )
    return torch.device("cuda", local_rank)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on GPU (where it is the native speed), float32 on CPU; else the named
    dtype (`dtype`: one of PrecomputeConfig.dtype's choices, checked there)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def file_sha256(paths: list[Path]) -> str:
    """sha256 over the names and bytes of `paths` (in the given order)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def check_target_dir(path: Path, trust_remote_code: bool) -> Any:
    """Load the config of `path` and check that it is a causal LM; returns the config.

    Raises ValueError naming the directory when it is missing, has no config.json, or is
    not a model AutoModelForCausalLM loads.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not path.is_dir():
        raise ValueError(f"--target {path}: no such directory (give a Hugging Face model folder)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--target {path}: no config.json, not a Hugging Face model folder")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise ValueError(f"--target {path}: cannot read config.json ({e})") from e
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not (remote and trust_remote_code):
        hint = " (it has remote code: pass --trust-remote-code)" if remote else ""
        raise ValueError(
            f"--target {path}: model_type {config.model_type!r} is not a causal language model "
            f"that AutoModelForCausalLM can load{hint}"
        )
    _check_causal_architecture(path, config)
    return config


# Architecture name endings of models with a language-modelling head over the vocabulary.
_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _check_causal_architecture(path: Path, config: Any) -> None:
    """Refuse a folder whose config.json names only architectures without a causal-LM head
    (a saved `BertModel` has a causal-LM model_type but no head: loading it would initialise
    one at random). A config that names no architecture is let through."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        return
    known = {name for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for name in ((value,) if isinstance(value, str) else value)}
    if not any(name in known or name.endswith(_CAUSAL_LM_SUFFIXES) for name in architectures):
        raise ValueError(
            f"--target {path}: config.json names architecture {', '.join(architectures)}, which is not a "
            "causal LM; a causal language model (*ForCausalLM) is required: save the model with its "
            "language-modelling head (e.g. AutoModelForCausalLM.save_pretrained)"
        )


def resolve_layer_ids(layer_ids: list[int] | None, num_feature_layers: int, num_layers: int,
                      where: str) -> list[int]:
    """The explicit ids checked against the target's depth, or the DFlash rule's ids."""
    if layer_ids is None:
        return default_layer_ids(num_layers, num_feature_layers)
    given = ",".join(map(str, layer_ids))
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"--feature-layers {given}: {bad} out of range for {where}, "
            f"which has {num_layers} decoder layers (ids 0..{num_layers - 1})"
        )
    if num_layers - 1 in layer_ids:
        # Hugging Face reports the last layer after the final norm (hidden_states[-1]), so
        # "hidden_states[id + 1]" and "the layer's output" disagree there; DFlash never uses it.
        raise ValueError(
            f"--feature-layers {given}: {num_layers - 1} is the last decoder layer of {where}, "
            "whose Hugging Face hidden state is taken after the final norm; choose ids up to "
            f"{num_layers - 2} (the DFlash rule stops at {max(0, num_layers - 3)})"
        )
    return list(layer_ids)


class TargetFolder:
    """What identifies a target whichever engine runs it: its folder (config, weights, tokenizer)
    and how it ran. The engines (`Target` here, vllm_engine.py's `VllmTarget`) set `path`,
    `config`, `num_layers` and `dtype`."""

    path: Path
    config: Any
    num_layers: int
    dtype: torch.dtype

    def identity(self) -> dict[str, Any]:
        """CacheSpec.target: what identifies this target and how it ran."""
        return {
            "name": self.path.name,
            "architecture": (self.config.architectures or [self.unnamed_architecture()])[0],
            "model_type": self.config.model_type,
            "num_layers": self.num_layers,
            "config_sha256": file_sha256([self.path / "config.json"]),
            "fingerprint": self.fingerprint,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def unnamed_architecture(self) -> str:
        """The architecture `identity` records when config.json names none."""
        return self.config.model_type

    @functools.cached_property
    def fingerprint(self) -> str | None:
        """The fingerprint of the target's weights (dflash.common.fingerprint)."""
        return target_fingerprint(self.path)

    def tokenizer_sha256(self) -> str:
        return file_sha256([self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()])


class Target(TargetFolder):
    """A causal LM that returns chosen layers' features and the top-k of its next-token
    distribution per position, and generates replies."""

    def __init__(self, path: Path, *, layer_ids: list[int] | None, num_feature_layers: int,
                 top_k: int, device: torch.device, dtype: torch.dtype, trust_remote_code: bool):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = Path(path)
        config = check_target_dir(self.path, trust_remote_code)
        text_config = config.get_text_config()
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.layer_ids = resolve_layer_ids(layer_ids, num_feature_layers, self.num_layers,
                                           f"--target {self.path}")
        if not 1 <= top_k <= self.vocab_size:
            raise ValueError(f"--top-k must be in [1, {self.vocab_size}] for this target, got {top_k}")
        self.top_k = top_k
        self.device, self.dtype = device, dtype
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()
        self.config = self.model.config
        self._captured: dict[int, torch.Tensor] = {}
        self._capture = False
        layers = _decoder_layers(self.model, self.num_layers)
        for layer_id in self.layer_ids:
            layers[layer_id].register_forward_hook(self._hook(layer_id))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.head_path = self._head_reproduces_logits()
        self.encode_s = 0.0
        """Seconds spent encoding features on the device (forward with a feature_codec)."""

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            if self._capture:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.inference_mode()
    def _head_reproduces_logits(self) -> bool:
        """Whether lm_head(base model output) equals the model's logits, on a 4-token probe."""
        head = self.model.get_output_embeddings()
        if self.model.base_model is self.model or head is None:
            return False
        ids = torch.arange(min(4, self.vocab_size), device=self.device)[None]  # [1, 4]
        out = self.model(input_ids=ids, use_cache=False, output_hidden_states=True)
        reference = out.logits.float()  # [1, 4, V]
        # hidden_states[-1] is the base model's output (after its final norm).
        mine = head(out.hidden_states[-1]).float()  # [1, 4, V]
        scale = reference.abs().max().clamp_min(1.0)
        return bool(((mine - reference).abs().max() <= 1e-2 * scale).item())

    @torch.inference_mode()
    def forward(self, sequences: list[np.ndarray], names: list[str],
                feature_codec: str | None = None) -> list[TargetOutput]:
        """Features and top-k for each sequence ([T_b] int token ids) of one batch.

        `names` label the sequences in errors: a non-finite feature or log-probability
        raises ValueError naming the sequence. With `feature_codec` in DEVICE_CODECS, on a
        device type in ENCODE_ON_DEVICE_TYPES, the features come encoded
        (TargetOutput.encoded) and `encode_s` holds the seconds the device spent encoding them.
        """
        lengths = [len(s) for s in sequences]
        batch, width = len(sequences), max(lengths)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [B, T]
        attention = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
        for b, seq in enumerate(sequences):
            ids[b, : len(seq)] = torch.from_numpy(np.asarray(seq, dtype=np.int64))
            attention[b, : len(seq)] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        valid = attention.bool()  # [B, T]
        self._capture = True
        try:
            if self.head_path:
                hidden = self.model.base_model(input_ids=ids, attention_mask=attention,
                                               use_cache=False).last_hidden_state[valid]  # [N, H]
                head = self.model.get_output_embeddings()
                logits_of = lambda rows: head(hidden[rows])  # noqa: E731  [n, V] model dtype
            else:
                logits = self.model(input_ids=ids, attention_mask=attention,
                                    use_cache=False).logits[valid]  # [N, V]
                logits_of = lambda rows: logits[rows]  # noqa: E731
            features = torch.stack([self._captured[i][valid] for i in self.layer_ids], dim=1)  # [N, L, H]
        finally:
            self._capture = False
            self._captured.clear()
        starts = np.cumsum([0] + lengths)
        if not torch.isfinite(features).all():
            row = int((~torch.isfinite(features)).flatten(1).any(1).nonzero()[0])
            raise ValueError(f"{names[_owner(starts, row)]}: non-finite target feature at position "
                             f"{row - starts[_owner(starts, row)]}")
        topk_ids, topk_logprobs = chunked_topk(logits_of, int(starts[-1]), self.top_k, self.vocab_size,
                                               self.device)  # [N, k] int32, [N, k] float32
        if not torch.isfinite(topk_logprobs).all():
            row = int((~torch.isfinite(topk_logprobs)).any(1).nonzero()[0])
            raise ValueError(f"{names[_owner(starts, row)]}: non-finite target log-probability at "
                             f"position {row - starts[_owner(starts, row)]}")
        if feature_codec in DEVICE_CODECS and self.device.type in ENCODE_ON_DEVICE_TYPES:
            return self._encoded_outputs(features, topk_ids, topk_logprobs, starts, feature_codec)
        features_np = _features_to_numpy(features)
        ids_np, logprobs_np = topk_ids.cpu().numpy(), topk_logprobs.cpu().numpy()
        return [TargetOutput(features=features_np[a:b], topk_ids=ids_np[a:b], topk_logprobs=logprobs_np[a:b])
                for a, b in zip(starts[:-1], starts[1:])]

    def _encoded_outputs(self, features: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                         starts: np.ndarray, feature_codec: str) -> list[TargetOutput]:
        """Encode the batch's features on the device ([N, L, H], checked finite) and start the
        copy of everything to the host; the outputs' `ready` waits for the copy."""
        began = time.perf_counter()
        rows = max(1, ENCODE_CHUNK_VALUES // (features.shape[1] * features.shape[2]))
        chunks = [encode_features(features[lo:lo + rows], feature_codec) for lo in range(0, len(features), rows)]
        encoded = {name: torch.cat([c[name] for c in chunks]) if len(chunks) > 1 else chunks[0][name]
                   for name in chunks[0]}
        encoded.update(topk_ids=topk_ids, topk_logprobs=topk_logprobs)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # times the encode; the GPU is done anyway
        self.encode_s += time.perf_counter() - began
        host, ready = to_host(encoded, self.device)
        scales = host.get("feature_scales")
        return [TargetOutput(features=host["features"][a:b], topk_ids=host["topk_ids"][a:b],
                             topk_logprobs=host["topk_logprobs"][a:b], encoded=True,
                             feature_scales=None if scales is None else scales[a:b], ready=ready)
                for a, b in zip(starts[:-1], starts[1:])]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float,
                 seed: int) -> list[Generated]:
        """Continue each prompt (left-padded into one batch) until an end-of-sequence token or
        its own `max_new_tokens`. Greedy at temperature 0; otherwise sampled from
        softmax(logits / temperature) with the full vocabulary, seeded with `seed`."""
        from transformers import GenerationConfig

        if not self.eos_ids:
            raise ValueError("the target defines no end-of-sequence token; regeneration cannot stop")
        batch, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [B, P]
        attention = torch.zeros((batch, width), dtype=torch.long)  # [B, P]
        for b, prompt in enumerate(prompts):
            ids[b, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention[b, width - len(prompt):] = 1
        # Every sampling knob is set explicitly: the target's generation_config.json often
        # asks for sampling with top-k/top-p, which must not leak into greedy regeneration.
        sample = temperature > 0
        config = GenerationConfig(
            max_new_tokens=max(max_new_tokens), do_sample=sample,
            temperature=temperature if sample else None, top_k=0 if sample else None,
            top_p=1.0 if sample else None, eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        if sample:
            torch.manual_seed(seed)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                                  generation_config=config)  # [B, P + new]
        results = []
        for b, row in enumerate(out[:, width:].tolist()):
            row = row[: max_new_tokens[b]]
            results.append(Generated.cut(row, self.eos_ids))
        return results

    def close(self) -> None:
        """Release the engine: nothing to do here (the model goes with this object); the vLLM
        engine's stops."""

    def unnamed_architecture(self) -> str:
        return type(self.model).__name__

    def write_target_dir(self, out: Path) -> None:
        """Write `out` (CACHE/target): `write_target_folder` with this model's embedding, LM head
        and final norm scale."""
        embed = self.model.get_input_embeddings().weight.detach()  # [V, H]
        head = self.model.get_output_embeddings().weight.detach()  # [V, H]
        # Cloned separately: safetensors refuses tensors that share memory (tied weights).
        tensors = {"embed_tokens.weight": embed.cpu().clone().contiguous(),
                   "lm_head.weight": head.cpu().clone().contiguous()}
        norm = final_norm_scale(self.model, self.hidden_size)
        if norm is not None:
            tensors["norm.weight"] = norm
        generation = self.model.generation_config if (self.path / "generation_config.json").is_file() else None
        write_target_folder(out, config=self.config, tokenizer=self.tokenizer, generation_config=generation,
                            tensors=tensors, info=target_info(self))


def target_info(target: Any) -> TargetInfo:
    """The TargetInfo of a loaded target of either engine (its config, tokenizer, layer ids,
    dtype and fingerprint)."""
    text_config = target.config.get_text_config()
    rope = getattr(text_config, "rope_parameters", None) or {}
    return TargetInfo(
        layer_ids=target.layer_ids,
        num_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
        model_type=target.config.model_type,
        mask_token_id=target.tokenizer.mask_token_id,
        pad_token_id=target.tokenizer.pad_token_id,
        eos_token_id=text_config.eos_token_id,
        bos_token_id=text_config.bos_token_id,
        rms_norm_eps=getattr(text_config, "rms_norm_eps", None),
        rope_theta=rope.get("rope_theta", getattr(text_config, "rope_theta", None)),
        dtype=str(target.dtype).removeprefix("torch."),
        fingerprint=target.fingerprint,
    )


def write_target_folder(out: Path, *, config: Any, tokenizer: Any, generation_config: Any,
                        tensors: dict[str, torch.Tensor], info: TargetInfo) -> None:
    """Write `out` (CACHE/target): config, tokenizer, generation config (when not None),
    head.safetensors (`tensors`: embedding and LM head, both always present, in the run's
    dtype, and the final norm's scale when known) and target.json. Published atomically
    (`atomic_dir`), so `out` is complete or absent."""
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        try:
            save_file(tensors, tmp / HEAD_FILE)
        except Exception as error:  # safetensors raises SafetensorError, not OSError, on a full disk
            raise OSError(f"{tmp / HEAD_FILE}: cannot write the target's embedding and LM "
                          f"head: {error}; free space under {out.parent} and run again") from error
        info.save(tmp)


def final_norm_scale(model: torch.nn.Module, hidden_size: int) -> torch.Tensor | None:
    """The target's final RMS norm as the per-channel scale it applies ([H] float32), or None
    when the model has no RMS norm at `base_model.norm`. Read by probing the module with a
    vector of ones (rms 1), so conventions such as Gemma's `1 + weight` come out right."""
    norm = getattr(model.base_model, "norm", None)
    if norm is None or "rmsnorm" not in type(norm).__name__.lower():
        return None
    weight = getattr(norm, "weight", None)
    if weight is None or tuple(weight.shape) != (hidden_size,):
        return None
    with torch.no_grad():
        probe = torch.ones(1, hidden_size, dtype=weight.dtype, device=weight.device)
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)) or 0.0)
        scale = norm(probe).float()[0] * (1.0 + eps) ** 0.5  # undo the eps in 1 / sqrt(1 + eps)
    return scale.cpu().contiguous()


def _decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():  # other layouts (e.g. GPT-2's `h`)
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    return merge_eos_ids(getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id,
                         tokenizer.eos_token_id)


def merge_eos_ids(*values: int | list[int] | None) -> list[int]:
    """The distinct end-of-sequence ids of `values` (each an id, a list of ids, or None), in order:
    the generation config's, the model config's and the tokenizer's."""
    ids: list[int] = []
    for value in values:
        for i in value if isinstance(value, list) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _owner(starts: np.ndarray, row: int) -> int:
    """Index of the sequence holding flattened row `row`."""
    return int(np.searchsorted(starts, row, side="right") - 1)


def to_host(tensors: dict[str, torch.Tensor], device: torch.device) -> tuple[dict[str, np.ndarray], Any]:
    """Numpy copies of `tensors` and a callable that waits until they hold their values. On
    CUDA the copies go to pinned memory on a side stream (after the work queued so far), so
    the next forward's kernels need not wait for them; elsewhere they are made here."""
    if device.type != "cuda":
        return {name: t.cpu().numpy() for name, t in tensors.items()}, None
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    host = {}
    with torch.cuda.stream(stream):
        for name, tensor in tensors.items():
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            pinned.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # the allocator keeps the source until the copy is done
            host[name] = pinned.numpy()  # a view: keeps the pinned block alive as long as it is used
    done = torch.cuda.Event()
    done.record(stream)
    return host, done.synchronize


@functools.cache
def _copy_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device)


def _features_to_numpy(features: torch.Tensor) -> np.ndarray:
    """[N, L, H] on any device -> numpy: bf16 as its uint16 bit patterns (no widening), else float32."""
    if features.dtype == torch.bfloat16:
        return features.view(torch.int16).cpu().numpy().view(np.uint16)
    return features.float().cpu().numpy()
