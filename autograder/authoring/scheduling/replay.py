"""Learner's and nanolab's schedulers side by side: built from one settings dict, a workload replayed
around each (``replay_schedule``'s engine part; for the learner's, played here through its handle, call by
call or, for the speed test, as one message of calls), and their records made comparable.
"""

from __future__ import annotations

from collections.abc import Callable

from autograder.authoring.testing import Calls, Remote, RemoteError, expect, identity
from labkit.lab04 import replay_schedule  # the notebook's own replay (its setup cell's source)
from nanolab import PyBlockAllocator
from nanolab.engine.config import EngineConfig
from nanolab.engine.request import FinishReason, Request, RequestStatus
from nanolab.engine.scheduler import Scheduler
from nanolab.memory.block_manager import BlockManager
from nanolab.model.sampling import SamplingParams

POLICIES = ("fcfs", "shortest", "priority")


def status_of(value) -> str:
    """A status read from the sandbox (an enum member crosses as its value: "running")."""
    return "None" if value is None else str(value)


def describe(cfg: dict) -> str:
    return (
        f"policy {cfg['scheduling_policy']!r}"
        + (f" (aging_steps={cfg['aging_steps']})" if cfg["scheduling_policy"] == "priority" else "")
        + f", max_num_seqs={cfg['max_num_seqs']}, max_num_batched_tokens={cfg['max_num_batched_tokens']}, "
        f"{cfg['num_blocks']} blocks of {cfg['block_size']}"
        + ("" if "chunked" not in cfg else f", chunked prefill {'on' if cfg['chunked'] else 'off'}")
    )


def reference_scheduler(cfg: dict) -> Scheduler:
    """nanolab's scheduler with ``cfg``'s settings: chunked prefill only if ``cfg["chunked"]`` (Lab 5; Lab 4
    has none), no prefix cache."""
    config = EngineConfig(
        block_size=cfg["block_size"],
        num_blocks=cfg["num_blocks"],
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=4096,
        enable_chunked_prefill=cfg.get("chunked", False),
        enable_prefix_caching=False,
        scheduling_policy=cfg["scheduling_policy"],
        aging_steps=cfg["aging_steps"],
    )
    return Scheduler(config, BlockManager(PyBlockAllocator(cfg["num_blocks"]), cfg["block_size"]))


def learner_scheduler(lab, cfg: dict):
    """The learner's Scheduler on the notebook's block manager; returns it and its allocator (handles)."""
    allocator = lab.BlockAllocator(cfg["num_blocks"])
    config = lab.SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        scheduling_policy=cfg["scheduling_policy"],
        aging_steps=cfg["aging_steps"],
        **({"enable_chunked_prefill": cfg["chunked"]} if "chunked" in cfg else {}),
    )
    return lab.Scheduler(config, lab.BlockManager(allocator, cfg["block_size"])), allocator


