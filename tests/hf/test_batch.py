"""treeattn.runtime.BatchRunner: rows joining and leaving at random steps over shared prefixes, on
tiny float64 models at p = 1, 2, 3, both placements, Tree and Ring, with sliding windows and
softcaps, and ALiBi biases (BLOOM, MPT). After every forward each row's logits equal single-process transformers run fresh
on its whole sequence (the prefix part it reads, then its own tokens), and every rank holds
exactly the row tokens its placement gives it, with the K/V transformers computes; a prefix
that adopts a finished row is checked the same way. Rows verify drafts too: logits at every
token of their line, then the rejected tokens trimmed. Tree runs lines both ways: stored on
their owners before the forward (``PLACED_MAX``) and after it, and steps run their tokens on
every rank or a share of them per rank (``SPLIT_MIN``)."""

import random

import pytest
import torch.distributed as dist

pytest.importorskip("transformers")

from test_session import Reference, check_shards, spread, tiny64  # noqa: E402

from treeattn.launch import launch  # noqa: E402


def owners_after(prefix_owner: list[int], n: int, placement: str, p: int, block: int) -> list[int]:
    """Owner ranks of ``n`` tokens appended to a sequence laid out as ``prefix_owner``."""
    own = list(prefix_owner)
    for _ in range(n):
        pos = len(own)
        if placement == "interleaved":
            own.append((pos // block) % p)
        else:
            counts = [own.count(r) for r in range(p)]
            own.append(counts.index(min(counts)))
    return own[len(prefix_owner) :]


def check_row(runner, row: int, seq: list[int], keep: int, owner: list[int], ref: Reference, what: str) -> None:
    rank = dist.get_rank()
    rc = runner.rows
    mine = [keep + i for i, o in enumerate(owner) if o == rank]
    n = int(rc.kv_len[row])
    assert rc.positions[row, :n].tolist() == mine, f"{what}: row {row} rank {rank} holds {rc.positions[row, :n]}"
    assert runner.row_ids[row] == seq[keep:], what
    if mine:
        for layer, (k, v) in enumerate(ref.keys(seq)):
            got_k, got_v = rc.k[layer][row, :, :n], rc.v[layer][row, :, :n]
            err = max((got_k - k[:, mine]).abs().max().item(), (got_v - v[:, mine]).abs().max().item())
            assert err <= ref.kv_tol, f"{what}: row {row} layer {layer}: K/V off by {err:.3g}"


def fp32_spread(model) -> tuple[float, float]:
    """Tolerances for families whose float64 transformers model still computes in float32 in
    places (BLOOM's and MPT's attention softmax): 2x the difference between its float64 and
    float32 forwards of 40 tokens (logits, K/V), at least :func:`spread`'s."""
    import copy

    import torch
    from transformers import DynamicCache

    from treeattn.hf.model import cache_kw

    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    m32 = copy.deepcopy(model).float()
    with torch.no_grad():
        a = model(ids, **cache_kw(model, DynamicCache()), use_cache=True)
        b = m32(ids, **cache_kw(m32, DynamicCache()), use_cache=True)
    e_logits = (a.logits - b.logits.double()).abs().max().item()
    e_kv = max(max((x.keys - y.keys.double()).abs().max().item(), (x.values - y.values.double()).abs().max().item())
               for x, y in zip(a.past_key_values.layers, b.past_key_values.layers, strict=True))  # fmt: skip
    tol, kv_tol = spread(model)
    return max(tol, 2 * e_logits), max(kv_tol, 2 * e_kv)


def run_case(kind: str, placement: str, attention: str, seed: int, steps: int, chunk: int | None = 4,
             placed_max: int = 16, split_min: int = 1 << 30) -> None:  # fmt: skip
    import treeattn.runtime.batch as batch
    from treeattn.runtime.batch import BatchRunner

    batch.PLACED_MAX = placed_max  # lines up to this long are stored before the forward (Tree)
    batch.SPLIT_MIN = split_min  # steps of this many tokens run a share of them per rank (parallel.split)

    p = dist.get_world_size()
    rng = random.Random(seed)
    m = tiny64(kind)
    V = m.config.vocab_size
    block = rng.choice([None, 1, 3])
    case = f"p={p} {kind} {placement} {attention} block={block} seed={seed} placed_max={placed_max} split_min={split_min}"
    runner = BatchRunner(m, max_batch=4, placement=placement, attention=attention, prefill_chunk=chunk, block=block)
    refs: dict[int, Reference] = {}
    for pid in (0, 1):  # two shared prefixes, prefilled in one or two calls
        ref = refs[pid] = Reference(m, placement, p)
        if kind in ("bloom", "mpt"):
            ref.tol, ref.kv_tol = fp32_spread(m)
        a = [rng.randrange(V) for _ in range(rng.randrange(8, 30))]
        runner.prefill(pid, a)
        ref.block = runner.prefixes[pid].cache.placement.block
        ref.extend([a])
        if rng.random() < 0.5:
            b = [rng.randrange(V) for _ in range(rng.randrange(1, 9))]
            runner.prefill(pid, b)
            ref.extend([b])
        check_shards(runner.prefixes[pid], ref, f"{case} prefix {pid}")
    rows: dict[int, dict] = {}  # row -> {pid, keep, seq, owner, blk}
    for step in range(steps):
        what = f"{case} step {step}"
        for row in sorted(rows):  # rows leave; a prefix one read whole may adopt its tokens
            if rng.random() < 0.15:
                r = rows.pop(row)
                adopt = rng.random() < 0.7
                runner.close(row, adopt=adopt)
                ref = refs.get(r["pid"])
                if adopt and ref is not None and r["keep"] == len(ref.ids[0]):
                    ref.keep([r["seq"][r["keep"] :]])
                if ref is not None:
                    check_shards(runner.prefixes[r["pid"]], ref, f"{what}: prefix {r['pid']} after row {row} left")
        # every running row decodes a token, or verifies it with a draft (logits at every token)
        lines = [(row, [rng.randrange(V) for _ in range(rng.choice([1, 1, 2, 4]))]) for row in rows]
        full = [row for row, ids in lines if len(ids) > 1]
        for row in [r for r in range(4) if r not in rows]:  # rows join: a prefix (or none), a keep, a chunk
            if rng.random() < (0.8 if not rows else 0.3):
                pid = rng.choice([0, 0, 1, None])
                if pid is None:
                    keep, seq, own, blk = 0, [], [], block or 1
                else:
                    ref = refs[pid]
                    keep = rng.randrange(1, len(ref.ids[0]) + 1)
                    seq, own, blk = list(ref.ids[0][:keep]), ref.owner[0][:keep], ref.block
                runner.open(row, pid, keep)
                rows[row] = dict(pid=pid, keep=keep, seq=seq, owner=[], pre=own, blk=blk)
                lines.append((row, [rng.randrange(V) for _ in range(rng.randrange(1, 6))]))
        if not lines:
            continue
        rng.shuffle(lines)
        out, i = runner.run(lines, full), 0
        for row, ids in lines:
            r = rows[row]
            n0 = len(r["seq"])
            r["seq"] += ids
            r["owner"] += owners_after(r["pre"] + r["owner"], len(ids), placement, p, r["blk"])
            for j in range(len(ids)) if row in full else [len(ids) - 1]:
                e = (out[i] - refs[0].logits(r["seq"][: n0 + j + 1])).abs().max().item()
                assert e <= refs[0].tol, f"{what}: row {row} (prefix {r['pid']}, keep {r['keep']}, token {j} of {len(ids)}): off by {e:.3g}"  # fmt: skip
                i += 1
            check_row(runner, row, r["seq"], r["keep"], r["owner"], refs[0], what)
            if row in full and rng.random() < 0.7:  # a rejected draft: its tokens go
                n = n0 + rng.randrange(1, len(ids))
                runner.trim(row, n - r["keep"])
                r["seq"], r["owner"] = r["seq"][:n], r["owner"][: n - r["keep"]]
                check_row(runner, row, r["seq"], r["keep"], r["owner"], refs[0], f"{what} trimmed to {n}")
        assert i == len(out), (i, out.shape)


def batch_worker(seed0: int) -> None:
    cases = [(pl, at) for pl in ("contiguous", "interleaved") for at in ("tree", "ring")]
    for i, (placement, attention) in enumerate(cases):  # Tree: lines of 3+ tokens stored after the forward, or not;
        # every step of p+ tokens split over the ranks, or none
        run_case("llama", placement, attention, seed0 + i, steps=16, chunk=(4, None)[i % 2], placed_max=(2, 16)[i // 2],
                 split_min=(1, 1 << 30, 1 << 30, 1)[i])  # fmt: skip
    # sliding windows (per query, on global positions, in the prefix and in the row) and softcaps
    run_case("mistral", "interleaved", "tree", seed0 + 10, steps=28, chunk=8, split_min=1)  # rows longer than the window
    run_case("mistral", "contiguous", "tree", seed0 + 13, steps=28, chunk=8, placed_max=1)
    run_case("gemma2", "contiguous", "ring", seed0 + 11, steps=28, chunk=8, split_min=6)
    run_case("gemma2", "interleaved", "tree", seed0 + 12, steps=10, chunk=None)
    # ALiBi (BLOOM, MPT): the bias from every key's global position, in the rows, the prefixes and a line's own tokens
    run_case("bloom", "interleaved", "tree", seed0 + 14, steps=12, chunk=8, placed_max=2, split_min=1)
    run_case("mpt", "contiguous", "ring", seed0 + 15, steps=12, chunk=8)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_batch_runner_matches_transformers(p):
    launch(batch_worker, p, (1000 * p,), timeout=900)
