"""Regeneration throughput: a local `transformers serve` through dflash-regenerate at
concurrency 1, 2, 4, 8 against in-process greedy generation (what `dflash-precompute
--regenerate` runs), on the embedded default's prompts (SmolLM2-135M-Instruct, chitchat)
on CPU in float32, and the share of server replies identical to in-process greedy ones.

    python -m bench.regenerate [--num-prompts 24] [--max-new-tokens 48] [--json]

Human table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def in_process(target: Path, records: list[dict], max_new_tokens: int) -> tuple[list[str], float, int]:
    """Greedy replies to each record's first user turn, one prompt at a time (float32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    replies, new_tokens = [], 0
    began = time.perf_counter()
    for record in records:
        ids = tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        reply = out[0, ids["input_ids"].shape[1]:]
        new_tokens += len(reply)
        replies.append(tokenizer.decode(reply, skip_special_tokens=True))
    return replies, time.perf_counter() - began, new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--work-dir", type=Path, default=REPO / ".demo")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from demo.prepare import chitchat_records, prepare_smollm2
    from dflash.precompute.local_server import local_server
    from dflash.precompute.regenerate import RegenerateConfig, run_regenerate

    target = prepare_smollm2(args.work_dir)
    records = [{"messages": r["messages"][:2]} for r in chitchat_records(limit=args.num_prompts, max_turns=2)]
    reference, ref_s, ref_tokens = in_process(target, records, args.max_new_tokens)
    rows = [{"path": "in-process", "concurrency": 1, "records_per_s": len(records) / ref_s,
             "new_tokens_per_s": ref_tokens / ref_s, "identical": 1.0}]
    with tempfile.TemporaryDirectory() as tmp, local_server(target, log=Path(tmp) / "serve.log") as url:
        data = Path(tmp) / "in.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            out = Path(tmp) / f"out{concurrency}.jsonl"
            summary = run_regenerate(RegenerateConfig(data=[data], out=out, servers=[url], progress=False,
                                                      max_new_tokens=args.max_new_tokens, concurrency=concurrency))
            replies = [json.loads(line)["messages"][1]["content"] for line in out.read_text().splitlines()]
            same = sum(a == b for a, b in zip(replies, reference)) / len(reference)
            rate = summary.to_dict()
            rows.append({"path": "transformers serve", "concurrency": concurrency,
                         "records_per_s": rate["records_per_s"], "new_tokens_per_s": rate["new_tokens_per_s"],
                         "identical": same})
    print(f"{'path':<20} {'conc.':>5} {'records/s':>10} {'new tok/s':>10} {'identical':>10}")
    for row in rows:
        print(f"{row['path']:<20} {row['concurrency']:>5} {row['records_per_s']:>10.2f} "
              f"{row['new_tokens_per_s']:>10.1f} {row['identical']:>10.0%}")
    if args.json:
        print(json.dumps({"num_prompts": len(records), "max_new_tokens": args.max_new_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
