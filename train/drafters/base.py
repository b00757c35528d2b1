"""What a drafter kind is: the one place a family of drafters plugs into fit, eval, export and loading.

A kind (torchtitan's `ModelSpec` idea) owns everything that differs between families, so
the core files (train/fit.py, train/config.py, train/acceptance.py, train/speculative.py,
train/export.py, train/loading.py, train/init_from.py) ask the kind and never which kind
it is:

- its fit options (a dataclass whose fields become `dflash-train fit` flags) and the
  `DrafterConfig` subclass that holds them in a drafter's config;
- its block layout: how many drafter rows one block of `num_drafts` drafts takes
  (`block_rows`), and which rows draft;
- training: the batch relabelling and the loss operands (rows, head, frozen columns) plus
  any loss of its own heads;
- "draft a block" (`draft`): the one implementation offline scoring (train/acceptance.py),
  the online loop (train/speculative.py) and the engine check (bench/engine_check.py) call;
- making the model, exporting it (Hugging Face fields, the tensor table vLLM's loader maps,
  the model card's lines), loading it back from a Hugging Face config, the head prefixes
  `--init-from` keeps apart, whether FSDP2 can shard it, and the vLLM method and runner.

`DrafterKind` is DFlash's behaviour; a kind that differs overrides what differs
(train/drafters/dspark.py). The registry is train/drafters/__init__.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dflash.train.model import FULL_ATTENTION, SLIDING_ATTENTION, DFlashDrafter, DrafterConfig, TargetHead


@dataclass
class LossOperands:
    """What the fused loss reads for one batch's labelled rows: `rows` [N, K] and `head`
    (its lm_head [V, K]) such that rows @ head.lm_head.T are the drafter's logits; the head's
    first `frozen_columns` columns get no gradient (0: the whole head is the frozen target
    head, which the loss never differentiates); `extra` is the kind's own (for `extra_loss`)."""

    rows: torch.Tensor
    head: TargetHead
    frozen_columns: int = 0
    extra: Any = None


@dataclass
class Drafts:
    """One call's drafted blocks: `tokens` [n, num_drafts] int64 target ids, and, when asked
    for, `margins` [n, num_drafts] fp32: each draft's top-1 minus top-2 logit."""

    tokens: torch.Tensor
    margins: torch.Tensor | None = None


