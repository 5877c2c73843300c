"""What a fetch attempt can end in, and the labels of ``feedline_fetch_errors_total{reason}``."""

from __future__ import annotations

# Labels of feedline_fetch_errors_total{reason}: one per failed attempt.
FETCH_ERRORS = ("http_status", "connection", "timeout", "truncated", "not_tar", "checksum", "too_large", "denied",
                "no_space")


class FetchError(Exception):
    """One failed attempt; ``reason`` is its fetch-error label, ``retry`` whether trying again soon may help,
    ``retry_after`` the seconds a store asked for (``Retry-After``), ``status`` the HTTP status of a refusal."""

    def __init__(self, reason: str, message: str, retry: bool, retry_after: float | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.retry = retry
        self.retry_after = retry_after
        self.status = status

    @property
    def store_down(self) -> bool:
        """The store itself failed (unreachable, timing out, 5xx): what the circuit breaker counts."""
        return self.retry and self.reason in ("connection", "timeout", "http_status")


class FetchAborted(Exception):
    """The sidecar is stopping; the partial file was discarded."""


def too_large(max_bytes: int) -> FetchError:
    """A body past the budget, however it is read (buffered or spliced)."""
    return FetchError("too_large", f"over {max_bytes} bytes, larger than the budget; raise --budget / FEEDLINE_BUDGET",
                      retry=False)
