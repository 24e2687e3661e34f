import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.cache import Placement, ShardedKVCache
from treeattn.launch import launch


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["contiguous", "interleaved"]),
    p=st.integers(1, 6),
    block=st.integers(1, 5),
    L=st.integers(0, 60),
    steps=st.integers(0, 40),
)
def test_placement_partitions_and_stays_balanced(kind, p, block, L, steps):
    pl = Placement(kind, p, block)
    pos = [pl.prompt_positions(r, L) for r in range(p)]
    allpos = torch.cat(pos)
    assert torch.equal(allpos.sort().values, torch.arange(L))  # a partition of 0..L-1
    assert all(bool((x[1:] > x[:-1]).all()) for x in pos)  # increasing on every rank
    counts = torch.tensor([[len(x) for x in pos]])
    gap = block if kind == "interleaved" else 1
    assert int(counts.max() - counts.min()) <= gap
    assert int(counts.max()) <= pl.max_per_rank(L)
    for _ in range(steps):  # decoded tokens keep the gap within one block
        owner = pl.decode_owner(counts.sum(1), counts)
        counts[0, owner[0]] += 1
        assert int(counts.max() - counts.min()) <= max(gap, block)
        assert int(counts.max()) <= pl.max_per_rank(int(counts.sum()))


def test_growth_stops_at_slot_limit():
    """Decoding past the capacity doubles it, but not past slot_limit; a larger need still grows."""
    c = ShardedKVCache(1, 1, 1, 2)
    c.begin_extend(torch.tensor([40]), 40)
    assert c.cap == 40
    c.slot_limit = 50
    c.place(1)
    assert c.cap == 50  # not 80
    c.place(10)
    assert c.cap == 51 and c.memory_bytes()["allocated"] == 51 * 2 * 2 * 4


def test_placement_errors():
    with pytest.raises(ValueError, match="placement must be one of"):
        Placement("zigzag", 2)
    with pytest.raises(ValueError, match="block >= 1"):
        Placement("interleaved", 2, 0)


def cache_worker(kind: str, block: int):
    """Store tokens whose K encodes (sequence, position) and check every step that each
    rank's valid slots hold exactly its tokens, with correct global positions."""
    p = dist.get_world_size()
    B, H, D, L = 3, 2, 4, 11
    lens = torch.tensor([11, 4, 1])  # right-padded batch
    c = ShardedKVCache(2, B, H, D, placement=kind, block=block, capacity=2)
    mine = c.begin_prefill(lens, L)

    def kv(b_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # [B, H, n, D] encoding (b, pos)
        val = b_idx.view(-1, 1) * 1000 + pos.view(1, -1)
        return val.view(len(b_idx), 1, -1, 1).expand(-1, H, -1, D).float()

    for layer in range(2):
        c.store_prefill(layer, kv(torch.arange(B), mine), -kv(torch.arange(B), mine))
    for step in range(25):
        seq = c.seq_lens
        gathered = [torch.empty(B, dtype=torch.int64) for _ in range(p)]
        dist.all_gather(gathered, c.kv_lens.clone())
        assert torch.equal(torch.stack(gathered, 1), c.counts), "counts replicated on every rank"
        assert torch.equal(c.counts.sum(1), seq)
        assert int(c.counts[0].max() - c.counts[0].min()) <= block  # the unpadded sequence stays balanced
        for layer in range(2):
            k, v, kl = c.local(layer)
            for b in range(B):
                n = int(kl[b])
                pos = c.positions[b, :n]
                assert torch.equal(k[b, 0, :n, 0], (b * 1000 + pos).float()) and torch.equal(
                    v[b, 0, :n, 0], -k[b, 0, :n, 0]
                )
                assert bool((pos[1:] > pos[:-1]).all()) and bool((pos < seq[b]).all())
        # every position 0..len-1 is held exactly once across the ranks
        for b in range(B):
            n = int(c.kv_lens[b])
            held = torch.zeros(int(seq[b]), dtype=torch.int64)
            held[c.positions[b, :n]] = 1
            dist.all_reduce(held)
            assert bool((held == 1).all()), f"step {step} seq {b}: {held.tolist()}"
        owner = c.begin_decode_step()
        for layer in range(2):
            new = kv(torch.arange(B), torch.zeros(1, dtype=torch.int64)) + seq.view(B, 1, 1, 1).float()
            c.store_decode(layer, new, -new)
        assert owner.shape == (B,)
    mem = c.memory_bytes()
    assert mem["used"] <= mem["allocated"] and c.cap < 2 * max(c.used, 16) + 1  # geometric, not per-step


@pytest.mark.parametrize("kind,block", [("interleaved", 1), ("interleaved", 3), ("contiguous", 1)])
def test_sharded_cache_contents_positions_balance(kind, block):
    launch(cache_worker, 3, (kind, block), timeout=120)


def mismatch_worker():
    rank = dist.get_rank()
    with pytest.raises(ValueError, match="ranks disagree on kv_heads"):
        ShardedKVCache(2, 1, 4 if rank else 2, 8)
    with pytest.raises(ValueError, match="placement must be one of"):
        ShardedKVCache(2, 1, 2, 8, placement="zigzag" if rank == 1 else "interleaved")


def test_sharded_cache_validates_once_across_ranks():
    launch(mismatch_worker, 2, timeout=60)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["contiguous", "interleaved"]),
    p=st.integers(1, 6),
    block=st.integers(1, 4),
    counts=st.lists(st.integers(0, 9), min_size=6, max_size=6),
    n=st.integers(0, 40),
    prompt=st.booleans(),
)
def test_block_owners_is_decode_owner_token_by_token(kind, p, block, counts, n, prompt):
    pl = Placement(kind, p, block)
    c = torch.tensor(counts[:p])
    start = int(c.sum())
    got = pl.block_owners(c, start, n, prompt=prompt).tolist()
    if prompt and start == 0:  # an empty sequence takes the prompt split
        want = [r for i in range(n) for r in range(p) if i in pl.prompt_positions(r, n).tolist()]
    else:
        want, cc = [], c.clone()[None]
        for j in range(n):
            o = int(pl.decode_owner(torch.tensor([start + j]), cc)[0])
            want.append(o)
            cc[0, o] += 1
    assert got == want


