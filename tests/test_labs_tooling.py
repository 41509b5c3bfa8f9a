"""The lab tooling: labs/ is generated from solutions/ deterministically, with the solutions removed,
the given cells locked and no outputs; check_notebooks catches drift; the solution notebooks run on a
real Jupyter kernel; the learner's classes have the reference's interface."""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import pytest
from grading_utils import solution_namespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_notebooks  # noqa: E402
import make_labs  # noqa: E402
import run_solutions  # noqa: E402

SOLUTIONS = make_labs.solution_notebooks()


def _nbgrader(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _by_id(nb: dict) -> dict[str, dict]:
    return {_nbgrader(c)["grade_id"]: c for c in nb["cells"] if "grade_id" in _nbgrader(c)}


def _interface(source: str) -> set[tuple[str, str, str | None]]:
    """(qualified name, signature, docstring) of every function and class in ``source``."""
    found = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = prefix + child.name
                signature = ast.unparse(child.args) if isinstance(child, ast.FunctionDef) else ""
                found.add((name, signature, ast.get_docstring(child)))
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def test_there_are_solution_notebooks():
    assert [p.name for p in SOLUTIONS] >= ["lab01_tokenizer.ipynb"]


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_generation_is_deterministic_and_labs_are_in_sync(source):
    text = make_labs.generate_lab(source)
    assert text == make_labs.generate_lab(source)
    assert (make_labs.LABS / source.name).read_text(encoding="utf-8") == text, "run `make labs`"


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_lab_hides_solutions_but_keeps_signatures_and_docstrings(source):
    solution = json.loads(source.read_text())
    lab = _by_id(json.loads((make_labs.LABS / source.name).read_text()))
    graded = [c for c in solution["cells"] if _nbgrader(c).get("solution")]
    assert graded
    for cell in graded:
        grade_id = _nbgrader(cell)["grade_id"]
        sol, blank = _source(cell), _source(lab[grade_id])
        assert "BEGIN SOLUTION" not in blank and "raise NotImplementedError()" in blank, grade_id
        region = sol.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
        assert region.strip() not in blank, f"the solution of {grade_id} leaked into the lab"
        assert _interface(sol) == _interface(blank), f"{grade_id}: signatures or docstrings differ"


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_lab_is_clean_locked_and_says_it_is_generated(source):
    nb = json.loads((make_labs.LABS / source.name).read_text())
    meta = nb["metadata"]["nanolab"]
    assert meta["lab"] == json.loads(source.read_text())["metadata"]["nanolab"]["lab"]
    assert "Do not edit" in meta["generated"] and source.name in meta["generated"]
    for cell in nb["cells"]:
        grader = _nbgrader(cell)
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
        if grader.get("locked"):
            assert cell["metadata"]["editable"] is False and cell["metadata"]["deletable"] is False
        if grader.get("solution"):
            assert cell["metadata"]["deletable"] is False and "checksum" in grader
        if grader.get("grade"):
            assert grader["points"] > 0 and _source(cell).startswith('"""Check that ')


def test_check_notebooks_passes_on_the_repository(capsys):
    assert check_notebooks.main() == 0, capsys.readouterr().err


def test_check_notebooks_reports_outputs_and_stale_labs(tmp_path, monkeypatch, capsys):
    lab = json.loads((make_labs.LABS / "lab01_tokenizer.ipynb").read_text())
    code = next(c for c in lab["cells"] if c["cell_type"] == "code")
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["hi\n"]}]
    code["execution_count"] = 3
    stale = tmp_path / "lab01_tokenizer.ipynb"
    stale.write_text(json.dumps(lab, indent=1))
    problems = check_notebooks.output_problems(stale)
    assert any("has outputs" in p for p in problems) and any("execution count" in p for p in problems)

    monkeypatch.setattr(check_notebooks, "LABS", tmp_path)
    monkeypatch.setattr(check_notebooks, "notebooks_in_git", lambda: [])
    assert check_notebooks.main() == 1
    assert "out of date" in capsys.readouterr().err


