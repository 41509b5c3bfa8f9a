"""The clients users already run against ``nanolab serve``, run for real: lm-evaluation-harness scores a
generation, a multiple-choice and a perplexity task exactly as offline `LLM` scores the same items, and
guidellm load-tests the server for a few seconds without an error.

Both clients live in an environment of their own (``make clients`` installs them in ``.venv-clients``;
``NANOLAB_CLIENTS_VENV`` names another). Without it these tests skip, saying so, unless
``NANOLAB_CLIENT_TEST=required`` (set by ``.ci/run`` once it has installed them). Nothing is downloaded:
the tasks read local JSON files and both clients run with the Hugging Face hub offline."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from helpers.live_server import serve_command  # noqa: E402

from nanolab import LLM, SamplingParams  # noqa: E402
from nanolab.model.loading import ASSETS_DIR  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MAX_LENGTH = 512  # the bundled model's max_model_len, given to lm-eval (which assumes 2048 otherwise)
TIE = 1e-4  # a greedy divergence is accepted only where offline's own top-two gap is below this

# Generation: greedy, up to 16 tokens, stopping at a newline. Some targets are what the model writes, some not.
GENERATE = [
    ("def __init__(self", ", **kw):"),
    ("from collections import", " namedtuple"),
    ("    def __repr__(self):\n        return", " self"),
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y =", " y"),
    ("with open(path) as f:\n        data =", " f.read()"),
    ("for i in range(", "10):"),
    ('if __name__ == "__main__":\n   ', " main()"),
    ("raise ValueError(", '"bad value")'),
]
# Multiple choice: the context, the choices (lm-eval puts a space between them), the right one.
CHOOSE = [
    ("import", ["os", "banana", "json"], 0),
    ("def __init__(self", ["):", ") + 1", "self self"], 0),
    ("from collections import", ["namedtuple", "print", "return"], 0),
    ("    for line in lines:\n        if not", ["line:", "else:", "import"], 0),
    ("x = [1, 2, 3]\nprint(len(", ["x))", "x]", "x}"], 0),
    ("try:\n    value = int(text)\nexcept", ["ValueError:", "ValueError!", "while"], 0),
    ("The café costs 3.50 €, so", ["x", "return", "the"], 2),
]
# Perplexity: whole texts, each scored from the end-of-text token on (each fits in one window of MAX_LENGTH).
TEXTS = [
    "def main():\n    print('hello world')\n",
    "for i in range(10):\n    total += i * 1234567 - 89\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "# naïve café ☕ — 3.14159 and 2718281828\n\tx\t=\t  42   \n\n\n",
    "import json\nwith open('data.json') as f:\n    data = json.load(f)\nprint(data['key'], 10**100)\n",
]


def run_client(args: list[str], cwd: Path, timeout: float = 300) -> str:
    """Run a client command offline (no hub, no telemetry); fail with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(cwd / "hf"),
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", NO_COLOR="1", COLUMNS="200")  # fmt: skip
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{Path(args[0]).name} exited with {done.returncode}:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    """The clients' environment's bin/: skipped where it is missing, failed where CI requires it."""
    venv = Path(os.environ.get("NANOLAB_CLIENTS_VENV") or REPO / ".venv-clients")
    found = venv / "bin"
    if not ((found / "lm_eval").exists() and (found / "guidellm").exists()):
        message = f"lm-eval and guidellm are not installed in {venv} (`make clients` installs them)"
        if os.environ.get("NANOLAB_CLIENT_TEST") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def server(bin_dir):
    with serve_command(["--served-model-name", "tinypy"]) as live:
        yield live


def write_tasks(folder: Path) -> list[str]:
    """Three lm-eval task files over local JSON lines: generation, multiple choice, perplexity."""
    data = {
        "gen": [{"prompt": p, "target": t} for p, t in GENERATE],
        "mc": [{"question": q, "choices": c, "answer": a} for q, c, a in CHOOSE],
        "ppl": [{"text": t} for t in TEXTS],
    }
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    specs = {
        "gen": "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
        "mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    }
    for name, spec in specs.items():
        path = json.dumps(str(folder / f"{name}.jsonl"))
        (folder / f"nanolab_{name}.yaml").write_text(f"task: nanolab_{name}\n" + common.format(path) + spec)
    return [f"nanolab_{name}" for name in specs]


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda row: row["doc_id"])


def scored(llm: LLM, ids: list[int], start: int) -> float:
    """Offline: the log-probability of ``ids[start:]`` given what comes before each of them."""
    (out,) = llm.generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False
    )
    return sum(entry.logprob for entry in out.prompt_logprobs[start:])


