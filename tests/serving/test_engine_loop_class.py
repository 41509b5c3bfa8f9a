"""`AsyncEngine(loop_class=...)`: the engine side built from a class of the caller's (Lab 8 plugs a learner's loop in
this way), and an engine side that crashes: every waiting caller is told at once, none waits forever."""

from __future__ import annotations

import asyncio

import pytest

from nanolab import LLM, SamplingParams
from nanolab.serving.async_engine import AsyncEngine, EngineLoop, EngineNotRunning


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=4, num_blocks=64)


async def generate(aengine: AsyncEngine, prompt: str) -> str:
    group = await aengine.add("g", [prompt], [SamplingParams(max_tokens=6, temperature=0)])
    while True:
        _, out = await asyncio.wait_for(group.queue.get(), 30)
        if out.finished:
            return out.outputs[0].text


def test_the_engine_side_is_built_by_loop_class_and_serves_as_nanolab_loop_does(llm: LLM) -> None:
    built = []

    class Counting(EngineLoop):
        def __init__(self, engine):
            super().__init__(engine)
            built.append(engine)
            self.steps = 0

        def step(self) -> None:
            self.steps += 1
            super().step()

    aengine = AsyncEngine(llm.model, llm.tokenizer, llm.engine.config, loop_class=Counting)
    aengine.start()
    try:
        text = asyncio.run(generate(aengine, "import os"))
    finally:
        aengine.shutdown()
    assert built == [aengine.engine] and aengine.loop.steps >= 6
    assert (
        text
        == llm.generate(["import os"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
        .outputs[0]
        .text
    )


class Crashing(EngineLoop):
    """Takes commands, then breaks on its first round: an exception escapes `run`."""

    def take_round(self):
        raise ZeroDivisionError("a bug in the loop")


def test_a_crashed_engine_loop_fails_the_waiting_add_at_once_and_refuses_the_next(llm: LLM) -> None:
    aengine = AsyncEngine(llm.model, llm.tokenizer, llm.engine.config, loop_class=Crashing)
    aengine.start()

    async def add():
        return await asyncio.wait_for(aengine.add("g", ["import os"], [SamplingParams(max_tokens=4)]), 10)

    try:
        with pytest.raises(EngineNotRunning, match="ZeroDivisionError: a bug in the loop"):
            asyncio.run(add())
        aengine._thread.join(10)
        assert not aengine.is_running
        with pytest.raises(EngineNotRunning):
            asyncio.run(add())
    finally:
        aengine.shutdown()


def test_a_request_that_finished_inside_a_failed_step_fails_instead_of_waiting_forever(llm: LLM) -> None:
    """A step can raise after a request finished in it (building the step's outputs, say): its final
    output is lost with the step's, so the error names it too, and the loop fails it like the others."""
    from nanolab.engine.engine import Engine
    from nanolab.serving.async_engine import STOP, AddCommand

    engine = Engine(llm.model, llm.tokenizer, llm.engine.config)
    build = engine.outputs.step_outputs

    def step_outputs(reqs, groups, finished_only):
        if any(r.is_finished for r in reqs):
            engine.outputs.step_outputs = build  # once
            raise RuntimeError("building the outputs broke")
        return build(reqs, groups, finished_only)

    engine.outputs.step_outputs = step_outputs
    loop = EngineLoop(engine)
    params = [SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=10, temperature=0)]
    commands = [AddCommand(0, ["short", "long"], ["import os", "def f(x):"], params, 0, None), STOP]
    rounds = []

    def receive(timeout):
        """The add at once; the stop (once) when the engine has nothing left to run."""
        if len(commands) == 2 or (commands and not engine.has_unfinished()):
            return commands.pop(0)
        assert timeout is not None, "the loop would wait forever for a command"
        return None

    loop.run(receive, rounds.append)
    failed = {rid: why for r in rounds for rid, why in r.failed}
    finished = {o.request_id for r in rounds for o in r.outputs if o.finished}
    assert set(failed) == {"short", "long"}, (failed, finished)
    assert "building the outputs broke" in failed["short"] and not finished and not loop.live
