"""The field's benchmark suites for `dflash-train eval --online --prompts NAME`: GSM8K,
MATH-500, HumanEval, MBPP and MT-Bench, loaded and formatted as z-lab's `dflash/benchmark.py`
does (the DFlash paper's tables; DSpark's Table 1 runs the same suites at temperature 1).

| name | hub dataset (config, split) | column | user turn |
|---|---|---|---|
| gsm8k | openai/gsm8k (main, test) | question | `{question}` + MATH_SUFFIX |
| math500 | HuggingFaceH4/MATH-500 (test) | problem | `{problem}` + MATH_SUFFIX |
| humaneval | openai/openai_humaneval (test) | prompt | HUMANEVAL_FORMAT |
| mbpp | google-research-datasets/mbpp (sanitized, test) | prompt | `{prompt}` as it is |
| mt-bench | HuggingFaceH4/mt_bench_prompts (train) | prompt (a list) | each turn as it is |

MT-Bench is multi-turn: its second turn is asked after the first turn's decoded reply (the
speculative output decoded with special tokens skipped), as the benchmark does. A row that
already holds `turns` (a list of formatted user turns: z-lab's cached `cache/NAME.jsonl`) is
used as it is.

Where the rows come from (`load_suite`): `NAME` alone loads the hub dataset through
`datasets.load_dataset` (the local Hugging Face cache first; with HF_HUB_OFFLINE=1 only
that); when that fails, the error is one line that says how to pass a local copy instead:
`NAME=PATH`, a JSONL, JSON or Parquet file, or a folder written by `datasets`' save_to_disk
(a DatasetDict's split is the suite's), with the suite's column as above. Several suites go
comma-separated (`gsm8k,mt-bench=/data/mt.jsonl`); `--limit N` takes the first N rows of
each (z-lab's `--max-samples` takes a seeded random N instead).

Licences of the data (none ships with dflash): GSM8K, MATH and HumanEval MIT; MBPP
CC-BY-4.0; MT-Bench's prompts Apache-2.0.

What this file trades off: a suite name is resolved before a file of that name would be
(`--prompts gsm8k` reads ./gsm8k only when such a file exists), so a records file named like
a suite shadows it; pass it as `gsm8k=PATH` to be explicit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{prompt}\n```")


@dataclass(frozen=True)
class Suite:
    """One benchmark suite: where the hub keeps it and how a row becomes user turns."""

    name: str
    hub: tuple[str, ...]
    """`datasets.load_dataset` positional arguments: the dataset id and its config, if any."""
    split: str
    column: str
    """The column the user turn is built from (MT-Bench: a list of turns)."""
    format: str = "{text}"
    """The user turn, with `{text}` for the column's text (z-lab's format)."""
    multi_turn: bool = False

    def turns(self, row: Any, where: str) -> list[str]:
        """The user turns of one row; ValueError naming `where` when the column is missing."""
        if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            return [str(turn) for turn in row["turns"]]  # already formatted (z-lab's cache)
        value = row.get(self.column) if isinstance(row, dict) else None
        if self.multi_turn and isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            return [self.format.replace("{text}", turn) for turn in value]
        if not self.multi_turn and isinstance(value, str):
            return [self.format.replace("{text}", value)]
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        kind = "a list of strings" if self.multi_turn else "a string"
        raise ValueError(f"{where}: a {self.name} row needs column '{self.column}' ({kind}) or 'turns'; found {found}")


SUITES: dict[str, Suite] = {suite.name: suite for suite in [
    Suite(name="gsm8k", hub=("openai/gsm8k", "main"), split="test", column="question", format="{text}" + MATH_SUFFIX),
    Suite(name="math500", hub=("HuggingFaceH4/MATH-500",), split="test", column="problem",
          format="{text}" + MATH_SUFFIX),
    Suite(name="humaneval", hub=("openai/openai_humaneval",), split="test", column="prompt",
          format=HUMANEVAL_FORMAT.replace("{prompt}", "{text}")),
    Suite(name="mbpp", hub=("google-research-datasets/mbpp", "sanitized"), split="test", column="prompt"),
    Suite(name="mt-bench", hub=("HuggingFaceH4/mt_bench_prompts",), split="train", column="prompt",
          multi_turn=True),
]}


@dataclass
class SuiteItem:
    """One row of a suite: its user turns, in order."""

    source: dict[str, Any]
    """{"file", "index"}: the suite's name (hub) or the local path, and the row's 0-based position."""
    turns: list[str]


def suite_specs(value: str) -> list[tuple[str, str | None]] | None:
    """`--prompts` as suites: [(name, local path or None)], or None when `value` is a records
    file (an existing path). ValueError when it is neither."""
    if Path(value).exists():
        return None
    specs = []
    for part in value.split(","):
        name, _, path = part.strip().partition("=")
        if name not in SUITES:
            raise ValueError(f"--prompts {value}: no such file, and {name!r} is not a suite "
                             f"({', '.join(SUITES)}; NAME=PATH for a local copy)")
        if path and not Path(path).exists():
            raise ValueError(f"--prompts {part}: {path} does not exist")
        specs.append((name, path or None))
    return specs


def load_suite(name: str, path: str | Path | None = None, *, limit: int | None = None) -> list[SuiteItem]:
    """The first `limit` rows (all: None) of suite `name`, from `path` or else from the hub."""
    suite = SUITES[name]
    rows = _local_rows(suite, Path(path)) if path is not None else _hub_rows(suite)
    items = []
    for index, (where, row) in enumerate(rows):
        if limit is not None and index >= limit:
            break
        items.append(SuiteItem(source={"file": str(path) if path is not None else name, "index": index},
                               turns=suite.turns(row, where)))
    if not items:
        raise ValueError(f"--prompts {name}{'=' + str(path) if path else ''}: no rows")
    return items


def _hub_rows(suite: Suite):
    import datasets

    try:
        dataset = datasets.load_dataset(*suite.hub, split=suite.split)
    except Exception as error:  # noqa: BLE001 - offline, no network, no such dataset: one line that says what to do
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"--prompts {suite.name}: could not load {suite.hub[0]} ({', '.join([*suite.hub[1:], suite.split])}) "
            f"from the hub or its local cache ({cause}); pass a local copy: --prompts {suite.name}=PATH, a JSONL, "
            f"JSON or Parquet file or a datasets save_to_disk folder with column '{suite.column}'") from None
    return ((f"{suite.hub[0]} row {i}", row) for i, row in enumerate(dataset))


def _local_rows(suite: Suite, path: Path):
    from dflash.common.records import iter_records

    if path.is_dir():
        import datasets

        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError as error:
            raise ValueError(f"--prompts {suite.name}={path}: a folder must be a dataset saved with "
                             f"datasets' save_to_disk ({error})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if suite.split not in loaded and len(loaded) != 1:
                raise ValueError(f"--prompts {suite.name}={path}: no split '{suite.split}' among {sorted(loaded)}")
            loaded = loaded[suite.split] if suite.split in loaded else next(iter(loaded.values()))
        return ((f"{path} row {i}", row) for i, row in enumerate(loaded))

    def rows():
        for record in iter_records([path], flag="--prompts"):
            where = f"{path} record {record.index + 1}"
            if record.error is not None:
                raise ValueError(f"{where}: {record.error}")
            yield where, record.data

    return rows()


__all__ = ["HUMANEVAL_FORMAT", "MATH_SUFFIX", "SUITES", "Suite", "SuiteItem", "load_suite", "suite_specs"]
