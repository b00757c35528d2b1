"""The embedded default, end to end: a DSpark drafter (DFlash's backbone plus a Markov head:
each draft sees the one before it) for SmolLM2-135M-Instruct on chitchat conversations, on a
laptop CPU, in under 10 minutes from a fresh clone on 2 cores (`make demo`, which runs
`python -m demo.run` from the repository root); on the GPU where there is one (`--device`).

It runs the real commands a user runs, in subprocesses, so that each shows its own progress:
prepare the target and prompts (dflash.testing.prepare), `dflash-precompute --regenerate`,
`dflash-train eval` of the untrained drafter, `dflash-train fit`, `dflash-train eval` of the
trained drafter offline and online (real speculative decoding against the target), and
`dflash-shards info`; then it prints a summary. Everything lives under DFLASH_DEMO_DIR
(default `.demo/` in the repository); a rerun reuses what is there: the prepared target and
prompts, the finished cache, the finished run.

The sizes are chosen for 2 CPU cores and a first run under 10 minutes, not for quality: one
drafter layer, a Markov head of rank 64, 3 drafts per verify, 768 one-exchange conversations whose
replies the target regenerates greedily, 1,200 steps, and a draft vocabulary of the 4,096 most
frequent reply tokens (scoring the whole 49,152-row head was most of a training step and of a
draft). Stage one runs the target in bfloat16 where the device computes it natively (a GPU, or
a CPU with AVX512-BF16 or AMX: `--stage-one-dtype`), which is what keeps 768 conversations
inside the 10 minutes on such a CPU; training and the online check stay float32. Half the
conversations and 900 steps (`--num-conversations 384 --max-steps 900`) take about 3 minutes
less where stage one runs in float32, for about 10% less online tau (bench/RESULTS.md "recipe",
2026-12-05). The rest is the best measured within the demo's time (bench/RESULTS.md
"recipe" has every change tried, with 3 seeds; DSpark beat DFlash there on tau offline and
online, on every seed, at the same budget). `--drafter dflash` trains the plain DFlash drafter instead.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import click
import torch

from bench.engine_venv import ensure_engine_venv
from demo import default_work_dir
from dflash.common.commands import DflashCommand
from dflash.common.options import NONE_WORD, ONLY_ON, PATH, check_choices, config_options, given
from dflash.common.records import iter_records
from dflash.shards.spec import BASIS_CODECS, FeatureCodec
from dflash.testing.prepare import chitchat_records, prepare_smollm2
from dflash.train import drafters


@dataclass(kw_only=True)
class DemoConfig:
    work_dir: Path = field(default_factory=default_work_dir, metadata={PATH: "dir"})
    """Where the target, prompts, cache and run live; DFLASH_DEMO_DIR sets the default (else .demo in
    the repository)."""
    num_conversations: int = 768
    """chitchat conversations cached (the first exchange of each; the target regenerates the
    replies)."""
    human_conversations: int = 0
    """Further chitchat conversations (those after the first `num_conversations`) cached with
    their own human replies, not regenerated: stage one's forward only (no generation), in the
    first cache's feature basis (`dflash-precompute --feature-basis`), trained on beside it
    (`fit --cache A --cache B`); every tau is scored on the first cache's held-out sequences
    and prompts. 0: none."""
    max_new_tokens: int = 48
    """Longest regenerated reply, and tokens decoded per prompt online."""
    max_length: int = 256
    """Longest cached sequence, in tokens."""
    stage_one_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """`dflash-precompute --dtype`, the target's precision while it regenerates the replies and
    writes their features: auto picks bfloat16 on a GPU (as `dflash-precompute` does) and on a
    CPU that computes it natively (AVX512-BF16 or AMX, where stage one runs faster than in
    float32), float32 on other CPUs (which would emulate it). Training and evaluation stay
    float32 whichever it is."""
    feature_codec: FeatureCodec = "basis-fp8"
    """How the cache stores features (dflash-precompute --feature-codec)."""
    feature_rank: int = 0
    """Basis codecs: coefficients per token (0: the target's hidden size)."""
    num_layers: int = 1
    """Drafter decoder layers."""
    drafter: Literal["dflash", "dspark"] = "dspark"
    """`fit --drafter`: dspark adds a low-rank Markov head, so each draft sees the draft before it
    (bench/RESULTS.md "recipe": higher tau than dflash on every seed at the same budget); served
    by vLLM's `dspark` method, on its V2 model runner."""
    markov_rank: int = 64
    """dspark: `fit --markov-rank` (64, not fit's 256: markov_w1 has a row per vocabulary token,
    and the demo trains only briefly)."""
    num_drafts: int | None = field(default=None, metadata={NONE_WORD: "auto"})
    """`fit --num-drafts`, drafts per verify; auto: a block of 3 drafter rows, whichever the kind
    (3 drafts for dspark, whose anchor row drafts too; 2 for dflash), so kinds compare at the same
    block tokens per step. Small, not fit's 15: a drafter this small and this briefly trained
    rarely has more than 2 drafts accepted, and on a CPU a verify costs more for every token it
    checks, so checking fewer drafts is faster."""
    anchors_per_seq: int = 32
    """Blocks drawn per sequence per epoch."""
    tokens_per_step: int = 510
    """Block tokens per optimizer step (170 blocks of 3)."""
    max_steps: int = 1200
    """Training steps."""
    lr: float = 1e-3
    """Peak learning rate (higher than fit's 6e-4: the demo trains only briefly)."""
    draft_vocab: int = 4096
    """`fit --draft-vocab`: draft from this many of the most frequent reply tokens (0: the whole
    vocabulary): a smaller head makes training and each draft cheaper. The export then carries
    `lm_head.weight` and `d2t`, which vLLM serves and z-lab's DFlashDraftModel does not load
    (pass 0 for a z-lab-loadable demo)."""
    eval_fraction: float = 0.1
    """Held-out share of the cached conversations (their prompts are the online ones)."""
    online_prompts: int = 20
    """Held-out prompts decoded online."""
    out_of_domain_prompts: int = 0
    """Prompts decoded out of domain, per suite (prompts in the GSM8K and HumanEval formats,
    written for the demo) and in domain, at temperature 0 and 1, for the summary's out of
    domain line (demo/out_of_domain.py; 2 cost about a minute on 2 CPU cores); 0: none, the
    default, to keep the first run short."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where every command runs: auto (the GPU when torch sees one, else the CPU), cpu or cuda.
    The drafter trains and the target decodes online in float32 (`fit --dtype float32`, `eval
    --dtype float32`), so the lossless check compares greedy ids nearly to the last bit on
    either; stage one's precision is --stage-one-dtype."""
    server: bool = field(default=False, metadata={ONLY_ON: True})
    """Regenerate the replies through a local `transformers serve` and dflash-regenerate
    instead of in-process `dflash-precompute --regenerate`."""
    vllm_server: bool = field(default=False, metadata={ONLY_ON: True})
    """As --server, through vLLM's OpenAI server from the engine venv (built when absent) at
    concurrency 64. Not the default: a fresh clone would first install vLLM, and on a CPU it
    regenerates no faster than in-process `generate` (bench/RESULTS.md "regenerate"); on GPUs,
    at tens of thousands of conversations, the server path is the one to take."""
    engine_check: bool = field(default=False, metadata={ONLY_ON: True})
    """After the summary, decode the same held-out prompts in vLLM's CPU build with the exported
    drafter (bench/engine_check.py: lossless, vLLM's per-step acceptance against dflash's, speeds
    at batch 1 and batched); builds the engine venv (.venv-engine) when absent. A DSpark drafter
    runs on vLLM's V2 runner, which on a CPU goes through Triton's interpreter inside the check's
    engine process: slow (4 prompts of 24 tokens took about 5 minutes); `python -m
    bench.engine_check --run .demo/run ... --limit 4 --max-new-tokens 24` checks fewer."""

    def __post_init__(self) -> None:
        check_choices(self)
        self.work_dir = Path(self.work_dir)
        if self.num_conversations * self.eval_fraction < 1:
            raise ValueError("num_conversations x eval_fraction must be >= 1 so that some prompts are held out")


def run(cmd: list[str], *, capture_json: bool = False) -> dict | None:
    """Run one command with its progress on the console; with capture_json, parse the JSON
    object its last stdout line holds."""
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    if not capture_json:
        subprocess.run(cmd, check=True)
        return None
    result = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    print("\n".join(lines[:-1]))
    return json.loads(lines[-1])


def prompts_file(data: Path, *, first: int, count: int, flag: str) -> Path:
    """`data` (JSONL) with the first exchange of chitchat conversations first .. first+count-1:
    written if missing, reused if it holds `count` records, refused (naming it) if it holds
    another number, since the caches and the run under WORK were built from it. `flag` is the
    option that asks for `count`, for the messages."""
    if not data.is_file():
        records = chitchat_records(limit=first + count, max_turns=2)[first:]
        if len(records) < count:
            raise SystemExit(f"{flag} {count}: chitchat_dataset has only {first + len(records)} usable "
                             f"conversations, {len(records)} after the first {first}; ask for fewer")
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        return data
    found = sum(1 for _ in iter_records([data]))
    if found != count:
        raise SystemExit(f"{data} holds {found} conversations, {flag} asks for {count}: give another "
                         f"--work-dir, or delete {data} and the caches and run beside it")
    return data


def bin_path(name: str) -> str:
    """A console script of this environment (the venv `make demo` created)."""
    return str(Path(sys.executable).parent / name)


def precompute_command(config: DemoConfig, *, target: Path, data: Path, out: Path, regenerate: bool,
                       basis: Path | None = None) -> list[str]:
    """`dflash-precompute` of `data` into `out`: regenerating the replies (in process) or not,
    in the feature basis of the cache `basis` or fitting its own."""
    return [
        bin_path("dflash-precompute"), "--target", str(target), "--data", str(data), "--out", str(out),
        *(["--regenerate", "--max-new-tokens", str(config.max_new_tokens)] if regenerate else []),
        "--max-length", str(config.max_length), "--feature-codec", config.feature_codec,
        *(["--feature-rank", str(config.feature_rank)] if config.feature_rank and basis is None else []),
        *(["--feature-basis", str(basis)] if basis is not None else []),
        "--device", config.device, "--dtype", stage_one_dtype(config), "--json",
    ]


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16 or AMX tiles); without
    either torch emulates them, slower than float32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def stage_one_dtype(config: DemoConfig) -> str:
    """`stage_one_dtype`, with auto resolved for the device stage one runs on."""
    if config.stage_one_dtype != "auto":
        return config.stage_one_dtype
    gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return "bfloat16" if gpu or native_bfloat16() else "float32"