class DrafterKind:
    """A drafter family. The base is DFlash's behaviour (block: the anchor and num_drafts masks;
    the anchor's row predicts nothing; drafts are each row's argmax through the head)."""

    name: ClassVar[str]
    """The registry key: `--drafter`'s value and a drafter config's `kind`."""
    title: ClassVar[str] = "DFlash"
    """The family's name in the model card's title."""
    architecture: ClassVar[str]
    """The exported config.json's `architectures` entry (what vLLM and Transformers load it as)."""
    vllm_method: ClassVar[str]
    """vLLM's `--speculative-config` method that serves the exported folder."""
    vllm_runner: ClassVar[str | None] = None
    """The vLLM model runner the method needs ("V2"), None: either."""
    config_class: ClassVar[type[DrafterConfig]] = DrafterConfig
    """The drafter config of this kind (a subclass adds the kind's own fields)."""
    options: ClassVar[type | None] = None
    """The kind's fit options (a kw_only dataclass; its fields join `dflash-train fit`'s flags and
    RUN/config.json when the kind is registered before train/config.py is imported); None: none."""
    head_prefixes: ClassVar[tuple[str, ...]] = ()
    """State-dict prefixes of the kind's heads beyond the DFlash backbone: `--init-from` gives
    them only to a drafter that has them (the others keep their fresh weights)."""
    dflash_config_keys: ClassVar[tuple[str, ...]] = ()
    """The kind's own fields of an exported config.json's `dflash_config` (`dflash_config_fields`
    writes them); a config.json of another kind that sets one is refused by name."""
    default_num_drafts: ClassVar[int] = 15
    """`fit --num-drafts auto`: a block of 16 drafter rows."""
    fsdp: ClassVar[bool] = True
    """Whether FSDP2 can shard it (False: a head acts in the loss, outside FSDP2's forward)."""

    # -- configuration ----------------------------------------------------------------------

    def check_options(self, options: Any, selected: bool) -> None:
        """ValueError when the fit options say something this kind refuses; `selected`: the
        run trains this kind (else its options are another kind's run's and must be idle)."""

    def drafter_config(self, config: DrafterConfig, options: Any) -> DrafterConfig:
        """The drafter config of this kind (`config_class`) from the generic one fit sized and
        the fit options (`config_fields`)."""
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(DrafterConfig)}
        return self.config_class(**fields, **self.config_fields(options))

    def check_fit(self, config: Any) -> None:
        """ValueError when the run's fit config (train/config.py's FitConfig, this kind
        selected) asks for something this kind cannot train."""

    def config_fields(self, options: Any) -> dict[str, Any]:
        """The kind's own drafter config fields, from the fit options."""
        return {}

    def claims_legacy(self, data: dict[str, Any]) -> bool:
        """Whether a drafter config dict written without `kind` (before kinds had names) is this
        kind's; the registry falls back to the default kind."""
        return False

    def option_names(self) -> frozenset[str]:
        """The names of the kind's fit options."""
        return frozenset(f.name for f in dataclasses.fields(self.options)) if self.options else frozenset()

    def check_init(self, source: DrafterConfig, config: DrafterConfig, where: str) -> None:
        """ValueError (naming the field and the flag) when `--init-from` weights made for
        `source` cannot load into this kind's drafter of `config` beyond the backbone's shapes."""

    def owns(self, name: str) -> bool:
        """Whether state-dict entry `name` is one of the kind's own tensors beyond the DFlash
        backbone (by default: under `head_prefixes`); `--init-from` gives them only to a
        drafter that has them."""
        return name.startswith(self.head_prefixes)

    # -- the block --------------------------------------------------------------------------

    def block_rows(self, num_drafts: int) -> int:
        """Drafter rows (queries) of one block that drafts `num_drafts` tokens: the anchor and
        num_drafts masks; the anchor's row predicts nothing."""
        return num_drafts + 1

    def num_drafts(self, block_rows: int) -> int:
        """The inverse of `block_rows`: what a `block_size` written before the block was named
        once meant for this kind (fit's flag, a run's files, an exported config.json)."""
        return block_rows - 1

    # -- the model and training -------------------------------------------------------------

    def make(self, config: DrafterConfig, **kwargs: Any) -> DFlashDrafter:
        """A freshly initialised drafter of `config` (kwargs: DFlashDrafter's)."""
        return DFlashDrafter(config, **kwargs)

    def training_batch(self, batch: Any, config: DrafterConfig) -> Any:
        """A batch read with blocks of num_drafts + 1 rows (the anchor and the positions it
        labels, train/data.py) -> the batch this kind's drafter trains on."""
        return batch

    def loss_operands(self, model: DFlashDrafter, rows: torch.Tensor, head: TargetHead, batch: Any) -> LossOperands:
        """rows [N, H]: the drafter's labelled rows; the frozen target head scores them."""
        return LossOperands(rows=rows, head=head)

    def extra_loss(self, model: DFlashDrafter, operands: LossOperands, backbone_rows: torch.Tensor,
                   ids: torch.Tensor, logprobs: torch.Tensor, top1: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor | None:
        """A summed weighted loss of the kind's own heads, added to the distillation loss; None: none.
        ids, logprobs [N, k]: the teacher's top-k in the operands' head rows; top1 [N] its greedy
        token; weights [N] the rows' weights."""
        return None

    # -- drafting ---------------------------------------------------------------------------

    def draft(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, head: TargetHead, *,
              linear: Any = None, margins: bool = False, rows_per_chunk: int = 1024,
              context: torch.Tensor | None = None) -> Drafts:
        """Greedy drafts of n blocks from the drafter's output rows.

        hidden [n, block_rows, H] (the drafter's forward over the blocks), anchors [n] target
        ids, head the drafter's head (`head.for_drafter`). `linear` (x [m, H], w [V, H]) ->
        [m, V] computes the logits (None: float32 matmuls, `rows_per_chunk` rows at a time).
        context [n, L*H]: the target features at the position before each anchor, for a kind
        whose head reads them (DFlash's block does not).
        """
        n, _, H = hidden.shape
        rows = hidden[:, 1:].reshape(-1, H)  # [n*D, H]: the anchor's row predicts nothing
        if linear is None and not margins:
            return Drafts(tokens=head.to_target(greedy_tokens(rows, head.lm_head, rows_per_chunk)).view(n, -1))
        logits = (linear or _float_linear)(rows, head.lm_head.to(hidden.dtype))  # [n*D, V]
        return _drafts(logits, head, n, margins)

    # -- export and loading -----------------------------------------------------------------

    def dflash_config_fields(self, config: DrafterConfig) -> dict[str, Any]:
        """What the exported config.json's `dflash_config` holds beyond the DFlash fields."""
        return {}

    def hf_fields(self, config: DrafterConfig) -> dict[str, Any]:
        """What the exported config.json holds beyond the DFlash fields and `architectures`
        (train/export.py)."""
        return {}

    def head_tensors(self, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """The tensors (name: shape) of the kind's heads that vLLM's loader maps, from an
        exported config.json (train/export.py's `vllm_tensors` adds the backbone's)."""
        return {}

    def loads(self, data: dict[str, Any]) -> bool:
        """Whether an exported config.json is this kind's (its `architectures`)."""
        return self.architecture in (data.get("architectures") or [])

    def check_hf(self, data: dict[str, Any], where: str) -> None:
        """ValueError naming `where` when the config.json sets a layout this kind does not
        implement. DFlash's block: the anchor's row does not sample."""
        dflash = data.get("dflash_config") or {}
        if bool(dflash.get("sample_from_anchor", data.get("sample_from_anchor"))):
            raise ValueError(f"{where}: this drafter implements Qwen3-style attention without bias or sinks, "
                             f"default half-split RoPE, SiLU and unscaled embeddings, values and logits; the "
                             f"checkpoint sets ['dflash_config.sample_from_anchor']")

    def config_from_hf(self, fields: dict[str, Any], data: dict[str, Any]) -> DrafterConfig:
        """The drafter config from the generic fields train/loading.py read and the config.json."""
        return self.config_class(**fields)

    def card_lines(self, config: DrafterConfig) -> list[str]:
        """The model card's paragraph on what this kind adds (train/export.py), [] for none."""
        return []

    def speculative_config(self, config: DrafterConfig) -> dict[str, Any]:
        """vLLM's --speculative-config for the exported folder (the model path left out)."""
        return {"method": self.vllm_method, "num_speculative_tokens": config.num_drafts}

    def hf_block_size(self, config: DrafterConfig) -> int:
        """The exported config.json's `block_size` (vLLM's and SGLang's field): the block's rows."""
        return self.block_rows(config.num_drafts)

    def serving_lines(self, config: DrafterConfig, target: str | None) -> list[str]:
        """The model card's "Serving" section: how to serve the folder with each engine."""
        c = config
        target, spec = vllm_placeholders(target, self.speculative_config(c))
        return [
            "## Serving",
            "",
            f"Serve next to the target it was trained for (its folder: `{target}`); greedy output is "
            f"the target's own. {c.num_drafts} drafts per verify of {c.num_drafts + 1} tokens: pass "
            f"`num_speculative_tokens` {c.num_drafts}; engines do not read `block_size` ({self.hf_block_size(c)}: the "
            "drafts and the anchor), and vLLM takes a larger value without complaint.",
            "",
            f"vLLM (`{self.vllm_method}` speculative method; keep `\"method\": \"{self.vllm_method}\"` explicit: "
            "without it vLLM guesses the method from the folder's name and, unless the name holds \"dflash\", runs "
            "this folder as a plain draft model that accepts nothing). vLLM runs the drafter in the "
            "target's dtype; for a float32 lossless check pass `--dtype float32` (vLLM's CPU build "
            "otherwise downcasts a float32 target to bfloat16, where near-ties flip):",
            "",
            *([f"Its layers mix {SLIDING_ATTENTION} and {FULL_ATTENTION}, which vLLM's DFlash loader serves only "
               "with its V2 model runner: set `VLLM_USE_V2_MODEL_RUNNER=1`.", ""]
              if c.layer_types is not None and FULL_ATTENTION in c.layer_types else []),
            "```bash",
            f"python -m vllm.entrypoints.openai.api_server --model {target} --speculative-config {spec}",
            "```",
            "",
            *sglang_serving(target, "DFLASH", "--speculative-num-draft-tokens", self.hf_block_size(c),
                            "the verify window: the drafts and the anchor"),
            "",
            ("Transformers: z-lab/dflash's `DFlashDraftModel.from_pretrained(folder)` and its "
             "`dflash_generate` loop." if c.draft_vocab_size is None else
             f"Draft vocabulary: this drafter scores {c.draft_vocab_size:,} of the target's {c.vocab_size:,} tokens "
             "(`lm_head.weight` holds the target head's rows of them, `d2t` maps each row to its token: "
             "target id = row + d2t[row]), which vLLM loads; z-lab/dflash's `DFlashDraftModel` loads no draft "
             "vocabulary, and SGLang 0.5.23's drops both tensors and drafts over the whole vocabulary (train "
             "without `--draft-vocab` for them)."),
        ]

    def export_warning(self, folder_name: str) -> str | None:
        """A warning for `dflash-train export` about the exported folder's name, None: none."""
        if "dflash" in folder_name.lower():
            return None
        return (f"Warning: --out {folder_name}: the folder name lacks \"dflash\"; keep \"method\": "
                f"\"{self.vllm_method}\" in vLLM's --speculative-config (without it vLLM guesses the method from the "
                "name and runs the folder as a plain draft model that accepts nothing)")


def vllm_placeholders(target: str | None, speculative: dict[str, Any]) -> tuple[str, str]:
    """(the target's placeholder path, vLLM's quoted --speculative-config) for a card's serving lines."""
    spec = (f"'{{\"method\": \"{speculative['method']}\", \"model\": \"/path/to/THIS/FOLDER\", "
            f"\"num_speculative_tokens\": {speculative['num_speculative_tokens']}}}'")
    return (f"/path/to/{target}" if target else "/path/to/TARGET"), spec


def vllm_serving(target: str, spec: str, intro: str, closing: str, sglang: list[str] = ()) -> list[str]:
    """A model card's "Serving" section: `intro`, vLLM's server command with the folder's
    --speculative-config `spec`, then `sglang` (`sglang_serving`'s lines, if any) and `closing`."""
    return ["## Serving", "", intro, "", "```bash",
            f"python -m vllm.entrypoints.openai.api_server --model {target} --speculative-config {spec}",
            "```", "", *sglang, *([""] if sglang else []), closing]


def v2_runner_serving(kind: DrafterKind, config: DrafterConfig, target: str | None, *, drafts_note: str,
                      closing: str, block_meaning: str) -> list[str]:
    """A model card's "Serving" section for a kind vLLM serves by its architecture on the V2 model runner
    only (DFlash2, LiLiCorr): vLLM's lines, then SGLang's (`--speculative-num-draft-tokens` the block,
    `block_meaning`), then `closing`. `drafts_note` follows the num_speculative_tokens value."""
    c = config
    target, spec = vllm_placeholders(target, kind.speculative_config(c))
    return vllm_serving(
        target, spec,
        f"Serve next to the target it was trained for (its folder: `{target}`) with vLLM's `{kind.vllm_method}` "
        f"speculative method (vLLM 0.32 or later: its `{kind.architecture}` architecture); greedy output is the "
        f"target's own. {c.num_drafts} drafts per verify of {c.num_drafts + 1} tokens: pass `num_speculative_tokens` "
        f"{c.num_drafts}{drafts_note}. It runs on vLLM's V2 model runner only, vLLM's default where Triton is "
        "installed, as on a GPU (on a CPU it needs Triton, which PyPI's build lacks):",
        closing,
        sglang_serving(target, "DFLASH", "--speculative-num-draft-tokens", kind.hf_block_size(c), block_meaning))


def sglang_serving(target: str, algorithm: str, block_flag: str, block: int, meaning: str) -> list[str]:
    """A model card's SGLang lines: its server command with `--speculative-algorithm algorithm` and
    the block in the flag SGLang resolves it from (`block_flag` `block`, which is `meaning`).
    SGLang 0.5.23 serves its DFLASH and DSPARK algorithms on CUDA, NPU and XPU devices only."""
    return [f"SGLang (`--speculative-algorithm {algorithm}`, 0.5.23 or later; a GPU: it serves the algorithm on CUDA, "
            f"NPU and XPU only; `{block_flag}` {block} is {meaning}):",
            "",
            "```bash",
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path /path/to/THIS/FOLDER {block_flag} {block}",
            "```"]


def greedy_tokens(hidden: torch.Tensor, lm_head: torch.Tensor, rows_per_chunk: int = 1024) -> torch.Tensor:
    """Argmax of `hidden @ lm_head.T` per row, `rows_per_chunk` rows at a time.

    hidden [N, H], lm_head [V, H]. Returns [N] int64. Logits are computed in float32.
    """
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)  # [N]
    weight = lm_head.float()
    for start in range(0, hidden.shape[0], rows_per_chunk):
        rows = hidden[start:start + rows_per_chunk].float()  # [n, H]
        out[start:start + rows_per_chunk] = (rows @ weight.T).argmax(-1)
    return out


def _float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight.float().T


def _drafts(logits: torch.Tensor, head: TargetHead, n: int, margins: bool) -> Drafts:
    """logits [n*D, V] -> Drafts of n blocks."""
    if not margins:
        return Drafts(tokens=head.to_target(logits.argmax(-1)).view(n, -1))
    top = logits.float().topk(2, dim=-1)  # [n*D, 2]
    return Drafts(tokens=head.to_target(top.indices[:, 0]).view(n, -1),
                  margins=(top.values[:, 0] - top.values[:, 1]).view(n, -1))


__all__ = ["Drafts", "DrafterKind", "LossOperands", "greedy_tokens", "sglang_serving", "v2_runner_serving",
           "vllm_placeholders", "vllm_serving"]
