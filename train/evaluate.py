"""`dflash-train eval`: the command, what it evaluates, and its report.

The figures come from two modules: offline scoring from a cache in train/acceptance.py (no
target needed; its docstring defines tau and every offline figure) and online speculative
decoding against the real target in train/online.py. This file chooses what they run on and
puts the results together:

- the drafter: RUN's newest checkpoint, or `--checkpoint` (a RUN/checkpoints/step-N folder or
  an exported one), read by `dflash.train.loading.load_drafter`;
- the sequences (`held_out_selection`): by default the run's held-out set (`held_out_mask`
  over its caches with its seed and eval_fraction, as fit drew it); a `--cache` of the run
  gives its share, another cache all of its sequences (`--split train`: the sequences fit
  trained on instead of the held-out ones); the cache must fit the drafter (layer
  ids, sizes, feature codec and basis) and, unless `--allow-target-mismatch`, come from the
  run's target;
- online with a cache (`sources_in_file`), the prompt records behind exactly the evaluated
  sequences, so offline and online figures stand side by side on the same conversations;
  or, `--prompts NAME`, benchmark suites (train/suites.py), each decoded and reported apart
  (`result["suites"]`, a table with the suites as columns);
- the target: a Hugging Face folder whose sizes match the drafter's, with its stop tokens
  (`dflash.train.online.load_target`; everything online comes from that module).

The report (`format_report`) is a short table; `--json` adds every figure as one JSON line.
The figures are merged into RUN/eval/<checkpoint>.json (`--no-save`: not), where
`dflash-train export` finds them for the model card: an offline-only call keeps the
checkpoint's earlier online figures. What this file trades off: eval reads fit's resolved
config (RUN/config.json) to rebuild the held-out set rather than storing the held-out ids,
so the set follows from (caches, seed, eval_fraction, the caches' paths): a cache moved
since fit is not found, and `--cache` with its new path scores all of its sequences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import click
import numpy as np
import torch

from dflash.common.commands import DflashCommand
from dflash.common.files import write_json_atomic
from dflash.common.fingerprint import target_fingerprint
from dflash.common.options import METAVAR, ONLY_ON, PATH, check_choices, config_options, given
from dflash.train.acceptance import OfflineTotals, evaluate_offline
from dflash.train.basis import match_features
from dflash.train.identity import cache_fingerprint, check_same_target, read_run_info
from dflash.train.loading import load_drafter
from dflash.train.model import DFlashDrafter, TargetHead
from dflash.train.online import (
    ChatRenderer,
    cache_stop_token_ids,
    drafter_proposer,
    evaluate_online,
    load_prompts,
    load_target,
    rollback_refusal,
    suite_prompts,
)
from dflash.train.run_folder import eval_results_path
from dflash.train.suites import load_suite, suite_specs


@dataclass(kw_only=True)
class EvalConfig:
    """`dflash-train eval`: what to evaluate, on what."""

    run: str | None = field(default=None, metadata={PATH: "dir"})
    """Run folder written by `dflash-train fit` (its drafter config, caches and held-out set)."""
    checkpoint: str | None = field(default=None, metadata={PATH: "any"})
    """A RUN/checkpoints/step-N folder or an exported drafter folder; unset: RUN's newest."""
    cache: str | None = field(default=None, metadata={PATH: "dir"})
    """Cache for the offline figures: one of the run's caches (its held-out sequences are used)
    or another cache (all its sequences). Unset: the held-out sequences of all the run's caches
    (offline mode), or no offline figures (online mode)."""
    split: Literal["held-out", "train"] = "held-out"
    """Which of the run's sequences: held-out (the set fit held out), or train (the ones it
    trained on: a drafter that scores far higher there than held out memorises its data and
    wants more of it; bench/RESULTS.md "recipe")."""
    online: bool = field(default=False, metadata={ONLY_ON: True})
    """Run real speculative decoding against the target."""
    target: str | None = field(default=None, metadata={PATH: "dir"})
    """Online: the target's Hugging Face folder."""
    prompts: str | None = field(default=None, metadata={METAVAR: "FILE|SUITES"})
    """Online: a records file as stage one reads it (JSONL, .jsonl.zst, JSON, Parquet); each
    record's conversation up to its last user turn is a prompt.
    With --cache, only the records behind that cache's evaluated sequences are used, and the
    offline figures are computed on exactly those sequences (side by side).
    Or benchmark suites by name, comma-separated: gsm8k, math500, humaneval, mbpp, mt-bench
    (loaded from the Hugging Face hub, in z-lab's prompt formats), each NAME=PATH for a local
    copy (JSONL, JSON, Parquet, or a datasets save_to_disk folder in the suite's columns)."""
    max_new_tokens: int = 256
    """Online: tokens generated per prompt at most."""
    num_drafts: int | None = None
    """Drafts per verify to decode and score with (the verify checks num_drafts + 1 tokens); unset:
    the drafter's own; 0 online: plain decoding."""
    limit: int | None = None
    """Evaluate at most this many sequences / prompts (the first ones, in order)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Online target (and drafter) dtype: auto (float32 on cpu, bfloat16 on cuda), float32 or
    bfloat16. float32 makes the lossless check exact nearly to the last bit; in bfloat16 a
    mismatch within bf16 rounding is reported as a near-tie, not a failure (train/README.md)."""
    temperature: float = 0.0
    """Online: sampling temperature; 0 decodes greedily (checked token for token against the
    target's greedy output), > 0 samples: the target draws at every position and drafts are
    accepted while they equal its draws (lossless in distribution)."""
    seed: int = 0
    """Online, temperature > 0: the sampling seed (each prompt and turn draws from its own
    generator, seeded from it)."""
    chat_template_kwargs: str | None = None
    """Online: JSON object for the chat template; unset: the cache's (a different one warns)."""
    chat_template: str | None = field(default=None, metadata={PATH: "file"})
    """Online: Jinja chat template file; unset: the cache's (or the tokenizer's)."""
    save: bool = True
    """Write the figures to RUN/eval/<checkpoint>.json (read by `dflash-train export`)."""
    allow_target_mismatch: bool = field(default=False, metadata={ONLY_ON: True})
    """Evaluate a cache or --target of another target than the run's (a warning in the report)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.online and (self.target is not None or self.prompts is not None):
            raise ValueError("--target and --prompts are used only with --online: add --online, or drop them")
        if self.online and (self.target is None or self.prompts is None):
            raise ValueError("eval --online needs --target (the target's folder) and --prompts (a JSONL file)")
        if not self.online and self.cache is None and self.run is None:
            raise ValueError("eval needs --cache or --run (whose held-out sequences are evaluated)")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_drafts is not None and self.num_drafts < (0 if self.online and self.cache is None else 1):
            raise ValueError(f"--num-drafts must be >= 1 (0 online: plain decoding), got {self.num_drafts}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.online and suite_specs(self.prompts) is not None and self.cache is not None:  # names checked here
            raise ValueError("--cache pairs offline figures with the records file the cache was built from; "
                             "a suite has none: drop --cache")


def held_out_selection(fit_config: dict[str, Any], cache_path: str | Path | None,
                       split: str = "held-out") -> list[tuple[Any, list[int]]]:
    """[(open cache, sequence indices)] to evaluate.

    The held-out set is the run's (`held_out_mask` over the concatenation of its caches, with
    its seed and eval_fraction); split "train" takes its complement instead. `cache_path`
    that is one of the run's caches gives its share of that set; another cache gives all its
    sequences; None gives every run cache's share.
    """
    from dflash.shards import open_cache
    from dflash.train.data import held_out_mask

    run_caches = [str(Path(p).resolve()) for p in fit_config.get("cache", [])]
    if cache_path is not None and str(Path(cache_path).resolve()) not in run_caches:
        cache = open_cache(cache_path)
        return [(cache, list(range(len(cache))))]
    opened = []
    for path in fit_config.get("cache", []):
        if not Path(path).is_dir():
            raise ValueError(f"the run's cache {path} (RUN/config.json) does not exist here: pass --cache "
                             "with its current location to evaluate all of its sequences")
        opened.append(open_cache(path))
    held = held_out_mask(sum(len(c) for c in opened), float(fit_config["eval_fraction"]), int(fit_config["seed"]))
    if split == "train":
        held = ~held
    selection, offset = [], 0
    for path, cache in zip(run_caches, opened):
        indices = np.flatnonzero(held[offset:offset + len(cache)]).tolist()
        offset += len(cache)
        if cache_path is None or path == str(Path(cache_path).resolve()):
            selection.append((cache, indices))
    if not any(indices for _, indices in selection):
        raise ValueError("the run holds out no sequence (eval_fraction 0?): pass --cache with a separate cache")
    return selection


def sources_in_file(cache: Any, indices: list[int], prompts: str | Path) -> dict[int, int]:
    """{record index in `prompts`: sequence index} for the sequences that came from that file.

    A cache names its input files as stage one was given them; they match `prompts` by
    resolved path, or else by file name (the cache may have been built elsewhere).
    """
    wanted = Path(prompts).resolve()
    by_path, by_name = {}, {}
    for i in indices:
        source = cache.source(i)
        if Path(source["file"]).resolve() == wanted:
            by_path[int(source["index"])] = i
        elif Path(source["file"]).name == wanted.name:
            by_name[int(source["index"])] = i
    return by_path or by_name


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return torch.device(name)


def _check_cache(cache: Any, drafter: DFlashDrafter) -> None:
    spec, c = cache.spec, drafter.config
    if spec.feature_width != c.context_width or cache.feature_basis_sha256 != c.feature_basis_sha256:
        raise ValueError(f"{cache.path}: cache features ({spec.feature_codec}, {spec.feature_width} per token) "
                         f"are not what the drafter's fc reads ({c.context_width} per token)")
    if spec.layer_ids != c.target_layer_ids or spec.hidden_size != c.hidden_size or spec.vocab_size != c.vocab_size:
        raise ValueError(
            f"{cache.path}: cache has layers {spec.layer_ids}, hidden {spec.hidden_size}, vocabulary "
            f"{spec.vocab_size}; the drafter expects layers {c.target_layer_ids}, hidden {c.hidden_size}, "
            f"vocabulary {c.vocab_size}: evaluate on a cache of the drafter's target")


def _select(config: EvalConfig, loaded) -> tuple[list[tuple[Any, list[int]]], set | None]:
    """Which sequences to score offline ([(cache, indices)]) and, online with a cache, which
    prompt records to keep (their record keys; None: the first `limit` of the file)."""
    selection: list[tuple[Any, list[int]]] = []
    if config.cache is not None or not config.online:
        if loaded.fit_config is not None:
            selection = held_out_selection(loaded.fit_config, config.cache, config.split)
        else:
            from dflash.shards import open_cache

            cache = open_cache(config.cache)
            selection = [(cache, list(range(len(cache))))]
    keep = None
    if config.online and selection:
        cache, indices = selection[0]
        if len(selection) > 1:
            raise ValueError("eval --online with a run of several caches: pass --cache with the one the "
                             "prompts file went into")
        matched = sources_in_file(cache, indices, config.prompts)
        if not matched:
            raise ValueError(f"none of the {len(indices)} evaluated sequences of {cache.path} came from "
                             f"{config.prompts}; pass the prompts file the cache was built from, or drop --cache")
        keep = set(sorted(matched)[: config.limit] if config.limit else matched)
        selection = [(cache, sorted(matched[r] for r in keep))]
    elif config.limit is not None:
        remaining, limited = config.limit, []
        for cache, indices in selection:
            limited.append((cache, indices[:remaining]))
            remaining -= len(limited[-1][1])
        selection = limited
    return selection, keep


def _run_cache(loaded) -> Any | None:
    """The run's first cache, for its chat-template settings (None: no run, or not here)."""
    from dflash.shards import open_cache

    paths = (loaded.fit_config or {}).get("cache") or []
    return open_cache(paths[0]) if paths and Path(paths[0]).is_dir() else None


