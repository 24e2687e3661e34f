"""`treeattn generate` refuses bad input with one clear line (exit code 2) before any rank
starts: missing or unreadable model files, hub ids that cannot be reached, prompts too long
for the model, empty prompt files, options that need each other."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from treeattn.cli import main  # noqa: E402


def _run(capsys, *args) -> str:
    code = main(["generate", "--nproc", "2", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    # status lines (e.g. "converting ...") may precede it; the error is the last line
    assert "Traceback" not in err and err.splitlines()[-1].startswith("treeattn generate: "), err
    return err


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A tiny Llama with only 64 positions, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("short")
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_missing_model_file(capsys, tmp_path):
    err = _run(capsys, "--model", str(tmp_path / "nope" / "model.gguf"), "--prompt-ids", "1,2")
    assert "no such file or directory" in err and "model.gguf" in err


def test_directory_without_a_model(capsys, tmp_path):
    assert "no config.json" in _run(capsys, "--model", str(tmp_path), "--prompt-ids", "1,2")


def test_pickled_weights_only_are_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert "safetensors" in _run(capsys, "--model", str(tmp_path), "--prompt-ids", "1,2")


def test_not_a_gguf_file(capsys, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"this is not a gguf file at all")
    assert "not a GGUF file" in _run(capsys, "--model", str(f), "--prompt-ids", "1,2")


def test_truncated_gguf_file(capsys, monkeypatch, tmp_path):
    pytest.importorskip("gguf")
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 9)  # the magic, then nothing usable
    cache = tmp_path / "cache"
    monkeypatch.setenv("TREEATTN_CACHE_DIR", str(cache))
    err = _run(capsys, "--model", str(f), "--prompt-ids", "1,2")
    assert "could not read this GGUF file" in err and "broken.gguf" in err
    assert not list((cache / "gguf").glob("broken-*")), "a failed conversion left a cache entry"


def test_unknown_hub_id_offline(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    err = _run(capsys, "--model", "nobody-treeattn/no-such-model", "--prompt-ids", "1,2")
    assert "nobody-treeattn/no-such-model" in err and "HF_HUB_OFFLINE" in err and "--model DIR" in err


def test_unknown_hub_id_unreachable(capsys, monkeypatch, tmp_path):
    # this machine has no route to the hub: the download fails fast, never hangs
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    err = _run(capsys, "--model", "nobody-treeattn/no-such-model", "--prompt-ids", "1,2")
    assert "nobody-treeattn/no-such-model" in err and "--model DIR" in err


def test_prompt_longer_than_max_positions(capsys, short_model):
    err = _run(capsys, "--model", str(short_model), "--prompt-len", "100")
    assert "100 tokens" in err and "64 positions" in err


def test_prompt_ids_outside_vocabulary(capsys, short_model):
    assert "vocabulary" in _run(capsys, "--model", str(short_model), "--prompt-ids", "5,100")


def test_empty_prompt_file(capsys, tmp_path, short_model):
    f = tmp_path / "empty.txt"
    f.write_text("  \n")
    assert "is empty" in _run(capsys, "--model", str(short_model), "--prompt-file", str(f))


def test_missing_prompt_file(capsys, tmp_path, short_model):
    assert "no such file" in _run(capsys, "--model", str(short_model), "--prompt-file", str(tmp_path / "x.txt"))


def test_prompt_text_without_tokenizer(capsys, short_model):
    assert "tokenizer" in _run(capsys, "--model", str(short_model), "--prompt", "hello")


def test_empty_prompt_ids(capsys):
    assert "--prompt-ids must be comma-separated integers, got ''" in _run(capsys, "--prompt-ids", "")


def test_temperature_0_samples_greedily():
    """``--sample --temperature 0`` is greedy decoding (as the server and OpenAI's API), so
    ``--compare-single`` may check it."""
    from treeattn.cli import build_parser
    from treeattn.cli.generate import prepare

    a = build_parser().parse_args(["generate", "--preset", "tiny-llama", "--prompt-ids", "1,2", "--sample",
                                   "--temperature", "0", "--compare-single"])  # fmt: skip
    prepare(a)
    assert a.do_sample is False
    a = build_parser().parse_args(["generate", "--preset", "tiny-llama", "--prompt-ids", "1,2", "--sample"])
    prepare(a)
    assert a.do_sample is True


def test_system_needs_chat(capsys):
    assert "--system needs --chat" in _run(capsys, "--system", "be brief", "--prompt-ids", "1,2")


def test_model_that_does_not_fit(capsys, monkeypatch):
    import treeattn.hf.models as models

    monkeypatch.setattr(models, "available_memory", lambda: 1 << 20)  # a host with 1 MiB free
    err = _run(capsys, "--preset", "tiny-llama", "--prompt-len", "64")
    assert "does not fit" in err and "GiB per rank" in err


def test_compare_single_refuses_sampling(capsys):
    err = _run(capsys, "--preset", "tiny-llama", "--sample", "--compare-single", "--max-new-tokens", "2")
    assert "--compare-single checks greedy decoding" in err


@pytest.mark.parametrize(
    "cmd,args,text",
    [
        ("generate", ["--nproc", "0"], "--nproc: must be >= 1, got 0"),
        ("generate", ["--nproc", "-1"], "--nproc: must be >= 1, got -1"),
        ("generate", ["--prefill-chunk", "-5"], "--prefill-chunk: must be an int >= 1 (or 0: off), got -5"),
        ("generate", ["--strategy", "bogus"], "--strategy: invalid choice: 'bogus'"),
        ("generate", ["--prefill", "ulysses"], "--prefill: invalid choice: 'ulysses'"),
        ("serve", ["--prefill", "bogus"], "--prefill: invalid choice: 'bogus'"),
        ("serve", ["--port", "-1"], "--port: must be >= 0, got -1"),
        ("generate", ["--threads", "x"], "--threads: not an integer: 'x'"),
        ("generate", ["--temperature", "-0.5"], "--temperature: must be a finite number >= 0, got -0.5"),
        ("generate", ["--temperature", "nan"], "--temperature: must be a finite number >= 0, got nan"),
        ("generate", ["--top-p", "1.5"], "--top-p: must be a finite number in (0, 1], got 1.5"),
        ("generate", ["--top-p", "0"], "--top-p: must be a finite number in (0, 1], got 0"),
        ("generate", ["--typical-p", "2"], "--typical-p: must be a finite number in (0, 1], got 2"),
        ("generate", ["--eta-cutoff", "1"], "--eta-cutoff: must be a finite number in [0, 1) (or 0: off), got 1"),
        ("serve", ["--max-batch", "0"], "--max-batch: must be an int >= 1, got 0"),
        ("serve", ["--num-draft-tokens", "16"], "--num-draft-tokens: must be <= 15, got 16"),
        ("generate", ["--timeout", "0"], "--timeout: must be a finite number > 0, got 0"),
        ("generate", ["--collective-timeout", "0"], "--collective-timeout: must be a finite number > 0, got 0"),
        ("serve", ["--collective-timeout", "-1"], "--collective-timeout: must be a finite number > 0, got -1"),
        ("demo", ["--nproc", "0"], "--nproc: must be >= 1, got 0"),
        ("demo", ["--seq", "0"], "--seq: must be >= 1, got 0"),
        ("demo", ["--timeout", "0"], "--timeout: must be a finite number > 0, got 0"),
        ("merge-demo", ["--nproc", "0"], "--nproc: must be >= 1, got 0"),
    ],
)
def test_bad_numbers_exit_2_with_one_line(capsys, cmd, args, text):
    """argparse's usage error (exit 2), not a traceback from inside a rank."""
    with pytest.raises(SystemExit) as e:
        main([cmd, *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and text in err and "Traceback" not in err, err


@pytest.mark.parametrize("cmd", ["demo", "merge-demo"])
def test_kv_heads_must_divide_heads(capsys, cmd):
    assert main([cmd, "--heads", "8", "--kv-heads", "3", "--seq", "64"]) == 2
    assert "--kv-heads 3 must divide --heads 8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,text",
    [
        (["--speculate", "draft"], "--speculate draft needs --draft-model"),
        (["--draft-model", "tiny-llama"], "--draft-model is used by --speculate draft only"),
        (["--speculate", "draft", "--draft-model", "small-llama"], "its vocabulary (4,096 tokens) differs"),
        (["--speculate", "prompt-lookup", "--batch", "2"], "--speculate decodes one sequence (batch 1)"),
        (["--speculate", "draft", "--draft-model", "/nonexistent/draft.gguf"], "--draft-model /nonexistent"),
        (["--penalty-alpha", "0.6"], "--penalty-alpha (contrastive search) needs --top-k >= 2"),
        (["--penalty-alpha", "1.5", "--top-k", "4"], "--penalty-alpha must lie in (0, 1], got 1.5"),
        (["--penalty-alpha", "0.6", "--top-k", "4", "--sample"], "contrastive search) is its own method"),
        (["--penalty-alpha", "0.6", "--top-k", "4", "--batch", "2"], "--penalty-alpha decodes one sequence"),
    ],
)
def test_speculate_bad_options(capsys, args, text):
    err = _run(capsys, "--preset", "tiny-llama", "--prompt-len", "8", *args)
    assert text in err, err


@pytest.mark.parametrize("flag", ["--num-draft-tokens", "--tree-width"])
def test_speculate_numbers_are_checked_by_argparse(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", flag, "0"])
    assert e.value.code == 2 and f"argument {flag}: must be an int >= 1, got 0" in capsys.readouterr().err
