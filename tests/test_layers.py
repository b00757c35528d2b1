import pytest

from dflash.shards import default_layer_ids, hidden_state_index


@pytest.mark.parametrize(
    ("num_layers", "num_features", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B, z-lab/Qwen3-8B-DFlash-b16's dflash_config
        (30, 5, [1, 8, 14, 20, 27]),  # SmolLM2-135M
        (28, 3, [1, 13, 25]),
        (30, 1, [15]),
    ],
)
def test_default_layer_ids(num_layers, num_features, expected):
    assert default_layer_ids(num_layers, num_features) == expected


def test_default_layer_ids_refuses_repeats():
    with pytest.raises(ValueError, match="repeat"):
        default_layer_ids(5, 4)


def test_hidden_state_index_skips_embedding_output():
    assert hidden_state_index(0) == 1
