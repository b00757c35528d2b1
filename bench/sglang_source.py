"""SGLang's drafter model sources, fetched from its wheel and run without SGLang installed.

SGLang needs a GPU and a stack of CUDA packages; what the tests want of it is its model code's
view of an exported folder: which config.json fields it reads, which modules it builds from
them and which of our tensors its `load_weights` maps where. `sglang_sources` downloads the
pinned wheel without its dependencies once (`pip download --no-deps`) and unpacks only the
files below into a cache folder. `sglang_model` executes those files' own classes and
functions (their parsed source, each module in its own namespace) with SGLang's parallel
layers, attention and rotary embedding replaced by stand-ins that hold the same parameters
at tensor parallel size 1 (`STANDINS`), builds the model on the meta device (no memory, no
kernels), and `load` feeds it our tensor names and shapes through SGLang's own
`load_weights`. Anything SGLang's constructors or loaders call that has no stand-in is
recorded (`SGLangModel.unstubbed`) instead of run, so a new dependency shows up in the tests
rather than passing silently.

What this trades off: the stand-ins are our reading of SGLang's layers (a QKV linear is one
[q + k + v, hidden] weight loaded by shard, a merged gate/up linear likewise); everything
that decides names, shapes, config fields and which tensors are dropped is SGLang's code.
"""

from __future__ import annotations

import ast
import builtins
import enum
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import typing
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
SGLANG_VERSION = "0.5.23"
SOURCES_ENV = "DFLASH_SGLANG_SOURCES"
DEFAULT_SOURCES = REPO / ".cache" / f"sglang-{SGLANG_VERSION}"
READY = ".dflash-sources-ready"  # written last, once every file below is unpacked
# The wheel is one per CPython version; its Python sources are the same in each.
WHEEL_TAGS = ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "--implementation", "cp"]
# Executed in this order (a module's imports resolve to the names of those before it).
MODULES = (
    "sglang/srt/speculative/dflash_utils.py",
    "sglang/srt/models/dflash.py",
    "sglang/srt/speculative/dspark_components/dspark_config.py",
    "sglang/srt/models/dspark.py",
    "sglang/srt/speculative/lilicorr_utils.py",
    "sglang/srt/models/lilicorr.py",
)
# Read as text only: the server's flags and how it resolves each algorithm's block; LiLiCorr's
# kernel file for its constants (`KERNEL_CONSTANTS`).
SERVER_FILES = ("sglang/srt/arg_groups/speculative_hook.py", "sglang/srt/arg_groups/field_order.py",
                "sglang/srt/speculative/spec_info.py", "sglang/kernels/ops/speculative/lilicorr.py")
KERNEL_CONSTANTS = {"MAX_FUSED_CANDIDATE_TOPK": "sglang/kernels/ops/speculative/lilicorr.py"}


def sglang_sources(path: str | Path | None = None) -> Path:
    """The folder holding SGLang's files (`path`, else $DFLASH_SGLANG_SOURCES, else
    REPO/.cache/sglang-VERSION), unpacked from the pinned wheel on first use; OSError (one line)
    when pip cannot download it."""
    folder = Path(path or os.environ.get(SOURCES_ENV) or DEFAULT_SOURCES).expanduser().absolute()
    if (folder / READY).is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *WHEEL_TAGS,
               f"sglang=={SGLANG_VERSION}", "-d", tmp, "-q"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("sglang-*.whl"))
        if result.returncode or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise OSError(f"pip download sglang=={SGLANG_VERSION} failed: {reason}")
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))  # renamed into place: one filesystem
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in MODULES + SERVER_FILES:
                wheel.extract(name, staging)
        (staging / READY).write_text(f"sglang=={SGLANG_VERSION}\n")
        shutil.rmtree(folder, ignore_errors=True)
        staging.replace(folder)
    return folder


# ---------------------------------------------------------------------------------------
# Stand-ins for what SGLang's model code imports and this file does not execute
# ---------------------------------------------------------------------------------------


@dataclass
class _Loads:
    """What SGLang's loaders did with the weights `load` offered: each weight's id that reached a
    parameter's loader, and each parameter's shards loaded ({None} for a whole tensor)."""

    reached: set[int] = field(default_factory=set)
    shards: dict[int, set] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


_LOADS = _Loads()  # one model is loaded at a time (`SGLangModel.load` resets it)


