"""The HTTP API's /metrics and /live, on the app itself (no stack): with API keys on, /metrics
answers only a caller with a valid key; /live answers anyone, and says nothing; a handler's
unexpected error is a 500 in OpenAI's error shape, and the app goes on answering."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx

from gateway.api.openai.app import HttpApi, create_app
from gateway.api.tenants import Tenancy

KEY = "k" * 40


def app(keys: dict[str, str], broken: bool = False) -> Any:
    async def engine_state() -> tuple[list[Any], int]:
        if broken:
            raise RuntimeError("a bug in the engine state")
        return [], 0

    api = HttpApi(frontend=SimpleNamespace(), tenancy=Tenancy(keys, b"salt"),  # type: ignore[arg-type]
                  metrics=SimpleNamespace(render=lambda engines, leases: "pagedkv_up 1\n"),  # type: ignore[arg-type]
                  served_model_name="m", max_body_bytes=1024, max_sse_buffer=4,
                  is_healthy=lambda: True, engine_state=engine_state)
    return create_app(api)


def get(keys: dict[str, str], path: str, authorization: str | None = None) -> httpx.Response:
    async def call() -> httpx.Response:
        headers = {"authorization": authorization} if authorization else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app(keys)),
                                     base_url="http://gateway") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(call())


def test_an_unexpected_error_is_a_500_and_the_app_answers_on():
    async def calls() -> list[httpx.Response]:
        # (An error re-raised past the middleware would raise here.)
        transport = httpx.ASGITransport(app=app({}, broken=True))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return [await client.get("/live", headers={"x-request-id": "trace-7"}),
                    await client.get("/health"), await client.get("/live")]

    failed, health, again = asyncio.run(calls())
    assert failed.status_code == 500
    assert failed.json()["error"]["message"] == "internal error: see the gateway's log"
    assert failed.headers["x-request-id"] == "trace-7"
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert again.status_code == 500 and "x-request-id" not in again.headers


def test_metrics_with_api_keys_on_need_a_valid_key():
    # No key, a wrong key: 401 in OpenAI's error shape, nothing of the metrics; a valid one
    # (the scraper's own line in the keys file): the text format.
    keys = {KEY: "prometheus"}
    for authorization in (None, "Bearer " + "x" * 40, KEY):
        response = get(keys, "/metrics", authorization)
        assert response.status_code == 401, authorization
        assert response.json()["error"]["type"] == "authentication_error"
        assert "pagedkv_up" not in response.text
    response = get(keys, "/metrics", f"Bearer {KEY}")
    assert response.status_code == 200 and response.text == "pagedkv_up 1\n"


def test_metrics_without_api_keys_are_open():
    response = get({}, "/metrics")
    assert response.status_code == 200 and response.text == "pagedkv_up 1\n"


def test_live_answers_without_a_key_and_reveals_nothing():
    for keys in ({KEY: "prometheus"}, {}):
        response = get(keys, "/live")
        assert response.status_code == 200 and response.json() == {"status": "alive"}