def run_eval(config: EvalConfig, *, show_progress: bool = True) -> dict[str, Any]:
    """Evaluate as `config` says; returns the figures (offline keys at top level, online ones
    under "online", or per suite under "suites") and saves them to RUN/eval/<checkpoint>.json
    when asked."""
    device = _device(config.device)
    loaded = load_drafter(config.run, config.checkpoint, device=device)
    drafter = loaded.drafter.eval()
    # The verify: the drafts and the target's bonus token.
    verify_size = (drafter.config.num_drafts if config.num_drafts is None else config.num_drafts) + 1
    result: dict[str, Any] = {"checkpoint": str(loaded.checkpoint), "step": loaded.step}

    selection, keep = _select(config, loaded)

    run_fingerprint = read_run_info(config.run).get("target_fingerprint") if config.run else None
    warnings = result["warnings"] = []
    fit_caches = (loaded.fit_config or {}).get("cache") or []
    if selection:
        drafter = match_features(drafter, selection[0][0], fit_caches)  # folds a basis for raw features
        for cache, _ in selection:
            _check_cache(cache, drafter)
            warnings.append(check_same_target(f"--cache {cache.path}", cache_fingerprint(cache), run_fingerprint,
                                              allow=config.allow_target_mismatch))
        result.update(_offline(drafter, selection, verify_size=verify_size, device=device,
                               show_progress=show_progress))
    if config.online:
        warnings.append(check_same_target(f"--target {config.target}", target_fingerprint(config.target),
                                          run_fingerprint, allow=config.allow_target_mismatch))
        template_cache = (selection[0][0] if selection
                          else _run_cache(loaded) if suite_specs(config.prompts) is not None else None)
        try:
            result.update(_online(config, match_features(drafter, None, fit_caches), template_cache, keep,
                                  verify_size=verify_size, device=device, show_progress=show_progress))
        except OnlineRefused as refused:
            if not selection:
                raise
            result["online_refused"] = str(refused)  # the offline figures are still saved and shown

    result["warnings"] = [w for w in dict.fromkeys(warnings) if w is not None]
    if config.save and config.run is not None:
        result["saved_to"] = str(_save_result(eval_results_path(Path(config.run), loaded.checkpoint), result))
    return result


