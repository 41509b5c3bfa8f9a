"""Hostile Lab 1 submissions, graded the way an instructor grades a class: ``nanolab grade --jobs 2`` on
one batch that also holds the solution and the blank lab, their neighbours, under bubblewrap.

Each hostile notebook is the blank lab with an attack in its cells: marks for no work (code taken from
the solution, the reference or a neighbour, around the import blocker), reading what the grader keeps
secret, starving or slowing the grader and its neighbours, escaping the sandbox or leaving things
behind, replies built to choke the decoder, and feedback built to spoof the terminal. Whatever they
do, after the batch:

- each scores no more than the blank lab, and the solution beside them full marks, as it does alone;
- the results files are valid and hold every notebook, and the batch ends in reasonable time and memory;
- no feedback holds a line of the hidden tests, the solutions or the reference, or the grader's
  environment, and the printed table has no control character;
- nothing outside the grader's own directories changed, no process is left and no directory leaked.

Without bubblewrap these skip (NANOLAB_SANDBOX_TEST=required, as in CI, makes that a failure).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers.grading_utils import cell, sub

from autograder.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab01_tokenizer.ipynb"
LAB = ROOT / "labs" / "lab01_tokenizer.ipynb"
HIDDEN = ROOT / "autograder" / "tests" / "test_lab01.py"
REFERENCE = ROOT / "nanolab" / "text" / "bpe.py"
GRADED = ("pair-counts", "merge", "train-merges", "bpe-encode", "tokenizer")
STUB = "raise NotImplementedError()"

if not isolation.status().available:
    if os.environ.get("NANOLAB_SANDBOX_TEST") == "required":
        pytest.fail(f"bubblewrap is required here: {isolation.status().reason}", pytrace=False)
    pytest.skip(f"no bubblewrap sandbox here: {isolation.status().reason}", allow_module_level=True)

# ---------------------------------------------------------------------------------------------- attacks

# Graded cells that only hand over to functions found elsewhere (in `_ns`): `def` and `class` statements,
# so the grader's reading of the notebook's text is satisfied, and whatever runs comes from `_ns`.
DELEGATE = {
    "pair-counts": "def pair_counts(ids):\n    return _ns['pair_counts'](ids)\n",
    "merge": "def merge(ids, pair, new_id):\n    return _ns['merge'](ids, pair, new_id)\n",
    "train-merges": "def train_merges(word_counts, n):\n    return _ns['train_merges'](word_counts, n)\n",
    "bpe-encode": "def bpe_encode(piece, ranks):\n    return _ns['bpe_encode'](piece, ranks)\n",
    "tokenizer": "class Tokenizer(_ns.get('Tokenizer', object)):\n    pass\n",
}

# Runs the graded cells of a solution notebook (its JSON in `_text`) under the cells' own file names.
RUN_CELLS = """
def _run_cells(_text):
    _cells = {}
    for _c in _json.loads(_text)["cells"]:
        _gid = _c.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        _cells[_gid] = "".join(_c["source"])
    if "NotImplementedError" in _cells.get("merge", "NotImplementedError"):
        return False
    for _gid in ("pair-counts", "merge", "train-merges", "bpe-encode", "tokenizer"):
        exec(compile(_cells[_gid], f"<cell {_gid}>", "exec"), _ns)
    return True
"""

SOLUTION_FROM_DISK = f"""
import json as _json
_ns = dict(globals())
{RUN_CELLS}
try:
    _run_cells(open({str(SOLUTION)!r}).read())
except Exception as _e:
    print("no solution:", _e)
"""

REFERENCE_FROM_DISK = f"""
_ns = dict(globals())
try:
    exec(compile(open({str(REFERENCE)!r}).read(), "<cell merge>", "exec"), _ns)
except Exception as _e:
    print("no reference:", _e)