BLOCK_ROWS = 3  # drafter rows per block of the demo's drafter, whichever the kind (`num_drafts` auto)


def drafts(config: DemoConfig) -> int:
    """The demo drafter's drafts per verify: `num_drafts`, or its kind's for BLOCK_ROWS rows."""
    return drafters.get(config.drafter).num_drafts(BLOCK_ROWS) if config.num_drafts is None else config.num_drafts


def fit_command(config: DemoConfig, *, caches: list[Path], run_dir: Path) -> list[str]:
    """`dflash-train fit` of the demo's drafter on `caches` into `run_dir`."""
    return [
        bin_path("dflash-train"), "fit", *[arg for c in caches for arg in ("--cache", str(c))], "--out", str(run_dir),
        "--num-layers", str(config.num_layers), "--num-drafts", str(drafts(config)), "--drafter", config.drafter,
        *(["--markov-rank", str(config.markov_rank)] if config.drafter == "dspark" else []),
        "--anchors-per-seq", str(config.anchors_per_seq), "--tokens-per-step", str(config.tokens_per_step),
        "--max-steps", str(config.max_steps), "--lr", str(config.lr), "--eval-fraction", str(config.eval_fraction),
        "--checkpoint-every", str(config.max_steps), "--eval-every", "0", "--spike-warmup-steps", "20",
        *(["--draft-vocab", str(config.draft_vocab)] if config.draft_vocab else []),
        "--device", config.device, "--dtype", "float32", "--save-initial",
    ]