def _offline(drafter: DFlashDrafter, selection: list, *, verify_size: int, device: torch.device,
             show_progress: bool) -> dict[str, Any]:
    """The offline figures of the selected (cache, sequence indices), with a progress bar."""
    from tqdm import tqdm

    head = TargetHead.load(selection[0][0].target_dir, device=device, dtype=torch.float32)
    bar = tqdm(total=sum(len(indices) for _, indices in selection), desc="offline", unit="seq",
               disable=not show_progress)

    def progress(totals: OfflineTotals) -> None:
        bar.update(1)
        bar.set_postfix(tau=f"{1 + totals.accepted_sum / max(totals.num_anchors, 1):.3f}")

    sequences = (cache[i] for cache, indices in selection for i in indices)
    figures = evaluate_offline(drafter, head, sequences, verify_size=verify_size, progress=progress,
                               stop_token_ids=cache_stop_token_ids(selection[0][0].target_dir))
    bar.close()
    figures["caches"] = [{"path": str(cache.path), "num_sequences": len(indices)} for cache, indices in selection]
    figures["regenerated"] = all(cache.spec.replies[0] for cache, _ in selection)
    figures["generation_temperature"] = selection[0][0].spec.replies[1]
    # the precision the target regenerated in, when stage one did it (an engine's is unknown)
    first = selection[0][0].spec
    figures["generation_dtype"] = first.target.get("dtype") if first.regenerated and len(selection) == 1 else None
    return figures


