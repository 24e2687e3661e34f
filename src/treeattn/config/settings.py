"""A run's settings as typed values: frozen, checked when made (``ValueError`` naming the field),
each field's default, range and help written once (the command lines are generated from them:
:func:`treeattn.config.add_arguments`), and agreed across ranks by a digest of every field
(:func:`treeattn.comm.validate.agree`)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import setting, validate_fields

ATTENTIONS: tuple[str, ...] = ("tree", "ring")
PREFILLS: tuple[str, ...] = ("auto", "tree", "ring")
PLACEMENTS: tuple[str, ...] = ("contiguous", "interleaved")
STRATEGIES: tuple[str, ...] = ("auto", "allreduce3", "allreduce2", "allgather", "hierarchical")
SPECULATE: tuple[str, ...] = ("prompt-lookup", "draft")


class _Settings:
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first field out of its type, choices or range (run when made)."""
        validate_fields(self)


@dataclass(frozen=True)
class Layout(_Settings):
    """How the sequence is spread over the ranks and attended across them."""

    placement: str = setting("interleaved", "KV placement: token i on rank (i // block) % p (interleaved), or the "
                             "first prompt split in p contiguous parts (contiguous)", choices=PLACEMENTS)  # fmt: skip
    block: int | None = setting(None, "tokens per placement block of the KV cache (default: by the first prompt's "
                                "length, up to 256)", low=1)  # fmt: skip
    attention: str = setting("tree", "decoding by Tree or Ring Attention", choices=ATTENTIONS)
    strategy: str = setting("auto", "how Tree decoding reduces the ranks' states (default auto: the cost model "
                            "picks)", choices=STRATEGIES)  # fmt: skip
    prefill: str = setting("auto", "how prompts are prefilled across ranks: queries gathered (tree), K/V passed "
                           "around (ring), or per chunk the one moving fewer bytes (auto)", choices=PREFILLS)  # fmt: skip
    prefill_chunk: int | None = setting(1024, "prompt tokens per rank run through the model at a time (None, on the "
                                        "command line 0: a whole prompt at once)", low=1, zero_is_none=True)  # fmt: skip
    cuda_graph: bool = setting(False, "on one CUDA rank: each decode step as a replayed CUDA graph (the same tokens, "
                               "less host time; ignored otherwise)")  # fmt: skip


@dataclass(frozen=True)
class Sampling(_Settings):
    """The next-token rule: greedy, or a draw through transformers' warpers in its order
    (temperature, top-k, top-p, min-p, typical-p, eta) from one generator seeded with ``seed``."""

    do_sample: bool = setting(False, "sample instead of greedy", flag="--sample")
    temperature: float = setting(1.0, "with --sample: the softmax temperature (0: greedy, as in OpenAI's API)", low=0)
    top_k: int | None = setting(None, "sample from the k likeliest tokens (None or 0: off); with "
                                "--penalty-alpha: the contrastive candidates", low=0, zero_is_none=True)  # fmt: skip
    top_p: float | None = setting(None, "with --sample: nucleus sampling, in (0, 1]", low=0, high=1, open_low=True)
    min_p: float | None = setting(None, "with --sample: min-p sampling, in [0, 1] (None or 0: off)", low=0, high=1)
    typical_p: float | None = setting(None, "with --sample: typical sampling, in (0, 1]", low=0, high=1,
                                      open_low=True)  # fmt: skip
    eta_cutoff: float | None = setting(None, "with --sample: eta sampling's cutoff, in [0, 1) (None or 0: "
                                       "off)", low=0, high=1, open_high=True,
                                       zero_is_none=True)  # fmt: skip
    seed: int = setting(0, "the sampling generator's seed", cli=False)


@dataclass(frozen=True)
class Speculation(_Settings):
    """Speculative decoding: who drafts (None: nobody), how deep, how wide (the fields are
    :func:`treeattn.decoding.generate`'s keywords)."""

    speculate: str | None = setting(None, "speculative decoding: drafts from earlier n-grams (prompt-lookup) or a "
                                 "--draft-model, verified in one forward per step (greedy output unchanged, "
                                 "sampling lossless)", choices=SPECULATE)  # fmt: skip
    num_draft_tokens: int = setting(5, "drafted tokens per branch", low=1)
    tree_width: int = setting(1, "draft branches verified together as a token tree (1: a chain)", low=1)
    adaptive_draft: bool = setting(True, "always draft --num-draft-tokens deep (default: as deep as measured step costs and "
                             "acceptance make worth it, none when no draft pays)", flag="--fixed-draft",
                             invert=True)  # fmt: skip


@dataclass(frozen=True)
class Serving(_Settings):
    """What ``treeattn serve``'s ranks run with (the HTTP side's options are rank 0's alone)."""

    cache_tokens: int = setting(32768, "KV tokens per rank the prefix cache may hold, the running requests included "
                                "(a shared prefix counts once); least recently used prefixes no running request "
                                "reads go first (0: no prefix cache)", low=0)  # fmt: skip
    max_batch: int = setting(8, "requests that run at once, batched into one forward per step (1: one at a time)",
                             low=1)  # fmt: skip
    max_num_batched_tokens: int | None = setting(None, "tokens one step runs in all (vLLM's flag): a new prompt's "
                                                 "chunk takes what the step's decoding and joining requests leave, "
                                                 "one token per rank at least (default: --prefill-chunk per rank, "
                                                 "whatever the others run)", low=1)  # fmt: skip
    draft_cache_tokens: int | None = setting(None, "with --draft-model: tokens its KV caches may hold in all on rank "
                                             "0, idle ones kept for later requests (default: --cache-tokens times "
                                             "the ranks, or 32768 per rank without a prefix cache)", low=1)  # fmt: skip
