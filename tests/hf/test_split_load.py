"""A checkpoint loaded straight into its split (treeattn.hf.load_split): at p = 2 and 3, from one
safetensors file and from a sharded checkpoint with its index, tied and untied output
embeddings, with biases, the attention heads whole and split (tpa 2 at p = 2); every parameter bitwise what loading the whole model and splitting it
gives, each rank reading only its shards (the bytes read counted; the embeddings and the head
by vocabulary rows), greedy tokens identical to
single-process transformers; a checkpoint without a tensor refused naming it; and the
``generate`` CLI from a directory with ``--tp 2`` against its single-process check."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from treeattn.launch import launch  # noqa: E402


def _save(tmp, preset: str, shard: str | None, tie: bool) -> str:
    from transformers import AutoModelForCausalLM

    from treeattn.hf.presets import preset_config

    cfg = preset_config(preset)
    cfg.tie_word_embeddings = tie
    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = f"{tmp}/{preset}-{shard}-{tie}"
    m.save_pretrained(d, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    return d


def split_worker(dirs: list[str], broken: str) -> None:
    from treeattn.decoding import generate
    from treeattn.hf import load_split
    from treeattn.hf import split_load as sl
    from treeattn.hf.models import load_model
    from treeattn.hf.tensor_parallel import tensor_parallel, tensor_parallel_ranks

    p = dist.get_world_size()
    read = [0]
    real = sl.open_checkpoint

    class Counting:  # open_checkpoint, counting the bytes of every tensor it hands out
        def __init__(self, *a, **k):
            self.h = real(*a, **k)

        def __enter__(self):
            self.h.__enter__()
            return self

        def __exit__(self, *e):
            return self.h.__exit__(*e)

        def keys(self):
            return self.h.keys()

        def get_tensor(self, k):
            t = self.h.get_tensor(k)
            read[0] += t.numel() * t.element_size()
            return t

        def get_slice(self, k):
            s = self.h.get_slice(k)

            class Sl:
                def __getitem__(_, i):
                    t = s[i]
                    read[0] += t.numel() * t.element_size()
                    return t

            return Sl()

    sl.open_checkpoint = Counting
    for d, tpa in [(d, t) for d in dirs for t in (1, 2) if p % t == 0]:  # tpa 2: the heads split too
        read[0] = 0
        m, _ = load_split(d, tpa=tpa)
        ref = tensor_parallel(load_model(d)[0], tpa=tpa)
        assert tensor_parallel_ranks(m) == p
        mine = dict(m.named_parameters(remove_duplicate=False))
        want = dict(ref.named_parameters(remove_duplicate=False))
        assert mine.keys() == want.keys(), mine.keys() ^ want.keys()
        for k, t in mine.items():
            assert t.dtype == want[k].dtype and torch.equal(t, want[k]), f"{d}: {k}"
        tied = m.config.tie_word_embeddings
        assert (m.lm_head.inner.weight is m.model.embed_tokens.weight) == tied, d  # this rank's rows of both
        V = m.config.vocab_size
        assert m.model.embed_tokens.weight.shape[0] <= -(-V // (64 * p)) * 64 < V, m.model.embed_tokens
        held = sum(t.numel() * t.element_size() for t in m.parameters())  # each tensor once
        whole = sum(t.numel() * t.element_size() for t in load_model(d)[0].parameters())
        assert read[0] == held < whole, (d, read[0], held, whole)  # only this rank's shards were read
        ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(5))
        w = load_model(d)[0]
        out = generate(m, ids, max_new_tokens=8, stop_at_eos=False)
        ref_out = w.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[:, 40:]  # fmt: skip
        assert torch.equal(out, ref_out), f"{d} tpa={tpa}: {out.tolist()} != {ref_out.tolist()}"
    with pytest.raises(ValueError, match="the checkpoint has no tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_split(broken)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("ckpt")
    dirs = [_save(tmp, "tiny-llama", None, True), _save(tmp, "tiny-qwen2", "300KB", False)]
    broken = _save(tmp, "tiny-llama", None, False)
    sd = load_file(f"{broken}/model.safetensors")
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, f"{broken}/model.safetensors", metadata={"format": "pt"})
    return dirs, broken


@pytest.mark.parametrize("p", [2, 3])
def test_load_split_reads_only_the_shards(p, checkpoints):
    dirs, broken = checkpoints
    assert len(list(Path(dirs[1]).glob("*.safetensors"))) > 1  # a sharded checkpoint
    launch(split_worker, p, (dirs, broken), timeout=600)


def test_cli_generate_from_a_directory_with_tp(checkpoints):
    d = checkpoints[0][1]
    for tp in ("2", "auto"):
        r = subprocess.run(
            [sys.executable, "-m", "treeattn", "generate", "--nproc", "2", "--model", d, "--tp", tp, "--prompt-ids",
             "5,9,2,7,1,4,4,8,3,3,6", "--max-new-tokens", "6", "--compare-single"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "identical to single-process model.generate" in r.stderr, r.stderr
        if tp == "auto":
            assert re.search(r"--tp auto: [12] \(built-in preset 'local', 17 tokens over 2 ranks", r.stderr), r.stderr


def test_open_checkpoint_reads_what_safetensors_reads(tmp_path):
    """The plain-read checkpoint reader against safetensors' own: every dtype treeattn reads, whole
    tensors and their parts (rows; columns of each row; a 0-d and a 3-D tensor), and the files
    and parts it refuses, each with a message that names them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from treeattn.hf.split_load import open_checkpoint

    g = torch.Generator().manual_seed(3)
    sd = {f"w.{dt}": (torch.randn(7, 11, generator=g) * 10).to(dt)
          for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8)}  # fmt: skip
    sd |= {"flag": torch.rand(5, generator=g) > 0.5, "scalar": torch.tensor(2.5), "cube": torch.randn(4, 3, 2, generator=g),
           "empty": torch.zeros(0, 4)}  # fmt: skip
    f = tmp_path / "m.safetensors"
    save_file(sd, f, metadata={"format": "pt"})
    with safe_open(f, framework="pt") as ref, open_checkpoint(f) as c:
        assert sorted(c.keys()) == sorted(ref.keys())
        for k in ref.keys():
            t = ref.get_tensor(k)
            got = c.get_tensor(k)
            assert got.dtype == t.dtype and torch.equal(got, t), k
            parts = [(slice(1, 3),)] if t.ndim else []
            if t.ndim == 2:
                parts += [(slice(None), slice(2, 9)), (slice(3, 5), slice(0, 1)), (slice(None), slice(4, 4))]
            for ix in parts:
                assert torch.equal(c.get_slice(k)[ix], t[ix]), (k, ix)
        with pytest.raises(ValueError, match="strided"):
            c.get_slice("w.torch.float32")[(slice(0, 6, 2),)]
        with pytest.raises(ValueError, match="cannot read part"):
            c.get_slice("cube")[(slice(None), slice(0, 1))]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not a safetensors file"):
        open_checkpoint(bad)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(f.read_bytes()[:-40])
    with open_checkpoint(cut) as c, pytest.raises(ValueError, match="truncated"):
        for k in c.keys():
            c.get_tensor(k)
