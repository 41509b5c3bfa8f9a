"""After the forward: each sampled token appended, its text decoded, the stop rules checked, outputs built.

The output processor keeps what the engine's outputs need beyond the `Request` itself: per request, an
`IncrementalDetokenizer` (its text, decoded only when someone reads it: offline generation without stop
strings decodes each request once, at the end) and two cursors, the text and tokens already handed out,
so each output's ``delta_*`` fields carry what no earlier output did. While a request with stop strings
runs, the end of its text that could still become a stop string is held back from the deltas
(`nanolab.engine.stopping.held_back`). A request's state is dropped with the output that reports it
finished (for a parallel-sampling request, when its whole group has finished).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanolab.engine.detokenizer import IncrementalDetokenizer, token_bytes_table
from nanolab.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanolab.engine.parallel import SampleGroup
from nanolab.engine.request import FinishReason, Request
from nanolab.engine.stopping import check_stop, held_back


@dataclass(eq=False)
class _OutputState:
    detokenizer: IncrementalDetokenizer | None  # None: the engine has no tokenizer, outputs carry no text
    emitted_text: int = 0  # characters of the text already handed out
    emitted_tokens: int = 0  # output tokens already handed out

    def text(self, req: Request) -> str:
        d = self.detokenizer
        if d is None:
            return ""
        d.update(req.output_token_ids)
        return d.text


class OutputProcessor:
    """Text, stop rules and outputs for the requests of one engine (see the module)."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.token_bytes = token_bytes_table(tokenizer) if tokenizer is not None else None
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        # A Hugging Face checkpoint may name more than one (Llama 3 ends a text and a chat turn differently)
        more = getattr(tokenizer, "eos_token_ids", ()) if tokenizer is not None else ()
        self.eos_token_ids = frozenset(t for t in (eos, *more) if t is not None)
        self.max_model_len = max_model_len
        self._states: dict[str, _OutputState] = {}

    def __len__(self) -> int:
        """Requests whose outputs are still tracked (0 once every request's last output is built)."""
        return len(self._states)

    def add(self, req: Request) -> None:
        detokenizer = IncrementalDetokenizer(self.token_bytes) if self.token_bytes is not None else None
        self._states[req.request_id] = _OutputState(detokenizer)

    def text(self, req: Request) -> str:
        """The request's output text so far (an incomplete UTF-8 character at the end waits)."""
        return self._states[req.request_id].text(req)

    def stop_reason(self, req: Request, token: int) -> FinishReason | None:
        """Check the stop rules for ``token``, just appended to ``req``'s output; with a stop string, the
        request's text is cut before it."""
        st = self._states[req.request_id]
        text, new_from = "", 0
        if req.sampling_params.stop and st.detokenizer is not None:
            new_from = len(st.detokenizer.text)
            text = st.text(req)
        reason, kept = check_stop(req, token, text, new_from, self.eos_token_ids, self.max_model_len)
        if len(kept) < len(text):
            st.detokenizer.truncate(len(kept))
        return reason

    def output(self, req: Request) -> RequestOutput:
        """The request's output now; its deltas are what no earlier output of it carried."""
        return self._build(req, [self._completion(req)], req.is_finished, len(req.output_token_ids))

    def group_output(self, group: SampleGroup, changed: Sequence[Request]) -> RequestOutput:
        """A parallel-sampling request's output: a `CompletionOutput` for each sample in ``changed`` (by
        index), or for every sample once the group has finished. Its metrics count every sample's tokens."""
        samples = group.samples if group.finished else sorted(changed, key=lambda s: s.sample_index)
        completions = [self._completion(s) for s in samples]
        num_output = sum(len(s.output_token_ids) for s in group.samples)
        out = self._build(group.samples[0], completions, group.finished, num_output)
        if group.finished:
            for s in group.samples:
                self._states.pop(s.request_id, None)
        return out

    def step_outputs(
        self, reqs: Sequence[Request], groups: dict[str, SampleGroup], finished_only: bool
    ) -> list[RequestOutput]:
        """The outputs of a step in which ``reqs`` got a token: one for each (with ``finished_only``, for
        each that finished), one for a parallel-sampling request however many of its samples are in
        ``reqs``. A finished group leaves ``groups``."""
        outputs = []
        changed: dict[str, list[Request]] = {}  # parallel-sampling requests: their samples with news
        for r in reqs:
            if r.group is not None:
                changed.setdefault(r.group.request_id, []).append(r)
            elif r.is_finished or not finished_only:
                outputs.append(self.output(r))
        for gid, samples in changed.items():
            group = groups[gid]
            if group.finished:
                del groups[gid]
            if group.finished or not finished_only:
                outputs.append(self.group_output(group, samples))
        return outputs

    def _completion(self, req: Request) -> CompletionOutput:
        st = self._states[req.request_id]
        if req.group is None and req.is_finished:
            del self._states[req.request_id]  # this is its last output
        text = st.text(req)
        visible = len(text)
        if not req.is_finished and req.sampling_params.stop:
            visible = max(st.emitted_text, visible - held_back(text, req.sampling_params.stop))
        new_text, first_new = text[st.emitted_text : visible], st.emitted_tokens
        st.emitted_text, st.emitted_tokens = visible, len(req.output_token_ids)
        has_text = st.detokenizer is not None
        with_logprobs = req.sampling_params.logprobs is not None
        return CompletionOutput(
            index=req.sample_index,
            text=text if has_text else None,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            delta_text=new_text,
            delta_token_ids=req.output_token_ids[first_new:],
            logprobs=list(req.output_logprobs) if with_logprobs else None,
            delta_logprobs=req.output_logprobs[first_new:] if with_logprobs else None,
        )

    @staticmethod
    def _build(
        req: Request, completions: list[CompletionOutput], finished: bool, num_output: int
    ) -> RequestOutput:
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=num_output,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
        )
        rid = req.group.request_id if req.group is not None else req.request_id
        prompt_lp = None
        if req.sampling_params.prompt_logprobs is not None and not req.wants_prompt_logprobs:
            prompt_lp = list(req.prompt_logprobs)
        return RequestOutput(
            rid, req.prompt, list(req.prompt_token_ids), completions, finished, metrics, prompt_lp
        )