def test_slots_before_per_query_and_rewind():
    """One process: kv_start per query ([B, T] bounds) after ragged blocks and a rewind."""
    c = ShardedKVCache(1, 2, 1, 2, placement="contiguous")
    c.begin_extend(torch.tensor([5, 3]), 5)  # ragged prompt on an empty cache
    assert not c.uniform() and c.seq_lens.tolist() == [5, 3]
    b, j, slots = c.place(4)  # every token on the only rank, after each sequence's own length
    assert b.tolist() == [0] * 4 + [1] * 4 and slots.tolist() == [5, 6, 7, 8, 3, 4, 5, 6]
    assert c.positions[1, :7].tolist() == list(range(7))
    bound = torch.tensor([[0, 4, 9], [2, 3, 100]])
    got = c.slots_before(bound)
    want = torch.tensor([[sum(int(x) < int(bd) for x in c.positions[s, : int(c.kv_lens[s])]) for bd in bound[s]]
                         for s in range(2)])  # fmt: skip
    assert torch.equal(got, want), (got, want)
    c.rewind(torch.tensor([2, 6]))
    assert c.seq_lens.tolist() == [2, 6] and c.slots_before(100).tolist() == [2, 6]
    c.rewind(2)
    assert c.uniform() and c.seq_lens.tolist() == [2, 2]


@pytest.mark.parametrize("lens,L", [([5, 5], 5), ([5, 3], 5), ([3, 3], 5)])
def test_decode_step_stores_at_one_slot_or_by_index(lens, L):
    """A step whose sequences all sit at one local slot stores each layer with one copy, a
    ragged one by index; the cache holds the same either way. Steps pass no lengths when every
    sequence's is the shard's used slots (lens_on_device), else the lengths."""
    B, H, D = 2, 2, 4
    c = ShardedKVCache(1, B, H, D, capacity=4)
    lens_t = torch.tensor(lens)
    c.begin_prefill(lens_t, L)  # ([3, 3], 5): equal lengths below the padding
    c.store_prefill(0, torch.ones(B, H, L, D), torch.ones(B, H, L, D))
    for step in range(3):
        c.begin_decode_step()
        assert (c._step_slot is not None) == (lens[0] == lens[1])
        new = torch.arange(B * H * D, dtype=torch.float32).view(B, H, 1, D) + 100 * step
        c.store_decode(0, new, -new)
        k, v = c.shard(0)
        for b in range(B):
            s = int(c.kv_lens[b]) - 1
            assert torch.equal(k[b, :, s], new[b, :, 0]) and torch.equal(v[b, :, s], -new[b, :, 0])
        kl = c.lens_on_device()
        # None exactly when every slot below `used` is valid for every sequence: not while
        # equal lengths sit below a padded prompt's slots ([3, 3] padded to 5: step 0)
        assert (kl is None) == bool((c.kv_lens == c.used).all())
        assert (kl is None) == (lens[0] == lens[1] and step + 1 >= L - lens[0])
        if kl is not None:
            assert torch.equal(kl, c.kv_lens)
