"""Retry policy as data, executed by tenacity.

One policy object says how often and how long a transient storage error is retried. The
drivers apply it around each single request (so a multipart upload retries one part, not
the whole file) with the driver's own ``is_transient`` predicate. The backends' own retry
loops (botocore, s3fs, gcsfs) are switched off on atomicstore's private filesystem
instances, so retries never multiply: the numbers here are the whole budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tenacity


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried.

    Attributes:
        attempts: total tries of one request, the first included (``1`` disables retries).
        initial_wait: first back-off in seconds; doubles each retry, with jitter.
        max_wait: cap of one back-off in seconds.
        deadline: cap in seconds on the time spent retrying one request (None: no cap).
    """

    attempts: int = 6
    initial_wait: float = 0.1
    max_wait: float = 5.0
    deadline: float | None = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be >= 1")
        if self.initial_wait < 0 or self.max_wait < 0:
            raise ValueError("RetryPolicy waits must be >= 0")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError("RetryPolicy.deadline must be > 0 or None")

    def _kwargs(self, is_transient: Callable[[BaseException], bool]) -> dict[str, Any]:
        stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(self.attempts)
        if self.deadline is not None:
            stop = stop | tenacity.stop_after_delay(self.deadline)
        return {
            "stop": stop,
            "wait": tenacity.wait_random_exponential(multiplier=self.initial_wait, max=self.max_wait),
            "retry": tenacity.retry_if_exception(is_transient),
            "reraise": True,
        }

    def retrying(self, is_transient: Callable[[BaseException], bool]) -> tenacity.Retrying:
        """A tenacity ``Retrying`` for synchronous calls."""
        return tenacity.Retrying(**self._kwargs(is_transient))

    def async_retrying(
        self, is_transient: Callable[[BaseException], bool]
    ) -> tenacity.AsyncRetrying:
        """A tenacity ``AsyncRetrying`` for coroutines run on a filesystem's event loop."""
        return tenacity.AsyncRetrying(**self._kwargs(is_transient))


NO_RETRY = RetryPolicy(attempts=1)