"""

NEIGHBOURS_FROM_PROC = f"""
import json as _json, os as _os
_ns = dict(globals())
{RUN_CELLS}
_paths = []
for _pid in filter(str.isdigit, _os.listdir("/proc")):
    try:
        _paths += [a.decode() for a in open(f"/proc/{{_pid}}/cmdline", "rb").read().split(b"\\0") if a.endswith(b".ipynb")]
    except OSError:
        pass
for _path in _paths:
    try:
        if _run_cells(open(_path).read()):
            break
    except Exception as _e:
        print("no neighbour:", _e)
"""

BLOCKER_REMOVED = f"""
import sys, types
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ImportBlocker"]
for _name in [m for m in sys.modules if m.split(".")[0] in ("nanolab", "autograder")]:
    del sys.modules[_name]
sys.path.insert(0, {str(ROOT)!r})
_ns = {{}}

def _own(f, gid):
    code = f.__code__.replace(co_filename=f"<cell {{gid}}>")
    return types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)

try:
    import nanolab.text.bpe as _bpe
    for _f, _gid in (("pair_counts", "pair-counts"), ("merge", "merge"), ("train_merges", "train-merges"),
                     ("bpe_encode", "bpe-encode")):
        _ns[_f] = _own(getattr(_bpe, _f), _gid)
    from nanolab.text.tokenizer import Tokenizer as _Tokenizer
    _ns["Tokenizer"] = _Tokenizer
except Exception as _e:
    print("no reference:", _e)
"""

# What the grader keeps secret, gathered in every form: hidden tests, solution, reference, environment.
GATHER_SECRETS = f"""
import base64 as _b64, os as _os
_secrets = []
for _path in ({str(HIDDEN)!r}, {str(SOLUTION)!r}, {str(REFERENCE)!r}):
    try:
        _data = open(_path, "rb").read()
        _secrets += [_data.decode()[:1500], _b64.b64encode(_data[:600]).decode()]
    except OSError as _e:
        _secrets.append(f"unreadable: {{_e}}")
for _pid in ["self", str(_os.getppid())] + list(filter(str.isdigit, _os.listdir("/proc"))):
    try:
        for _var in open(f"/proc/{{_pid}}/environ", "rb").read().split(b"\\0"):
            if _var.startswith(b"NANOLAB_GRADER_SECRET="):
                _value = _var.split(b"=", 1)[1]
                _secrets += [_value.decode(), _value[::-1].decode(), _b64.b64encode(_value).decode()]
    except OSError:
        pass
LEAK = "\\n".join(_secrets)
"""

# The grader's processes as the sandbox may see them: its parents up to the one whose command line
# names the batch (never further: not the test run), and whatever else names the batch.
TARGETS = """
import os, resource, signal

def _targets(marker):
    found, pid = set(), os.getppid()
    while pid > 1:
        found.add(pid)
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                break
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{p}/cmdline", "rb").read():
                found.add(int(p))
        except OSError:
            pass
    return found - {os.getpid()}

def _starve(marker):
    for pid in _targets(marker):
        for limit, value in ((resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_NOFILE, 3), (resource.RLIMIT_AS, 50 << 20)):
            try:
                resource.prlimit(pid, limit, (value, value))
            except (OSError, ValueError):
                pass
        try:
            os.sched_setaffinity(pid, {0})
        except OSError:
            pass
"""

# A process that leaves its sandbox's process tree and stays: fork, setsid, exec, with `marker` in argv.
DETACH = """
import os, sys

def _detach(code, *args):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", code, *args])
        os._exit(0)
