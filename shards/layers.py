"""Which target layers feed the drafter, and where their outputs live.

Both stages need this (stage one to cache the features, stage two's online evaluation to
extract them from the live target), so it lives here, below both, as pure Python.
"""


def default_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """The DFlash rule: `num_features` decoder-layer ids spread from the second layer to the
    third-to-last, `round(1 + i * (num_layers - 4) / (num_features - 1))`; one feature takes
    the middle layer `num_layers // 2`.

    Qwen3-8B (36 layers, 5 features) gives [1, 9, 17, 25, 33]; SmolLM2 (30) [1, 8, 14, 20, 27].
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_layers // 2]
    if num_layers < 4:
        raise ValueError(
            f"the DFlash layer rule needs at least 4 decoder layers for {num_features} features, "
            f"the target has {num_layers}: pass explicit layer ids instead"
        )
    # Python's round() (half to even), exactly as z-lab/dflash's inference code computes it,
    # so an exported drafter and a serving engine that recomputes the ids agree.
    ids = [round(1 + i * (num_layers - 4) / (num_features - 1)) for i in range(num_features)]
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"{num_features} features over {num_layers} layers repeat a layer ({ids}): "
            "use fewer features or explicit layer ids"
        )
    return ids


def hidden_state_index(layer_id: int) -> int:
    """Index into Hugging Face `output_hidden_states` for decoder layer `layer_id`'s output.

    `hidden_states[0]` is the embedding output, so layer i's output is `hidden_states[i + 1]`.
    Features are stacked in the order of the layer ids, giving [T, L, H] per sequence.
    """
    return layer_id + 1
