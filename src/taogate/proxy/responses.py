"""Stateful Responses: every request about a stored response goes to the instance that holds it.

vLLM keeps stored responses in its own process, so ``previous_response_id``, ``GET`` and ``cancel``
only work where the response was made. A response's id is the request's ``request_id`` body field,
which vLLM takes as given; so when the client did not choose one, the gateway does, naming the
instance it sends the request to: ``resp_<instance token>_<16 hex>``, the token a hash of the
instance's name. Any replica with the same instances decodes it, with no state shared and nothing
to expire. An id the client chose is remembered here instead (bounded in count and bytes, with
expiry), so it routes through this replica only. An id longer than ``MAX_ID_BYTES`` is refused, and
an id once bound to an instance stays bound: a later request naming it cannot re-point it.

When the instance an id names is no longer in the fleet, the answer is the one vLLM gives for an
unknown id; an id the gateway cannot place goes wherever dispatch sends it, to be answered there.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, Final

import orjson
from mypy_extensions import mypyc_attr

from taogate.errors import BadRequest, ErrorShape, NotFound, stream_error
from taogate.proxy.usage import counts

__all__ = [
    "MAX_ID_BYTES",
    "RESPONSES_ERRORS",
    "ResponseIds",
    "ResponseNotFound",
    "ResponsesErrors",
    "checked_id",
    "usage_counts",
]

_OURS: Final = re.compile(r"resp_([0-9a-f]{8})_[0-9a-f]{16}")

#: The longest ``request_id`` a client may choose (UTF-8 bytes): ids are tokens, not payloads.
MAX_ID_BYTES: Final = 256


@mypyc_attr(native_class=False)
class ResponsesErrors(ErrorShape):
    """OpenAI's shape, but a stream ends as the Responses API's do: an ``event: error`` whose
    ``type`` a client dispatching on events reads, with no ``[DONE]`` (Responses streams have
    none); its ``error`` object still makes the OpenAI SDK raise its APIError."""

    def stream_end(self, message: str, code: str) -> bytes:
        error = stream_error(message, code)
        payload = {"type": "error", "code": code, "message": message, "param": None, "error": error}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


RESPONSES_ERRORS: Final[ResponsesErrors] = ResponsesErrors()  # typed: mypyc reads it across a cycle


def checked_id(value: str) -> str:
    """A client-chosen response id, or a 400 when it is longer than ``MAX_ID_BYTES``."""
    if len(value) > MAX_ID_BYTES or len(value.encode()) > MAX_ID_BYTES:
        raise BadRequest(
            f"'request_id' is longer than {MAX_ID_BYTES} bytes.",
            code="invalid_request_id",
            param="request_id",
        )
    return value


@mypyc_attr(native_class=False)
class ResponseNotFound(NotFound):
    """vLLM's own answer for a response id it does not hold."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param="response_id")

    def body(self) -> bytes:
        error = {"message": self.message, "type": "invalid_request_error", "param": "response_id"}
        return orjson.dumps({"error": {**error, "code": 404}})


def token(instance: str) -> str:
    return hashlib.blake2b(instance.encode(), digest_size=4, person=b"taogate-resp").hexdigest()


class ResponseIds:
    """Mints self-routing ids and remembers the ids clients chose: at most ``limit`` of them and
    ``max_bytes`` of their characters, each for ``ttl`` s; past a bound the oldest go first."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        limit: int = 100_000,
        max_bytes: int = 8 << 20,
        ttl: float = 86_400.0,
    ) -> None:
        self._clock = clock
        self._limit = limit
        self._max_bytes = max_bytes
        self._ttl = ttl
        self._chosen: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id → (instance, expiry)
        self._bytes = 0  # the remembered ids' characters
        self._tokens: dict[str, str] = {}

    def _token(self, instance: str) -> str:
        found = self._tokens.get(instance)
        if found is None:
            if len(self._tokens) > 4096:  # names come from config and discovery: bounded anyway
                self._tokens.clear()
            found = self._tokens[instance] = token(instance)
        return found

    def mint(self, instance: str) -> str:
        return f"resp_{self._token(instance)}_{os.urandom(8).hex()}"

    def __len__(self) -> int:
        return len(self._chosen)

    @property
    def bytes(self) -> int:
        """The characters of the ids remembered now."""
        return self._bytes

    def remember(self, response_id: str, instance: str) -> None:
        """Bind a client-chosen id to the instance that made its response, unless it is bound
        already: the first binding holds until it expires, whoever names the id later."""
        chosen = self._chosen
        now = self._clock()
        known = chosen.get(response_id)
        if known is not None:
            if known[1] >= now:
                return
            self._forget(response_id)
        chosen[response_id] = (instance, now + self._ttl)
        self._bytes += len(response_id)
        while chosen and (len(chosen) > self._limit or self._bytes > self._max_bytes):
            self._forget(next(iter(chosen)))

    def _forget(self, response_id: str) -> None:
        del self._chosen[response_id]
        self._bytes -= len(response_id)

    def owner(self, response_id: str, instances: Collection[str]) -> str | None:
        """The instance holding ``response_id``, None when unknown; ResponseNotFound when the
        instance it was made on has left the fleet."""
        known = self._chosen.get(response_id)
        if known is not None:
            instance, expiry = known
            if expiry < self._clock():
                self._forget(response_id)
            elif instance in instances:
                return instance
            else:
                raise ResponseNotFound(response_id)
        match = _OURS.fullmatch(response_id)
        if match is None:
            return None
        for instance in instances:
            if self._token(instance) == match.group(1):
                return instance
        raise ResponseNotFound(response_id)


def usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, output tokens, cached tokens) from a Response's usage object."""
    return counts(usage, "input_tokens", "output_tokens", "input_tokens_details")