def pair(llm: LLM, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """A (context, continuation) pair cut into tokens as lm-eval cuts it for a causal model: the whole text
    encoded once, the context's own encoding marking where the continuation starts."""
    encode = llm.tokenizer.encode
    context_ids = encode(context)
    return context_ids, encode(context + continuation)[len(context_ids) :]


def test_lm_eval_scores_generation_choice_and_perplexity_as_offline_llm_does(
    bin_dir, server, llm, tmp_path
) -> None:
    tasks = write_tasks(tmp_path)
    out = tmp_path / "out"
    base = str(server.http.base_url).rstrip("/")
    run_client(
        [str(bin_dir / "lm_eval"), "--model", "local-completions", "--model_args",
         f"model=tinypy,base_url={base}/v1/completions,tokenizer_backend=remote,max_length={MAX_LENGTH},"
         "num_concurrent=4,max_retries=1",
         "--tasks", ",".join(tasks), "--include_path", str(tmp_path), "--log_samples", "--output_path", str(out)],
        tmp_path,
    )  # fmt: skip
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    for task, metrics in results.items():
        print(
            f"lm-eval {task}:", {k: round(v, 4) for k, v in metrics.items() if "," in k and "stderr" not in k}
        )

    # generation: each answer is offline's greedy text, so the score is offline's
    want = llm.generate(
        [p for p, _ in GENERATE],
        SamplingParams(max_tokens=16, temperature=0, stop=["\n"], logprobs=2),
        use_tqdm=False,
    )
    got = samples(out, "nanolab_gen")
    assert len(got) == len(GENERATE)
    ties = 0
    for row, offline in zip(got, want):
        text = row["filtered_resps"][0]
        expected = offline.outputs[0]
        if text != expected.text:  # accepted only at a genuine near-tie of offline's own top two
            k = next(i for i in range(len(expected.token_ids) + 1)
                     if not text.startswith(llm.tokenizer.decode(expected.token_ids[: i + 1])))  # fmt: skip
            top = expected.logprobs[k].top
            assert top[0][1] - top[1][1] < TIE, (
                f"{row['doc']['prompt']!r}: {text!r} != offline {expected.text!r}"
            )
            ties += 1
    print(f"generation: {ties} near-tie(s) accepted")
    matches = [o.outputs[0].text == t for o, (_, t) in zip(want, GENERATE)]
    assert 0 < sum(matches) < len(matches)  # the items tell a right answer from a wrong one
    if not ties:
        assert results["nanolab_gen"]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))

    # multiple choice: each choice's log-likelihood, as offline scores the same tokens
    rows = samples(out, "nanolab_mc")
    assert len(rows) == len(CHOOSE)
    right = right_norm = 0
    for row, (context, choices, answer) in zip(rows, CHOOSE):
        offline = []
        for choice in choices:
            context_ids, continuation_ids = pair(llm, context, " " + choice)
            offline.append(scored(llm, context_ids + continuation_ids, len(context_ids)))
        served = [float(ll) for ll, _ in row["filtered_resps"]]
        assert served == pytest.approx(offline, abs=1e-4), context
        right += max(range(len(choices)), key=offline.__getitem__) == answer
        norm = [ll / len(c) for ll, c in zip(offline, choices)]  # lm-eval divides by the choice's length
        right_norm += max(range(len(choices)), key=norm.__getitem__) == answer
    assert results["nanolab_mc"]["acc,none"] == pytest.approx(right / len(CHOOSE))
    assert results["nanolab_mc"]["acc_norm,none"] == pytest.approx(right_norm / len(CHOOSE))
    assert 0 < right < len(CHOOSE)

    # perplexity: each text's log-likelihood from the end-of-text token on
    rows = samples(out, "nanolab_ppl")
    assert len(rows) == len(TEXTS)
    total = 0.0
    for row, text in zip(rows, TEXTS):
        ids = llm.tokenizer.encode(text)
        assert len(ids) < MAX_LENGTH - 1  # one window: lm-eval's rolling windows are its own affair
        offline = scored(llm, [llm.tokenizer.eos_token_id, *ids], 1)
        assert float(row["filtered_resps"][0]) == pytest.approx(offline, abs=1e-4), text
        total += offline
    size = sum(len(t.encode()) for t in TEXTS)
    words = sum(row["word_perplexity"][1] for row in rows)
    ppl = results["nanolab_ppl"]
    assert ppl["byte_perplexity,none"] == pytest.approx(math.exp(-total / size), rel=1e-4)
    assert ppl["bits_per_byte,none"] == pytest.approx(-total / size / math.log(2), rel=1e-4)
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)


def test_guidellm_load_tests_the_server_without_an_error(bin_dir, server, llm, tmp_path) -> None:
    report = tmp_path / "guidellm.json"
    base = str(server.http.base_url).rstrip("/")
    run_client(
        [str(bin_dir / "guidellm"), "run", "--backend", f"kind=openai_http,target={base},model=tinypy",
         "--data", "kind=synthetic_text,prompt_tokens=48,output_tokens=24",
         "--tokenizer", f"kind=huggingface_auto,model={ASSETS_DIR / 'tinypy'}",
         "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_duration,seconds=4",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        tmp_path,
    )  # fmt: skip
    (bench,) = json.loads(report.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == 0 and made["successful"] >= 8, made
    done = bench["requests"]["successful"]
    # every request streamed all the tokens it asked for (guidellm asks to ignore the end-of-text token)
    assert {r["output_metrics"]["text_tokens"] for r in done} == {24}, [r["output_metrics"] for r in done[:3]]
    # the prompt token counts are the server's own, for the prompt guidellm sent, rendered as a chat
    for r in done[:4]:
        body = json.loads(r["request_args"])["body"]
        messages = [{"role": m["role"], "content": "".join(part["text"] for part in m["content"])}
                    for m in body["messages"]]  # fmt: skip
        counted = server.http.post("/tokenize", json={"messages": messages}).json()["count"]
        assert r["input_metrics"]["text_tokens"] == counted
    throughput = bench["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]["median"]
    print(
        f"guidellm: {made['successful']} requests, {throughput:.0f} output tokens/s, TTFT median {ttft:.0f} ms"
    )
