"""Malformed HTTP (duplicate Content-Length, oversized headers, garbage) is answered 400 by aiohttp,
which also logs a full traceback on ``aiohttp.server`` for each one: an easy way to flood the log.
This filter drops those records and counts them in ``kvstrata_router_malformed_http_total`` instead;
every other record passes untouched."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import Counter

SERVER_LOGGER = "aiohttp.server"
log = logging.getLogger("kvstrata.router.http")


class MalformedHttpFilter(logging.Filter):
    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.counter.labels(type(exc).__name__).inc()
        log.debug("malformed HTTP request refused: %s: %s", type(exc).__name__, exc.message)
        return False

    def logger(self) -> logging.Logger:
        """A logger of this router's own for aiohttp's server (``RequestHandler(logger=...)``) that
        carries this filter and passes everything else on to ``aiohttp.server``'s handlers. Its own,
        so that routers embedded side by side each count their own requests."""
        own = logging.Logger(SERVER_LOGGER)  # not registered: nothing to leak per router
        own.parent = logging.getLogger(SERVER_LOGGER)
        own.addFilter(self)
        return own
