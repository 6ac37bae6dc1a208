"""The Batch API with the real `openai` package against a live server: upload, create, poll, download, and
the refusals (invalid files and lines, another tenant's ids); the queue limit and validation's durability are in
test_batch_intake.py."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
from sqlalchemy import select

from billing.models import UsageEntry

CHAT = "/v1/chat/completions"


def client_for(server, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys[tenant], max_retries=0)


def chat_line(custom_id: str, content: str, model: str, url: str = CHAT, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                     "temperature": 0, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def upload(client: openai.OpenAI, content: bytes):
    return client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")


def wait_for(client: openai.OpenAI, batch_id: str, statuses=("completed", "failed", "expired", "cancelled"),
             timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def output_lines(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture
def batch_server(serve):
    live = serve(batch_poll_s=0.05, batch_window=4)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    live.add_tenant("globex", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    return live


def test_a_batch_runs_to_completion_and_each_line_matches_the_live_answer(batch_server):
    client = client_for(batch_server)
    model = batch_server.engine.model_name
    prompts = {f"req-{i}": f"question number {i}" for i in range(10)}
    file = upload(client, jsonl([chat_line(cid, text, model) for cid, text in prompts.items()]))
    assert file.purpose == "batch" and file.bytes > 0
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.request_counts.total == 10
    done = wait_for(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.completed == 10 and done.request_counts.failed == 0
    assert done.metadata == {"job": "nightly"} and done.completed_at >= done.created_at
    assert done.error_file_id is None
    lines = output_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == sorted(prompts)
    for line in lines:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        live = client.chat.completions.create(model=model, messages=[{"role": "user", "content":
                                                                       prompts[line["custom_id"]]}],
                                              max_tokens=6, temperature=0).model_dump(exclude_unset=True)
        body = line["response"]["body"]
        for key in ("id", "created"):
            body.pop(key), live.pop(key)
        # The live request finds the line's prompt in the tenant's prefix cache; nothing else may differ.
        body["usage"].pop("prompt_tokens_details"), live["usage"].pop("prompt_tokens_details")
        assert body == json.loads(json.dumps(live))
    # Each line has its one ledger row: tier batch, its batch and custom_id.
    with batch_server.db.connect() as connection:
        rows = connection.execute(select(UsageEntry.custom_id, UsageEntry.tier, UsageEntry.status, UsageEntry.gpu_seconds)
                                  .where(UsageEntry.batch_id == batch.id)).all()
    assert sorted(r.custom_id for r in rows) == sorted(prompts)
    assert {r.tier for r in rows} == {"batch"} and {r.status for r in rows} == {"ok"}
    assert all(r.gpu_seconds > 0 for r in rows)
    assert client.batches.list().data[0].id == batch.id


def test_completions_endpoint_batch_answers_like_the_live_endpoint(batch_server):
    client = client_for(batch_server)
    model = batch_server.engine.model_name
    line = {"custom_id": "only", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": "abc", "max_tokens": 5, "temperature": 0}}
    batch = client.batches.create(input_file_id=upload(client, jsonl([line])).id, endpoint="/v1/completions",
                                  completion_window="24h")
    done = wait_for(client, batch.id)
    [out] = output_lines(client, done.output_file_id)
    live = client.completions.create(model=model, prompt="abc", max_tokens=5, temperature=0)
    assert out["response"]["body"]["choices"][0]["text"] == live.choices[0].text


def test_a_file_that_is_not_jsonl_is_refused_at_upload(batch_server):
    client = client_for(batch_server)
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, b'{"custom_id": "a"}\nnot json at all\n')
    assert e.value.body["code"] == "invalid_jsonl" and "line 2" in e.value.body["message"]


def test_an_upload_for_another_purpose_is_refused(batch_server):
    client = client_for(batch_server)
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"


@pytest.mark.parametrize("bad, code", [
    (lambda model: chat_line("b", "x", model, url="/v1/completions"), "mismatched_url"),
    (lambda model: chat_line("a", "x", model), "duplicate_custom_id"),
    (lambda model: chat_line("b", "x", "someone-elses-adapter"), "model_not_found"),
    (lambda model: chat_line("b", "x", model, max_tokens=100_000), "context_length_exceeded"),
    (lambda model: chat_line("b", "x", model, temperature="hot"), None),
])
def test_a_bad_line_fails_the_batch_naming_the_line(batch_server, bad, code):
    client = client_for(batch_server)
    model = batch_server.engine.model_name
    file = upload(client, jsonl([chat_line("a", "fine", model), bad(model)]))
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert created.status == "validating"
    batch = wait_for(client, created.id)
    assert batch.status == "failed" and batch.failed_at is not None
    [error] = batch.errors.data
    assert error.line == 2
    if code is not None:
        assert error.code == code


def test_another_tenant_can_neither_see_nor_cancel_a_batch_or_file(batch_server):
    acme, globex = client_for(batch_server, "acme"), client_for(batch_server, "globex")
    file = upload(acme, jsonl([chat_line("a", "mine", batch_server.engine.model_name)]))
    batch = acme.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    for call in (lambda: globex.batches.retrieve(batch.id), lambda: globex.batches.cancel(batch.id),
                 lambda: globex.files.retrieve(file.id), lambda: globex.files.content(file.id),
                 lambda: globex.files.delete(file.id),
                 lambda: globex.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert globex.batches.list().data == [] and globex.files.list().data == []
    assert wait_for(acme, batch.id).status == "completed"


def test_cancel_keeps_finished_lines_and_ends_cancelled(serve):
    live = serve(batch_poll_s=0.05, batch_window=1)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    client = client_for(live)
    model = live.engine.model_name
    file = upload(client, jsonl([chat_line(f"l{i}", f"q{i}", model, max_tokens=30) for i in range(20)]))
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    finished = done.request_counts.completed
    assert 1 <= finished < 20
    assert len(output_lines(client, done.output_file_id)) == finished


def test_files_list_retrieve_and_delete(batch_server):
    client = client_for(batch_server)
    file = upload(client, jsonl([chat_line("a", "x", batch_server.engine.model_name)]))
    assert client.files.retrieve(file.id).filename == "input.jsonl"
    assert [f.id for f in client.files.list(purpose="batch").data] == [file.id]
    assert client.files.delete(file.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)


def test_the_usage_report_shows_the_batch_tier_beside_the_others(batch_server):
    from datetime import date, timedelta

    from billing.reports import usage_report

    client = client_for(batch_server)
    model = batch_server.engine.model_name
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "live"}], max_tokens=3)
    batch = client.batches.create(input_file_id=upload(client, jsonl([chat_line("a", "x", model)])).id,
                                  endpoint=CHAT, completion_window="24h")
    assert wait_for(client, batch.id).status == "completed"
    today = date.today()
    rows = {row.group: row for row in usage_report(batch_server.db, today - timedelta(days=1),
                                                   today + timedelta(days=2))}
    assert rows["batch"].requests == 1 and rows["batch"].gpu_seconds > 0 and rows["batch"].cost > 0
    assert rows["premium"].requests == 1


def test_batch_lines_do_not_count_against_the_tenants_interactive_rate_limits(serve):
    live = serve(batch_poll_s=0.05)
    live.add_tenant("slow", "standard", rpm=1, tpm=100_000, max_concurrent=1)
    client = client_for(live, "slow")
    model = live.engine.model_name
    batch = client.batches.create(input_file_id=upload(client, jsonl([chat_line(f"l{i}", f"q{i}", model)
                                                                      for i in range(6)])).id,
                                  endpoint=CHAT, completion_window="24h")
    assert wait_for(client, batch.id).request_counts.completed == 6
    # Six lines ran, yet the tenant's one request a minute is still there for it.
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "live"}], max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "again"}], max_tokens=2)


def test_a_batch_past_its_window_expires_with_the_results_so_far(serve):
    from sqlalchemy import update

    from billing.batch_models import Batch

    live = serve(batch_poll_s=0.05, batch_window=1)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    client = client_for(live)
    model = live.engine.model_name
    batch = client.batches.create(input_file_id=upload(client, jsonl([chat_line(f"l{i}", f"q{i}", model,
                                                                                max_tokens=30)
                                                                      for i in range(20)])).id,
                                  endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with live.db.begin() as connection:  # 24 hours later
        connection.execute(update(Batch).where(Batch.id == batch.id).values(expires_at=int(time.time()) - 1))
    done = wait_for(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    finished = done.request_counts.completed
    assert 1 <= finished < 20
    assert len(output_lines(client, done.output_file_id)) == finished


def test_a_file_over_the_size_limit_is_refused_with_413_even_when_sent_chunked(serve):
    import httpx

    live = serve(batch_max_file_bytes=2000)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    big = jsonl([chat_line(f"l{i}", "x" * 100, live.engine.model_name) for i in range(40)])
    with pytest.raises(openai.APIStatusError) as e:
        upload(client_for(live), big)
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    boundary = "tiergateboundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n').encode() + big \
        + f"\r\n--{boundary}--\r\n".encode()

    def chunks():  # no content-length: the server must count as it reads
        for i in range(0, len(body), 512):
            yield body[i:i + 512]

    answer = httpx.post(live.url + "/v1/files", content=chunks(),
                        headers={"authorization": f"Bearer {live.keys['acme']}",
                                 "content-type": f"multipart/form-data; boundary={boundary}"})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "file_too_large"
    small = jsonl([chat_line("a", "x", live.engine.model_name)])
    assert upload(client_for(live), small).bytes == len(small)


def test_an_upload_with_too_many_lines_is_refused(serve):
    live = serve(batch_max_file_lines=3)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    with pytest.raises(openai.BadRequestError) as e:
        upload(client_for(live), jsonl([chat_line(f"l{i}", "x", live.engine.model_name) for i in range(4)]))
    assert e.value.body["code"] == "too_many_lines"


def test_lines_with_structured_output_all_run_though_the_tenant_compiles_one_grammar_at_a_time(batch_server):
    client = client_for(batch_server)
    model = batch_server.engine.model_name
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
               for i in range(6)]
    lines = [chat_line(f"s{i}", "json please", model, max_tokens=20,
                       response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
             for i, schema in enumerate(schemas)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(lines)).id, endpoint=CHAT,
                                  completion_window="24h")
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6, done