"""

SPOOF = "\\x1b[2K\\r\\x1b[1Asolution.ipynb    1   22/22\\x1b]0;owned\\x07\\u202e"


def _prepend(nb: dict, grade_id: str, code: str) -> None:
    cell(nb, grade_id)["source"] = code + "\n" + "".join(cell(nb, grade_id)["source"])


def _stubs(nb: dict, replacement: str) -> None:
    for grade_id in GRADED:
        sub(nb, grade_id, STUB, replacement)


def _delegating(prelude: str):
    def tamper(nb: dict, env: dict) -> None:
        for grade_id, source in DELEGATE.items():
            cell(nb, grade_id)["source"] = source
        _prepend(nb, "pair-counts", prelude)

    return tamper


def _leaks(nb, env):
    _prepend(nb, "pair-counts", GATHER_SECRETS)
    _stubs(nb, "raise RuntimeError(LEAK)")


def _leaks_at_load(nb, env):
    _prepend(nb, "pair-counts", GATHER_SECRETS + "\nprint(LEAK[-3000:])\nimport os\nos._exit(3)\n")


def _starves_the_grader(nb, env):
    marker = env["marker"]
    code = TARGETS + DETACH + f"\n_starve({marker!r})\n"
    daemon = (
        TARGETS
        + "import time\nfor _ in range(150):\n    _starve(__import__('sys').argv[1])\n    time.sleep(0.2)\n"
    )
    _prepend(nb, "pair-counts", code + f"_detach({daemon!r}, {marker!r})\n")
    _stubs(nb, f"_starve({marker!r}); raise NotImplementedError()")


def _escapes(nb, env):
    canary = env["canary"]
    code = (
        DETACH
        + f"""
import fcntl, os, struct
_detach("import time\\nwhile True: time.sleep(1)", {env["marker"]!r})
for _name, _target in (("dir_link", {str(canary.parent)!r}), ("file_link", {str(canary)!r})):
    for _where in (".", "/tmp"):
        try:
            os.symlink(_target, os.path.join(_where, _name))
        except OSError as _e:
            print("symlink:", _e)
for _action in (lambda: open({str(canary)!r}, "w").write("owned"), lambda: os.chmod({str(canary)!r}, 0o777),
                lambda: os.unlink({str(canary)!r}), lambda: os.chmod(".", 0)):
    try:
        _action()
    except OSError as _e:
        print("refused:", _e)
os.makedirs("locked/deeper", exist_ok=True)
open("locked/deeper/f", "w").write("x")
try:
    _fd = os.open("locked/deeper/f", os.O_RDONLY)
    fcntl.ioctl(_fd, 0x40086602, struct.pack("i", 0x10))  # chattr +i
except OSError as _e:
    print("chattr:", _e)
os.chmod("locked/deeper", 0)
os.chmod("locked", 0o500)
try:
    with open("filler", "wb") as _f:
        for _ in range(40):
            _f.write(b"x" * (16 << 20))
except OSError as _e:
    print("full:", _e)
"""
    )
    _prepend(nb, "pair-counts", code)


def _restarts(nb, env):
    _prepend(nb, "pair-counts", "open('filler', 'wb').write(b'x' * (100 << 20))\n")
    _stubs(nb, "import os; os._exit(1)")


def _chokes_the_decoder(nb, env):
    p61 = 2**61 - 1
    sub(nb, "pair-counts", STUB, f"return {{k * {p61}: 1 for k in range(1, 150_001)}}")
    sub(nb, "merge", STUB, "return 'x' * 60_000_000")
    sub(nb, "train-merges", STUB, "return [[] for _ in range(900_000)]")
    sub(nb, "bpe-encode", STUB, "return {(k * " + str(p61) + ", k): 0 for k in range(1, 50_001)}")
    doubling = "[(0, 0)] + [(256 + i, 256 + i) for i in range(60)]"
    cell(nb, "tokenizer")["source"] = (
        "class Tokenizer:\n"
        f"    merges = {doubling}\n"
        "    special_tokens = {}\n"
        "    def __init__(self, *args, **kwargs):\n        pass\n"
        "    @classmethod\n    def train(cls, *args, **kwargs):\n        return cls()\n"
        "    def encode(self, *args, **kwargs):\n        return [0]\n"
    )


def _spoofs_the_terminal(nb, env):
    _prepend(nb, "pair-counts", f"print({SPOOF!r} * 50)")
    _stubs(nb, f"raise RuntimeError({SPOOF!r})")


ATTACKS = {
    "solution_from_disk": _delegating(SOLUTION_FROM_DISK),
    "reference_from_disk": _delegating(REFERENCE_FROM_DISK),
    "neighbours_from_proc": _delegating(NEIGHBOURS_FROM_PROC),
    "blocker_removed": _delegating(BLOCKER_REMOVED),
    "leaks": _leaks,
    "leaks_at_load": _leaks_at_load,
    "starves_the_grader": _starves_the_grader,
    "escapes": _escapes,
    "restarts": _restarts,
    "chokes_the_decoder": _chokes_the_decoder,
    "spoofs_the_terminal": _spoofs_the_terminal,
}

# A correct train made slow on the timed input (it sleeps), with CPU hogs and an attempt to pin the
# grader to one CPU: only the speed budget may fail, and the solution beside it must not.
SLOW_TRAIN = (
    TARGETS
    + DETACH
    + """
