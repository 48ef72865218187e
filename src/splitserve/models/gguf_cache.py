"""A GGUF file converted once: its config, float32 weights and tokenizer, kept in a cache.

Loading a GGUF costs ~10 s on a quiet 2-core CPU before the model runs a step: the ``gguf``
reader parses every vocabulary entry, the quantized tensors are dequantized in numpy, and
the tokenizer is rebuilt from the metadata. A worker restart, a test that spawns workers,
or a second engine would pay it again. The first load writes what it computed into an
entry of the cache; later loads of the same file read the entry instead:

    <cache>/gguf-v1-<xxh3-128 of the file>/
        config.json          the ModelConfig, as the GGUF gave it
        model.safetensors    every tensor under its HF name, float32, as gguf_weights yields it
        tokenizer/           the tokenizer as ``save_pretrained`` writes it (with the template)

The key is the file's content, so an edited or replaced file is a new entry and a copy of
the same file is the same one. An entry appears whole or not at all: it is written in a
temporary directory and renamed into place; when two processes convert the same file at
once, the first rename wins and the other discards its copy. The cache is an accelerator
only: an entry that cannot be read is removed and rebuilt, and a cache that cannot be
written (read-only, full) leaves the load as it was, with a warning.

``SPLITSERVE_MODEL_CACHE`` names the directory (default ``$XDG_CACHE_HOME/splitserve/models``,
else ``~/.cache/splitserve/models``); ``off`` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from splitserve.models.config import ModelConfig

log = logging.getLogger(__name__)

ENV_VAR = "SPLITSERVE_MODEL_CACHE"
FORMAT = "gguf-v1"  # bump when what an entry holds, or how it is made, changes
_CHUNK = 16 << 20


def cache_dir() -> Path | None:
    """Where converted models live, or ``None`` when ``SPLITSERVE_MODEL_CACHE=off``."""
    configured = os.environ.get(ENV_VAR, "").strip()
    if configured.lower() == "off":
        return None
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitserve" / "models"


def file_digest(path: str) -> str:
    """xxh3-128 of the file's bytes (~0.1 s for the default model's 100 MB)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Entry:
    """One converted file in the cache (which may not exist yet)."""

    def __init__(self, root: Path, digest: str) -> None:
        self.root = root
        self.path = root / f"{FORMAT}-{digest}"

    def exists(self) -> bool:
        return self.path.is_dir()

    def read_config(self, model_id: str) -> ModelConfig:
        fields = json.loads((self.path / "config.json").read_text())
        return ModelConfig(**{**fields, "model_id": model_id})

    def read_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from load_file(self.path / "model.safetensors").items()

    def has_tokenizer(self) -> bool:
        return (self.path / "tokenizer").is_dir()

    @property
    def tokenizer_dir(self) -> str:
        return str(self.path / "tokenizer")

    def write(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer) -> None:
        """Write the entry (with the tokenizer when there is one); a failure to write is a
        warning, never an error of the load."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.root))
        except OSError as e:
            log.warning("model cache %s is not writable (%s); loading without it", self.root, e)
            return
        try:
            (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
            save_file({n: t.contiguous() for n, t in weights.items()}, tmp / "model.safetensors")
            if tokenizer is not None:
                tokenizer.save(tmp / "tokenizer")
            for made in tmp.rglob("*"):  # mkdtemp's 0700 would hide the entry from others
                made.chmod(0o755 if made.is_dir() else 0o644)
            tmp.chmod(0o755)
            self._publish(tmp)
        except OSError as e:
            log.warning("could not write model cache entry %s (%s)", self.path, e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _publish(self, tmp: Path) -> None:
        try:
            os.rename(tmp, self.path)
        except OSError:
            if not self.exists():  # not lost to a concurrent writer of the same entry
                raise

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# What reading a damaged entry can raise: missing files, bad JSON, a truncated safetensors.
READ_ERRORS = (OSError, ValueError, TypeError, KeyError, SafetensorError)
