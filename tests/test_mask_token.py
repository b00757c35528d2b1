"""The mask token rule (`choose_mask_token_id`): never a stop, pad, bos or unk token nor a token
the chat template writes; the tokenizer's mask token, else the first spare embedding row, else
an unused special token. Tokenizer folders are written as JSON in the test, shaped like
Qwen3's (spare embedding rows, pad in the eos list) and SmolLM2's (no spare rows, pad = eos).
"""

import json
from pathlib import Path

import pytest

from dflash.shards import TargetInfo
from dflash.train.mask_token import choose_mask_token_id
from dflash.train.model import DrafterConfig
from dflash.train.synthetic import write_synthetic_target

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tokenizer(target_dir: Path, *, plain: range, added: list[tuple[str, bool]], first_added: int,
                    config: dict, template: str | None = CHATML, template_in_config: bool = False,
                    generation: dict | None = None) -> Path:
    """tokenizer.json with the `plain` ids and the `added` (content, special) tokens from id
    `first_added` on, tokenizer_config.json `config`, the chat template (a .jinja file or in
    the config), generation_config.json."""
    target_dir.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in plain}
    tokens = [{"id": first_added + i, "content": content, "special": special}
              for i, (content, special) in enumerate(added)]
    (target_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab},
                                                           "added_tokens": tokens}))
    if template is not None and template_in_config:
        config = {**config, "chat_template": template}
    elif template is not None:
        (target_dir / "chat_template.jinja").write_text(template)
    (target_dir / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (target_dir / "generation_config.json").write_text(json.dumps(generation))
    return target_dir


def info(vocab_size: int, **fields) -> TargetInfo:
    return TargetInfo(**{"layer_ids": [1, 3], "num_layers": 4, "hidden_size": 32, "vocab_size": vocab_size,
                         "tie_word_embeddings": False, "model_type": "qwen3", **fields})


QWEN_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
              ("<|object_ref_start|>", True), ("<think>", False)]
QWEN_CONFIG = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


@pytest.mark.parametrize("template_in_config", [False, True])
def test_qwen3_like_targets_take_the_first_spare_embedding_row(tmp_path, template_in_config):
    """Qwen3: tokenizer ids 0..151668, embedding 151936 rows, pad <|endoftext|> is a stop token:
    the old rule (mask, else pad) picked a stop token; the first spare row is z-lab's 151669."""
    target_dir = write_tokenizer(tmp_path, plain=range(100), added=QWEN_ADDED, first_added=100, config=QWEN_CONFIG,
                                 template_in_config=template_in_config,
                                 generation={"eos_token_id": [102, 100], "pad_token_id": 100})
    target = info(128, pad_token_id=100, eos_token_id=102)
    assert choose_mask_token_id(target, target_dir) == 105
    assert choose_mask_token_id(target) == 127  # no tokenizer files: the highest free row


SMOL_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
              ("<repo_name>", True), ("<reponame>", True)]
SMOL_CONFIG = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
               "unk_token": "<|endoftext|>"}


def smol_like(tmp_path, **overrides) -> tuple[TargetInfo, Path]:
    """SmolLM2: the specials come first (ids 0-16), the embedding has no spare row, pad = eos."""
    options = dict(plain=range(len(SMOL_ADDED), 40), added=SMOL_ADDED, first_added=0, config=SMOL_CONFIG)
    target_dir = write_tokenizer(tmp_path, **{**options, **overrides})
    return info(40, pad_token_id=2, eos_token_id=2, bos_token_id=1), target_dir


def test_without_spare_rows_an_unused_special_token_is_taken(tmp_path):
    target, target_dir = smol_like(tmp_path)
    assert choose_mask_token_id(target, target_dir) == 3  # <repo_name>: not unk/bos/eos/pad


def test_a_special_token_the_template_writes_is_skipped(tmp_path):
    target, target_dir = smol_like(tmp_path, template=CHATML + "{{ '<repo_name>' }}")
    assert choose_mask_token_id(target, target_dir) == 4


@pytest.mark.parametrize("mask, expected", [
    ("<reponame>", 4),  # the tokenizer's own mask token
    ("<|im_end|>", 3),  # a mask token that is also the stop token is not used
    ("<|im_start|>", 3),  # ... nor one the template writes (and that is bos here)
])
def test_the_tokenizers_mask_token_comes_first_unless_it_is_a_stop_token(tmp_path, mask, expected):
    target, target_dir = smol_like(tmp_path, config={**SMOL_CONFIG, "mask_token": {"content": mask}})
    assert choose_mask_token_id(target, target_dir) == expected


def test_target_json_mask_token_is_used_when_it_is_not_a_stop_token(tmp_path):
    target, target_dir = smol_like(tmp_path)
    assert choose_mask_token_id(info(40, mask_token_id=4, eos_token_id=2), target_dir) == 4
    assert choose_mask_token_id(info(40, mask_token_id=2, eos_token_id=2), target_dir) == 3


def test_generation_config_stop_tokens_are_excluded(tmp_path):
    target, target_dir = smol_like(tmp_path, generation={"eos_token_id": [2, 3]})
    assert choose_mask_token_id(target, target_dir) == 4


def test_no_candidate_is_a_usage_error(tmp_path):
    target, target_dir = smol_like(tmp_path, added=SMOL_ADDED[:3])
    with pytest.raises(ValueError, match="fit config field `mask_token_id`"):
        choose_mask_token_id(target, target_dir)


@pytest.mark.parametrize("fields, expected", [
    ({"mask_token_id": 49}, 49), ({}, 49), ({"eos_token_id": [49, 2]}, 48),
    ({"eos_token_id": 49, "pad_token_id": 48, "bos_token_id": 47}, 46),
])
def test_without_tokenizer_files_the_highest_free_row_is_taken(fields, expected):
    assert choose_mask_token_id(info(50, **fields)) == expected


def test_from_target_reads_the_tokenizer_beside_target_json_and_keeps_an_override(tmp_path):
    target_dir = tmp_path / "target"
    write_synthetic_target(target_dir, vocab_size=64, hidden_size=32, num_layers=6, layer_ids=[0, 2, 4],
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64)
    assert DrafterConfig.from_target(target_dir, num_hidden_layers=1).mask_token_id == 62  # eos is 63
    write_tokenizer(target_dir, plain=range(50), added=QWEN_ADDED, first_added=50, config=QWEN_CONFIG)
    assert DrafterConfig.from_target(target_dir, num_hidden_layers=1).mask_token_id == 55
    assert DrafterConfig.from_target(target_dir, num_hidden_layers=1, mask_token_id=63).mask_token_id == 63
