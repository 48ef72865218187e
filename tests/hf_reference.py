"""transformers' own model on the bundled GGUF, as the reference our engine is checked and
benchmarked against (tests and benchmarks/engine_throughput.py share it)."""

from __future__ import annotations

import os

import torch

from splitserve.models.loader import default_model_path


def load_transformers_default_model():
    """``(model, load_result)``: transformers' GGUF path (its dequantization and q/k
    un-permutation), built without ``from_pretrained``, which insists on the ``accelerate``
    package for GGUF files. ``load_result`` is ``load_state_dict``'s report, for checking."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    directory, name = os.path.split(path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config).float()
    result = model.load_state_dict(tensors, strict=False)
    return model.eval(), result