def eval_command(config: DemoConfig, *, run_dir: Path, cache: Path, checkpoint: Path,
                 online: tuple[Path, Path] | None = None) -> list[str]:
    """`dflash-train eval` of `checkpoint` on the held-out sequences of `cache`; with `online`
    = (target, prompts), also speculative decoding of the first held-out prompts, in float32."""
    command = [bin_path("dflash-train"), "eval", "--run", str(run_dir), "--cache", str(cache),
               "--device", config.device, "--json", "--checkpoint", str(checkpoint)]
    if online is not None:
        command += ["--online", "--target", str(online[0]), "--prompts", str(online[1]), "--dtype", "float32",
                    "--limit", str(config.online_prompts), "--max-new-tokens", str(config.max_new_tokens)]
    return command


@click.command(cls=DflashCommand)
@config_options(DemoConfig)
def main(**options) -> None:
    """The embedded default end to end: prepare SmolLM2-135M-Instruct and chitchat prompts,
    cache, train, evaluate offline and online, summarise. Every DemoConfig field is a flag,
    for quicker or larger runs than the default."""
    run_demo(DemoConfig(**given(options)))


def run_demo(config: DemoConfig) -> None:
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    print("== preparing SmolLM2-135M-Instruct and chitchat prompts", flush=True)
    target = prepare_smollm2(work)
    data = prompts_file(work / "chitchat.jsonl", first=0, count=config.num_conversations,
                        flag="--num-conversations")
    seconds = {"prepare": time.monotonic() - started}

    cache, run_dir = work / "cache", work / "run"
    regenerate = True
    stage_began = time.monotonic()  # stage one: a server's regeneration included
    if config.server or config.vllm_server:  # the same replies from a serving engine; the cache is built from them
        from dflash.precompute.local_server import local_server

        name = "vllm" if config.vllm_server else "server"
        cache, run_dir = work / f"cache-{name}", work / f"run-{name}"
        regenerated = work / ("chitchat.regenerated-vllm.jsonl" if config.vllm_server else "chitchat.regenerated.jsonl")
        options = {"vllm_python": ensure_engine_venv() / "bin" / "python"} if config.vllm_server else {}
        with local_server(target, log=work / f"{name}.log", **options) as url:
            run([bin_path("dflash-regenerate"), "--data", str(data), "--out", str(regenerated), "--server", url,
                 "--max-new-tokens", str(config.max_new_tokens), "--concurrency", "64" if options else "4",
                 "--json"])
        data, regenerate = regenerated, False
    precompute = run(precompute_command(config, target=target, data=data, out=cache, regenerate=regenerate),
                     capture_json=True)

    caches = [cache]
    human = None
    if config.human_conversations:
        # Their own replies: the target's forward only, encoded in the first cache's basis so
        # that fit can train on both.
        human_data = prompts_file(work / "chitchat-human.jsonl", first=config.num_conversations,
                                  count=config.human_conversations, flag="--human-conversations")
        caches.append(work / "cache-human")
        human = run(precompute_command(config, target=target, data=human_data, out=caches[-1], regenerate=False,
                                       basis=cache if config.feature_codec in BASIS_CODECS else None),
                    capture_json=True)
    seconds["stage one"] = time.monotonic() - stage_began

    stage_began = time.monotonic()
    run(fit_command(config, caches=caches, run_dir=run_dir))  # a finished run is left as it is
    seconds["fit"] = time.monotonic() - stage_began

    stage_began = time.monotonic()
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    initial, final = checkpoints[0], checkpoints[-1]
    before = run(eval_command(config, run_dir=run_dir, cache=cache, checkpoint=initial), capture_json=True)
    after = run(eval_command(config, run_dir=run_dir, cache=cache, checkpoint=final), capture_json=True)
    # Online on the first held-out prompts; this call also reports offline tau on exactly
    # those prompts' cached sequences, side by side with the online figure.
    paired = run(eval_command(config, run_dir=run_dir, cache=cache, checkpoint=final, online=(target, data)),
                 capture_json=True)
    info = run([bin_path("dflash-shards"), "info", "--json", str(cache)], capture_json=True)
    from dflash.shards.report import format_info

    print(format_info(info))
    unseen = None
    if config.out_of_domain_prompts:
        from demo.out_of_domain import format_line, out_of_domain

        print("\n== out of domain: suite-style prompts beside held-out chitchat, at temperature 0 and 1", flush=True)
        unseen = out_of_domain(work=work, run_dir=run_dir, target=target, cache=cache, data=data,
                               suites=["gsm8k", "humaneval"], num_prompts=config.out_of_domain_prompts,
                               max_new_tokens=config.max_new_tokens, device=config.device)
    seconds["evaluation"] = time.monotonic() - stage_began

    online = paired["online"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in metrics if "step" in m and "loss" in m]
    speedup = online["tokens_per_s"] / online["baseline_tokens_per_s"]
    print("\n== summary")
    print(f"  cache        {precompute['num_sequences']:,} sequences, {precompute['num_tokens']:,} tokens, "
          f"{precompute['bytes_per_token']['total']:,.0f} bytes/token")
    if human is not None:
        print(f"  + human      {human['num_sequences']:,} sequences, {human['num_tokens']:,} tokens with their human "
              f"replies (forward only, the same basis)")
    bf16_bytes = 2 * len(info["feature_layers"]) * info["hidden_size"]
    print(f"  features     {info['bytes_per_token']['features']:,.0f} bytes/token ({info['feature_codec']}"
          + (f", rank {info['feature_rank']}" if info.get("feature_rank") else "")
          + f") beside bf16's {bf16_bytes:,}: {info['bytes_per_token']['features'] / bf16_bytes:.3f}x")
    train_s = sum(m["step_time_s"] for m in steps)  # from the run's own log: right on a rerun too
    print(f"  training     {steps[-1]['step']} steps in {train_s:,.0f} s; loss {steps[0]['loss']:.3f} -> "
          f"{steps[-1]['loss']:.3f}")
    print(f"  tau offline  before training {before['acceptance_length']:.3f}, after {after['acceptance_length']:.3f} "
          f"({after['num_anchors']:,} held-out anchors, {config.drafter}: {after['num_drafts']} drafts per verify)")
    print(f"  tau online   {online['acceptance_length']:.3f} at {after['num_drafts']} drafts per verify over "
          f"{online['num_prompts']} held-out prompts (replayed from the cache on the same prompts "
          f"{paired['replay_acceptance_length']:.3f}); lossless: {'yes' if online['lossless'] else 'NO'}")
    print(f"  speed        {online['tokens_per_s']:.1f} tok/s speculative vs {online['baseline_tokens_per_s']:.1f} "
          f"tok/s plain greedy ({speedup:.2f}x)")
    if unseen is not None:
        print(format_line(unseen))
    print(f"  device       {online['device']} (stage one {stage_one_dtype(config)}, training and evaluation "
          f"{online['dtype']}; --device {config.device})")
    print(f"  wall time    {time.monotonic() - started:,.0f} s ("
          + ", ".join(f"{name} {value:,.0f}" for name, value in seconds.items()) + ")")
    if not online["lossless"] or after["acceptance_length"] <= before["acceptance_length"]:
        sys.exit("demo FAILED: online decoding was not lossless or training did not raise tau")
    if config.engine_check:
        engine_check(config, run_dir=run_dir, target=target, data=data, cache=cache)


def engine_check(config: DemoConfig, *, run_dir: Path, target: Path, data: Path, cache: Path) -> None:
    """bench/engine_check.py on the demo's run (its exit status fails the demo when vLLM
    disagrees with dflash)."""
    print("\n== engine check: vLLM's CPU build decodes the held-out prompts with the exported drafter", flush=True)
    venv = ensure_engine_venv()
    run([sys.executable, "-m", "bench.engine_check", "--run", str(run_dir), "--target", str(target),
         "--prompts", str(data), "--cache", str(cache), "--limit", str(config.online_prompts),
         "--max-new-tokens", str(config.max_new_tokens), "--engine-venv", str(venv)])


if __name__ == "__main__":
    main()
