"""Parallel sampling: ``n`` samples of one prompt, the prompt computed once.

A request with ``SamplingParams.n > 1`` is sample 0 of a `SampleGroup`. It alone is scheduled while its
prompt is computed (its seats for the other samples are reserved when it is admitted). In the step that
computes the last of its prompt, the engine forks it: `fork_samples` makes the ``n - 1`` further samples,
each a request of its own from then on, and the scheduler's ``fork`` gives each of them the parent's KV
blocks, shared (a block is copied only when a sample first writes into a shared one: copy-on-write).
Every sample draws its first token from the prompt's logits; sample i's seed is the request's seed + i
(vLLM's rule), so n seeded samples give the tokens of n separate requests seeded that way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanolab.engine.request import Request


@dataclass(eq=False)
class SampleGroup:
    """The ``n`` samples of one request: sample 0 computes the prompt, then forks into the others."""

    request_id: str  # the request's id (sample 0's); the other samples' ids add "#<index>"
    n: int  # samples in all (lowered to those that exist if the group is aborted before it forks)
    samples: list[Request]

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.n and all(s.is_finished for s in self.samples)

    def sample_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"


def fork_samples(parent: Request) -> list[Request]:
    """The further samples of ``parent`` (none unless it is sample 0 of a group that has not forked),
    added to its group. They are new requests, not yet known to the scheduler or the engine."""
    group, children = parent.group, []
    if group is None or not parent.samples_to_fork:
        return children
    seed = parent.sampling_params.seed
    for i in range(len(group.samples), group.n):
        params = dataclasses.replace(parent.sampling_params, n=1, seed=None if seed is None else seed + i)
        child = type(parent)(
            group.sample_id(i),
            parent.prompt_token_ids,
            params,
            prompt=parent.prompt,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            group=group,
            sample_index=i,
        )
        child.prompt_logprobs = parent.prompt_logprobs  # the same prompt: known once for all
        group.samples.append(child)
        children.append(child)
    return children