class OnlineRefused(ValueError):
    """The target's family cannot be decoded exactly (its cache cannot be rolled back)."""


def _online(config: EvalConfig, drafter: DFlashDrafter, template_cache: Any, keep: Any, *, verify_size: int,
            device: torch.device, show_progress: bool) -> dict[str, Any]:
    """{"online": figures} for a records file, or {"suites": [figures per suite]}: speculative
    decoding against the target (`drafter` with raw features, the chat template of
    `template_cache` unless the config overrides it)."""
    from tqdm import tqdm

    from dflash.train.chat_template import resolve_template_settings

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        config.dtype, torch.float32 if device.type == "cpu" else torch.bfloat16)
    target, tokenizer, stop = load_target(config.target, drafter, device=device, dtype=dtype)
    refusal = rollback_refusal(target)
    if refusal is not None:
        raise OnlineRefused(f"eval --online --target {config.target}: {refusal}")
    template_kwargs, template_text = resolve_template_settings(
        template_cache, config.chat_template_kwargs, config.chat_template)
    renderer = ChatRenderer(tokenizer, template_text, template_kwargs)
    proposer = drafter_proposer(drafter.to(dtype), target)

    def decode(prompts, desc: str) -> dict[str, Any]:
        bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not show_progress)

        def online_progress(done: int, total: int, taus: list[int], mismatches: list) -> None:
            bar.update(1)
            bar.set_postfix(tau=f"{np.mean(taus) if taus else 0:.3f}", mismatches=len(mismatches))

        online = evaluate_online(target, proposer, prompts, max_new_tokens=config.max_new_tokens,
                                 verify_size=verify_size, layer_ids=drafter.config.target_layer_ids,
                                 stop_token_ids=stop, progress=online_progress, temperature=config.temperature,
                                 seed=config.seed, renderer=renderer)
        bar.close()
        online.update(stop_token_ids=sorted(stop), device=str(device), dtype=str(dtype).removeprefix("torch."),
                      target=str(config.target), chat_template_kwargs=template_kwargs)
        return online

    specs = suite_specs(config.prompts)
    if specs is not None:
        return {"suites": [{"suite": name, "prompts": str(path or name), "rejected": [],
                            **decode(suite_prompts(load_suite(name, path, limit=config.limit), renderer), name)}
                           for name, path in specs]}
    prompts, rejected = load_prompts(config.prompts, renderer, keep=keep,
                                     limit=None if keep is not None else config.limit)
    if not prompts:
        shown = "; ".join(f"line {r['index'] + 1}: {r['reason']}" for r in rejected[:3])
        raise ValueError(f"--prompts {config.prompts}: no usable prompt ({len(rejected)} record(s) rejected"
                         + (f"; {shown}" if shown else "") + "): give JSONL chat records with a user turn")
    return {"online": {**decode(prompts, "online"), "rejected": rejected, "prompts": str(config.prompts)}}


