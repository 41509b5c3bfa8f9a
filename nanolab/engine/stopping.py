"""When a request stops, and the text a stream may show before it does.

A request finishes with "stop" when it samples an end-of-sequence token (unless ``ignore_eos``), one of
its ``stop_token_ids``, or completes one of its ``stop`` strings; with "length" when it has
``max_tokens`` output tokens or fills the model's context. A stop string is cut from the final text, and
it can end in the middle of a token or span several tokens, so it is searched in the decoded text, not
among token ids. While a request runs, a stream holds back the end of its text that could still grow
into a stop string (`held_back`), so no client ever sees part of one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from nanolab.engine.request import FinishReason, Request


def check_stop(
    req: Request,
    token: int,
    text: str,
    new_from: int,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[FinishReason | None, str]:
    """Whether ``req`` stops on ``token``, just appended to its ``output_token_ids``; returns the finish
    reason (None: it goes on) and its text, cut before the first stop string when one ends the request.

    ``text`` is the request's output text with ``token``; ``text[new_from:]`` is what this token added (a
    stop string found in it may begin up to ``len(stop) - 1`` characters earlier). The rules, first match
    wins: an end-of-sequence token (any of ``eos_token_ids``) unless ``ignore_eos``, or a stop token id:
    "stop"; a stop string in the text: "stop"; ``max_tokens`` output tokens, or ``max_model_len`` tokens
    in all: "length".

    Example:
        >>> from nanolab import SamplingParams
        >>> r = Request("r", [1, 2], SamplingParams(max_tokens=5, stop=["\\n\\n"]))
        >>> r.output_token_ids += [7, 8]
        >>> check_stop(r, 8, "x = 1\\n\\ny", 5, {0}, 64)
        (<FinishReason.STOP: 'stop'>, 'x = 1')
    """
    p = req.sampling_params
    if token in eos_token_ids and not p.ignore_eos:
        return FinishReason.STOP, text
    if p.stop_token_ids and token in p.stop_token_ids:
        return FinishReason.STOP, text
    if p.stop:
        cut = find_stop_string(text, p.stop, new_from)
        if cut is not None:
            return FinishReason.STOP, text[:cut]
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH, text
    return None, text


def find_stop_string(text: str, stops: Sequence[str], new_from: int) -> int | None:
    """Where the earliest stop string that ends past ``new_from`` begins in ``text``, or None.

    Only those can be new: one that ended before ``new_from`` would have stopped the request already.
    """
    hits = [i for s in stops if s and (i := text.find(s, max(0, new_from - len(s) + 1))) != -1]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (0: none).

    Example:
        >>> held_back("x = 1\\n", ["\\n\\n", "###"]), held_back("x = 1", ["\\n\\n"])
        (1, 0)
    """
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
