"""A response as the Responses API streams it: typed SSE events, each numbered.

    response.created, response.in_progress                     at once
    text:  response.output_item.added (a message), response.content_part.added, then
           response.output_text.delta per piece
    call:  response.output_item.added (a function_call), then
           response.function_call_arguments.delta per piece of its arguments
    end:   per item, in output order: response.output_text.done, response.content_part.done
           (text) or response.function_call_arguments.done (call); response.output_item.done;
           then response.completed (or response.incomplete: cut by max_output_tokens)
    a failure mid-stream: an `error` event, and the stream ends
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from gateway.backend import BackendError
from gateway.errors import OpenAIError
from gateway.protocol import random_id
from gateway.responses.protocol import FunctionCallItem, OutputMessage, OutputText
from gateway.sequence import SequenceOutput
from gateway.tools.output import CallStream
from gateway.tools.parsers import ToolCall, ToolDelta
from gateway.tools.plan import ToolPlan

if TYPE_CHECKING:
    from gateway.responses.serving import _Turn


class ResponseStream:
    def __init__(self, turn: _Turn, tools: ToolPlan | None) -> None:
        self.turn = turn
        self.calls = CallStream(tools) if tools is not None else None
        self.seq = 0
        self.items: list[OutputMessage | FunctionCallItem] = []  # by output_index
        self.message: OutputMessage | None = None  # the text item being written
        self.by_call: dict[int, FunctionCallItem] = {}  # call delta index -> its item

    async def events(self, outputs: AsyncGenerator[SequenceOutput, None]
                     ) -> AsyncGenerator[str, None]:
        yield self._event("response.created", response=self.turn.response.model_dump())
        yield self._event("response.in_progress", response=self.turn.response.model_dump())
        reason = None
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    self.turn.count.observe(out)
                    reason = out.finish_reason or reason
                    for delta in self._deltas(out):
                        for event in self._apply(delta):
                            yield event
            for event in self._close():
                yield event
            response = await self.turn.finish(self.items, *self._result(), reason)
        except (OpenAIError, BackendError) as exc:
            param = exc.param if isinstance(exc, OpenAIError) else None
            yield self._event("error", code=None, message=str(exc), param=param)
            return
        kind = "completed" if response.status == "completed" else "incomplete"
        yield self._event(f"response.{kind}", response=response.model_dump())

    def _deltas(self, out: SequenceOutput) -> list[ToolDelta]:
        if self.calls is not None:
            return self.calls.feed(out.text, out.finished)
        return [ToolDelta(content=out.text)] if out.text else []

    def _apply(self, d: ToolDelta) -> list[str]:
        """The events one delta makes: an item opened, then its piece."""
        events = []
        if d.index is None:
            if self.message is None:
                self.message = OutputMessage(id=random_id("msg"), status="in_progress",
                                             content=[])
                events += self._added(self.message)
                events.append(self._event(
                    "response.content_part.added", item_id=self.message.id,
                    output_index=self._index(self.message), content_index=0,
                    part=OutputText(text="").model_dump()))
            self.message.content = [OutputText(text=_text(self.message) + (d.content or ""))]
            events.append(self._event(
                "response.output_text.delta", item_id=self.message.id,
                output_index=self._index(self.message), content_index=0, delta=d.content,
                logprobs=[]))
            return events
        if d.index not in self.by_call:
            item = FunctionCallItem(id=random_id("fc"), call_id=d.id or random_id("call"),
                                    name=d.name or "", arguments="", status="in_progress")
            self.by_call[d.index] = item
            events += self._added(item)
        item = self.by_call[d.index]
        if d.arguments:
            item.arguments += d.arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item.id, output_index=self._index(item),
                                      delta=d.arguments))
        return events

    def _close(self) -> list[str]:
        events = []
        for index, item in enumerate(self.items):
            item.status = "completed"
            if isinstance(item, OutputMessage):
                text = _text(item)
                events.append(self._event("response.output_text.done", item_id=item.id,
                                          output_index=index, content_index=0, text=text,
                                          logprobs=[]))
                events.append(self._event("response.content_part.done", item_id=item.id,
                                          output_index=index, content_index=0,
                                          part=OutputText(text=text).model_dump()))
            else:
                events.append(self._event("response.function_call_arguments.done",
                                          item_id=item.id, output_index=index,
                                          name=item.name, arguments=item.arguments))
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=item.model_dump()))
        return events

    def _result(self) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of the whole output, for the stored conversation."""
        text = "".join(_text(i) for i in self.items if isinstance(i, OutputMessage))
        calls = [ToolCall(i.name, i.arguments, i.call_id) for i in self.items
                 if isinstance(i, FunctionCallItem)]
        return text or None, calls

    def _added(self, item: OutputMessage | FunctionCallItem) -> list[str]:
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=self._index(item),
                            item=item.model_dump())]

    def _index(self, item: OutputMessage | FunctionCallItem) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


def _text(item: OutputMessage) -> str:
    return "".join(part.text for part in item.content)