def test_check_notebooks_reports_bad_nbgrader_metadata(tmp_path):
    nb = json.loads(SOLUTIONS[0].read_text())
    del nb["metadata"]["nanolab"]
    cells = nb["cells"]
    _nbgrader(cells[2])["grade_id"] = _nbgrader(cells[1])["grade_id"]
    check = next(c for c in cells if _nbgrader(c).get("grade"))
    del _nbgrader(check)["points"]
    path = tmp_path / "broken.ipynb"
    path.write_text(json.dumps(nb))
    problems = " ".join(check_notebooks.metadata_problems(path))
    assert (
        "metadata.nanolab.lab" in problems and "grade_id also used" in problems and "needs points" in problems
    )


def _solution_namespace(name: str = "lab01_tokenizer.ipynb") -> dict:
    return solution_namespace(name)


def test_lab01_setup_patterns_are_the_reference_patterns():
    from nanolab.text.pretokenize import GPT2_PATTERN, GPT4_PATTERN

    namespace = _solution_namespace()
    assert namespace["GPT2_PATTERN"] == GPT2_PATTERN and namespace["GPT4_PATTERN"] == GPT4_PATTERN


def test_lab01_learner_functions_have_the_reference_signatures():
    from nanolab.text import bpe
    from nanolab.text.tokenizer import Tokenizer as Reference

    namespace = _solution_namespace()
    for name in ("pair_counts", "merge", "bpe_encode"):
        assert inspect.signature(namespace[name]) == inspect.signature(getattr(bpe, name)), name
    learner_train = list(inspect.signature(namespace["train_merges"]).parameters)
    assert learner_train == list(inspect.signature(bpe.train_merges).parameters)[: len(learner_train)]
    learner = namespace["Tokenizer"]
    for method in ("__init__", "train", "encode", "decode", "decode_bytes"):
        mine = list(inspect.signature(getattr(learner, method)).parameters)
        theirs = list(inspect.signature(getattr(Reference, method)).parameters)
        assert mine == theirs[: len(mine)], method
    tok = learner.train("the cat sat on the mat " * 20, 265, special_tokens=["<|endoftext|>"])
    reference = Reference.train("the cat sat on the mat " * 20, 265, special_tokens=["<|endoftext|>"])
    for attribute in ("vocab_size", "special_tokens", "eos_token_id"):
        assert getattr(tok, attribute) == getattr(reference, attribute), attribute
    assert tuple(tok.merges) == reference.merges


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_solution_notebook_runs_top_to_bottom_on_a_real_kernel(source, tmp_path, monkeypatch):
    monkeypatch.setattr(run_solutions, "OUT", tmp_path)
    run_solutions.ensure_kernel()
    run_solutions.run_notebook(source, timeout=120)
    executed = json.loads((tmp_path / source.name).read_text())
    outputs = [o for c in executed["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("all checks passed" in "".join(o.get("text", "")) for o in outputs)
    assert json.loads(source.read_text()) == json.loads(source.read_text())  # solutions/ untouched
    assert all(c.get("outputs", []) == [] for c in json.loads(source.read_text())["cells"])


LAB02 = "lab02_attention_kv_cache.ipynb"


def _parameters(fn) -> list[tuple[str, object]]:
    """Names and defaults of a callable's parameters (annotations aside: the notebook's name its own types)."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_lab02_learner_code_has_the_reference_signatures():
    from nanolab.model import attention, kv_cache, sampling

    namespace = _solution_namespace(LAB02)
    assert _parameters(namespace["causal_attention"]) == _parameters(attention.dense_causal_attention)
    assert _parameters(namespace["kv_cache_bytes"]) == _parameters(kv_cache.kv_cache_bytes)
    for name in ("filter_logits", "sample", "make_generator"):
        assert _parameters(namespace[name]) == _parameters(getattr(sampling, name)), name
    learner, reference = namespace["ContiguousKVCache"], kv_cache.ContiguousKVCache
    for method in ("__init__", "prepare", "attend", "reset"):
        assert _parameters(getattr(learner, method)) == _parameters(getattr(reference, method)), method


def test_lab02_setup_mirrors_the_reference_config_and_sampling_params():
    """The notebook's SamplingParams has the reference's fields and defaults (those it has), and its
    ModelShape the reference config's fields and head_dim, so the same hidden tests fit both."""
    import dataclasses

    from nanolab.model.config import ModelConfig
    from nanolab.model.sampling import SamplingParams

    namespace = _solution_namespace(LAB02)
    reference = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    mine = {f.name: f.default for f in dataclasses.fields(namespace["SamplingParams"])}
    assert mine.items() <= reference.items()
    with pytest.raises(ValueError, match="top_p"):
        namespace["SamplingParams"](top_p=0)
    assert namespace["SamplingParams"](temperature=0).greedy and not namespace["SamplingParams"]().greedy
    shape_fields = {f.name for f in dataclasses.fields(namespace["ModelShape"])}
    assert shape_fields <= {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(n_layers=3, n_heads=6, n_kv_heads=2, d_model=48, max_seq_len=64)
    shape = namespace["ModelShape"](**{name: getattr(config, name) for name in shape_fields})
    assert shape.head_dim == config.head_dim
    assert namespace["make_generator"](None) is None


def test_lab02_learner_cache_plugs_into_the_reference_model():
    """The solution's cache is a KVCacheProtocol and, in a random model, gives nanolab.generate's greedy tokens."""
    import torch

    from nanolab.model.config import ModelConfig
    from nanolab.model.generate import generate
    from nanolab.model.kv_cache import KVCacheProtocol
    from nanolab.model.transformer import Transformer

    namespace = _solution_namespace(LAB02)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=50, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=40)
    )
    model.eval()
    cache = namespace["ContiguousKVCache"](model.config, 30)
    assert isinstance(cache, KVCacheProtocol)
    assert cache.nbytes == namespace["kv_cache_bytes"](model.config, 30)
    prompt = [3, 14, 15, 9, 2]
    new, output = torch.tensor(prompt), []
    with torch.inference_mode():
        for _ in range(20):
            hidden = model(new, cache.prepare(len(new)), cache)
            output.append(int(model.compute_logits(hidden[-1:]).argmax()))
            new = torch.tensor(output[-1:])
    assert output == generate(model, None, prompt, max_new_tokens=20).token_ids


LAB03 = "lab03_paged_kv.ipynb"


def test_lab03_learner_code_has_the_reference_signatures():
    """Lab 3's graded names take the reference's parameters (a learner class may stop before the
    reference's optional extras: the prefix cache, the attention backend)."""
    from nanolab import PyBlockAllocator
    from nanolab.memory import fragmentation, paging
    from nanolab.memory.block_manager import BlockManager
    from nanolab.memory.paged_kv_cache import PagedKVCache

    namespace = _solution_namespace(LAB03)
    assert _parameters(namespace["simulate"]) == _parameters(fragmentation.simulate)
    for name in ("slot_of", "slot_mapping"):
        assert _parameters(namespace[name]) == _parameters(getattr(paging, name)), name
    pairs = [
        (
            "BlockAllocator",
            PyBlockAllocator,
            ("__init__", "allocate", "free", "incref", "ref_count", "free_list"),
        ),
        (
            "BlockManager",
            BlockManager,
            ("__init__", "num_blocks_for", "grow", "release", "fork", "copy_on_write"),
        ),
        ("PagedKVCache", PagedKVCache, ("__init__", "prepare", "attend", "copy_blocks")),
    ]
    for name, reference, methods in pairs:
        for method in methods:
            mine = _parameters(getattr(namespace[name], method))
            theirs = _parameters(getattr(reference, method))
            assert mine == theirs[: len(mine)] and len(mine) >= len(theirs) - 2, (name, method)
    for prop in ("num_free", "num_total"):
        assert isinstance(getattr(namespace["BlockAllocator"], prop), property), prop
    assert isinstance(PagedKVCache.nbytes, property) and isinstance(
        namespace["PagedKVCache"].nbytes, property
    )


def test_lab03_setup_mirrors_the_reference_types_and_replay():
    """The setup cell's SimRequest, SimResult, SeqSlice and PagedSequence have the reference's fields (in
    order, where the hidden tests read them by position), its OutOfBlocksError the reference's name, and
    its replay gives, on the reference allocator, what the hidden tests' copy of it gives."""
    import dataclasses
    import importlib.util
    import random
    import warnings

    from nanolab import OutOfBlocksError, PyBlockAllocator
    from nanolab.memory import fragmentation
    from nanolab.memory.block_manager import PagedSequence
    from nanolab.memory.paged_kv_cache import SeqSlice

    spec = importlib.util.spec_from_file_location(
        "hidden_lab03", ROOT / "autograder" / "tests" / "test_lab03.py"
    )
    hidden = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the grader's markers (points) are registered by its plugin only
        spec.loader.exec_module(hidden)
    namespace = _solution_namespace(LAB03)
    fields = {
        name: [f.name for f in dataclasses.fields(namespace[name])] for name in ("SimRequest", "SeqSlice")
    }
    assert fields["SimRequest"] == list(fragmentation.SimRequest._fields)
    assert fields["SeqSlice"] == list(SeqSlice._fields)
    assert tuple(namespace["SeqSlice"]([1, 2], 3, 4)) == ([1, 2], 3, 4)  # unpacks like the NamedTuple
    assert namespace["SimResult"]._fields == fragmentation.SimResult._fields
    assert {f.name for f in dataclasses.fields(namespace["PagedSequence"])} <= set(
        PagedSequence.__annotations__
    )
    assert namespace["OutOfBlocksError"].__name__ == OutOfBlocksError.__name__
    rng = random.Random(0)
    ops = [("allocate", rng.randint(-1, 5)) if i % 3 else ("free", [rng.randint(-1, 6)]) for i in range(60)]
    assert namespace["replay"](PyBlockAllocator(6), ops) == hidden.replay(PyBlockAllocator(6), ops)


def test_lab03_solution_allocator_and_cache_plug_into_the_reference():
    """The solution's allocator is a BlockAllocatorProtocol, and its paged cache serves a random model in
    nanolab's engine with nanolab's greedy outputs."""
    import torch

    from nanolab import BlockAllocatorProtocol, KVCacheProtocol, SamplingParams
    from nanolab.engine.llm import LLM
    from nanolab.model.config import ModelConfig
    from nanolab.model.transformer import Transformer

    namespace = _solution_namespace(LAB03)
    assert isinstance(namespace["BlockAllocator"](3), BlockAllocatorProtocol)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=50, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=64)
    )
    settings = dict(block_size=4, num_blocks=12, max_num_seqs=3)  # too small for all three: preemptions
    prompts = [[3, 14, 15, 9, 2], [6, 5, 3], [5, 8, 9, 7, 9, 3, 2, 3]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in LLM(model.eval(), **settings).generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(model, block_allocator=namespace["BlockAllocator"], **settings)
    llm.engine.kv_cache = namespace["PagedKVCache"](model.config, 12, 4)
    assert isinstance(llm.engine.kv_cache, KVCacheProtocol)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and llm.stats().preemptions > 0


def test_lab03_docstring_examples_run_on_the_solution():
    """Every ``>>>`` example in Lab 3's fill-in cells gives what it shows, with the solution's code."""
    import doctest

    namespace = _solution_namespace(LAB03)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    names = ("simulate", "BlockAllocator", "slot_of", "slot_mapping", "BlockManager", "PagedKVCache")
    tests = [
        t for name in names for t in finder.find(namespace[name], name, globs=dict(namespace)) if t.examples
    ]
    assert len(tests) >= len(names)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
