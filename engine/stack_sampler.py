"""Every thread's Python stack, sampled from inside the process: where a server's host time goes
on machines where py-spy cannot attach (the GPU machines refuse most of its samples).

    PDSERVE_STACK_SAMPLES=DIR pdserve up ...     # every pdserve process writes into DIR:
        ROLE-PID.txt        one line per distinct stack: `thread;outer frame;...;inner frame N`
                            (py-spy's raw format: pdserve.bench.pyspy_summary reads it)
        ROLE-PID.cpu.json   each OS thread's CPU seconds (user + system, /proc) since sampling
                            began, by name, and the samples taken
    PDSERVE_STACK_SAMPLE_WHILE=PATH              # only while PATH exists (a load's run), CPU
                                                 # counted from when it first appeared

NOTE: a daemon thread wakes every 1 / PDSERVE_STACK_SAMPLE_HZ seconds (default 100), takes
`sys._current_frames()` and counts each thread's stack as a tuple of (code, line): formatting
waits for the dump, so a sample costs tens of microseconds of the GIL. The sampler needs the GIL
to look, so it sees every thread at a moment some thread let it go; a thread blocked in C (a
lock, a socket, a CUDA synchronisation, torch's kernels) shows the Python line that called in.
The thread CPU file says which threads ran (read twice a second, so a thread's last half
second may be missing); the stacks say where. Both files are rewritten every
few seconds and at exit, so a process stopped by a signal keeps what it had.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType

ENV_DIR = "PDSERVE_STACK_SAMPLES"
ENV_HZ = "PDSERVE_STACK_SAMPLE_HZ"
ENV_GATE = "PDSERVE_STACK_SAMPLE_WHILE"
DUMP_EVERY_S = 5.0
CPU_EVERY_S = 0.5

Stack = tuple[tuple[object, int], ...]  # (code object, line), outermost first


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """{native thread id: (OS thread name, CPU seconds)} of this process's threads."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


class StackSampler:
    def __init__(self, path: Path, hz: float, gate: str = "") -> None:
        self.path = path
        self.interval = 1.0 / hz
        self.gate = gate  # sample only while this path exists ("": always)
        self.counts: collections.Counter[tuple[str, Stack]] = collections.Counter()
        self.samples = 0
        self._cpu_start = {} if gate else _thread_cpu()  # gated: taken when it first opens
        self._opened = not gate
        self._cpu_seen: dict[int, tuple[str, float]] = {}  # the last reading, ended threads too
        self._names: dict[int, str] = {}  # native id -> Python thread name, as they were seen
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the sampler thread's counts against a dump at exit
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)  # its own dump under way ends first: one writer a file
        self.dump()

    def _run(self) -> None:
        me = threading.get_ident()
        next_dump = time.monotonic() + DUMP_EVERY_S
        next_cpu = 0.0
        while not self._stop.wait(self.interval):
            if self.gate and not os.path.exists(self.gate):
                continue
            if not self._opened:
                self._cpu_start, self._opened = _thread_cpu(), True
            by_ident = {t.ident: t for t in threading.enumerate()}
            with self._lock:
                for ident, frame in sys._current_frames().items():
                    if ident == me:
                        continue
                    thread = by_ident.get(ident)
                    name = thread.name if thread is not None else f"thread-{ident}"
                    if thread is not None and thread.native_id is not None:
                        self._names[thread.native_id] = name
                    self.counts[(name, _stack(frame))] += 1
                self.samples += 1
            if time.monotonic() >= next_cpu:  # a thread's CPU is read while it lives
                self._cpu_seen.update(_thread_cpu())
                next_cpu = time.monotonic() + CPU_EVERY_S
            if time.monotonic() >= next_dump:
                self.dump()
                next_dump = time.monotonic() + DUMP_EVERY_S

    def dump(self) -> None:
        if not self._opened:
            return
        with self._lock:
            lines = [";".join([name, *(_frame_text(code, line) for code, line in stack)])
                     + f" {count}" for (name, stack), count in self.counts.items()]
            samples = self.samples
        if not self.gate or os.path.exists(self.gate):
            self._cpu_seen.update(_thread_cpu())
        threads = collections.Counter()
        for tid, (os_name, seconds) in self._cpu_seen.items():
            start = self._cpu_start.get(tid, (os_name, 0.0))[1]
            threads[f"{self._names.get(tid, os_name)} [{tid}]"] += round(seconds - start, 3)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)
        cpu = {"samples": samples, "interval_s": self.interval,
               "threads_cpu_s": dict(threads.most_common())}
        self.path.with_suffix(".cpu.json").write_text(json.dumps(cpu, indent=1) + "\n")


def _stack(frame: FrameType | None) -> Stack:
    stack = []
    while frame is not None:
        stack.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(reversed(stack))


def _frame_text(code: object, line: int) -> str:
    parts = Path(code.co_filename).parts  # type: ignore[attr-defined]
    where = "/".join(parts[-2:])
    return f"{getattr(code, 'co_qualname', code.co_name)} ({where}:{line})"  # type: ignore


def start_from_env(role: str) -> StackSampler | None:
    """Start sampling this process when PDSERVE_STACK_SAMPLES names a folder (made if need
    be); the files are named after `role` and the pid. None when it is not set."""
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return None
    hz = float(os.environ.get(ENV_HZ, "100"))
    if hz <= 0:
        raise ValueError(f"{ENV_HZ} must be > 0, got {hz}")
    Path(folder).mkdir(parents=True, exist_ok=True)
    sampler = StackSampler(Path(folder) / f"{role}-{os.getpid()}.txt", hz,
                           os.environ.get(ENV_GATE, ""))
    sampler.start()
    return sampler
