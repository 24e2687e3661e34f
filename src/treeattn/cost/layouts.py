"""One decode step of a whole model over N ranks, per layout of its weights and its K/V cache:
what each rank reads, what the ranks exchange, whether it fits.

Layouts (N ranks; TPA: the ranks one layer's attention heads are split over, KVP = N / TPA:
the ranks the sequence is split over):

- ``kvp`` (treeattn without ``--tp``): the weights whole on every rank, the sequence split over
  all N; per layer one reduction of the attention states (the cheapest Tree strategy).
- ``tp`` (vLLM's ``--tensor-parallel-size``): the weights split over N, the sequence whole;
  TPA = min(N, KV heads), so past the KV heads each KV head and its cache are held N / KV
  heads times over; per layer two all-reduces of the hidden state.
- ``kvp x tp`` (Helix; treeattn with ``--tp``, TPA = 1): Q/K/V split over TPA (every KVP rank
  of a head slice computes them), the sequence over KVP, the output projection and the MLP
  over all N; per layer one all-to-all of the partial states over query heads (its size
  independent of the context) and two all-reduces. The TPA dividing the KV heads with the
  least time is taken.

A rank's step: its weight bytes + its K/V bytes read at ``device_mem_bw * attn_efficiency``
(decode is memory-bound), plus ``attn_alpha`` per layer, plus the collectives (alpha-beta,
:mod:`treeattn.cost.formulas`, ``collective_alpha`` per call; a group wider than a node at
the inter-node constants), plus the vocabulary-parallel LM head and its all-gather of logits.
Memory per rank: its weights + its K/V; it fits when that is at most 90 % of ``device_mem``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import formulas as F
from .model import Cluster, linear_params, reduction_costs

STATE = 4  # bytes per attention state element (float32)


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes (a Llama-style gated MLP: ``mlp_mats`` = 3 linears of
    ``hidden x intermediate``; 2 for a plain MLP, as BLOOM's and MPT's)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    mlp_mats: int = 3

    def params(self) -> int:
        per = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + self.mlp_mats * self.hidden * self.intermediate
        return self.layers * per + self.vocab * self.hidden * (1 if self.tied else 2)


MODELS: dict[str, Shape] = {  # Meta's published configs
    "llama-3.1-8b": Shape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": Shape("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256),
    "llama-3.1-405b": Shape("Llama-3.1-405B", 126, 16384, 128, 8, 128, 53248, 128256),
}
LAYOUTS: tuple[str, ...] = ("kvp", "tp", "kvp x tp")


@dataclass(frozen=True)
class Step:
    """One layout's decode step: seconds and their parts, bytes per rank, whether it fits."""

    layout: str
    tpa: int
    kvp: int
    seconds: float
    weights_s: float
    kv_s: float
    comm_s: float
    weight_bytes: float
    kv_bytes: float
    fits: bool | None


def _ar(c: Cluster, n: float, group: int) -> float:
    """An all-reduce of ``n`` bytes over ``group`` ranks (inter-node constants past a node)."""
    if group <= 1:
        return 0.0
    a, b = (c.intra_alpha, c.intra_beta) if group <= c.devices_per_node else (c.inter_alpha, c.inter_beta)
    return c.collective_alpha + F.pick(c.allreduce_algo, F.ar_ring(n, group, a, 1 / b), F.ar_tree(n, group, a, 1 / b))


def _a2a(c: Cluster, n: float, group: int) -> float:
    if group <= 1:
        return 0.0
    a, b = (c.intra_alpha, c.intra_beta) if group <= c.devices_per_node else (c.inter_alpha, c.inter_beta)
    return c.collective_alpha + F.a2a(n, group, a, 1 / b)


