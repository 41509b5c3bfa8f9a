"""Write a nanolab checkpoint's tokenizer as a Hugging Face one, beside its own.

    python scripts/export_hf_tokenizer.py                    # the bundled model (nanolab/assets/tinypy)
    python scripts/export_hf_tokenizer.py path/to/checkpoint
    python scripts/export_hf_tokenizer.py --check            # exit 1 if the bundled model's files are stale

Reads ``nanolab_tokenizer.json``, the chat template (``chat_template.jinja``) and the context length
(``config.json``'s ``max_seq_len``), and writes ``tokenizer.json`` and ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained`` reads (see `nanolab.text.hf_export`). nanolab itself keeps
reading ``nanolab_tokenizer.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from nanolab.model.loading import load_chat_template, read_json, resolve_checkpoint
from nanolab.text.hf_export import HF_CONFIG_FILE, HF_TOKENIZER_FILE
from nanolab.text.tokenizer import TOKENIZER_FILENAME, Tokenizer


def export(directory: Path, out: Path) -> Path:
    tok = Tokenizer.load(directory / TOKENIZER_FILENAME)
    template = load_chat_template(directory, tok)
    max_len = read_json(directory / "config.json").get("max_seq_len")
    return tok.save_hf(out, None if template is None else template.source, max_len)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "checkpoint", nargs="?", default=None, help="checkpoint directory (default: the bundled model)"
    )
    p.add_argument(
        "--check", action="store_true", help="compare with the files there instead of writing them"
    )
    args = p.parse_args()
    directory = resolve_checkpoint(args.checkpoint)
    if not (directory / TOKENIZER_FILENAME).exists():
        p.error(f"{directory} has no {TOKENIZER_FILENAME}: only a nanolab tokenizer can be exported")
    if not args.check:
        export(directory, directory)
        print(f"wrote {directory / HF_TOKENIZER_FILE} and {directory / HF_CONFIG_FILE}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = export(directory, Path(tmp))
        stale = [
            name
            for name in (HF_TOKENIZER_FILE, HF_CONFIG_FILE)
            if not (directory / name).exists()
            or json.loads((directory / name).read_text()) != json.loads((fresh / name).read_text())
        ]
    if stale:
        print(
            f"stale in {directory}: {', '.join(stale)}; run python scripts/export_hf_tokenizer.py",
            file=sys.stderr,
        )
        return 1
    print(f"{directory}: the Hugging Face tokenizer files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