def learner_replay(lab, cfg: dict, events: list[tuple]) -> tuple[list, Remote, Remote]:
    """replay_schedule's records for the learner's Scheduler, made here rather than by the notebook's helper
    (which runs in the learner's process, where a graded cell could rewrite it): the grader plays the engine's
    part, calling the Scheduler through its handle and keeping the notebook's requests' tokens and states
    itself (`lab.set`), so every decision recorded is one the Scheduler itself made. A round trip per read (the
    speed test sends its calls in one message instead: `driven_calls`). Returns the records, and the scheduler and its allocator
    (handles) to check afterwards."""
    scheduler, allocator = learner_scheduler(lab, cfg)
    status, reason = lab.RequestStatus, lab.FinishReason
    finished = lab.ref(status, "FINISHED")
    length, aborted = lab.ref(reason, "LENGTH"), lab.ref(reason, "ABORT")
    live: dict = {}
    records = []
    for event in events:
        try:
            if event[0] == "add":
                rid, prompt_len, output_len, priority, arrival = event[1:]
                req = expect(lab.Request(rid, [1] * prompt_len, priority, arrival), Remote, "Request(...)")
                scheduler.add(req)
                live[rid] = (req, output_len)
                record: tuple = ("ok",)
            elif event[0] == "abort":
                req, _ = live.pop(event[1])
                scheduler.abort(req)
                lab.set(req, "status", finished)
                lab.set(req, "finish_reason", aborted)
                record = ("ok",)
            else:
                out = scheduler.schedule()
                scheduled = expect(out.scheduled, (list, tuple), "SchedulerOutput.scheduled")
                pairs = []
                for entry in scheduled:
                    req, n = expect(entry, tuple, "each entry of SchedulerOutput.scheduled")
                    pairs.append((expect(req, Remote, "a scheduled request"), n))
                ids = [req.request_id for req, _ in pairs]
                batch = {rid: n for rid, (_, n) in zip(ids, pairs)}
                tables = {
                    rid: list(expect(req.block_table, (list, tuple), "block_table"))
                    for rid, (req, _) in zip(ids, pairs)
                }
                preempted = [
                    r.request_id for r in expect(out.preempted, (list, tuple), "SchedulerOutput.preempted")
                ]
                record = ("step", batch, preempted, tables)
                for rid, (req, n) in zip(ids, pairs):
                    computed = req.num_computed_tokens + n
                    lab.set(req, "num_computed_tokens", computed)
                    if computed == req.num_tokens:  # sampled: one more token
                        outputs = [*req.output_token_ids, 0]
                        lab.set(req, "output_token_ids", outputs)
                        if len(outputs) >= live[rid][1]:
                            scheduler.finish(req)
                            lab.set(req, "status", finished)
                            lab.set(req, "finish_reason", length)
                            del live[rid]
        except RemoteError as e:  # the learner's code raised: part of the behaviour being compared
            record = ("error", e.type_name, e.message)
        except KeyError as e:  # an abort of a request that add refused, as replay_schedule records it
            record = ("error", "KeyError", str(e))
        records.append(record)
    return records, scheduler, allocator


