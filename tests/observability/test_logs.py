"""JSON log lines carrying the request's id, tenant and tier from a contextvar."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from gateway.logs import bind, configure_logging, current_request_id, json_handler, request_context


@pytest.fixture
def log_lines():
    stream = io.StringIO()
    logger = logging.getLogger("tiergate.test.logs")
    handler = json_handler(stream)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    def lines() -> list[dict]:
        return [json.loads(line) for line in stream.getvalue().splitlines()]

    yield logger, lines
    logger.removeHandler(handler)


def test_each_line_is_one_json_object_with_the_request_fields(log_lines):
    logger, lines = log_lines
    with request_context("chatcmpl-7", tenant="acme", tier="premium"):
        logger.info("admitted %d tokens", 42, extra={"prompt_tokens": 42})
    [line] = lines()
    assert line["msg"] == "admitted 42 tokens"
    assert line["level"] == "info" and line["logger"] == "tiergate.test.logs"
    assert line["request_id"] == "chatcmpl-7" and line["tenant"] == "acme" and line["tier"] == "premium"
    assert line["prompt_tokens"] == 42
    assert line["ts"].endswith("+00:00")


def test_lines_outside_a_request_have_no_request_id(log_lines):
    logger, lines = log_lines
    with request_context("chatcmpl-1"):
        pass
    logger.warning("engine started")
    [line] = lines()
    assert "request_id" not in line and current_request_id() is None


def test_bind_adds_fields_learned_later_in_the_request(log_lines):
    logger, lines = log_lines
    with request_context("chatcmpl-2"):
        logger.info("auth")
        bind(tenant="acme", tier="standard")
        logger.info("limits")
    first, second = lines()
    assert "tenant" not in first
    assert second["tenant"] == "acme" and second["tier"] == "standard"
    with pytest.raises(RuntimeError):
        bind(tenant="nobody")


def test_concurrent_requests_each_log_their_own_id(log_lines):
    logger, lines = log_lines

    async def handle(request_id: str) -> None:
        with request_context(request_id):
            await asyncio.sleep(0.001)
            logger.info("first token")
            await asyncio.sleep(0.001)
            logger.info("done")

    async def main() -> None:
        await asyncio.gather(*(handle(f"req-{i}") for i in range(5)))

    asyncio.run(main())
    by_request: dict[str, list[str]] = {}
    for line in lines():
        by_request.setdefault(line["request_id"], []).append(line["msg"])
    assert by_request == {f"req-{i}": ["first token", "done"] for i in range(5)}


def test_exceptions_are_logged_inside_the_json_line(log_lines):
    logger, lines = log_lines
    with request_context("chatcmpl-3"):
        try:
            raise ValueError("bad body")
        except ValueError:
            logger.exception("request failed")
    [line] = lines()
    assert line["level"] == "error" and "ValueError: bad body" in line["exc"]
    assert line["request_id"] == "chatcmpl-3"


def test_configure_logging_routes_uvicorn_and_engine_logs_to_one_json_stream():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    uvicorn_error = logging.getLogger("uvicorn.error")
    saved_uvicorn = (list(uvicorn_error.handlers), uvicorn_error.propagate, uvicorn_error.level)
    uvicorn_error.setLevel(logging.WARNING)  # as uvicorn leaves it after a run with log_level="warning"
    stream = io.StringIO()
    try:
        configure_logging("info", stream)
        logging.getLogger("engine.engine").info("step failed")
        uvicorn_error.info("Uvicorn running")
        logging.getLogger("engine.engine").debug("dropped below the level")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        uvicorn_error.handlers[:], uvicorn_error.propagate, _ = saved_uvicorn
        uvicorn_error.setLevel(saved_uvicorn[2])
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["logger"], line["msg"]) for line in lines] == [
        ("engine.engine", "step failed"),
        ("uvicorn.error", "Uvicorn running"),
    ]