def _check_loaded(param: nn.Parameter, weight: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    _LOADS.reached.add(id(weight))
    if tuple(weight.shape) != tuple(shape):
        _LOADS.errors.append(f"{what}: got {tuple(weight.shape)}, SGLang's parameter takes {tuple(shape)}")


def default_weight_loader(param: nn.Parameter, weight: torch.Tensor) -> None:
    """SGLang's loader for an unsharded parameter: the shapes must agree."""
    _check_loaded(param, weight, param.shape, getattr(param, "_name", "parameter"))
    _LOADS.shards.setdefault(id(param), set()).add(None)


class _ShardedLinear(nn.Module):
    """SGLang's column/row/replicated/QKV/merged linears at tensor parallel size 1: one weight
    [sum(output_sizes), input_size] (and a bias) whose loader takes either the whole tensor or
    one named shard of the output rows (`shards`: name -> rows)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, shards: dict | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = int(input_size), int(sum(output_sizes))
        self.shards = shards or {}
        self.quant_method = None  # unquantized
        self.weight = nn.Parameter(torch.empty(self.output_size, self.input_size), requires_grad=False)
        self.weight.weight_loader = functools.partial(self._load, rows_last=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            self.bias.weight_loader = functools.partial(self._load, rows_last=True)

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: Any = None, *, rows_last: bool) -> None:
        rows = self.output_size if shard_id is None else self.shards[shard_id]
        shape = (rows,) if rows_last else (rows, self.input_size)
        _check_loaded(param, weight, shape, f"shard {shard_id!r}" if shard_id is not None else "linear")
        _LOADS.shards.setdefault(id(param), set()).add(shard_id)

    def complete(self, param: nn.Parameter) -> bool:
        done = _LOADS.shards.get(id(param), set())
        return None in done or (bool(self.shards) and done >= set(self.shards))


def _qkv(hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True, **_):
    kv = total_num_kv_heads or total_num_heads
    sizes = {"q": total_num_heads * head_size, "k": kv * head_size, "v": kv * head_size}
    return _ShardedLinear(hidden_size, list(sizes.values()), bias, sizes)


def _merged(input_size, output_sizes, bias=True, **_):
    return _ShardedLinear(input_size, list(output_sizes), bias, dict(enumerate(output_sizes)))


def _linear(input_size, output_size, bias=True, **_):
    return _ShardedLinear(input_size, [output_size], bias)


class _RMSNorm(nn.Module):
    """SGLang's RMSNorm / GemmaRMSNorm: one weight [hidden]."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(int(hidden_size)))
        self.eps = eps


class _Recorded(nn.Module):
    """A parameter-free module standing for SGLang's RadixAttention, rotary embedding or
    activation: it keeps the arguments it was built with, which the tests compare."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


def _rope_config(config: Any) -> tuple[float, dict | None]:
    """SGLang's get_rope_config for a plain RoPE: (theta from rope_parameters, else rope_theta; no scaling)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))), None


class _Struct:
    """msgspec.Struct as SGLang's config structs use it (keyword construction, frozen)."""

    def __init_subclass__(cls, **_: Any) -> None:
        super().__init_subclass__()
        dataclass(frozen=True, kw_only=True)(cls)


AttentionType = enum.Enum("AttentionType", "DECODER DECODER_BIDIRECTIONAL ENCODER_ONLY")
RaggedVerifyMode = enum.Enum("RaggedVerifyMode", {"STATIC": "static", "CAP_ACCEPT": "cap-accept",
                                                  "COMPACT": "compact"})


def _set_weight_attrs(param: Any, attrs: dict | None) -> None:
    for key, value in (attrs or {}).items():
        setattr(param, key, value)


STANDINS: dict[str, Any] = {
    "torch": torch, "nn": nn, "F": F, "logging": logging, "partial": functools.partial,
    "dataclass": dataclass, "msgspec": SimpleNamespace(Struct=_Struct),
    **{name: getattr(typing, name) for name in ("Any", "Callable", "Iterable", "List", "Optional", "Sequence",
                                                 "Tuple", "TYPE_CHECKING")},
    "ABC": __import__("abc").ABC, "abstractmethod": __import__("abc").abstractmethod,
    "Integral": __import__("numbers").Integral,
    "QKVParallelLinear": _qkv, "MergedColumnParallelLinear": _merged, "RowParallelLinear": _linear,
    "ColumnParallelLinear": _linear, "ReplicatedLinear": _linear, "LinearBase": _ShardedLinear,
    "RMSNorm": _RMSNorm, "GemmaRMSNorm": _RMSNorm, "RadixAttention": _Recorded, "SiluAndMul": _Recorded,
    "get_rope": _Recorded, "get_rope_config": _rope_config, "AttentionType": AttentionType,
    "RaggedVerifyMode": RaggedVerifyMode, "default_weight_loader": default_weight_loader,
    "set_weight_attrs": _set_weight_attrs, "add_prefix": lambda name, prefix: f"{prefix}.{name}" if prefix else name,
    "get_parallel": lambda: SimpleNamespace(tp_size=1, tp_rank=0),
    "is_npu": lambda: False, "_is_npu": False, "is_gfx95_supported": lambda: False,
    "get_compiler_backend": lambda: "eager", "_flashinfer_top_k": None,
    # Quantized linear methods: no stand-in linear is one.
    "ModelOptNvFp4A16LinearMethod": type("ModelOptNvFp4A16LinearMethod", (), {}),
    "ModelOptFp4LinearMethod": type("ModelOptFp4LinearMethod", (), {}),
}


class _Unstubbed:
    """A name SGLang imports that has no stand-in: usable at class definition, recorded when called."""

    calls: list[str] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> _Unstubbed:
        _Unstubbed.calls.append(self.name)
        return _Unstubbed(f"{self.name}()")

    def __getattr__(self, attribute: str) -> _Unstubbed:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unstubbed(f"{self.name}.{attribute}")


class _Namespace(dict):
    """A module's globals: its own names, then Python's builtins, the stand-ins and the names of
    the SGLang modules executed before it (what it imports from them), else `_Unstubbed`."""

    def __init__(self, name: str, imported: dict[str, Any], standins: dict[str, Any]) -> None:
        super().__init__(__name__=name, __builtins__=builtins)
        self.imported, self.standins = imported, standins

    def __missing__(self, key: str) -> Any:
        if hasattr(builtins, key):
            return getattr(builtins, key)
        if key in self.standins:
            return self.standins[key]
        if key in self.imported:
            return self.imported[key]
        return _Unstubbed(key)


def _executable(tree: ast.Module) -> ast.Module:
    """The module without its imports, try/if blocks (optional imports) and the decorators of
    its functions (torch.compile): its classes, functions and constants."""
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            body.append(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom, ast.Try, ast.If)):
            continue
        else:
            if isinstance(node, ast.FunctionDef):
                node.decorator_list = []
            body.append(node)
    return ast.Module(body=body, type_ignores=[])


