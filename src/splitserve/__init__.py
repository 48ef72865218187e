"""splitserve: LLM serving built for AI agents."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so torch-free users (router, sim) stay light.
    if name == "LLM":
        from splitserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
