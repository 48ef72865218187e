"""Reading an HF model directory: ``config.json`` and single or sharded ``*.safetensors``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from splitserve.models.config import ModelConfig

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def read_config(directory: str, model_id: str) -> ModelConfig:
    """The model config, with ``generation_config.json``'s EOS ids merged in when present."""
    d = _read_json(os.path.join(directory, "config.json"))
    config = ModelConfig.from_hf_dict(d, model_id=model_id)
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
        extra = gen.get("eos_token_id")
        extra = extra if isinstance(extra, list) else [] if extra is None else [extra]
        config.eos_token_ids += [int(i) for i in extra if int(i) not in config.eos_token_ids]
    return config


def weight_files(directory: str) -> list[str]:
    """The safetensors files holding the weights, or ``ValueError`` naming what is missing."""
    index_path = os.path.join(directory, _INDEX)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        files = [os.path.join(directory, f) for f in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index_path} names weight files that do not exist: {missing}")
        return files
    single = os.path.join(directory, _SINGLE)
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{directory} has neither {_SINGLE} nor {_INDEX}")


def hf_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every weight file, in the file's dtype."""
    for path in weight_files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read safetensors file {path}: {e}") from e


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data