def _constant(path: Path, name: str) -> Any:
    """A module-level literal `name = ...` of a file SGLang's models import (read, not run)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path}: no {name}")


def _module_imports(tree: ast.Module) -> list[str]:
    """The names a module's top-level imports bind (inside its try/if blocks too)."""
    names, blocks = [], list(tree.body)
    while blocks:
        node = blocks.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [alias.asname or alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, (ast.Try, ast.If)):
            blocks += node.body + node.orelse + [n for h in getattr(node, "handlers", []) for n in h.body]
    return names


@functools.cache
def sglang_namespaces(folder: Path, ragged_verify_mode: str = "static") -> dict[str, dict[str, Any]]:
    """SGLang's modules (`MODULES`), each executed in its own namespace: relative path -> names.
    `ragged_verify_mode` is SGLANG_RAGGED_VERIFY_MODE (DSpark builds its confidence head unless
    it is "static", the default)."""
    constants = {name: _constant(folder / relative, name) for name, relative in KERNEL_CONSTANTS.items()}
    standins = {**STANDINS, **constants, "read_ragged_verify_mode": lambda: RaggedVerifyMode(ragged_verify_mode)}
    imported: dict[str, Any] = {}
    namespaces = {}
    for relative in MODULES:
        tree = ast.parse((folder / relative).read_text(), relative)
        imports = _module_imports(tree)
        tree = _executable(tree)
        # Named as this module: dataclasses looks the defining module up in sys.modules.
        namespace = _Namespace(__name__, dict(imported), standins)
        # Class bodies look names up without `__missing__`: bind what the module imports first.
        namespace.update({name: namespace[name] for name in imports if name != "annotations"})
        exec(compile(tree, str(folder / relative), "exec"), namespace)
        namespaces[relative] = namespace
        for name, value in namespace.items():
            imported.setdefault(name, value)
    return namespaces


# ---------------------------------------------------------------------------------------
# An exported folder as SGLang's model code sees it
# ---------------------------------------------------------------------------------------


class _ReadDict(dict):
    """A config dict that records the keys read from it (`prefix` + key) into `reads`."""

    def __init__(self, data: dict, reads: set[str], prefix: str) -> None:
        super().__init__(data)
        self.reads, self.prefix = reads, prefix

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads.add(self.prefix + str(key))
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.reads.add(self.prefix + str(key))
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.reads.add(self.prefix + str(key))
        return super().__contains__(key)


