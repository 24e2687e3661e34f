"""``treeattn demo``: Tree vs Ring decoding over a sharded KV on local ranks."""

from __future__ import annotations

import torch.distributed as dist

from .bench.latency import STRATS, measure


def worker(seq: int, heads: int, kv_heads: int, dim: int, dtype: str, reps: int, warmup: int) -> None:
    cfg = dict(heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, batch=1, reps=reps, warmup=warmup,
               check=True, single=False)  # fmt: skip
    rows, extra = measure(cfg, seq)
    if dist.get_rank() != 0:
        return
    p = dist.get_world_size()
    print(
        f"treeattn demo: p={p} ranks (gloo, 1 thread each), {seq:,} tokens (~{seq // p:,} per rank), "
        f"q {heads} heads, kv {kv_heads} heads x {dim}, {dtype}, B=1, Tq=1, {reps} steps of each method in turn after {warmup} warm-up"
    )
    print("\n| method | median ms | p10-p90 ms | max err vs float64 | bytes sent/rank/step | collectives + p2p |")
    print("|---|---|---|---|---|---|")
    med = {}
    for r in rows:
        name = "local attention (own shard, no comm)" if r["method"] == "local" else r["method"]
        med[r["method"]] = r["median_s"]
        err = "-" if r["max_err"] is None else f"{r['max_err']:.2e}"
        sends = f" + {r['p2p_sends']} sends" if r["p2p_sends"] else ""
        print(f"| {name} | {r['median_s'] * 1e3:.2f} | {r['p10_s'] * 1e3:.2f}-{r['p90_s'] * 1e3:.2f} | {err} "
              f"| {r['bytes_sent']:,} | {r['collectives']}{sends} |")  # fmt: skip
    best = min(STRATS, key=lambda s: med[f"tree {s}"])
    hint = "; set TREEATTN_PROFILE to use a calibrated one" if extra["auto_model"].startswith("built-in") else ""
    print(f"\nauto picked: {extra['auto']} (cost model: {extra['auto_model']}{hint})")
    print(f"Ring / Tree(auto) = {med['ring'] / med['tree auto']:.2f}x;  Ring / Tree(best: {best}) = "
          f"{med['ring'] / med[f'tree {best}']:.2f}x;  Tree(auto) / local attention = {med['tree auto'] / med['local']:.2f}x")  # fmt: skip
    print(f"validation (check=True) costs {extra['validation_s'] * 1e3:.2f} ms per call (median, tiny shard)")
    bad = [r["method"] for r in rows if r["max_err"] is not None and r["max_err"] > extra["tol"]]
    print(
        f"tolerance (2x one-pass {dtype} error): {extra['tol']:.2e} -> "
        + ("all exact" if not bad else f"FAILED: {bad}")
    )
    if bad:
        raise SystemExit(f"results outside tolerance: {bad}")
