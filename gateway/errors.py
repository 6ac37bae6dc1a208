"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error a client sees; raised anywhere in a request's path, rendered once by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_param(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    # The same answer for an adapter that exists but is not granted: a tenant
    # must not learn the names of other tenants' adapters.
    return APIError(
        404, f"The model `{model}` does not exist or you do not have access to it.", param="model", code="model_not_found"
    )


def invalid_api_key() -> APIError:
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def service_unavailable(message: str, headers: Mapping[str, str] | None = None) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable", headers=headers)
