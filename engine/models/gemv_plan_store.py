"""Decode GEMV plans kept per host: every process on one GPU model picks the same kernels.

NOTE: `plan_decode_gemv` times candidate kernels at load, and timings move by a few percent
between loads, so two processes (a prefill and a decode worker, a worker and a colocated
reference) could choose differently where candidates are close; their bf16 outputs would then
differ by rounding, and greedy tokens of near-flat distributions split. So the first process to
plan a shape records its choice in a JSON file, and later ones read it instead of timing (they
also start faster). The whole planning runs under an exclusive lock on the file: processes
starting together wait for the first one's choices.

    key    "<what> <n>x<k> <dtype> | <GPU name> sm<major><minor> | torch <v> triton <v>"
    value  {"<padded M>": [block_n, block_k, num_warps, pdl] or null (the fallback), ...}

A file that cannot be read (corrupt, another format) is replaced; one that cannot be written
(read-only home) leaves the plan timed per process, as without a store. Where the file lives:
`EngineConfig.decode_gemv_cache` (None: no store).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

Choices = dict[int, tuple | None]  # padded M -> the tile's fields, or None for the fallback


class PlanStore:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Choices]]:
        """The recorded choices, under the file's exclusive lock; what the caller adds to the
        dict is written back when the block ends. Without a usable file: an empty dict, kept
        nowhere."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_name(self.path.name + ".lock"), "a")  # noqa: SIM115
        except OSError as exc:
            logger.warning("decode GEMV plan store %s unusable (%s): timing every shape",
                           self.path, exc)
            yield {}
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            known = self._read()
            before = dict(known)
            yield known
            if known != before:
                self._write(known)

    def _read(self) -> dict[str, Choices]:
        try:
            raw = json.loads(self.path.read_text())
            return {key: {int(m): None if c is None else tuple(c) for m, c in value.items()}
                    for key, value in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            logger.warning("decode GEMV plan store %s unreadable (%s): replaced", self.path, exc)
            return {}

    def _write(self, known: dict[str, Choices]) -> None:
        text = json.dumps({key: {str(m): None if c is None else list(c) for m, c in v.items()}
                           for key, v in sorted(known.items())}, indent=1)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".gemv_plans.")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)  # readers never see half a file
        except OSError as exc:
            logger.warning("decode GEMV plan store %s not written: %s", self.path, exc)


def plan_key(what: str, n: int, k: int, dtype: str, device: str, versions: str) -> str:
    return f"{what} {n}x{k} {dtype} | {device} | {versions}"
