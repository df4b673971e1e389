"""The learning tap: a picked request's response as it passes through the gateway in front.

Response headers, body chunks and the end reach the same learner, leases and accounting as in
``serve``: the first body chunk of a stream is its first token (TTFT, the lease's prefill done),
the usage comes from the proxy's own SSE tap or body probe, and the end releases the lease and the
key's admission (its tokens settled from the usage) and learns the instance's speed from a 200. A
stream that closes first (a client that went away, a gateway that reset) releases both too. A
gateway that served the request at another endpoint than the pick (a fallback) has the request
accounted to that instance.
"""

from __future__ import annotations

from taogate.fleet.load_report import RESPONSE_HEADER as LOAD_REPORT_RESPONSE
from taogate.gateway import Gateway
from taogate.picker.admit import Picked, header_changes
from taogate.picker.encoding import Headers
from taogate.picker.hints import instance_at
from taogate.proxy.auth import header
from taogate.proxy.retry import FailureKind, classify
from taogate.proxy.usage import UsageTap, usage_of_body

__all__ = ["Tap"]


class Tap:
    """Follows one picked request's response; ``end`` or ``close`` account it exactly once."""

    __slots__ = ("_body", "_body_size", "_first", "_gateway", "_sse", "_status", "done", "picked")

    def __init__(self, gateway: Gateway, picked: Picked) -> None:
        self._gateway = gateway
        self.picked = picked
        self._status: int | None = None
        self._sse: UsageTap | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._first = False
        self.done = False

    def headers(self, raw: Headers, served: str | None) -> tuple[Headers, list[bytes]]:
        """The response headers are in: the header changes for the client (``serve``'s
        ``downstream_headers``: the instance's name and the request id added, what only the
        gateway may say removed)."""
        p, gw = self.picked, self._gateway
        if served is not None and served != p.endpoint:
            self._moved(served)
        status = header(raw, b":status")
        self._status = int(status) if status and status.isdigit() else 502
        plain = [(k, v) for k, v in raw if not k.startswith(b":")]
        if (header(plain, b"content-type") or b"").startswith(b"text/event-stream"):
            self._sse = UsageTap()
            p.rec.stream = True
        inst = p.lease.instance
        if p.forward.ask_load:
            report = header(plain, LOAD_REPORT_RESPONSE.encode())
            inst.record_load_report(report.decode("latin-1") if report is not None else None, gw.clock())
        after = p.forward.answer_headers(plain, p.rid, inst.name)
        after.extend(p.admitted.headers)
        return header_changes(plain, after)

    def _moved(self, served: str) -> None:
        """The gateway used a fallback: the lease moves to the instance that served."""
        p, gw = self.picked, self._gateway
        inst = instance_at(gw.fleet, served)
        if inst is None or inst is p.lease.instance:
            return
        lease = gw.dispatcher.lease_on(inst.name, p.facts)
        if lease is None:
            return
        p.lease.release()
        p.lease = lease
        p.endpoint = served
        p.rec.instance = inst.name

    def body(self, chunk: bytes) -> None:
        """A chunk of the response body: a stream's first one is its first token."""
        if not chunk:
            return
        if self._sse is not None:
            if not self._first:
                self._first_token()
            self._sse.feed(chunk)
            return
        limit = self._gateway.settings.gateway.max_response_bytes
        if self._body_size + len(chunk) <= limit:
            self._body.append(chunk)
        self._body_size += len(chunk)

    def _first_token(self) -> None:
        self._first = True
        p = self.picked
        p.lease.first_token()
        p.rec.ttfb = self._gateway.clock() - p.sent_at

    def end(self) -> None:
        """The response ended: usage, the instance's health, learning, the lease, the account."""
        if self.done:
            return
        self.done = True
        p, gw = self.picked, self._gateway
        rec, inst = p.rec, p.lease.instance
        status = self._status if self._status is not None else 502
        try:
            if self._sse is not None:
                rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = p.route.usage(self._sse.usage)
            else:
                self._first_token()  # a whole answer: its time to the last byte (as ``serve``)
                if status == 200 and self._body_size <= gw.settings.gateway.max_response_bytes:
                    data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                    rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = p.route.usage(
                        usage_of_body(data)
                    )
            rec.status = status
            if status >= 400:
                verdict = classify(FailureKind.STATUS, status=status)
                if verdict.instance_fault:
                    gw.events.request_failed(inst)
                rec.error = verdict.reason
            if status < 500:
                gw.events.request_succeeded(inst)
                if status == 200:
                    p.forward.succeeded(inst.name)
                    if p.route.generates:
                        gw.accounting.learn(rec, p.facts, p.size, p.lease)
        finally:
            p.lease.release()
            gw.limiter.release(p.admitted, rec)
            gw.accounting.record(rec)

    def close(self) -> None:
        """The stream closed before the response ended: the client went away, or the gateway reset
        the request (before or after the response began)."""
        if self.done:
            return
        self.done = True
        p, gw = self.picked, self._gateway
        p.rec.status = 499
        p.rec.error = "client_gone" if self._status is not None else "no_response"
        gw.metrics.client_disconnects.inc()
        p.lease.release()
        gw.limiter.release(p.admitted, p.rec)
        gw.accounting.record(p.rec)