def _save_result(path: Path, result: dict[str, Any]) -> Path:
    """Merge `result` into RUN/eval/<checkpoint>.json: an offline-only call keeps the
    checkpoint's earlier online figures, and suites merge by (suite, temperature, seed)."""
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if "online" in result or "suites" in result:
        saved.pop("online_refused", None)  # an earlier refusal, of this or another target
    suites = {(e["suite"], e["temperature"], e["seed"]): e for e in saved.get("suites", []) + result.get("suites", [])}
    saved.update(result)
    if suites:
        saved["suites"] = list(suites.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, saved, indent=1, sort_keys=False)
    return path


def format_report(result: dict[str, Any]) -> str:
    """The human table printed by `dflash-train eval`."""
    step = f" (step {result['step']})" if result.get("step") is not None else ""
    lines = [f"checkpoint {result['checkpoint']}{step}"]
    if result.get("acceptance_length") is not None:
        lines.append(
            f"offline  tau {result['acceptance_length']:.3f} over {result['num_anchors']} anchors of "
            f"{result['num_sequences']} sequences ({result['num_drafts']} drafts per verify of "
            f"{result['verify_size']})")
        if result.get("replay_acceptance_length") is not None:
            made, online = result.get("generation_dtype"), (result.get("online") or {}).get("dtype")
            if not (result.get("regenerated") and result.get("generation_temperature") == 0):
                kind = "proxy: replies not the target's greedy output"
            elif made and online and made != online:  # near-ties of one precision go the other way in the other
                kind = f"near online greedy tau: replies regenerated greedily in {made}, decoded online in {online}"
            else:
                kind = "= online greedy tau (replies regenerated greedily" + (f" in {made})" if made else ")")
            lines.append(f"         replayed decoding tau {result['replay_acceptance_length']:.3f} over "
                         f"{result['num_replay_verifications']} verifications ({kind})")
        width = len(result["per_position_acceptance"])
        lines.append("position " + " ".join(f"{k:>5d}" for k in range(1, width + 1)))
        for name in ("acceptance", "match"):
            values = result[f"per_position_{name}"]
            lines.append(f"{name:<8} " + " ".join("    -" if v is None else f"{v:5.3f}" for v in values))
    lines += [f"warning: {warning}" for warning in result.get("warnings", [])]
    if "online_refused" in result:
        lines.append("online   not decoded: refused (the error below says why)")
    online = result.get("online")
    if online:
        lines.append(_online_line(online))
        lines.append(
            f"         {online['tokens_per_s']:.1f} tok/s speculative vs {online['baseline_tokens_per_s']:.1f} "
            f"tok/s {'greedy' if online['lossless'] is not None else 'plain sampling'} ({online['speedup']:.2f}x, "
            f"{online['device']} {online['dtype']})")
        lines += [_mismatch_line(m) for m in online["mismatches"]]
        if online["rejected"]:
            lines.append(f"         {len(online['rejected'])} prompt records skipped "
                         f"(first: line {online['rejected'][0]['index'] + 1}: {online['rejected'][0]['reason']})")
    if result.get("suites"):
        lines.append(format_suites(result["suites"]))
    return "\n".join(lines)


