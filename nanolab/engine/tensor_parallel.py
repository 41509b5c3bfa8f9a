"""One model over several processes: the tensor-parallel model runner and its workers.

    driver process (rank 0)                                      worker process (rank r = 1 .. N-1)
    -----------------------                                      ----------------------------------
    scheduler, block tables, sampling                            its shard of the model, its KV heads
    each step: broadcast (token ids, KV layout, copies)  ---->   receive the step
               run its shard  <-- all-reduce after each -->      run its shard
                                  attention and MLP
               logits of the sampled rows, sample

The driver is the engine's own process: it keeps the scheduler, the block manager and every request, and
is rank 0 of the model (`TensorParallelRunner` is a `ModelRunner` whose `forward` first broadcasts the step).
Each worker holds its rank's shard of the weights and a paged KV cache with its rank's KV heads, laid out by
the same block tables, so a block id means the same tokens on every rank. The model's layers sum their
partial outputs with ``torch.distributed`` all-reduces (`nanolab.model.tensor_parallel`) over gloo, since
tensor parallelism runs on the CPU (`EngineConfig` refuses another ``device`` with it; a group for CUDA
tensors would be NCCL's: ``_new_group`` takes either, and under torchrun the backend follows the model's
device). The hidden states after the last layer are whole on every rank; only the driver computes logits.

Life cycle:

- `TensorParallelRunner` starts ``size - 1`` workers with ``torch.multiprocessing`` ("spawn": fresh
  interpreters), each given its shard, and joins them in a process group over a ``TCPStore`` on
  ``127.0.0.1`` and a free port (or ``NANOLAB_TP_ADDR`` / ``NANOLAB_TP_PORT``), so several engines on one
  machine never collide. Launched by ``torchrun`` (``WORLD_SIZE`` equal to the tensor-parallel size), every
  rank runs the user's script: rank 0 becomes the driver, the others serve as workers inside ``LLM(...)``
  and exit when the driver closes; ``MASTER_ADDR``/``MASTER_PORT`` (torchrun's) then reach other machines.
- Workers ignore Ctrl-C (it reaches the whole terminal's process group): the driver stops them. A worker
  whose driver dies (even by SIGKILL) notices within a second and exits.
- A worker that dies fails the next step (or the one running) with `TensorParallelError` naming the rank
  and its exit code; the other workers are stopped and the engine refuses further steps. `close` (the
  engine's) stops the workers; so does the interpreter's exit.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nanolab.engine.model_runner import ModelRunner
from nanolab.memory.paged_kv_cache import PagedKVCache, SeqSlice
from nanolab.model.config import ModelConfig
from nanolab.model.tensor_parallel import TPShard, check_shardable, shard_state_dict
from nanolab.model.transformer import Transformer

__all__ = ["TensorParallelError", "TensorParallelRunner", "launched_by_torchrun", "set_group", "shard_model"]

STARTUP_TIMEOUT_S = 120.0  # for every rank to join the group
# A worker waits for the next step as long as the engine is idle (a server may be idle for hours), so the
# group's own timeout is long; a dead peer is noticed at once (its sockets close), not by this timeout.
IDLE_TIMEOUT = datetime.timedelta(days=7)
PARENT_CHECK_S = 1.0  # how often a worker checks that its driver is still there
_READY_KEY = "nanolab/tp/ready"  # the store's count of workers that built their shard


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or could not start; the engine can run no further step."""


def launched_by_torchrun(size: int) -> bool:
    """Whether this process is one of ``size`` ranks that ``torchrun`` (or another launcher setting the
    same variables) started."""
    return int(os.environ.get("WORLD_SIZE", "1")) == size > 1 and "RANK" in os.environ


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _new_group(store: Any, rank: int, size: int, backend: str) -> Any:
    """A process group of ``size`` ranks over ``store`` (every rank must call this)."""
    if backend == "nccl":  # pragma: no cover - needs CUDA
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, IDLE_TIMEOUT)


def _broadcast(group: Any, obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; two broadcasts: its length, then its bytes). The bytes
    travel in CPU tensors, whatever device the model is on: gloo's."""
    if obj is not None or group.rank() == 0:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.long, device="cpu")
    else:
        size = torch.zeros(1, dtype=torch.long, device="cpu")
    group.broadcast([size], dist.BroadcastOptions()).wait()
    if group.rank() == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    group.broadcast([buf], dist.BroadcastOptions()).wait()
    return obj if group.rank() == 0 else pickle.loads(buf.numpy().tobytes())


