"""What the grader needs to know about each lab: its cells, its graded names, what is off limits.

A lab notebook carries its number in its metadata (``metadata.nanolab.lab``), put there in
``solutions/`` and kept by ``make labs``. The cells are found by their nbgrader ``grade_id``: the
*setup* cells (locked imports and helpers the graded code may use) and the *graded* cells (where the
learner writes code), which are the only cells the grader runs. Visible check cells and experiment
cells never run during grading.

The reference modules a lab mirrors are blocked inside the sandbox while that lab is graded, so a
learner's `Tokenizer` that is really ``nanolab.Tokenizer`` fails loudly instead of scoring.

Adding a lab starts here, with its `LabSpec` in `LABS`; ``autograder/README.md`` lists the other places.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from autograder.sandbox.limits import DEFAULT_MEMORY_MB


@dataclass(frozen=True)
class LabSpec:
    """One lab, as the grader sees it."""

    number: int
    name: str  # short name: "tokenizer"
    title: str  # "Lab 1: Tokenizer"
    notebook: str  # file name in labs/ and solutions/
    setup_cells: tuple[str, ...]  # grade_ids of locked cells the graded code needs, in order
    graded_cells: MappingProxyType  # grade_id -> names that cell must define (learner's own code)
    blocked_modules: MappingProxyType  # module -> why graded code may not import it
    preload: tuple[str, ...] = ()  # imported in the sandbox before limits apply (speed, address space)
    # Third-party packages graded code may import besides the preloads. The sandbox's file system holds
    # these, the preloads and their dependencies, and no other package (autograder.sandbox.isolation).
    packages: tuple[str, ...] = ()
    # Sandbox address space on top of the interpreter and the preloads. Raise it only for a lab that
    # truly needs more, with the reason in a comment.
    memory_mb: int = DEFAULT_MEMORY_MB
    # Imported by the grading worker, with the preloads, before its own memory cap is set
    # (autograder.grading.grade): the big modules the lab's hidden tests import, nanolab's engine importing torch.
    # The cap then bounds what grading maps, not the size of the torch build (a CUDA build maps about 3 GB on import).
    grader_preload: tuple[str, ...] = ("torch", "numpy")

    @property
    def graded_names(self) -> tuple[str, ...]:
        return tuple(name for names in self.graded_cells.values() for name in names)

    @property
    def test_prefix(self) -> str:
        """Hidden test modules for this lab are ``test_labNN*.py``."""
        return f"test_lab{self.number:02d}"

    def cell_of(self, name: str) -> str | None:
        """The grade_id of the graded cell that defines ``name``."""
        return next((cell for cell, names in self.graded_cells.items() if name in names), None)


_OWN_CODE = "the grader grades the code you write in the notebook, not the reference implementation"

LABS: dict[int, LabSpec] = {
    1: LabSpec(
        number=1,
        name="tokenizer",
        title="Lab 1: Tokenizer",
        notebook="lab01_tokenizer.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "pair-counts": ("pair_counts",),
                "merge": ("merge",),
                "train-merges": ("train_merges",),
                "bpe-encode": ("bpe_encode",),
                "tokenizer": ("Tokenizer",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "tiktoken": "your BPE must be your own (the notebook uses tiktoken only to check it)",
                "tokenizers": "your BPE must be your own",
                "transformers": "your BPE must be your own",
                "sentencepiece": "your BPE must be your own",
            }
        ),
        preload=("regex",),
        grader_preload=(),  # the tokenizer's tests import no torch
    ),
    2: LabSpec(
        number=2,
        name="attention",
        title="Lab 2: Attention and the KV cache",
        notebook="lab02_attention_kv_cache.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "causal-attention": ("causal_attention",),
                "kv-cache": ("ContiguousKVCache",),
                "kv-bytes": ("kv_cache_bytes",),
                "top-k": ("apply_top_k",),
                "top-p": ("apply_top_p",),
                "filter-logits": ("filter_logits",),
                "sample": ("sample",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "transformers": "your attention and sampling must be your own",
                "vllm": "your attention and sampling must be your own",
            }
        ),
        # The models run in the grader: the sandbox gets each layer's q, k, v and sends back the
        # attention, so it needs torch (preloaded: importing it maps a lot of address space) but holds
        # only small tensors. The solution passes with 256 MB on top of torch; 2048 (twice the default)
        # leaves room for correct code that materialises more (full score matrices, float64 copies).
        preload=("torch", "numpy"),
        memory_mb=2048,
    ),
    3: LabSpec(
        number=3,
        name="paged-kv",
        title="Lab 3: Paged KV memory",
        notebook="lab03_paged_kv.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "simulate": ("simulate",),
                "block-allocator": ("BlockAllocator",),
                "slots": ("slot_of", "slot_mapping"),
                "block-manager": ("BlockManager",),
                "paged-kv-cache": ("PagedKVCache",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "vllm": "your allocator and paged attention must be your own",
            }
        ),
        # The models run in the grader; the sandbox holds the learner's pools (a few MB) and gets each
        # layer's q, k, v. torch is preloaded because importing it maps a lot of address space.
        preload=("torch", "numpy"),
    ),
    4: LabSpec(
        number=4,
        name="schedulers",
        title="Lab 4: Schedulers",
        notebook="lab04_schedulers.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "transitions": ("admit", "preempt", "finish"),
                "batching": ("simulate_batching",),
                "policies": ("waiting_order",),
                "victim": ("choose_victim",),
                "scheduler": ("Scheduler",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "vllm": "your scheduler must be your own",
            }
        ),
        # Pure Python: the models run in the grader, which replays the scheduler's decisions.
    ),
    5: LabSpec(
        number=5,
        name="chunked-prefill",
        title="Lab 5: Chunked prefill",
        notebook="lab05_chunked_prefill.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "chunk-mask": ("chunk_mask",),
                "plan-prefill": ("plan_prefill",),
                "scheduler": ("Scheduler",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "vllm": "your scheduler must be your own",
            }
        ),
        # chunk_mask returns a torch tensor (a few KB); the models run in the grader, which prefills with
        # the learner's masks and replays the scheduler's decisions. torch is preloaded because importing
        # it maps a lot of address space; numpy carries tensors across.
        preload=("torch", "numpy"),
    ),
    6: LabSpec(
        number=6,
        name="radix-cache",
        title="Lab 6: The radix prefix cache",
        notebook="lab06_radix_cache.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "reusable-prefix": ("reusable_prefix",),
                "radix-cache": ("RadixCache",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "sglang": "your radix cache must be your own",
                "vllm": "your prefix cache must be your own",
            }
        ),
        # Pure Python: the models run in the grader, whose engine calls the learner's cache and allocator
        # in the sandbox.
    ),
    7: LabSpec(
        number=7,
        name="engine",
        title="Lab 7: The engine loop",
        notebook="lab07_engine.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "layout-batch": ("layout_batch",),
                "stop-rules": ("check_stop", "held_back"),
                "detokenizer": ("IncrementalDetokenizer",),
                "engine": ("Engine",),
                "static": ("generate_static",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "vllm": "your engine must be your own",
                "sglang": "your engine must be your own",
            }
        ),
        # Pure Python: the setup cell's toy parts (a scheduler, a block manager and a model runner whose
        # "model" reads every sequence back through its block table) stand in for the model, in the sandbox.
    ),
    8: LabSpec(
        number=8,
        name="serving",
        title="Lab 8: Serving it",
        notebook="lab08_serving.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "validate": ("parse_completion_request",),
                "validate-chat": ("parse_chat_request",),
                "sse": ("completion_events",),
                "sse-chat": ("chat_events",),
                "engine-loop": ("EngineLoop",),
                "admission": ("Admission",),
                "metrics": ("observe_output", "observe_stats"),
                "quantile": ("histogram_quantile",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "vllm": "your server must be your own",
                "sglang": "your server must be your own",
                "fastapi": "the graded pieces need no web framework: the standard library is enough",
                "pydantic": "validate the body yourself: that is the exercise",
            }
        ),
        # Pure Python: the setup cell's toy engine stands in for the model, in the sandbox; the HTTP server
        # runs in the grader (test_lab08_server.py) and in the notebook's experiments. prometheus_client:
        # the setup's MetricSet, which the learner's accounting writes into.
        packages=("prometheus_client",),
    ),
    9: LabSpec(
        number=9,
        name="speculative-decoding",
        title="Lab 9: Speculative decoding",
        notebook="lab09_speculative_decoding.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "propose-ngram": ("propose_ngram",),
                "verify-greedy": ("verify_greedy",),
                "rejection-sample": ("rejection_sample",),
                "rollback": ("rollback",),
                "expected-tokens": ("expected_tokens_per_step",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "vllm": "your speculative decoding must be your own",
                "sglang": "your speculative decoding must be your own",
                "transformers": "your speculative decoding must be your own",
            }
        ),
        # The models run in the grader, whose engine calls the learner's proposer, verification, sampler
        # and rollback (over the setup's KVPool, the engine's allocator) in the sandbox. The sampler works on
        # small torch tensors: torch is preloaded because importing it maps a lot of address space; numpy
        # carries arrays across.
        preload=("torch", "numpy"),
    ),
    10: LabSpec(
        number=10,
        name="tensor-parallel",
        title="Lab 10: Tensor parallelism",
        notebook="lab10_tensor_parallel.ipynb",
        setup_cells=("setup",),
        graded_cells=MappingProxyType(
            {
                "split-linear": ("column_shard", "row_shard"),
                "heads": ("head_ranges",),
                "fused": ("qkv_shard", "gate_up_shard"),
                "mlp": ("mlp_forward",),
                "attention": ("attention_forward",),
            }
        ),
        blocked_modules=MappingProxyType(
            {
                "nanolab": _OWN_CODE,
                "autograder": "graded code may not use the grader",
                "vllm": "your tensor parallelism must be your own",
                "sglang": "your tensor parallelism must be your own",
                "megatron": "your tensor parallelism must be your own",
                "transformers": "your tensor parallelism must be your own",
            }
        ),
        # The models run in the grader, which cuts their weights with the learner's functions and runs each
        # layer's sharded attention and MLP in the sandbox: every rank a thread of the setup's run_ranks,
        # joined by its LocalGroup. torch is preloaded because importing it maps a lot of address space.
        preload=("torch", "numpy"),
    ),
}


def lab_spec(number: int) -> LabSpec:
    """The spec of lab ``number``; ValueError naming the known labs otherwise."""
    if number not in LABS:
        known = ", ".join(f"{n} ({spec.name})" for n, spec in sorted(LABS.items()))
        raise ValueError(f"there is no lab {number} to grade; known labs: {known}")
    return LABS[number]