class HFConfig:
    """config.json as SGLang's model code reads a Hugging Face config: its fields as attributes
    (AttributeError when absent, so `getattr(config, name, default)` takes the default), with
    every field read recorded in `reads` (`dflash_config.` + key for the nested ones; a nested
    dict unpacked with `**`, as DSpark's config merge does, reads unrecorded)."""

    def __init__(self, data: dict[str, Any]) -> None:
        reads: set[str] = set()
        values = {key: _ReadDict(value, reads, f"{key}.") if isinstance(value, dict) else value
                  for key, value in data.items()}
        object.__setattr__(self, "reads", reads)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self.reads.add(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def get_text_config(self) -> HFConfig:
        return self


@dataclass
class SGLangModel:
    """SGLang's drafter class for an exported config.json, built on the meta device."""

    model: nn.Module
    config: HFConfig
    unstubbed: list[str]
    """Calls SGLang's constructor made to names without a stand-in."""

    def parameters(self) -> dict[str, tuple[int, ...]]:
        """SGLang's parameter names (as `load_weights` resolves them) and shapes."""
        return {name: tuple(p.shape) for name, p in self.model.named_parameters()}

    def load(self, tensors: dict[str, tuple[int, ...]]) -> LoadReport:
        """Run SGLang's `load_weights` on tensors of these names and shapes (meta tensors)."""
        global _LOADS
        _LOADS = _Loads()
        _Unstubbed.calls.clear()
        weights = {name: torch.empty(shape, device="meta") for name, shape in tensors.items()}
        error = None
        try:
            self.model.load_weights(list(weights.items()))
        except ValueError as raised:  # SGLang's own refusal (a missing head tensor, a shape)
            error = str(raised)
        modules = {id(p): m for m in self.model.modules() for p in m.parameters(recurse=False)}
        unloaded = sorted(name for name, p in self.model.named_parameters()
                          if not (modules[id(p)].complete(p) if isinstance(modules[id(p)], _ShardedLinear)
                                  else None in _LOADS.shards.get(id(p), set())))
        return LoadReport(ignored=sorted(name for name, w in weights.items() if id(w) not in _LOADS.reached),
                          unloaded=unloaded, mismatched=list(_LOADS.errors), error=error,
                          unstubbed=list(_Unstubbed.calls))


@dataclass
class LoadReport:
    """What SGLang's `load_weights` did with an export's tensors."""

    ignored: list[str]
    """Our tensors no SGLang parameter took (its DFlash loader drops unknown names silently)."""
    unloaded: list[str]
    """SGLang's parameters (or shards of them) no tensor of ours filled."""
    mismatched: list[str]
    """Shape disagreements its weight loaders would refuse."""
    error: str | None
    """SGLang's own ValueError from `load_weights`, None: none."""
    unstubbed: list[str]
    """Calls to names without a stand-in during loading."""


def sglang_model(folder: Path, config: dict[str, Any], *, ragged_verify_mode: str = "static") -> SGLangModel:
    """SGLang's class for `config`'s architecture (from its model files' `EntryClass` lists)
    built from `config` on the meta device; ValueError (SGLang's own) when its constructor
    refuses the config, LookupError when no class of that name is in the files."""
    namespaces = sglang_namespaces(Path(folder), ragged_verify_mode)
    classes = {cls.__name__: cls for ns in namespaces.values() for cls in ns.get("EntryClass") or []}
    (architecture,) = config["architectures"]
    if architecture not in classes:
        raise LookupError(f"SGLang {SGLANG_VERSION} has no model class {architecture} (it has {sorted(classes)})")
    hf = HFConfig(config)
    _Unstubbed.calls.clear()
    with torch.device("meta"):
        model = classes[architecture](hf)
    for name, p in model.named_parameters():
        p._name = name
    return SGLangModel(model=model, config=hf, unstubbed=list(_Unstubbed.calls))


def entry_file(folder: Path, architecture: str) -> str:
    """The model file (relative path) whose `EntryClass` lists `architecture`."""
    for relative, namespace in sglang_namespaces(Path(folder)).items():
        if any(cls.__name__ == architecture for cls in namespace.get("EntryClass") or []):
            return relative
    raise LookupError(architecture)


def server_source(folder: Path, relative: str) -> ast.Module:
    """One of `SERVER_FILES`, parsed."""
    return ast.parse((Path(folder) / relative).read_text(), relative)


__all__ = ["DEFAULT_SOURCES", "HFConfig", "LoadReport", "SGLANG_VERSION", "SGLangModel", "entry_file",
           "server_source", "sglang_model", "sglang_namespaces", "sglang_sources"]