def step(c: Cluster, m: Shape, n: int, seq: int, layout: str, *, batch: int = 1, dtype_bytes: int = 2,
         tpa: int | None = None) -> Step:  # fmt: skip
    """One decode step of ``batch`` sequences of ``seq`` tokens over ``n`` ranks in ``layout``
    (``tpa``: for ``kvp x tp``, the head split; default the fastest dividing the KV heads)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    c.placement(n)  # ValueError when the cluster has fewer ranks
    if layout == "kvp x tp" and tpa is None:
        options = [t for t in range(1, min(n, m.kv_heads) + 1) if m.kv_heads % t == 0 and n % t == 0]
        return min((step(c, m, n, seq, layout, batch=batch, dtype_bytes=dtype_bytes, tpa=t) for t in options),
                   key=lambda s: s.seconds)  # fmt: skip
    e, h, d, L = dtype_bytes, m.hidden, m.head_dim, m.layers
    if layout == "kvp":
        tpa, kvp, split = 1, n, 1
    elif layout == "tp":
        tpa, kvp, split = min(n, m.kv_heads), 1, n
    else:
        tpa, kvp, split = tpa or 1, n // (tpa or 1), n
    qkv = h * d * (m.heads + 2 * m.kv_heads) * e / tpa
    rest = (m.heads * d * h + m.mlp_mats * h * m.intermediate) * e / split
    head = m.vocab * h * e / n  # vocabulary-parallel in every layout
    embed = m.vocab * h * e * (0 if m.tied else 1) / (1 if layout == "kvp" else n)  # held, one row read
    w_read = L * (qkv + rest) + head
    kv_heads_here = max(1, m.kv_heads // tpa)
    kv = L * batch * kv_heads_here * -(-seq // kvp) * 2 * d * e
    bw = c.device_mem_bw * c.attn_efficiency
    P = linear_params(c)
    comm = 0.0
    hq = m.heads // tpa  # query heads of a rank's slice
    if layout == "kvp":
        out_b, lse_b = batch * m.heads * d * STATE, batch * m.heads * STATE
        comm += L * min(v for k, v in reduction_costs(c, out_b, lse_b, n).items() if k != "auto")
    elif layout == "kvp x tp" and kvp > 1:
        comm += L * _a2a(c, batch * hq * (d + 1) * STATE, kvp)
    if split > 1:  # two per layer, and the vocabulary-parallel embedding's one
        comm += (2 * L + 1) * _ar(c, batch * h * e, n)
    logits = F.ag_ring(batch * m.vocab / n * STATE, n, c.intra_alpha if n <= c.devices_per_node else c.inter_alpha,
                       1 / (c.intra_beta if n <= c.devices_per_node else c.inter_beta))  # fmt: skip
    comm += logits + (c.collective_alpha if n > 1 else 0.0)
    w_s, kv_s = w_read / bw, kv / bw + L * float(P["attn_alpha"] or 0.0)
    held = w_read + embed  # every weight a rank holds is read once a step, but the embeddings (one row each)
    if layout == "kvp":  # the head is read by vocabulary slices but held whole (the tied table too)
        held += head * (n - 1)
    fits = None if c.device_mem is None else held + kv <= 0.9 * c.device_mem
    return Step(layout, tpa, kvp, w_s + kv_s + comm, w_s, kv_s, comm, held, kv, fits)


def shape_of(config) -> Shape:
    """The :class:`Shape` of a transformers config (its text config; duck-typed: no import)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    mt = getattr(c, "model_type", "model")
    inter = getattr(c, "intermediate_size", None)
    if inter is None:  # plain MLPs: BLOOM's 4 x hidden, MPT's expansion_ratio x hidden
        inter = int(getattr(c, "expansion_ratio", 4) * c.hidden_size)
    return Shape(mt, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                 getattr(c, "num_key_value_heads", None) or c.num_attention_heads, hd, inter, c.vocab_size,
                 bool(getattr(c, "tie_word_embeddings", False)), 3 if mt not in ("bloom", "mpt") else 2)  # fmt: skip


def pick_tp(c: Cluster, m: Shape, n: int, seq: int, *, batch: int = 1, dtype_bytes: int = 2,
            tpa: int | None = 1) -> tuple[int, Step, Step]:  # fmt: skip
    """``--tp auto``: ``(1 or n, the step with the weights whole, the step with them split)``:
    the weights split over the ``n`` ranks (the ``kvp x tp`` layout at ``tpa``; None: the
    fastest head split) when that step is faster or only it fits, else whole (``kvp``)."""
    whole = step(c, m, n, seq, "kvp", batch=batch, dtype_bytes=dtype_bytes)
    split = step(c, m, n, seq, "kvp x tp", batch=batch, dtype_bytes=dtype_bytes, tpa=tpa)
    if n == 1:
        return 1, whole, split
    better = split.seconds < whole.seconds if (whole.fits is not False) == (split.fits is not False) else split.fits
    return (n if better else 1), whole, split


def table(c: Cluster, models: list[str], seqs: list[int], ranks: list[int], batch: int = 1) -> str:
    """A markdown table of ms/token per layout (``(no fit)`` where a rank's weights and K/V
    exceed 90 % of its memory)."""
    rows = ["| model | tokens | ranks | " + " | ".join(LAYOUTS) + " | best |", "|---|---|---|" + "---|" * (len(LAYOUTS) + 1)]
    for name in models:
        m = MODELS[name]
        for seq in seqs:
            for n in ranks:
                cells, best = [], None
                for lay in LAYOUTS:
                    s = step(c, m, n, seq, lay, batch=batch)
                    mark = "" if s.fits is not False else " (no fit)"
                    extra = f" (TPA {s.tpa})" if lay == "kvp x tp" else ""
                    cells.append(f"{1e3 * s.seconds:.2f}{extra}{mark}")
                    if s.fits is not False and (best is None or s.seconds < best.seconds):
                        best = s
                rows.append(f"| {m.name} | {_short(seq)} | {n} | " + " | ".join(cells) + f" | {best.layout if best else 'none fits'} |")
    return "\n".join(rows)


def _short(n: int) -> str:
    return f"{n / 2**20:g}M" if n % 2**20 == 0 else f"{n / 2**10:g}k" if n % 2**10 == 0 else str(n)
