"""Model state dicts in the two forms checkpoints hold them: flat dotted names, and
Megatron-LM's nested form (`model['language_model']['embedding']['word_embeddings']
['weight']`, `model['language_model']['transformer']['layers.0...']`)."""


def to_nested_state_dict(flat):
    """Flat model keys -> Megatron 1.1.5's nested form, as the Megatron layout saves it."""
    nested = {}
    for key, tensor in flat.items():
        parts = key.split(".")
        if parts[:2] == ["language_model", "transformer"]:
            nested.setdefault("language_model", {}).setdefault("transformer", {})[
                ".".join(parts[2:])] = tensor
            continue
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = tensor
    return nested


def to_flat_state_dict(nested, prefix=""):
    """Nested dicts -> flat dotted keys (any nesting: Megatron's, and the module
    Megatron-DeepSpeed saves from its state_dict_for_save_checkpoint)."""
    flat = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(to_flat_state_dict(value, name + "."))
        else:
            flat[name] = value
    return flat