def _lossless(entry: dict[str, Any]) -> str:
    """"yes" / "NO" with the counts of real mismatches and near-ties (`online.first_mismatch`)."""
    ties = entry.get("num_near_ties") or 0
    tie_words = f"{ties} near-tie{'s' if ties != 1 else ''} within {entry.get('dtype', 'the dtype')} rounding"
    if entry["lossless"]:
        return "yes" + (f" ({tie_words}, no real mismatch)" if ties else "")
    real = entry["num_real_mismatches"]
    return f"NO ({real} real mismatch{'es' if real != 1 else ''}" + (f", {tie_words})" if ties else ")")


def _mismatch_line(m: dict[str, Any]) -> str:
    """One mismatch of the report: where, both tokens, the reference's margins, and its kind."""
    where = f"{m['file']}:{m['index']}" + (f" turn {m['turn']}" if "turn" in m else "") + f" at token {m['position']}"
    gap = "" if m["reference_gap"] is None else f", gap to it {m['reference_gap']:.4g} (bound {m['tie_bound']:.4g})"
    margin = "" if m["reference_margin"] is None else f" (margin {m['reference_margin']:.4g}{gap})"
    kind = "near-tie" if m["near_tie"] else "mismatch"
    return (f"         {kind} {where}: target {m['reference_token']}{margin}, "
            f"speculative {m['speculative_token']}")


def _online_line(online: dict[str, Any]) -> str:
    """The online figure's first line: tau, how many verifies and prompts, and lossless."""
    if online["lossless"] is None:
        status = f"in distribution (sampled at temperature {online['temperature']:g}, seed {online['seed']})"
    else:
        status = _lossless(online)
    return (f"online   tau {online['acceptance_length'] or 0:.3f} over {online['num_verifications']} verifications, "
            f"{online['num_prompts']} prompts, lossless {status}")


