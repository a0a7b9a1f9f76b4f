"""HTTP client of the coordinator API: JSON in, JSON out, errors mapped to our tree.

Connection failures and 5xx answers are retried with backoff for up to ``retry_timeout``
seconds (a coordinator restart looks like that); 4xx answers are not retried.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import httpx

from ._exceptions import (
    ConflictError,
    CoordinatorError,
    CoordinatorUnavailableError,
    InvalidRequestError,
    ManifestMismatchError,
    NotFoundError,
    RetentionError,
    UnauthorizedError,
)

__all__ = ["CoordinatorClient"]

logger = logging.getLogger(__name__)

_BY_CODE = {"manifest_mismatch": ManifestMismatchError, "retention": RetentionError}
_BY_STATUS = {401: UnauthorizedError, 404: NotFoundError, 409: ConflictError,
              400: InvalidRequestError, 411: InvalidRequestError, 413: InvalidRequestError,
              422: InvalidRequestError}


def error_from_response(resp: httpx.Response) -> CoordinatorError:
    try:
        body = resp.json()
        code, detail = str(body.get("code", "")), str(body.get("detail", resp.text))
    except Exception:
        code, detail = "", resp.text[:500]
    cls = _BY_CODE.get(code) or _BY_STATUS.get(resp.status_code) or CoordinatorError
    return cls(resp.status_code, detail, code)


class CoordinatorClient:
    """One per Hub; thread-safe (httpx.Client is)."""

    def __init__(self, url: str, token: Optional[str] = None, *, timeout: float = 30.0,
                 retry_timeout: float = 60.0, verify: Any = True) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, verify=verify)
        self.retry_timeout = retry_timeout

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, json: Any = None, params: Any = None,
                retry_timeout: Optional[float] = None, timeout: Optional[float] = None) -> Any:
        budget = self.retry_timeout if retry_timeout is None else retry_timeout
        deadline = time.monotonic() + budget
        delay = 0.05
        while True:
            try:
                kw: dict[str, Any] = {"json": json, "params": params}
                if timeout is not None:
                    kw["timeout"] = timeout
                resp = self._http.request(method, path, **kw)
            except httpx.TransportError as e:
                problem: str = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 400:
                    return resp.json()
                if resp.status_code < 500:
                    raise error_from_response(resp)
                problem = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if time.monotonic() + delay > deadline:
                raise CoordinatorUnavailableError(
                    0, f"coordinator {self.url} unreachable for {budget:.0f}s ({method} {path}): {problem}",
                    "unavailable",
                )
            logger.debug("coordinator %s %s failed (%s); retrying in %.2fs", method, path, problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> Any:
        return self.request("POST", path, json=json if json is not None else {}, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)