_starve("{marker}")
for _ in range(2):
    _detach("import time\\nend = time.time() + 20\\nwhile time.time() < end: pass", "{marker}")
"""
)

# Runs the command in argv and reports the largest resident size of any process below it (KB).
MEASURE = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print("max-rss-kb", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def _state(path: Path) -> tuple:
    return path.read_bytes(), path.stat().st_mode, path.stat().st_mtime_ns


def _marked(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and int(pid) != os.getpid():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    marker = f"nanolab-hostile-{uuid.uuid4().hex}"
    folder = base / marker  # the batch's command line names the marker: the attacks look for it
    folder.mkdir()
    canary = base / "outside" / "canary.txt"
    canary.parent.mkdir()
    canary.write_text("untouched")
    os.chmod(canary, 0o644)
    env = {"marker": marker, "canary": canary}
    paths = {"solution": folder / "solution.ipynb", "blank": folder / "blank.ipynb"}
    paths["solution"].write_text(SOLUTION.read_text())
    paths["blank"].write_text(LAB.read_text())
    for name, tamper in ATTACKS.items():
        nb = json.loads(LAB.read_text())
        tamper(nb, env)
        paths[name] = folder / f"{name}.ipynb"
        paths[name].write_text(json.dumps(nb))
    nb = json.loads(SOLUTION.read_text())
    _prepend(nb, "pair-counts", SLOW_TRAIN.replace("{marker}", marker))
    first_line = "        num_merges = vocab_size - 256 - len(specials)\n"  # in Tokenizer.train
    slow = "        if len(text) > 100_000:  # the timed input\n            __import__('time').sleep(20)\n"
    sub(nb, "tokenizer", first_line, slow + first_line, 1)
    paths["slow_train"] = folder / "slow_train.ipynb"
    paths["slow_train"].write_text(json.dumps(nb))

    private_tmp = base / "tmp"
    private_tmp.mkdir()
    secret = uuid.uuid4().hex
    canary_before = _state(canary)
    out_json, out_csv = base / "grades.json", base / "grades.csv"
    command = [sys.executable, "-m", "nanolab.cli", "grade", *map(str, paths.values()), "--jobs", "2"]
    command += ["--timeout", "5", "--memory-mb", "512", "--details", "--json", str(out_json)]
    command += ["--csv", str(out_csv)]
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, *command],
        capture_output=True,
        text=True,
        cwd=base,
        env={**os.environ, "TMPDIR": str(private_tmp), "NANOLAB_GRADER_SECRET": secret},
        timeout=900,
    )
    elapsed = time.monotonic() - start
    time.sleep(0.5)  # let anything that is dying finish dying
    rows = json.loads(out_json.read_text()) if out_json.exists() else None
    return {
        "run": run,
        "elapsed": elapsed,
        "names": list(paths),
        "rows": dict(zip(paths, rows)) if rows and len(rows) == len(paths) else None,
        "json_text": out_json.read_text() if out_json.exists() else "",
        "csv": out_csv,
        "secret": secret,
        "marker": marker,
        "canary": canary,
        "canary_before": canary_before,
        "private_tmp": private_tmp,
    }


def _tests(row: dict) -> dict[str, dict]:
    return {t["id"]: t for t in row["tests"]}


# ---------------------------------------------------------------------------------------------- verdicts


def test_the_batch_is_graded_and_its_results_files_are_whole(batch):
    run = batch["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert batch["rows"] is not None, "the JSON results must hold one entry per notebook"
    assert len(batch["csv"].read_text().splitlines()) == 1 + len(batch["names"])
    assert "sandbox: bubblewrap" in run.stderr


def test_the_solution_beside_them_scores_full_marks(batch):
    row = batch["rows"]["solution"]
    failed = {t["id"]: t["output"] for t in row["tests"] if t["status"] != "passed"}
    assert row["max_score"] > 0 and row["score"] == row["max_score"], failed


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_hostile_notebook_scores_no_more_than_the_blank_lab(batch, name):
    row, blank = batch["rows"][name], batch["rows"]["blank"]
    assert blank["score"] == 0 and blank["max_score"] == batch["rows"]["solution"]["max_score"]
    assert [t["id"] for t in row["tests"]] == [t["id"] for t in blank["tests"]], "every test is reported"
    assert row["score"] <= blank["score"], {t["id"]: t["output"][:300] for t in row["tests"] if t["score"]}
    assert all(t["status"] == "failed" and t["output"] for t in row["tests"])


def test_slow_training_fails_the_speed_budget_and_nothing_else(batch):
    """A correct train that sleeps on the timed input, with CPU hogs beside it, fails the speed budget
    (whose reference is timed by CPU time, so the hogs cannot raise it) and passes everything else."""
    tests = _tests(batch["rows"]["slow_train"])
    assert tests["test_training_speed_is_within_budget"]["status"] == "failed"
    others = {i: t["output"][:200] for i, t in tests.items() if i != "test_training_speed_is_within_budget"}
    assert all(tests[i]["status"] == "passed" for i in others), others


def test_no_feedback_quotes_the_grader_or_its_environment(batch):
    """Neither the hidden tests, the solution nor the reference (as text or base64), nor the grader's
    environment, appears anywhere in the results."""
    text, secret = batch["json_text"], batch["secret"]
    forbidden = [secret, secret[::-1], base64.b64encode(secret.encode()).decode()]
    for path in (HIDDEN, SOLUTION, REFERENCE):
        data = path.read_bytes()
        forbidden.append(base64.b64encode(data[:600]).decode()[:200])
        forbidden += [line.strip() for line in data.decode().splitlines() if len(line.strip()) > 40][:40]
    leaked = [f for f in forbidden if f in text or json.dumps(f)[1:-1] in text]
    assert not leaked, leaked[:3]


def test_the_printed_table_has_no_control_characters(batch):
    out = batch["run"].stdout
    assert "22/22" in out and "FAIL" in out
    bad = {c for c in out if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F}
    assert not bad and "\u202e" not in out, bad


def test_nothing_outside_changed_and_nothing_was_left_behind(batch):
    assert _state(batch["canary"]) == batch["canary_before"], (
        "a file outside the grader's directories changed"
    )
    assert not _marked(batch["marker"]), "a process of the batch outlived it"
    assert not list(batch["private_tmp"].iterdir()), "the grader left directories behind"


def test_the_grader_stayed_small_and_quick(batch):
    """The replies built to choke the decoder cost the grader neither memory nor time: every process of
    the batch (sandboxes included, each under 512 MB) stays far below the gigabytes they used to take."""
    rss = [line for line in batch["run"].stderr.splitlines() if line.startswith("max-rss-kb")]
    assert rss and int(rss[-1].split()[1]) < 1_200_000, rss
    assert batch["elapsed"] < 300
