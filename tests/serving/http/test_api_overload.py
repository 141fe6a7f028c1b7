"""Bounded admission: the ``Admission`` primitive on its own, and a saturated server that
answers 429 at once instead of hanging, then recovers."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import requests

from specops.core.errors import OverloadedError, QueueTimeoutError
from specops.serving.http.admission import Admission
from tests.serving.http.api_support import MODEL, assert_error, metric, running, serve_config, wait_until


# ---------------------------------------------------------------- Admission, unit
async def _queued(adm: Admission, n: int) -> None:
    for _ in range(200):
        if adm.snapshot().waiting == n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"expected {n} waiting, have {adm.snapshot()}")


def test_queue_full_is_refused_at_once_and_a_long_wait_times_out():
    async def main():
        adm = Admission(1, 1, queue_timeout_s=0.3)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await _queued(adm, 1)
        t0 = time.perf_counter()
        with pytest.raises(OverloadedError) as over:
            await adm.acquire()
        assert time.perf_counter() - t0 < 0.05 and over.value.code == "overloaded"
        with pytest.raises(QueueTimeoutError) as late:
            await waiter
        assert time.perf_counter() - t0 >= 0.25 and late.value.code == "queue_timeout"
        assert "waited 0.3s for a decode worker" in str(late.value)
        snap = adm.snapshot()
        assert (snap.running, snap.waiting, snap.load) == (1, 0, 0.5)
        adm.release()
        assert adm.snapshot().running == 0

    asyncio.run(main())


def test_released_slots_go_to_waiters_first_come_first_served():
    async def main():
        adm = Admission(1, 3, queue_timeout_s=10)
        await adm.acquire()
        order: list[int] = []

        async def wait(i):
            await adm.acquire()
            order.append(i)

        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(wait(i)))
            await _queued(adm, i + 1)
        assert adm.snapshot().load == 1.0
        for n in range(3):
            adm.release()  # hands the slot over: running stays 1
            await asyncio.wait_for(tasks[n], 2)
            assert order == list(range(n + 1))
            assert (adm.snapshot().running, adm.snapshot().waiting) == (1, 2 - n)
        adm.release()
        assert (adm.snapshot().running, adm.snapshot().waiting) == (0, 0)

    asyncio.run(main())


def test_release_from_another_thread_wakes_the_waiter():
    async def main():
        adm = Admission(1, 1, queue_timeout_s=10)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await _queued(adm, 1)
        t = threading.Thread(target=lambda: (time.sleep(0.05), adm.release()))
        t.start()
        await asyncio.wait_for(waiter, 2)
        t.join()
        assert (adm.snapshot().running, adm.snapshot().waiting) == (1, 0)
        await asyncio.to_thread(adm.release)
        assert adm.snapshot().running == 0

    asyncio.run(main())


@pytest.mark.parametrize("release_first", [False, True])
def test_a_cancelled_waiter_does_not_leak_the_slot(release_first):
    async def main():
        adm = Admission(1, 2, queue_timeout_s=10)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await _queued(adm, 1)
        if release_first:  # the slot is on its way to the waiter (a callback) when it is cancelled
            adm.release()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.01)  # let a pending hand-over run
        if not release_first:
            assert (adm.snapshot().running, adm.snapshot().waiting) == (1, 0)
            adm.release()
        assert (adm.snapshot().running, adm.snapshot().waiting) == (0, 0)
        await adm.acquire()  # and the slot is usable
        assert adm.snapshot().running == 1

    asyncio.run(main())


# ---------------------------------------------------------------- a saturated server
def test_overload_gets_429_at_once_and_the_server_recovers(tiny_models, tmp_path):
    cfg = serve_config(tiny_models, max_concurrency=1, max_queue=1, queue_timeout_s=60)
    with running(cfg, tmp_path) as srv:
        url = srv.url
        rejected_before = metric(
            requests.get(url + "/metrics").text, "specops_admission_rejected_total", reason="queue_full"
        )
        # target-only decoding of 300 tokens takes 0.4-5 s on the tiny model; all 8 arrive within milliseconds
        body = {
            "model": MODEL,
            "prompt": "hello there",
            "max_tokens": 300,
            "temperature": 0,
            "speculation": {"method": "target"},
        }
        n = 8
        start = threading.Barrier(n)
        results: list = [None] * n

        def fire(i):
            start.wait()
            t0 = time.perf_counter()
            r = requests.post(url + "/v1/completions", json=body, timeout=120)
            results[i] = (r, time.perf_counter() - t0)

        threads = [threading.Thread(target=fire, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        health = requests.get(url + "/healthz", timeout=5)  # the process answers while saturated
        assert health.status_code == 200
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a request hung"
        statuses = sorted(r.status_code for r, _ in results)
        ok = [r for r, _ in results if r.status_code == 200]
        refused = [(r, s) for r, s in results if r.status_code == 429]
        assert len(ok) >= 2 and refused and len(ok) + len(refused) == n, statuses  # one ran, one waited, rest 429
        for r, seconds in refused:
            assert_error(r, 429, "overloaded")
            assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["Retry-After"] == "1"
            assert seconds < min(s for r2, s in results if r2.status_code == 200), "429 must not wait for a worker"
        assert all(r.json()["usage"]["completion_tokens"] == 300 for r in ok)
        assert len({r.json()["choices"][0]["text"] for r in ok}) == 1
        # recovered: probes, a new request, and the refusals counted
        ready = requests.get(url + "/readyz")
        assert requests.get(url + "/healthz").status_code == 200 and ready.status_code == 200
        assert (ready.json()["running"], ready.json()["waiting"]) == (0, 0)
        r = requests.post(url + "/v1/completions", json=body | {"max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        text = requests.get(url + "/metrics").text
        assert metric(text, "specops_admission_rejected_total", reason="queue_full") == rejected_before + len(refused)
        assert metric(text, "specops_api_requests_total", endpoint="/v1/completions", status="429") >= len(refused)
        assert metric(text, "specops_admission_queue_depth") == 0


def test_queue_and_request_timeouts(tiny_models, tmp_path):
    cfg = serve_config(tiny_models, max_concurrency=1, max_queue=1, queue_timeout_s=0.2, request_timeout_s=0.5)
    long = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": 1000,
        "temperature": 0,
        "speculation": {"method": "target"},
    }  # longer than request_timeout_s on any machine
    with running(cfg, tmp_path) as srv:
        url = srv.url + "/v1/completions"

        def counts() -> tuple[float, float]:
            text = requests.get(srv.url + "/metrics").text
            return (
                metric(text, "specops_requests_cancelled_total", reason="timeout"),
                metric(text, "specops_admission_rejected_total", reason="queue_timeout"),
            )

        timeouts0, queue_timeouts0 = counts()
        first: list = []
        t = threading.Thread(target=lambda: first.append(requests.post(url, json=long, timeout=60)), daemon=True)
        t.start()
        assert wait_until(lambda: srv.state.admission.snapshot().running == 1, 10)
        waited = requests.post(url, json=long | {"max_tokens": 2}, timeout=60)  # queued behind it, gives up
        err = assert_error(waited, 503, "queue_timeout")
        assert err["type"] == "service_unavailable" and waited.headers["Retry-After"] == "1"
        assert "waited 0.2s" in err["message"]
        t.join(30)
        assert not t.is_alive()
        err = assert_error(first[0], 504, "request_timeout")
        assert err["type"] == "timeout" and "more than 0.5s" in err["message"]
        # a stream that runs out of time ends with an in-band OpenAI-shaped error instead of [DONE]
        extra_timeouts = 0
        for _ in range(3):
            with requests.post(url, json=long | {"stream": True}, stream=True, timeout=60) as r:
                if r.status_code == 504:  # no token within 0.5 s on a loaded machine: a plain 504 (also a timeout)
                    assert_error(r, 504, "request_timeout")
                    extra_timeouts += 1
                    continue
                assert r.status_code == 200
                events = [line.removeprefix(b"data: ") for line in r.iter_lines() if line]
                break
        else:
            pytest.fail("three streams in a row timed out before their first token")
        assert b"[DONE]" not in events and len(events) >= 2
        last = json.loads(events[-1])
        assert (last["error"]["code"], last["error"]["type"]) == ("request_timeout", "timeout")
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert counts() == (timeouts0 + 2 + extra_timeouts, queue_timeouts0 + 1)
        assert wait_until(lambda: srv.state.admission.snapshot().running == 0, 5)
        for _ in range(3):  # the server serves again; on a loaded machine 3 tokens may still take > 0.5 s
            ok = requests.post(url, json=long | {"max_tokens": 3})
            if ok.status_code != 504:
                break
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
