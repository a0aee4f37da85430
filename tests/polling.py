"""Waiting in a test for what crosses a real call or process: polled, never a fixed sleep."""

from __future__ import annotations

import asyncio
from typing import Any


async def until(ready: Any, what: str, timeout_s: float = 30.0) -> None:
    """Until `ready()` is true; fails naming `what` after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not ready():
        assert asyncio.get_running_loop().time() < deadline, f"not {what} in {timeout_s} s"
        await asyncio.sleep(0.01)
