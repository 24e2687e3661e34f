"""End-to-end generation: time to first token and per-token decode, Tree vs Ring (Table 1 analogue)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist


def worker(cfg: dict, prompt_lens: list[int], out_path: str) -> None:
    from ..decoding import generate
    from ..hf.presets import build_model

    r, p = dist.get_rank(), dist.get_world_size()
    model, _ = build_model(cfg["preset"], None, getattr(torch, cfg["dtype"]), seed=0)
    for L in prompt_lens:
        ids = torch.randint(0, model.config.vocab_size, (1, L), generator=torch.Generator().manual_seed(L))
        toks = {}
        for attention in ("tree", "ring"):
            info: dict = {}
            toks[attention] = generate(model, ids, max_new_tokens=cfg["new_tokens"], attention=attention, info=info)
            t = torch.tensor([info["ttft"], statistics.median(info["decode"])], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r == 0:
                row = {"attention": attention, "p": p, "prompt": L, "preset": cfg["preset"], "dtype": cfg["dtype"],
                       "new_tokens": cfg["new_tokens"], "ttft_s": float(t[0]), "decode_s_per_token": float(t[1])}  # fmt: skip
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if not torch.equal(toks["tree"], toks["ring"]):
            raise RuntimeError(f"tree and ring generated different tokens at prompt length {L}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for att, c in (("tree", "C0"), ("ring", "C3")):
        pts = sorted((r["prompt"], r["ttft_s"], r["decode_s_per_token"]) for r in rows if r["attention"] == att)
        if pts:
            x, a, b = zip(*pts, strict=True)
            axes[0].plot(x, [v * 1e3 for v in a], "o-", color=c, label=att)
            axes[1].plot(x, [v * 1e3 for v in b], "o-", color=c, label=att)
    axes[0].set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (ms)")
    axes[1].set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="decode ms per token (median)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