class _Worker:
    """What a worker process runs: its shard, its KV cache, and the loop that follows the driver's steps."""

    def __init__(self, model: Transformer, kv_cache: PagedKVCache, group: Any) -> None:
        self.model, self.kv_cache, self.group = model, kv_cache, group

    @torch.inference_mode()
    def serve(self) -> None:
        while True:
            step = _broadcast(self.group)
            if step is None:
                return
            token_ids, seqs, copies = step
            if copies:
                self.kv_cache.copy_blocks(copies)
            positions = self.kv_cache.prepare([SeqSlice(*s) for s in seqs])
            ids = torch.tensor(token_ids, dtype=torch.long, device=self.kv_cache.device)
            self.model(ids, positions, self.kv_cache)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(1)


def shard_model(model: Transformer, tp: TPShard) -> Transformer:
    """Rank ``tp.rank``'s shard of the whole ``model``: the default ``shard_fn`` (`Transformer.shard`)."""
    return model.shard(tp)


def _shard_from_state(config: dict, state: dict[str, torch.Tensor], tp: TPShard) -> Transformer:
    """A spawned worker's shard, from the tensors the driver sliced for it."""
    return Transformer.from_state_dict(ModelConfig.from_dict(config), state, "the driver's shard", tp)


def _worker_main(
    rank: int,
    size: int,
    addr: str,
    port: int,
    build: Callable[[TPShard], Transformer],
    cache: dict[str, Any],
    parent: int,
    threads: int,
) -> None:
    """A worker: build the shard (``build(tp)``), join the group, follow the driver until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops the workers
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    store = dist.TCPStore(addr, port, size, False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    model = build(TPShard(rank, size)).eval()  # the group comes once every rank is ready
    del build
    kv_cache = PagedKVCache(model.config, num_kv_heads=model.layers[0].attn.n_kv_heads, **cache)
    store.add(_READY_KEY, 1)
    group = _new_group(store, rank, size, "gloo")
    set_group(model, TPShard(rank, size, group))
    _Worker(model, kv_cache, group).serve()


def set_group(model: Transformer, tp: TPShard) -> None:
    """Point every layer of ``model`` at ``tp`` (the same rank, now with its process group)."""
    model.tp = tp
    for layer in model.layers:
        layer.attn.tp = layer.mlp.tp = tp


def _kill_all(workers: list[Any]) -> None:
    """Stop workers left running by a runner nobody closed (it was garbage-collected)."""
    for proc in workers:
        if proc.exitcode is None:
            proc.kill()


class TensorParallelRunner(ModelRunner):
    """A `ModelRunner` over a model split across ``size`` processes; this process is rank 0 (the driver).

    ``model`` is the whole model: each rank gets its shard of it (`nanolab.model.tensor_parallel`), and the
    driver keeps only its own. Every `forward` sends the step to the workers first. ``threads`` is torch's
    intra-op threads per worker (None: this process's share, ``torch.get_num_threads() // size``, at least
    1). ``shard_fn(model, tp)`` builds a rank's shard (default `shard_model`); when it is given, the
    workers are forked rather than spawned, so it may be a function of a notebook's, and every layer's
    ``tp`` is replaced once the rank has joined the group. Call `close` when done (the engine does).
    """

    def __init__(
        self,
        model: Transformer,
        size: int,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "auto",
        threads: int | None = None,
        shard_fn: Callable[[Transformer, TPShard], Transformer] | None = None,
    ) -> None:
        check_shardable(model.config, size)
        self.size = size
        self._workers: list[Any] = []
        self._group: Any = None
        self._failed: str | None = None
        self._owns_world = False  # launched by torchrun: this runner initialised torch.distributed
        cache = {"num_blocks": num_blocks, "block_size": block_size, "attention_backend": attention_backend}
        threads = threads or max(1, torch.get_num_threads() // size)
        state = model.state_dict()
        given = shard_fn is not None
        shard_fn = shard_fn or shard_model
        if launched_by_torchrun(size):
            rank = int(os.environ["RANK"])
            self._owns_world = not dist.is_initialized()
            if self._owns_world:
                dist.init_process_group(_backend(model.lm_head.weight.device))
            self._group = dist.new_group(list(range(size)))
            shard = shard_fn(model, TPShard(rank, size, self._group)).eval()
            kv_cache = PagedKVCache(model.config, num_kv_heads=shard.layers[0].attn.n_kv_heads, **cache)
            if rank != 0:  # this rank serves the driver, then its script ends here
                _Worker(shard, kv_cache, self._group).serve()
                self._destroy_groups()
                raise SystemExit(0)
        else:
            addr = os.environ.get("NANOLAB_TP_ADDR", "127.0.0.1")
            store = dist.TCPStore(
                addr,
                int(os.environ.get("NANOLAB_TP_PORT", 0)),  # 0: a free port
                size,
                True,
                timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
                wait_for_workers=False,
            )
            port = store.port
            # A shard function of the caller's may live where a fresh interpreter cannot import it (a
            # notebook): the workers are then forked, and find it, and the whole model, in their memory.
            ctx = torch.multiprocessing.get_context("fork" if given else "spawn")
            config = model.config.to_dict()
            try:
                for rank in range(1, size):
                    if given:
                        build = functools.partial(shard_fn, model)
                    else:  # each worker is sent its own slices only
                        build = functools.partial(
                            _shard_from_state, config, shard_state_dict(model.config, state, rank, size)
                        )
                    args = (rank, size, addr, port, build, cache, os.getpid(), threads)
                    proc = ctx.Process(target=_worker_main, args=args, name=f"nanolab-tp-{rank}", daemon=True)
                    # Ctrl-C reaches every process of the terminal's group; a worker must only stop when
                    # told. It starts with SIGINT blocked (inherited through fork and exec), then ignores it.
                    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                    try:
                        proc.start()
                    finally:
                        signal.pthread_sigmask(signal.SIG_SETMASK, old)
                    self._workers.append(proc)
                weakref.finalize(self, _kill_all, list(self._workers))
                self._wait_ready(store)
                self._group = _new_group(store, 0, size, "gloo")
            except BaseException as e:
                self._stop_workers()
                if isinstance(e, TensorParallelError):
                    raise
                raise TensorParallelError(f"the tensor-parallel workers could not start: {e}") from e
            shard = shard_fn(model, TPShard(0, size, self._group)).eval()
            set_group(shard, TPShard(0, size, self._group))
            kv_cache = PagedKVCache(model.config, num_kv_heads=shard.layers[0].attn.n_kv_heads, **cache)
        super().__init__(shard.eval(), kv_cache)

    def _wait_ready(self, store: Any) -> None:
        """Wait until every worker has built its shard (before any rank joins the group, whose setup
        would wait for a dead worker until it times out)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while store.add(_READY_KEY, 0) < len(self._workers):
            dead = self._dead_workers()
            if dead:
                raise TensorParallelError(
                    f"{dead} while starting (its error is printed above). A script that builds an engine "
                    'with tensor_parallel_size > 1 must do it under `if __name__ == "__main__":`, as '
                    "multiprocessing's spawn requires"
                )
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"the tensor-parallel workers were not ready after {STARTUP_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.02)

    def forward(
        self, token_ids: list[int], seqs: list[SeqSlice], blocks_to_copy: Sequence[tuple[int, int]] = ()
    ) -> torch.Tensor:
        self._check_workers()
        try:
            _broadcast(self._group, (token_ids, [tuple(s) for s in seqs], list(blocks_to_copy)))
            return super().forward(token_ids, seqs, blocks_to_copy)
        except Exception as e:
            # A rank that failed mid-step leaves the others inside a collective: no later step can
            # line up with them, so the workers are stopped and the engine refuses to go on.
            dead = self._dead_workers()
            self._failed = dead or f"a tensor-parallel step failed ({type(e).__name__}: {e})"
            self._stop_workers()
            raise TensorParallelError(self._failed) from e

    def _dead_workers(self) -> str | None:
        for rank, proc in enumerate(self._workers, start=1):
            if proc.exitcode is not None:
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"
                )
        return None

    def _check_workers(self) -> None:
        if self._failed is None:
            self._failed = self._dead_workers()
            if self._failed is not None:
                self._stop_workers()
        if self._failed is not None:
            raise TensorParallelError(f"{self._failed}; this engine can run no more steps")

    def _stop_workers(self, timeout: float = 5.0) -> None:
        for proc in self._workers:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._workers:
            proc.join(timeout)

    def _destroy_groups(self) -> None:
        """Under torchrun: leave the process groups (their threads must end before the interpreter does)."""
        if dist.is_initialized():
            dist.destroy_process_group(self._group)
            if self._owns_world:
                dist.destroy_process_group()

    def close(self) -> None:
        """Stop the workers (they finish the step they are in first). Idempotent."""
        if self._failed is None and self._group is not None:
            self._failed = "the engine was closed"
            try:
                if not self._dead_workers():
                    _broadcast(self._group, None)
            except Exception:  # noqa: BLE001 - a worker already gone: it is stopped below either way
                pass
            deadline = time.monotonic() + 5.0
            for proc in self._workers:
                proc.join(max(0.0, deadline - time.monotonic()))
            if not self._workers:  # torchrun's ranks
                self._destroy_groups()
        self._stop_workers()
