"""Regeneration throughput on the embedded default's prompts (SmolLM2-135M-Instruct,
chitchat, CPU, float32, greedy): the server path (dflash-regenerate against a local
`transformers serve`, and against vLLM's OpenAI server from the engine venv when it is built)
at each concurrency, against stage one's own in-process path (a real `dflash-precompute
--regenerate` run: prompts batched by length, left-padded, `generate`), and the share of
server replies identical to the replies that run cached.

    python -m bench.regenerate [--num-prompts 24] [--max-new-tokens 48] [--threads 1]
                               [--concurrency 1,2,4,8] [--servers transformers,vllm] [--json]

vLLM's server (bench/engine_venv.sh; $DFLASH_ENGINE_VENV names another venv) runs in float32
with its default CPU threads (all cores); its rows are left out, with the reason printed, when
the engine venv is not built.

The in-process rows: "generate" times stage one's generation calls only (its summary's
generate_s, the work the server does), "whole run" the whole dflash-precompute run (target
load, tokenizing, generation, the capturing forward, writing the cache). The server rows
time dflash-regenerate against a server already started and warmed by one request. New
tokens: in-process, the cached reply tokens (the loss mask: each reply's tokens plus the
end-of-turn token it generated); server, the completion tokens the server reports.

Human table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def prompts_file(work_dir: Path, num_prompts: int, out: Path) -> Path:
    """The first `num_prompts` records of the demo's chitchat.jsonl (prepared when absent)."""
    from dflash.common.records import iter_records
    from dflash.testing.prepare import prepare_chitchat

    source = prepare_chitchat(work_dir / "chitchat.jsonl", limit=256, max_turns=2)
    records = [record.data for record in iter_records([source], limit=num_prompts)]
    out.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    return out


def in_process(target: Path, data: Path, out: Path, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """A real stage-one run with --regenerate; its timing and the replies it cached (in input order)."""
    from transformers import AutoTokenizer

    from dflash.precompute.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute
    from dflash.shards import open_cache

    summary = run_precompute(PrecomputeConfig(
        target=target, data=[data], out=out, regenerate=True, max_new_tokens=args.max_new_tokens,
        max_length=args.max_length, device="cpu", dtype="float32", progress=False))
    tokenizer = AutoTokenizer.from_pretrained(target)
    cache = open_cache(out)
    replies: dict[int, str] = {}
    new_tokens = 0
    for i in range(len(cache)):
        row = cache.raw(i)
        mask = row.loss_mask.astype(bool)
        new_tokens += int(mask.sum())
        replies[int(row.source["index"])] = tokenizer.decode(row.input_ids[mask].tolist(), skip_special_tokens=True)
    cache.close()
    num = summary.regenerated_replies
    timing = {"generate_s": summary.generate_s, "wall_s": summary.wall_s, "records": num,
              "new_tokens": new_tokens, "cut": summary.cut_replies}
    return timing, [replies[i] for i in sorted(replies)]


def server_rows(path: str, url: str, data: Path, reference: list[str], out_dir: Path,
                args: argparse.Namespace) -> list[dict]:
    """dflash-regenerate against the server at `url`, warmed by one request, at each
    concurrency of args.concurrency: one row each."""
    from dflash.common.records import iter_records
    from dflash.precompute.regenerate import RegenerateConfig, run_regenerate

    stem = path.replace(" ", "-")
    run_regenerate(RegenerateConfig(data=[data], out=out_dir / f"{stem}-warmup.jsonl", servers=[url], limit=1,
                                    progress=False, max_new_tokens=args.max_new_tokens))
    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        out = out_dir / f"{stem}-{concurrency}.jsonl"
        summary = run_regenerate(RegenerateConfig(data=[data], out=out, servers=[url], progress=False,
                                                  max_new_tokens=args.max_new_tokens, concurrency=concurrency))
        replies = [r.data["messages"][-1]["content"] for r in iter_records([out])]
        assert len(replies) == len(reference), (len(replies), len(reference))
        rate = summary.to_dict()
        rows.append({"path": path, "concurrency": concurrency, "records_per_s": rate["records_per_s"],
                     "new_tokens_per_s": rate["new_tokens_per_s"], "seconds": summary.wall_s,
                     "new_tokens": summary.new_tokens, "cut": summary.cut_replies,
                     "identical": sum(a == b for a, b in zip(replies, reference)) / len(reference)})
        print(f"  {path} at concurrency {concurrency}: {summary.wall_s:.1f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=256, help="the demo's --max-length")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of both sides (1: on a shared CPU more threads spin on busy cores)")
    parser.add_argument("--servers", default="transformers,vllm",
                        help="server paths to time: transformers (transformers serve), vllm (vLLM's OpenAI server)")
    parser.add_argument("--work-dir", type=Path, default=REPO / ".demo")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from bench.engine_venv import engine_venv, engine_venv_ready
    from dflash.precompute.local_server import local_server
    from dflash.testing.prepare import prepare_smollm2

    torch.set_num_threads(args.threads)
    target = prepare_smollm2(args.work_dir)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prompts_file(args.work_dir, args.num_prompts, tmp / "prompts.jsonl")
        timing, reference = in_process(target, data, tmp / "cache", args)
        for path, seconds in (("in-process, generate", timing["generate_s"]),
                              ("in-process, whole run", timing["wall_s"])):
            rows.append({"path": path, "concurrency": None, "records_per_s": timing["records"] / seconds,
                         "new_tokens_per_s": timing["new_tokens"] / seconds, "seconds": seconds,
                         "new_tokens": timing["new_tokens"], "cut": timing["cut"], "identical": 1.0})
        servers = args.servers.split(",")
        if "transformers" in servers:
            with local_server(target, threads=args.threads, log=tmp / "serve.log") as url:
                rows += server_rows("transformers serve", url, data, reference, tmp, args)
        venv = engine_venv()
        if "vllm" in servers and not engine_venv_ready(venv):
            print(f"no vLLM rows: the engine venv {venv} is not built (bash bench/engine_venv.sh {venv})")
        elif "vllm" in servers:
            with local_server(target, vllm_python=venv / "bin" / "python", log=tmp / "vllm.log") as url:
                rows += server_rows("vLLM server", url, data, reference, tmp, args)
    print(f"{args.num_prompts} chitchat prompts, {args.max_new_tokens} new tokens at most, greedy, float32, "
          f"{args.threads} torch thread(s) per side")
    print(f"{'path':<22} {'conc.':>5} {'seconds':>8} {'records/s':>10} {'new tok':>8} {'new tok/s':>10} "
          f"{'cut':>4} {'identical':>10}")
    for row in rows:
        conc = "-" if row["concurrency"] is None else str(row["concurrency"])
        print(f"{row['path']:<22} {conc:>5} {row['seconds']:>8.1f} {row['records_per_s']:>10.2f} "
              f"{row['new_tokens']:>8} {row['new_tokens_per_s']:>10.1f} {row['cut']:>4} {row['identical']:>10.0%}")
    if args.json:
        print(json.dumps({"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                          "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
