"""Where the cached replies came from: stage one's --regenerate, a serving engine through
dflash-regenerate (recorded in the manifest's options), or the data as given."""

from __future__ import annotations

import pytest

from dflash.shards import CacheSpec


def spec(**fields) -> CacheSpec:
    return CacheSpec(vocab_size=50, hidden_size=8, layer_ids=[1, 2], top_k=4, max_length=32,
                     target={"name": "t", "num_layers": 4, "config_sha256": "x"}, **fields)


@pytest.mark.parametrize("fields, expected", [
    ({}, (False, None)),
    ({"regenerated": True, "generation_temperature": 0.0}, (True, 0.0)),
    ({"regenerated": True, "generation_temperature": 0.7}, (True, 0.7)),
    ({"options": {"replies": {"made_by": "engine", "model": "m", "temperature": 0.0}}}, (True, 0.0)),
    ({"options": {"replies": {"made_by": "engine", "model": "m", "temperature": 1.0}}}, (True, 1.0)),
    ({"options": {"replies": {"made_by": "data"}}}, (False, None)),
])
def test_replies_source(fields, expected):
    assert spec(**fields).replies == expected