def format_suites(entries: list[dict[str, Any]]) -> str:
    """Benchmark suites as the papers print them: one column per suite, tau and the
    per-position acceptance in rows, then speed."""
    width = max(10, *(len(e["suite"]) + 2 for e in entries))
    temperatures = sorted({e["temperature"] for e in entries})
    lines = ["suites   " + ", ".join(f"temperature {t:g}" for t in temperatures)
             + f", {entries[0]['num_drafts']} drafts per verify of {entries[0]['verify_size']}"
             + f", at most {entries[0]['max_new_tokens']} new tokens per turn",
             f"{'':24s}" + "".join(f"{e['suite']:>{width}s}" for e in entries)]

    def row(label: str, values: list[str]) -> str:
        return f"{label:24s}" + "".join(f"{v:>{width}s}" for v in values)

    lines.append(row("tau", [f"{e['acceptance_length'] or 0:.3f}" for e in entries]))
    lines.append(row("tau, mean over turns", [f"{e['mean_turn_acceptance_length'] or 0:.3f}" for e in entries]))
    for k in range(1, max(len(e["per_position_acceptance"]) for e in entries) + 1):
        lines.append(row(f"accepted through {k}", [
            "-" if k > len(e["per_position_acceptance"]) or e["per_position_acceptance"][k - 1] is None
            else f"{e['per_position_acceptance'][k - 1]:.3f}" for e in entries]))
    lines.append(row("tok/s speculative", [f"{e['tokens_per_s'] or 0:.1f}" for e in entries]))
    lines.append(row("tok/s plain", [f"{e['baseline_tokens_per_s'] or 0:.1f}" for e in entries]))
    lines.append(row("speedup", [f"{e['speedup'] or 0:.2f}x" for e in entries]))
    lines.append(row("prompts (turns)", [f"{e['num_prompts']} ({e['num_turns']})" for e in entries]))
    lines.append(row("lossless", ["sampled" if e["lossless"] is None else "yes" if e["lossless"] else "NO"
                                  for e in entries]))
    lines.append(row("near-ties / real", ["-" if e["lossless"] is None
                                          else f"{e['num_near_ties']} / {e['num_real_mismatches']}"
                                          for e in entries]))
    for e in entries:
        lines += [f"         {e['suite']}: {'near-tie' if m['near_tie'] else 'mismatch'} at {m['index']}"
                  + (f" turn {m['turn']}" if "turn" in m else "") + f" token {m['position']}" for m in e["mismatches"]]
    return "\n".join(lines)


@click.command("eval", cls=DflashCommand)
@config_options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object on the last line.")
def eval_command(as_json: bool, **options: Any) -> None:
    """Acceptance length of a drafter: offline from a cache, and with --online against the target.

    \b
    tau = 1 + the number of leading drafts the target accepts (its bonus token counts 1).
    Offline: every eligible anchor of the held-out sequences (or of --cache), block position
    k scored against the cached top-1 at a+k-1; "replayed" follows greedy decoding along
    each sequence's last reply and equals the online tau when the cache was made with
    --regenerate at temperature 0. Online: real greedy speculative decoding, checked token
    for token against the target's own greedy output (lossless); --temperature T > 0 samples
    (lossless in distribution). --prompts gsm8k,mt-bench decodes benchmark suites in z-lab's
    prompt formats, one column each in the report (train/README.md lists the suites).
    """
    result = run_eval(EvalConfig(**given(options)))  # a ValueError is a one-line error (DflashCommand)
    click.echo(format_report(result))
    if as_json:
        click.echo(json.dumps(result))
    if "online_refused" in result:  # after the offline figures: one Error line, exit status 1
        raise ValueError(result["online_refused"])
