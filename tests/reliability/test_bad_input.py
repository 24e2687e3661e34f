"""Bad input across the public API: each case raises the documented exception on EVERY rank,
fast, with a message naming the argument and the expected and actual values; after a
collective call's error the process group still works.

One launch (p = 2) runs every case in turn and records what each rank raised; each case is
then checked by its own test. For a collective call (tree_decode, ring_decode,
ShardedKVCache) the bad input is given on ONE rank (alternating) and the good rank must
raise too; for a local call (Topology, ShardedKVCache methods, generate's argument checks)
every rank gets the same bad input, as the documented usage ("same arguments on every rank").

Bad inputs tested elsewhere (not repeated here):
- tests/ops/test_attention.py::test_bad_input (14 cases of attention_with_lse: q not 4-D,
  Hq % Hkv, head dim, dtype mismatch, batch, k/v lengths, kv_lens > S / < 0 / float /
  wrong shape, NaN q, unknown backend, non-finite scale, integer dtype) and
  ::test_non_tensor_is_type_error;
- tests/comm/test_validation_and_meter.py::test_validation_raises_on_every_rank (tree_decode
  and ring_decode, bad on one rank: ranks disagreeing on B, Hq, Hkv, D, Dv, Tq, dtype,
  scale, strategy, new tokens, new_mask; q not 4-D, Hq % Hkv, NaN q, kv_lens > S / < 0 /
  float, new_k without new_v, new_k shape, new_mask shape, unknown strategy, q not a tensor)
  and ::test_topology_mismatch_raises_instead_of_hanging;
- tests/cache/test_sharded.py::test_placement_errors and
  ::test_sharded_cache_validates_once_across_ranks (kv_heads mismatch, unknown placement on
  one rank);
- tests/hf/test_generate.py::test_batch_and_sampling (left-padded attention_mask);
- tests/bench/test_simulate.py::test_predict_rejects_bad_input, tests/test_cli.py::test_bad_option_is_an_error.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from treeattn.launch import launch

P = 2
D = 16
HANG_BOUND = 10.0  # seconds: a case that takes longer counts as a hang


def make(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, Tq, S = 2, 4, 2, 3, 5
    return dict(
        q=torch.randn(B, Hq, Tq, D, generator=g),
        k=torch.randn(B, Hkv, S, D, generator=g),
        v=torch.randn(B, Hkv, S, D, generator=g),
        new_k=torch.randn(B, Hkv, Tq, D, generator=g),
        new_v=torch.randn(B, Hkv, Tq, D, generator=g),
        kv_lens=torch.tensor([5, 3]),
    )


def _inf_q(d):
    q = d["q"].clone()
    q[1, 2, 0, 3] = float("inf")
    return {**d, "q": q}


def _no_new(d, **kw):
    return {**{k: v for k, v in d.items() if k not in ("new_k", "new_v")}, **kw}


# id -> (call, where the bad input goes, exception, substrings every rank's message must
# contain). call(good_kwargs, bad) runs the API; bad=False must succeed (for "one rank" cases).
def _tree(change):
    def call(d, bad):
        import treeattn

        kw = {**d, "strategy": "allgather"}
        return treeattn.tree_decode(**(change(kw) if bad else kw))

    return call


def _ring(change):
    def call(d, bad):
        import treeattn

        return treeattn.ring_decode(**(change(d) if bad else d))

    return call


def _cache(**bad_kw):
    def call(d, bad):
        from treeattn.cache import ShardedKVCache

        return ShardedKVCache(1, 2, 2, D, **(bad_kw if bad else {}))

    return call


def _local(fn):
    def call(d, bad):
        return fn()

    return call


def _topology(n):
    def fn():
        import treeattn

        return treeattn.Topology(n)

    return fn


def _prefill_too_long():
    from treeattn.cache import ShardedKVCache

    ShardedKVCache(1, 2, 2, D).begin_prefill(torch.tensor([9, 3]), 8)


def _prefill_twice():
    from treeattn.cache import ShardedKVCache

    c = ShardedKVCache(1, 2, 2, D)
    c.begin_prefill(torch.tensor([4, 3]), 4)
    c.begin_prefill(torch.tensor([4, 3]), 4)


def _store_before_step():
    from treeattn.cache import ShardedKVCache

    c = ShardedKVCache(1, 2, 2, D)
    c.begin_prefill(torch.tensor([4, 3]), 4)
    c.store_decode(0, torch.zeros(2, 2, 1, D), torch.zeros(2, 2, 1, D))


def _generate(**kw):
    def fn():
        from treeattn.decoding import generate

        args = dict(input_ids=torch.ones(2, 5, dtype=torch.int64), max_new_tokens=4)
        args.update(kw)
        generate(torch.nn.Module(), **args)  # the arguments are checked before the model is used

    return fn


def _hierarchical_uneven():
    def call(d, bad):
        import treeattn

        return treeattn.tree_decode(**d, strategy="hierarchical", topology=treeattn.Topology(3))

    return call


ONE, EVERY = "one rank", "every rank"
CASES = {
    # tree_decode / ring_decode: a local error on one rank becomes a ValueError on all
    "tree k on another device": (_tree(lambda d: {**d, "k": d["k"].to("meta")}), ONE, ValueError,
                                 ["q, k, v must be on one device", "q cpu, k meta, v cpu"]),
    "ring v on another device": (_ring(lambda d: {**d, "v": d["v"].to("meta")}), ONE, ValueError,
                                 ["q, k, v must be on one device", "v meta"]),
    "tree kv_lens on another device": (_tree(lambda d: {**d, "kv_lens": d["kv_lens"].to("meta")}), ONE, ValueError,
                                       ["kv_lens must be on q's device cpu, got meta"]),
    "tree scale NaN": (_tree(lambda d: {**d, "scale": float("nan")}), ONE, ValueError,
                       ["scale must be a finite float or None, got nan"]),
    "ring scale inf": (_ring(lambda d: {**d, "scale": float("inf")}), ONE, ValueError,
                       ["scale must be a finite float or None, got inf"]),
    "tree scale a string": (_tree(lambda d: {**d, "scale": "0.5"}), ONE, ValueError,
                            ["scale must be a finite float or None, got '0.5'"]),
    "tree kv_lens bool": (_tree(lambda d: {**d, "kv_lens": torch.tensor([True, False])}), ONE, ValueError,
                          ["kv_lens must be an integer tensor of shape [B]=(2,)", "got torch.bool (2,)"]),
    "ring kv_lens wrong shape": (_ring(lambda d: {**d, "kv_lens": torch.tensor([5, 3, 1])}), ONE, ValueError,
                                 ["kv_lens must be an integer tensor of shape [B]=(2,)", "got torch.int64 (3,)"]),
    "tree kv_lens a list": (_tree(lambda d: {**d, "kv_lens": [5, 3]}), ONE, ValueError,
                            ["TypeError: kv_lens must be a torch.Tensor or None, got list"]),
    "tree k dtype differs from q": (_tree(lambda d: {**d, "k": d["k"].bfloat16()}), ONE, ValueError,
                                    ["q, k, v must share one dtype", "q torch.float32, k torch.bfloat16"]),
    "ring head dims differ": (_ring(lambda d: {**d, "k": d["k"][..., :8]}), ONE, ValueError,
                              ["head dim: q has D=16, k has D=8"]),
    "tree k and v lengths differ": (_tree(lambda d: {**d, "v": d["v"][:, :, :3]}), ONE, ValueError,
                                    ["k and v must agree in [H, S]", "k (2, 2, 5, 16), v (2, 2, 3, 16)"]),
    "tree batch differs": (_tree(lambda d: {**d, "k": d["k"][:1], "v": d["v"][:1]}), ONE, ValueError,
                           ["batch size: q has B=2, k has 1, v has 1"]),
    "tree q integer": (_tree(lambda d: {**d, "q": d["q"].long()}), ONE, ValueError,
                       ["q must be float16, bfloat16, float32 or float64, got torch.int64"]),
    "ring inf in q": (_ring(_inf_q), ONE, ValueError, ["q contains NaN or inf"]),
    "tree new_v dtype differs": (_tree(lambda d: {**d, "new_v": d["new_v"].double()}), ONE, ValueError,
                                 ["new_v must match q's dtype/device torch.float32/cpu, got torch.float64/cpu"]),
    "ring new_mask not bool": (_ring(lambda d: {**d, "new_mask": torch.ones(3, 3, dtype=torch.int64)}), ONE,
                               ValueError, ["new_mask must be a bool tensor [Tq, Tq]=(3, 3)", "got torch.int64 (3, 3)"]),
    "tree new_mask without new tokens": (_tree(lambda d: _no_new(d, new_mask=torch.ones(3, 3, dtype=torch.bool))),
                                         ONE, ValueError, ["new_mask was given without new_k/new_v"]),
    "tree hierarchical with uneven nodes": (_hierarchical_uneven(), EVERY, ValueError,
                                            ["group size 2 is not a multiple of ranks_per_node=3"]),
    # Topology
    "Topology(0)": (_local(_topology(0)), EVERY, ValueError, ["ranks_per_node must be a positive int, got 0"]),
    "Topology('2')": (_local(_topology("2")), EVERY, ValueError, ["ranks_per_node must be a positive int, got '2'"]),
    # ShardedKVCache: created collectively, a bad argument on one rank raises on all
    "cache capacity negative": (_cache(capacity=-1), ONE, ValueError, ["capacity >= 0, got 1, 2, 2, 16, 1, -1"]),
    "cache block 0": (_cache(block=0), ONE, ValueError, ["block must be >= 1", "got 1, 2, 2, 16, 0, 0"]),
    "cache integer dtype": (_cache(dtype=torch.int32), ONE, ValueError, ["dtype must be a float dtype, got torch.int32"]),
    "cache prompt longer than padded": (_local(_prefill_too_long), EVERY, ValueError,
                                        ["prompt_lens must be [B]=2 ints in [0, 8], got [9, 3]"]),
    "cache prefill twice": (_local(_prefill_twice), EVERY, RuntimeError,
                            ["begin_prefill on a cache that already holds tokens"]),
    "cache store_decode before begin_decode_step": (_local(_store_before_step), EVERY, RuntimeError,
                                                    ["store_decode before begin_decode_step"]),
    # generate (its argument checks are local: every rank passes the same arguments)
    "generate max_new_tokens 0": (_local(_generate(max_new_tokens=0)), EVERY, ValueError,
                                  ["max_new_tokens must be >= 1, got 0"]),
    "generate unknown attention": (_local(_generate(attention="flash")), EVERY, ValueError,
                                   ["attention must be one of ('tree', 'ring'), got 'flash'"]),
    "generate input_ids 1-D": (_local(_generate(input_ids=torch.ones(5, dtype=torch.int64))), EVERY, ValueError,
                               ["input_ids must be [B, L] with L >= 1, got (5,)"]),
    "generate attention_mask shape": (_local(_generate(attention_mask=torch.ones(2, 4, dtype=torch.int64))), EVERY,
                                      ValueError, ["attention_mask must be [B, L]=(2, 5), got (2, 4)"]),
    "generate empty prompt": (_local(_generate(attention_mask=torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]))),
                              EVERY, ValueError, ["every prompt needs at least one token, got lengths [3, 0]"]),
}  # fmt: skip

# generate shares each rank's verdict on its arguments in its agreement all-gather: a bad
# argument on one rank raises ValueError on every rank, well within the collective timeout.
GENERATE_ONE_RANK = "generate max_new_tokens 0 on one rank"
ONE_RANK_TIMEOUT = 2.0


def bad_input_worker(outdir: str) -> None:
    import treeattn
    import treeattn.hf  # noqa: F401  (imports transformers: not inside a timed case)
    from treeattn.comm.collectives import CollectiveError

    rank = dist.get_rank()
    good = make()
    want = treeattn.tree_decode(**good, strategy="allgather")
    results = {}
    for i, (name, (call, where, _, _)) in enumerate(CASES.items()):
        bad = where == EVERY or rank == i % P  # the bad rank alternates
        t0 = time.monotonic()
        try:
            call(good, bad)
            res = {"exc": None, "msg": ""}
        except Exception as e:
            res = {"exc": type(e).__name__, "msg": str(e)}
        res["took"] = time.monotonic() - t0
        res["bad"] = bad
        # the group still works: the next call gives the same result
        res["group ok"] = torch.equal(treeattn.tree_decode(**good, strategy="allgather"), want)
        results[name] = res

    # last (it breaks the sub-group): a bad generate argument on rank 1 only
    sub = dist.new_group(timeout=datetime.timedelta(seconds=ONE_RANK_TIMEOUT))
    t0 = time.monotonic()
    try:
        _generate(max_new_tokens=0 if rank == 1 else 4, group=sub)()
        res = {"exc": None, "msg": ""}
    except (ValueError, CollectiveError) as e:
        res = {"exc": type(e).__name__, "msg": str(e)}
    except Exception as e:  # the good rank would go on to use the dummy model
        res = {"exc": type(e).__name__, "msg": str(e)}
    results[GENERATE_ONE_RANK] = {**res, "took": time.monotonic() - t0, "bad": rank == 1, "group ok": True}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad_input")
    launch(bad_input_worker, P, (str(out),), timeout=180, collective_timeout=30)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(P)}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_on_every_rank(name, results):
    _, where, exc, texts = CASES[name]
    for r in range(P):
        got = results[r][name]
        what = f"{name!r} ({where}) rank {r} ({'bad' if got['bad'] else 'good'} input)"
        assert got["exc"] == exc.__name__, f"{what}: raised {got['exc']}: {got['msg']}"
        for t in texts:
            assert t in got["msg"], f"{what}: {t!r} not in {got['msg']!r}"
        if where == ONE and not got["bad"]:
            bad_rank = next(x for x in range(P) if results[x][name]["bad"])
            assert f"rank {bad_rank}: " in got["msg"], f"{what}: the bad rank is not named: {got['msg']!r}"
        assert got["took"] < HANG_BOUND, f"{what}: took {got['took']:.1f} s"
        assert got["group ok"], f"{what}: the process group is broken afterwards"


def test_at_least_15_new_cases():
    assert len(CASES) >= 15


def test_generate_bad_argument_on_one_rank(results):
    good = results[0][GENERATE_ONE_RANK]
    bad = results[1][GENERATE_ONE_RANK]
    assert bad["exc"] == "ValueError" and "max_new_tokens must be >= 1" in bad["msg"], bad
    print(f"\ngenerate, bad argument on one rank: the other rank got {good['exc']} after {good['took']:.2f} s")
    assert good["exc"] == "ValueError" and "rank 1: max_new_tokens must be >= 1" in good["msg"], good
