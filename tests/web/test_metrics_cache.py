"""The metrics endpoint's cache and ETag: a repeated request is answered 304 (after the
login and ownership checks), the cached series equals a fresh read, and points the worker
writes to a running job show up at once."""

import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext

from webapp.jobs import selectors
from webapp.jobs.models import Job, Metric
from workers.sink import DatabaseSink


@pytest.fixture(autouse=True)
def empty_cache():
    cache.clear()
    yield
    cache.clear()


def write_points(job: Job, step: int, values: dict[str, float]) -> None:
    """Store points as the worker does: through its sink, which also moves the job on."""
    sink = DatabaseSink(job).start()
    sink.metric(step, values)
    sink.close()


def metrics_url(job: Job, query: str = "") -> str:
    return f"/api/jobs/{job.pk}/metrics/{query}"


@pytest.mark.django_db(transaction=True)
def test_a_repeated_request_gets_304_until_a_new_point_arrives(alice, alice_client):
    job = Job.objects.create(owner=alice, kind="rl", status="running", config={})
    write_points(job, 1, {"reward/mean": 0.25})
    first = alice_client.get(metrics_url(job))
    assert first.status_code == 200 and first["ETag"]

    again = alice_client.get(metrics_url(job), headers={"if-none-match": first["ETag"]})
    assert again.status_code == 304 and again.content == b""
    assert again["ETag"] == first["ETag"]

    write_points(job, 2, {"reward/mean": 0.5})
    after = alice_client.get(metrics_url(job), headers={"if-none-match": first["ETag"]})
    assert after.status_code == 200 and after["ETag"] != first["ETag"]
    assert [p["step"] for p in after.json()["metrics"]["reward/mean"]] == [1, 2]


def test_each_query_has_its_own_etag(alice_client, alice_eval):
    etags = {
        alice_client.get(metrics_url(alice_eval, query))["ETag"]
        for query in ("", "?since=5", "?names=loss/kl", "?max_points=10")
    }
    assert len(etags) == 4


def test_another_user_gets_404_not_304(alice_client, bob_client, client, alice_eval):
    etag = alice_client.get(metrics_url(alice_eval))["ETag"]
    refused = bob_client.get(metrics_url(alice_eval), headers={"if-none-match": etag})
    assert refused.status_code == 404 and "ETag" not in refused
    anonymous = client.get(metrics_url(alice_eval), headers={"if-none-match": etag})
    assert anonymous.status_code == 401


QUERIES = {
    "": {},
    "?since=27": {"since": 27},
    "?names=loss/kl,spiky": {"names": ["loss/kl", "spiky"]},
    "?max_points=50": {"max_points": 50},
}


def test_cached_series_equal_fresh_reads(alice_client, alice_eval):
    Metric.objects.bulk_create(
        Metric(job=alice_eval, step=s, name="spiky", value=float(s % 13)) for s in range(1, 301)
    )
    Job.objects.filter(pk=alice_eval.pk).update(last_step=300)
    for cached in (False, True):
        for query, arguments in QUERIES.items():
            with CaptureQueriesContext(connection) as queries:
                body = alice_client.get(metrics_url(alice_eval, query)).json()
            read_metrics = any("jobs_metric" in q["sql"] for q in queries.captured_queries)
            assert read_metrics != cached, query
            assert body["metrics"] == selectors.metric_series(alice_eval, **arguments), query
            assert body["last_step"] == 300


def test_times_are_the_stored_timestamps(alice_eval):
    series = selectors.metric_series(alice_eval, names=["loss/kl"])["loss/kl"]
    stored = Metric.objects.filter(job=alice_eval, name="loss/kl").order_by("step")
    assert [p["t"] for p in series] == [m.created.timestamp() for m in stored]


@pytest.mark.django_db(transaction=True)
def test_a_running_jobs_new_step_replaces_its_cached_series(alice, alice_client):
    job = Job.objects.create(owner=alice, kind="rl", status="running", config={})
    write_points(job, 1, {"reward/mean": 0.25, "loss/kl": 0.1})
    before = alice_client.get(metrics_url(job, "?names=reward/mean")).json()
    assert before["last_step"] == 1
    write_points(job, 2, {"reward/mean": 0.5, "loss/kl": 0.2})
    after = alice_client.get(metrics_url(job, "?names=reward/mean")).json()
    assert after["last_step"] == 2
    assert [p["value"] for p in after["metrics"]["reward/mean"]] == [0.25, 0.5]
