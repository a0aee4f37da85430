"""Cancellation over Redis pub/sub: the ids of requests cancelled while a worker listens
(published by ``RequestStore.cancel`` on the ``{p}:cancel`` channel, see pdserve.cluster.state)."""

from __future__ import annotations

import contextlib

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from pdserve.cluster.state import DEFAULT_PREFIX, Keys, wrap_redis_errors


class CancelListener:
    """Ids of requests cancelled while subscribed, as an async iterator::

        async with CancelListener(client) as cancelled:
            async for request_id in cancelled:
                engine.abort(request_id)

    Pub/sub is best effort (a message published while nobody listens is lost), so a worker
    should also check ``RequestStore.is_cancelled`` when it admits a request. Entering waits for
    the subscription to be confirmed: a ``cancel`` issued afterwards is always delivered.
    Iteration raises ``StateStoreError`` if the connection is lost for good.
    """

    def __init__(self, client: Redis, prefix: str = DEFAULT_PREFIX) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self._pubsub: PubSub | None = None

    @wrap_redis_errors
    async def __aenter__(self) -> CancelListener:
        """Open a dedicated pub/sub connection and subscribe to the cancel channel."""
        self._pubsub = self.client.pubsub()
        try:
            await self._pubsub.subscribe(self.keys.cancel_channel)
            while True:  # the first reply on a fresh connection is the subscribe confirmation
                msg = await self._pubsub.get_message(timeout=None)
                if msg is not None and msg["type"] == "subscribe":
                    return self
        except BaseException:
            await self.__aexit__()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        """Unsubscribe and close the pub/sub connection (errors while closing are ignored)."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is None:
            return
        with contextlib.suppress(RedisError):
            await pubsub.unsubscribe()
        with contextlib.suppress(RedisError):
            await pubsub.aclose()

    def __aiter__(self) -> CancelListener:
        return self

    @wrap_redis_errors
    async def __anext__(self) -> str:
        """Block until the next cancelled request id arrives."""
        if self._pubsub is None:
            raise RuntimeError("use CancelListener inside 'async with'")
        while True:
            msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
            if msg is not None and msg["type"] == "message":
                return str(msg["data"])
