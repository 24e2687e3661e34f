"""treeattn.cost: formulas, profiles (round trip, bad files), and the choice of ``auto``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import treeattn
from treeattn.comm.strategies import LinkModel, choose_strategy, strategy_costs
from treeattn.comm.topology import Topology
from treeattn.cost import PRESETS, Profile, ProfileError, choose, load_profile, resolve, save_profile
from treeattn.cost import formulas as F
from treeattn.cost.profile import to_dict

LOCAL = PRESETS["local"]
OUT, LSE = 8 * 128 * 4, 8 * 4  # one float32 state: B=1, H=8, D=128


def slow_inter(c=LOCAL):
    return replace(c, name="slow-inter", inter_alpha=2e-3, inter_beta=10e6)


# --- formulas ------------------------------------------------------------------------------


@pytest.mark.parametrize("f", [F.allreduce_ring, F.allreduce_tree, F.allgather_ring, F.allgather_recursive_doubling])
def test_formulas_monotone_in_size_and_p(f):
    sizes, ps = [1e2, 1e4, 1e6], [2, 3, 4, 8, 64]
    for p in ps:
        t = [f(n, p, 1e-5, 1e9) for n in sizes]
        assert all(a < b for a, b in zip(t, t[1:], strict=False))
    for n in sizes:
        t = [f(n, p, 1e-5, 1e9) for p in ps]
        assert all(a <= b for a, b in zip(t, t[1:], strict=False)) and t[0] < t[-1]
    assert f(1e6, 1, 1e-5, 1e9) == 0.0


def test_seed_paper_volume_eq14():
    # eq. 14: V_tree = 2 (p-1)/p numel, numel = bd + 2 b n_h; with alpha = 0 and beta = 1 B/s the
    # ring all-reduce's time is its bytes
    b, d, nh, p = 2, 1024, 8, 8
    numel = b * d + 2 * b * nh
    assert F.allreduce_ring(numel, p, 0.0, 1.0) == pytest.approx(2 * (p - 1) / p * numel)


def test_ring_pass_overlap():
    assert F.ring_pass(4, 2.0, 1.0, True) == 1 + 3 * 2
    assert F.ring_pass(4, 2.0, 1.0) == 1 + 3 * 2 + 1


# --- profiles ------------------------------------------------------------------------------


def test_profile_round_trip(tmp_path):
    c = replace(slow_inter(), p2p_alpha=None, device_mem=24e9, notes="test")
    path = save_profile(tmp_path / "sub" / "p.json", c, fit={"n_rows": 3})
    prof = load_profile(path)
    assert prof.cluster == c and prof.fit == {"n_rows": 3}
    doc = json.loads(path.read_text())
    assert doc["format_version"] == 1 and doc["levels"]["inter"] == {"alpha": 2e-3, "beta": 10e6}
    assert doc["attention"]["efficiency"] == c.attn_efficiency
    assert doc["fitted_on"]["hostname"] and "cpu" in doc["fitted_on"] and "git_commit" in doc["fitted_on"]
    assert str(path) in prof.describe()
    assert resolve(str(path))[0] == c and resolve(prof)[0] == c and resolve(c)[0] == c


def _write(tmp_path, doc) -> str:
    p = tmp_path / "bad.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d["levels"]["inter"].pop("beta"), "levels.inter.beta"),
        (lambda d: d["levels"].pop("intra"), "levels.intra.alpha"),
        (lambda d: d["levels"]["intra"].update(beta=-1), "levels.intra.beta"),
        (lambda d: d["levels"]["intra"].update(alpha="fast"), "levels.intra.alpha"),
        (lambda d: d["attention"].update(efficiency=None), "attention.efficiency"),
        (lambda d: d["topology"].update(nodes=0.5), "topology.nodes"),
        (lambda d: d["algorithms"].update(allreduce="magic"), "algorithms.allreduce"),
        (lambda d: d.update(format_version=99), "format_version"),
        (lambda d: d.pop("format"), "format"),
        (lambda d: d.update(name=""), "name"),
    ],
)
def test_malformed_profile_names_file_and_field(tmp_path, edit, field):
    doc = to_dict(LOCAL)
    edit(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(ProfileError, match=rf"{path}.*'{field}'"):
        load_profile(path)


def test_absent_or_unparsable_profile(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ProfileError, match=rf"{missing}: cannot read"):
        load_profile(missing)
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(_write(tmp_path, "{"))
    with pytest.raises(ProfileError, match="JSON object"):
        load_profile(_write(tmp_path, "[1]"))
    monkeypatch.setenv("TREEATTN_PROFILE", missing)
    with pytest.raises(ProfileError, match=missing):
        resolve()
    with pytest.raises(TypeError):
        resolve(3)


def test_env_var_and_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("TREEATTN_PROFILE", raising=False)
    assert resolve() == (LOCAL, "built-in preset 'local'")
    assert resolve(backend="nccl")[0] is PRESETS["dgx-h100"]
    path = save_profile(tmp_path / "p.json", slow_inter())
    monkeypatch.setenv("TREEATTN_PROFILE", str(path))
    c, desc = resolve()
    assert c == slow_inter() and "TREEATTN_PROFILE" in desc
    save_profile(path, replace(slow_inter(), inter_beta=20e6))  # changed file: re-read
    assert resolve()[0].inter_beta == 20e6


# --- the choice of auto ----------------------------------------------------------------------


def test_auto_picks_hierarchical_when_inter_node_is_slow(tmp_path):
    path = save_profile(tmp_path / "slow.json", slow_inter())
    for p, r in ((4, 2), (8, 2), (8, 4), (16, 4)):
        assert choose_strategy(OUT, LSE, p, Topology(r), profile=str(path)) == "hierarchical"
        if p == 4:  # built-in local, one fast link: 2 calls cost more than 1 call with 2 more steps
            assert choose_strategy(OUT, LSE, p, Topology(r)) == "allgather"
        costs = strategy_costs(OUT, LSE, p, Topology(r), profile=str(path))
        assert costs["hierarchical"] < min(v for k, v in costs.items() if k != "hierarchical")
    # one node (or no topology): nothing crosses the slow link
    assert choose_strategy(OUT, LSE, 4, None, profile=str(path)) == choose(LOCAL, OUT, LSE, 4)
    # unequal nodes: hierarchical is impossible, never picked
    assert strategy_costs(OUT, LSE, 6, Topology(4), profile=str(path))["hierarchical"] == float("inf")
    assert choose_strategy(OUT, LSE, 6, Topology(4), profile=str(path)) != "hierarchical"


def test_linkmodel_overrides_still_work():
    slow = LinkModel(inter_alpha=2e-3, inter_beta=10e6)
    assert choose_strategy(OUT, LSE, 8, Topology(2), slow) == "hierarchical"
    assert strategy_costs(OUT, LSE, 1) == dict.fromkeys(("allreduce3", "allreduce2", "allgather", "hierarchical"), 0.0)


def test_tree_decode_single_process_profile_errors(tmp_path):
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    good = save_profile(tmp_path / "ok.json", slow_inter())
    ref = treeattn.tree_decode(q, k, v)
    assert torch.equal(treeattn.tree_decode(q, k, v, profile=str(good)), ref)
    assert torch.equal(treeattn.tree_decode(q, k, v, profile=slow_inter()), ref)
    bad = _write(tmp_path, {"format": "treeattn-cost-profile", "format_version": 1})
    with pytest.raises(ValueError, match=rf"{bad}.*'levels.intra.alpha'"):
        treeattn.tree_decode(q, k, v, profile=bad)
    assert isinstance(Profile(LOCAL).describe(), str)


# --- treeattn simulate --calibrate --profile-out / --profile ---------------------------------


def test_simulate_writes_and_reads_a_profile(tmp_path, capsys):
    from treeattn.cli import build_parser
    from treeattn.cost import predict

    truth = replace(LOCAL, compute_slots=2, collective_alpha=150e-6, intra_beta=1.5e9, attn_efficiency=0.7)
    rows = [
        {"method": m, "p": p, "seq": s, "batch": b, "heads": 16, "kv_heads": 16, "dim": 64, "dtype": "float32"}
        | {"median_s": predict(truth, p, s, b, 16, 16, 64, 4, m.removeprefix("tree "))}
        for m in ("local", "tree allgather", "tree allreduce2", "ring")
        for p in (2, 4)
        for s in (4096, 65536)
        for b in (1, 32)
    ]
    (tmp_path / "lat.json").write_text(json.dumps({"rows": rows}))
    prof = tmp_path / "prof.json"
    parser = build_parser()
    a = parser.parse_args(["simulate", "--preset", "local", "--calibrate", str(tmp_path / "lat.json")]
                          + ["--profile-out", str(prof), "--p", "2", "--seq", "4096"])  # fmt: skip
    assert a.func(a) == 0
    c = load_profile(prof).cluster
    assert c.collective_alpha == pytest.approx(150e-6, rel=0.05) and c.intra_beta == pytest.approx(1.5e9, rel=0.05)
    assert json.loads(prof.read_text())["fit"]["n_rows"] == len(rows)
    a = parser.parse_args(["simulate", "--profile", str(prof), "--p", "2", "4", "--seq", "4096"])
    assert a.func(a) == 0
    assert str(prof) in capsys.readouterr().out
    a = parser.parse_args(["simulate", "--profile", str(tmp_path / "none.json")])
    assert a.func(a) == 2 and "none.json" in capsys.readouterr().err
