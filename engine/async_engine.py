"""`AsyncLLMEngine`: many concurrent callers, one running batch.

NOTE: one background thread owns the `LLMEngine` and is the only one to touch it. Callers on the
event loop never block on a step: they submit commands (add, abort, reserve, ...) to a queue that
the thread drains between steps, and read per-request output queues that the thread fills with
`loop.call_soon_threadsafe`. A request arriving while others decode joins the batch at the next
step; commands are served in arrival order, so none starves behind a busy batch. After every
round of commands and every step (the moments blocks are freed) the thread grants the decode
reservations queued for free KV blocks, first come first served, and settles their futures.

    event loop ──call(fn)──▶ commands ──▶ [engine thread: drain commands → step → deliver]
         ▲                                                                   │
         └──────────────── per-request asyncio.Queue ◀───────────────────────┘
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from engine import handover_trace
from engine.config import NO_KV_WAIT, KVWaitConfig
from engine.kv_events import KVEventBatch, prefix_events
from engine.kv_handoff import Reservation
from engine.kv_progress import KVProgress, KVWatch
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine, PromptInput
from engine.loop_hops import call_on_loops
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.request_streams import EngineDeadError, RequestFailed, RequestStreams, settle
from engine.reservation_wait import await_reservation
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerStats
from engine.step_budget import with_server_budget
from engine.step_profiler import StepProfiler
from engine.step_timeline import StepTimeline

logger = logging.getLogger(__name__)

T = TypeVar("T")
HANDOVER_S = 0.002  # the longest the engine thread waits for an event loop after commands
# (fn, args, the future its answer settles and that future's loop: None when nobody waits)
_Command = tuple[Callable[..., Any], tuple, asyncio.Future | None,
                 asyncio.AbstractEventLoop | None]


class _Failed:
    """A command that fails the engine loop (a tensor-parallel rank died while it idled)."""

    def __init__(self, exc: RuntimeError) -> None:
        self.exc = exc


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]):
        """`engine`, or a function that builds it: called on the engine's own thread, the one
        that steps it (a CPU engine built on another thread runs its steps ~3x slower:
        engine/omp_threads.py); what it raises is raised here."""
        self._commands: queue.SimpleQueue[_Command | _Failed | None] = queue.SimpleQueue()
        self._stopping = False
        self._error: BaseException | None = None
        self._streams = RequestStreams("the engine loop has failed")
        # Engine thread only: reservations queued for free blocks -> the future their blocks
        # (or None: aborted while queued) are handed to.
        self._granted: dict[str, asyncio.Future] = {}
        self._polls: list[Callable[[], None]] = []  # `between_steps`
        self._timeline: StepTimeline | None = None  # PDSERVE_STEP_TIMELINE, set by the thread
        failed: list[BaseException] = []  # what building the engine raised
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(engine, failed, ready),
                                        name="pdserve-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> AsyncLLMEngine:
        """Build from the same arguments as `LLM`; without `max_num_batched_tokens` (and with
        chunked prefill) a step takes the server's budget for the device
        (engine/step_budget.py)."""
        config = build_engine_config(model, **with_server_budget(kwargs))
        return cls(lambda: LLMEngine(config))

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self, prompt: PromptInput, sampling_params: SamplingParams | None, request_id: str,
        prior_output_token_ids: list[int] | None = None, kv_watch: KVWatch | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one prompt until it finishes.

        Each output is cumulative, or holds only what is new with
        `SamplingParams(output_kind="delta")`, or comes once at the end with "final_only".
        Leaving the loop early (break, cancellation, a dropped client) aborts the request and
        frees its blocks. Bad input raises ValueError before anything is queued.
        `prior_output_token_ids`, `kv_watch`: see `LLMEngine.add_request` (a request resumed
        from another worker; the prefill role's KV progress, from `watch_kv`); `lora_request`:
        the LoRA adapter to run under (None: the base model).
        """
        self._open(request_id)
        add = functools.partial(self.engine.add_request,
                                prior_output_token_ids=prior_output_token_ids, kv_watch=kv_watch,
                                lora_request=lora_request)
        try:
            await self.call(add, request_id, prompt, sampling_params)
        except asyncio.CancelledError:
            self._streams.discard(request_id)
            self._abort_soon(request_id)  # the add may still be queued: undo it after it runs
            raise
        except BaseException:
            self._streams.discard(request_id)
            raise
        async with aclosing(self._consume(request_id)) as outputs:  # closed with us: aborts first
            async for out in outputs:
                yield out

    def watch_kv(
        self, on_progress: Callable[[KVProgress], None], layers_per_group: int = 1
    ) -> KVWatch:
        """Prefill role: a watch for `generate(..., kv_watch=)` that hands each of the request's
        KV progress notes to `on_progress` on the calling event loop, in order."""
        return KVWatch(on_progress, layers_per_group, asyncio.get_running_loop())

    async def release(self, request_id: str) -> bool:
        """Prefill role: free a finished request's held blocks (`LLMEngine.release`); False if
        it held none."""
        return await self.call(self.engine.release, request_id)

    async def held_requests(self) -> list[str]:
        """Prefill role: the finished requests holding blocks now."""
        return await self.call(_held_ids, self.engine)

    async def reserve_remote(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
        prior_output_token_ids: list[int] | None = None, wait: KVWaitConfig = NO_KV_WAIT,
        lora_request: LoRARequest | None = None,
    ) -> Reservation | None:
        """Decode role: register a request prefilled on another worker and reserve its blocks
        (returned: in order, and how many leading ones this worker's prefix cache held). Its
        outputs are read with `stream(request_id)` once `commit_remote` has queued it.

        When the cache has no room, the request waits for its blocks behind those that came
        first, as `wait` allows; None if it is aborted (`abort`) while it waits. Raises
        KVCacheFullError (no room, none within `wait.seconds`, `wait.max_requests` waiting
        already) / ValueError, keeping nothing; a cancelled caller keeps nothing either."""
        self._open(request_id)
        granted = asyncio.get_running_loop().create_future()
        return await await_reservation(
            request_id, self.call(self._reserve, request_id, prompt_token_ids, sampling_params,
                                  prior_output_token_ids, wait, granted, lora_request),
            granted, wait, self._streams, lambda: self.abort(request_id),
            lambda: self._abort_soon(request_id))

    async def commit_remote(
        self, request_id: str, first_token_id: int, logprobs: tuple[float, dict] | None
    ) -> None:
        """Decode role: the request's KV is in place; queue it behind its first token.

        Returns once the commit is queued, without waiting for the engine thread: that runs it
        before its next step (a busy engine finishes the step it is in first), and commands
        run in order, so an abort sent after this lands after the commit. NOTE: waiting made
        every KV push's reply wait for the decode step in flight, and concurrent pushes
        queue behind each other's steps. A commit that fails there (a bug: a request aborted
        meanwhile is not one) aborts the request and ends its stream with the error."""
        if self._error is not None:
            raise EngineDeadError("the engine loop has failed") from self._error
        self._commands.put((self._commit, (request_id, first_token_id, logprobs), None, None))

    def between_steps(self, poll: Callable[[], None]) -> None:
        """Call `poll()` on the engine thread before each round of queued commands, that is
        before every step, without waiting for any event loop (a KV commit doorbell: it may
        call `commit_here`). Exceptions it raises fail the engine loop."""
        self._polls.append(poll)

    def wake(self) -> None:
        """Wake the engine thread if it idles, so it runs its `between_steps` polls (from any
        thread: a doorbell's waker)."""
        self._commands.put((_nothing, (), None, None))

    def commit_here(
        self, request_id: str, first_token_id: int, logprobs: tuple[float, dict] | None
    ) -> None:
        """`commit_remote` for a caller on the engine thread (a `between_steps` poll): the
        request joins the step about to be scheduled."""
        assert threading.current_thread() is self._thread, "commit_here: engine thread only"
        self._commit(request_id, first_token_id, logprobs)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter now (`LLMEngine.add_lora`: ValueError if it is bad)."""
        await self.call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter (`LLMEngine.remove_lora`: KeyError, LoRAInUseError)."""
        await self.call(self.engine.remove_lora, lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now (read without waiting for the engine thread)."""
        return self.engine.list_loras()

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a request registered by `reserve_remote`; closing early aborts it."""
        if request_id not in self._streams:
            raise KeyError(f"request {request_id!r} is not open")
        async with aclosing(self._consume(request_id)) as outputs:  # closed with us: aborts first
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (held or reserved blocks too); its stream ends without
        a final output. True if the engine knew the request."""
        found = await self.call(self._abort, request_id)
        self._streams.end(request_id)
        return found

    @property
    def is_running(self) -> bool:
        """False once the engine thread failed or was shut down."""
        return self._error is None and not self._stopping and self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What made the engine loop fail, if it has."""
        return self._error

    async def stats(self) -> SchedulerStats:
        return await self.call(self.engine.stats)

    async def prefix_events(self, full: bool) -> KVEventBatch:
        """The prefix cache's events since the last call; with `full`, every cached hash (for
        the cluster's KV-aware routing)."""
        return await self.call(prefix_events, self.engine.block_manager, full)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` (a method of `self.engine`) on the engine thread between steps."""
        if self._error is not None:
            raise EngineDeadError("the engine loop has failed") from self._error
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._commands.put((fn, args, future, loop))
        return await future

    def shutdown(self) -> None:
        """Stop the engine thread (requests in flight are abandoned)."""
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=30)
        if self._timeline is not None:  # its collections no longer noted; its file written
            self._timeline.close()
        self.engine.shutdown()

    # ---- event-loop side helpers ---------------------------------------------------------
    def _abort_soon(self, request_id: str) -> None:
        """Queue an abort without waiting for it (the caller is being cancelled). Commands run
        in order, so it lands after any add/reserve of the same request still in the queue."""
        if self._error is None and not self._stopping:
            future = asyncio.get_running_loop().create_future()
            self._commands.put((self._abort, (request_id,), future, asyncio.get_running_loop()))

    def _open(self, request_id: str) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine loop has failed") from self._error
        self._streams.open(request_id)

    def _consume(self, request_id: str) -> AsyncIterator[RequestOutput]:
        return self._streams.consume(request_id, lambda: self.call(self._abort, request_id))

    # ---- engine thread -------------------------------------------------------------------
    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], failed: list[BaseException],
             ready: threading.Event) -> None:
        """The engine thread: build the engine if given a builder, then step it."""
        try:
            self.engine = engine() if callable(engine) else engine
            # PDSERVE_TORCH_PROFILER_DIR: a torch.profiler window over the steps
            self._profiler = StepProfiler.from_env(self.engine.config.role)
            # PDSERVE_STEP_TIMELINE: every step and collection in time order
            self._timeline = StepTimeline.from_env(self.engine.config.role)
            self.engine.runner.on_rank_failure(lambda exc: self._commands.put(_Failed(exc)))
        except BaseException as exc:  # noqa: BLE001 - raised by the constructor
            failed.append(exc)
            return
        finally:
            ready.set()
        self._loop()

    def _loop(self) -> None:
        while not self._stopping:
            try:
                if self._profiler is not None and not self.engine.has_work():
                    self._profiler.idle()
                for poll in self._polls:
                    poll()
                self._run_commands(self.engine.step_delay_s() if self.engine.has_work() else None)
                outputs = []
                if (not self._stopping and self.engine.has_work()
                        and not self.engine.step_delay_s()):
                    handover_trace.mark_all("step")
                    step = (self.engine.step if self._profiler is None
                            else lambda: self._profiler.step(self.engine.step))
                    outputs = step() if self._timeline is None else self._timeline.step(step)
                self._grant_reservations()  # blocks freed by the commands or the step
            except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
                self._error = exc
                self._fail_all(exc)
                return
            self._deliver_step(outputs)

    def _reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prior: list[int] | None, wait: KVWaitConfig, granted: asyncio.Future,
        lora_request: LoRARequest | None,
    ) -> Reservation | None:
        """Reserve now (the blocks) or queue (None; `granted` gets the blocks later)."""
        reservation = self.engine.reserve_request(request_id, prompt_token_ids, params, prior,
                                                  max_waiting=wait.max_waiting,
                                                  lora_request=lora_request)
        if reservation is None:
            self._granted[request_id] = granted
        return reservation

    def _grant_reservations(self) -> None:
        for request_id, reservation in self.engine.grant_reservations():
            future = self._granted.pop(request_id)
            future.get_loop().call_soon_threadsafe(settle, future, reservation, None)

    def _commit(
        self, request_id: str, first_token_id: int, logprobs: tuple[float, dict] | None
    ) -> None:
        """`commit_remote`'s command: nobody waits for it, so its failure goes to the stream."""
        handover_trace.mark(request_id, "commit_run")
        try:
            self.engine.commit_request(request_id, first_token_id, logprobs)
        except Exception as exc:  # noqa: BLE001 - handed to the request's reader
            if self.engine.abort_request(request_id):  # else: aborted already, nothing waits
                self._streams.put(request_id, RequestFailed(exc))

    def _abort(self, request_id: str) -> bool:
        """`LLMEngine.abort_request`; a reservation queued for blocks is told None."""
        future = self._granted.pop(request_id, None)
        if future is not None:
            future.get_loop().call_soon_threadsafe(settle, future, None, None)
        return self.engine.abort_request(request_id)

    def _run_commands(self, timeout: float | None) -> None:
        """Run queued commands, having waited up to `timeout` seconds for one (None: until one
        comes, the engine idle; 0: not at all; more: its steps paced). Then let the callers'
        event loops take their answers before the next step (below)."""
        loops: set[asyncio.AbstractEventLoop] = set()
        try:
            while True:
                try:
                    command = self._commands.get(block=timeout != 0, timeout=timeout)
                except queue.Empty:
                    return
                timeout = 0
                if command is None:
                    return
                if isinstance(command, _Failed):
                    raise command.exc
                fn, args, future, loop = command
                if future is None:  # nobody waits for its answer
                    fn(*args)
                    continue
                loops.add(loop)
                try:
                    result = fn(*args)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    loop.call_soon_threadsafe(settle, future, None, exc)
                else:
                    loop.call_soon_threadsafe(settle, future, result, None)
        finally:
            for loop in loops:
                _hand_over(loop)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their readers, one hop per event loop (engine/loop_hops.py)."""
        for out in outputs:
            handover_trace.mark(out.request_id, "step_out")
        call_on_loops(self._streams.output_calls(outputs))

    def _fail_all(self, exc: BaseException) -> None:
        self._streams.fail_all(exc)
        dead = EngineDeadError("the engine loop has failed")
        dead.__cause__ = exc
        for future in self._granted.values():
            future.get_loop().call_soon_threadsafe(settle, future, None, dead)


def _nothing() -> None:
    """`wake`'s command."""


def _hand_over(loop: asyncio.AbstractEventLoop) -> None:
    """Wait (at most HANDOVER_S) until `loop` has run what this thread queued on it and the
    coroutines that woke up from it. NOTE: without this the engine thread went straight into
    its next step, and the event loop, woken to answer (a KV commit's reply, a reservation's
    grant), waited for the GIL behind the step's Python: ~0.8 ms of a 1.7 ms commit-to-reply on
    a 2-core box, traced with both ends' clocks. Commands come per request, not per step."""
    if loop.is_closed():
        return
    done = threading.Event()
    try:
        loop.call_soon_threadsafe(loop.call_soon, done.set)  # behind the woken coroutines
    except RuntimeError:  # closed meanwhile
        return
    done.wait(HANDOVER_S)


def _held_ids(engine: LLMEngine) -> list[str]:
    """The requests holding blocks for export (on the engine thread)."""
    return list(engine.scheduler.held)