def driven_calls(lab, scheduler, cfg: dict, events: list[tuple]) -> tuple[Calls, Callable[[list], list]]:
    """The whole of ``events`` ("add" and "step" only) as one `Calls` list that drives the learner's Scheduler
    from here, for a speed test: the notebook's ``replay_schedule`` is not in the way, and there is no round
    trip per call. The engine's part after each step (tokens computed, a token sampled, a request finished)
    is nanolab's on the same events, so it is the right one exactly when the Scheduler decided as nanolab's
    did, which the records then show. Returns the calls and a function turning their results into
    ``replay_schedule``'s records."""
    assert all(e[0] in ("add", "step") for e in events), "driven_calls plays adds and steps only"
    make, add, schedule, finish = (
        lab.Request, lab.ref(scheduler, "add"), lab.ref(scheduler, "schedule"), lab.ref(scheduler, "finish")
    )  # fmt: skip
    finished, length = lab.ref(lab.RequestStatus, "FINISHED"), lab.ref(lab.FinishReason, "LENGTH")
    reference = reference_scheduler(cfg)
    calls, requests, plan = Calls(), {}, []
    live: dict = {}
    for event in events:
        if event[0] == "add":
            rid, prompt_len, output_len, priority, arrival = event[1:]
            requests[rid] = calls.call(make, rid, [1] * prompt_len, priority, arrival)
            plan.append(("add", rid, calls.call(add, requests[rid])))
            try:
                reference.add(req := reference_request(rid, prompt_len, priority, arrival))
                live[rid] = (req, output_len)
            except ValueError:
                pass
            continue
        out = reference.schedule()
        output = calls.call(schedule)
        results = (output, calls.get(output, "scheduled"), calls.get(output, "preempted"))
        ids = [req.request_id for req, _ in out.scheduled]
        tables = [calls.get(requests[rid], "block_table") for rid in ids]
        plan.append(("step", results, ids, tables))
        for req, n in out.scheduled:  # replay_schedule's engine part, on both schedulers
            req.num_computed_tokens += n
            calls.set(requests[req.request_id], "num_computed_tokens", req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(0)
                outputs = calls.get(requests[req.request_id], "output_token_ids", keep=False)
                calls.call(calls.get(outputs, "append", keep=False), 0, keep=False)
                if len(req.output_token_ids) >= live[req.request_id][1]:
                    reference.finish(req)
                    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
                    calls.call(finish, requests[req.request_id], keep=False)
                    calls.set(requests[req.request_id], "status", finished)
                    calls.set(requests[req.request_id], "finish_reason", length)
                    del live[req.request_id]

    def records(results: list) -> list:
        got = dict(zip(calls.keep, results))
        rid_of = {
            identity(v): rid for rid, ref in requests.items() if isinstance(v := got[ref.index], Remote)
        }

        def rid(handle) -> str:
            return rid_of.get(identity(handle), "?") if isinstance(handle, Remote) else "?"

        made = []
        for entry in plan:
            if entry[0] == "add":
                value = got[entry[2].index]
                made.append(
                    ("error", value.type_name, value.message) if isinstance(value, RemoteError) else ("ok",)
                )
                continue
            _, results, ids, tables = entry
            first, scheduled, preempted = (got[r.index] for r in results)
            if isinstance(first, RemoteError):
                made.append(("error", first.type_name, first.message))
                continue
            scheduled = expect(scheduled, (list, tuple), "SchedulerOutput.scheduled")
            pairs = [expect(s, tuple, "each entry of SchedulerOutput.scheduled") for s in scheduled]
            batch = {rid(p[0]): p[1] if len(p) > 1 else None for p in pairs}
            table_of = dict(zip(ids, (got[t.index] for t in tables)))
            made.append(
                (
                    "step",
                    batch,
                    [rid(r) for r in expect(preempted, (list, tuple), "SchedulerOutput.preempted")],
                    {
                        r: list(table_of[r]) if isinstance(table_of.get(r), (list, tuple)) else None
                        for r in batch
                    },
                )
            )
        return made

    return calls, records


def reference_request(rid: str, prompt_len: int, priority: int, arrival: float) -> Request:
    """nanolab's `Request` for an "add" event: ``prompt_len`` tokens, greedy."""
    return Request(rid, [1] * prompt_len, SamplingParams(), priority=priority, arrival_time=arrival)


def reference_replay(cfg: dict, events: list[tuple]) -> tuple[list, Scheduler]:
    """nanolab's Scheduler through the notebook's replay_schedule (run here), with nanolab's requests."""
    scheduler = reference_scheduler(cfg)
    return replay_schedule(scheduler, events, reference_request), scheduler


def comparable(record: tuple) -> tuple:
    """A record with the order of the batch and of the tables kept (dicts compare without it), and an
    error's message left out (only its type counts)."""
    if record[:1] == ("error",):
        return tuple(record[:2])
    if (
        record[:1] == ("step",)
        and len(record) == 4
        and isinstance(record[1], dict)
        and isinstance(record[3], dict)
    ):
        return ("step", list(record[1].items()), record[2], list(record[3].items()))
    return tuple(record)


class Driver:
    """replay_schedule's engine part one event at a time, around nanolab's Scheduler, to build workloads around what the reference does
    (abort a request while it is waiting, running or preempted)."""

    def __init__(self, cfg: dict) -> None:
        self.scheduler = reference_scheduler(cfg)
        self.live: dict[str, tuple] = {}
        self.steps = 0

    def play(self, event: tuple) -> None:
        if event[0] == "add":
            rid, prompt_len, output_len, priority, arrival = event[1:]
            req = reference_request(rid, prompt_len, priority, arrival)
            try:
                self.scheduler.add(req)
            except ValueError:
                return
            self.live[rid] = (req, output_len)
        elif event[0] == "abort":
            req, _ = self.live.pop(event[1])
            self.scheduler.abort(req)
            req.status = RequestStatus.FINISHED
        else:
            self.steps += 1
            out = self.scheduler.schedule()
            for req, n in out.scheduled:
                req.num_computed_tokens += n
                if req.num_computed_tokens == req.num_tokens:
                    req.output_token_ids.append(0)
                    if len(req.output_token_ids) >= self.live[req.request_id][1]:
                        self.scheduler.finish(req)
                        req.status = RequestStatus.FINISHED
                        del self.live[req.request_id]

    def in_state(self, state: str) -> list[str]:
        return [rid for rid, (req, _) in self.live.items() if req.status == state]
