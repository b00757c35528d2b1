"""The vLLM worker's end of stage one: a KV connector that turns each finished request's
captured hidden states into what the cache stores, inside the worker, so that nothing
full-width leaves it.

vLLM's `extract_hidden_states` speculative method writes the residual stream at the chosen
layers into a cache-only attention layer's KV cache during prefill ([slots, layers, H] in the
model dtype, paged). When a request finishes, this connector (loaded by vLLM through
`kv_connector_module_path`, on TP rank 0 only) reads its slots and

- takes the last captured layer (vLLM id num_hidden_layers, before the final norm) through the
  target's final RMS norm and LM head, then log-softmax in fp32 and top-k, chunked
  (`dflash.precompute.topk.chunked_topk`, the transformers engine's code);
- encodes the other layers with the cache's device codec (bf16 or fp8,
  `dflash.precompute.device_codecs`, bit for bit the writer's numpy encoders); with a basis
  codec or none they leave in the model dtype, as the transformers engine hands them to the
  writer;
- writes them as one `.npz` file a request under the spool directory (a tmpfs, /dev/shm, where
  there is one: memory, not disk), named in the request's `kv_transfer_params`, which the
  driver (`dflash.precompute.vllm_engine`) reads and deletes at once.

It subclasses vLLM's `ExampleHiddenStatesConnector` for the scheduler side and the KV-cache
bookkeeping; its write is synchronous (no pinned memory, no CUDA stream), so it runs on a
CPU-only torch too.

Imports vLLM: loaded only inside the engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from dflash.precompute.device_codecs import DEVICE_CODECS, encode_features
from dflash.precompute.topk import apply_head, chunked_topk, load_head


class _Done:
    """What `get_finished` polls: the write already happened."""

    @staticmethod
    def query() -> bool:
        return True


class DflashHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Encodes features and takes the top-k in the worker (module docstring). Its
    `kv_connector_extra_config`: "shared_storage_path" (the spool directory) and "target" (the
    model folder, for the final norm and LM head). A request's `kv_transfer_params` give its
    "dflash_top_k" and "dflash_codec" (a device codec, or null for the model dtype); a request
    without them (a reply `generate` asks for) writes nothing."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._target = Path(extra["target"])
        self._head: tuple[torch.Tensor, torch.Tensor, float] | None = None  # loaded on first use
        self.use_lock = False

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for req_id, name in self._request_filenames.items():  # what `_submit_async_write` writes
            self._request_filenames[req_id] = str(Path(name).with_suffix(".npz"))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if "dflash_top_k" not in params:  # a reply to generate: nothing to keep
            self._request_filenames.pop(request.request_id, None)
            return False, None
        delay, out = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is not None:  # travels to the worker in the connector metadata
            pending.top_k, pending.codec = int(params["dflash_top_k"]), params.get("dflash_codec")
            assert pending.codec is None or pending.codec in DEVICE_CODECS, pending.codec
        return delay, out

    def _submit_async_write(self, pending: Any) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None] + blocks[:, None] * self._block_size).flatten().to(self._kv_cache.device)
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens)  # [T, L + 1, H] model dtype
        arrays = self._encode(hidden, pending.top_k, pending.codec)
        arrays["token_ids"] = pending.token_ids.numpy().astype(np.int64)
        path = Path(pending.filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as f:
            np.savez(f, **arrays)
        os.replace(partial, path)
        self._req_copy_events[pending.req_id] = _Done()

    @torch.inference_mode()
    def _encode(self, hidden: torch.Tensor, top_k: int, codec: str | None) -> dict[str, np.ndarray]:
        """[T, L + 1, H] captured states -> the arrays that leave the worker: features
        (encoded, or in the model dtype as uint16 bf16 bits / float32), fp8 scales, top-k."""
        if self._head is None:
            self._head = load_head(self._target, hidden.device, hidden.dtype)
        norm, head, eps = self._head
        features, last = hidden[:, :-1], hidden[:, -1]  # [T, L, H], [T, H]
        ids, logprobs = chunked_topk(lambda rows: apply_head(last[rows], norm, head, eps), len(last),
                                     top_k, head.shape[0], hidden.device)
        arrays = {"topk_ids": ids.cpu().numpy(), "topk_logprobs": logprobs.cpu().numpy()}
        if not torch.isfinite(features).all():
            arrays["nonfinite_row"] = np.asarray(int((~torch.isfinite(features)).flatten(1).any(1).nonzero()[0]))
            return arrays
        if codec is not None:
            encoded = encode_features(features, codec)
            arrays["features"] = encoded["features"].cpu().numpy()
            if "feature_scales" in encoded:
                arrays["feature_scales"] = encoded["feature_scales"].cpu().numpy()
        elif features.dtype == torch.bfloat16:
            arrays["features"] = features.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
        else:
            arrays["features"] = features.float().cpu().numpy()
        return arrays
