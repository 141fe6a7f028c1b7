"""The push half of hot-swap: alias changes as ModelEvents on ``spec.events``.

- :class:`EventPublisher` is the registry's ``on_change`` hook: every promotion or
  rollback is published as a :class:`~specops.streams.records.ModelEvent` keyed by model name.
- :class:`EventWatcher` is a serving replica's listener. It consumes ``spec.events`` in
  its own consumer group (one per replica, ``serving-events-<replica>``), so every replica
  sees every event, and calls ``on_event`` for each. Events older than the watcher are
  skipped: polling has already covered them. A malformed event is dead-lettered by the
  consumer. A lost event costs at most one poll interval, never a wrong version, because
  the follower always resolves the alias in the registry itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from specops.registry import AliasChange
from specops.streams import OutMessage, StreamConfig, codec, open_stream
from specops.streams.consumer import RecordConsumer
from specops.streams.errors import StreamError
from specops.streams.records import ModelEvent

log = logging.getLogger(__name__)


class EventPublisher:
    """Publish registry alias changes to ``spec.events`` (a RegistryStore ``on_change`` hook)."""

    def __init__(self, stream_cfg: StreamConfig) -> None:
        self.stream_cfg = stream_cfg
        self._lock = threading.Lock()
        self._stream = None
        self._producer = None

    def __call__(self, change: AliasChange) -> None:
        event = ModelEvent(
            kind=change.kind,
            model_name=change.model_name,
            version=change.version,
            previous_version=change.previous_version,
            reason=change.reason[:4096],
        )
        with self._lock:
            if self._producer is None:
                self._stream = open_stream(self.stream_cfg)
                self._producer = self._stream.producer()
            self._producer.publish(
                self.stream_cfg.topics.events, [OutMessage(key=event.key, value=codec.encode(event))]
            )
        log.info(
            "published %s of %s version %s on %s",
            change.kind,
            change.model_name,
            change.version,
            self.stream_cfg.topics.events,
        )

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close()
            if self._stream is not None:
                self._stream.close()
            self._producer = self._stream = None


class EventWatcher:
    """Calls ``on_event(ModelEvent)`` for each event published after it started."""

    def __init__(
        self,
        stream_cfg: StreamConfig,
        replica: str,
        on_event: Callable[[ModelEvent], None],
        *,
        poll_timeout_s: float = 0.5,
        retry_s: float = 2.0,
    ) -> None:
        self.stream_cfg = stream_cfg
        self.group = f"serving-events-{replica}"
        self.on_event = on_event
        self.poll_timeout_s = poll_timeout_s
        self.retry_s = retry_s
        self.started_at = time.time()
        self.num_events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"events-{replica}", daemon=True)

    def start(self) -> EventWatcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with (
                    open_stream(self.stream_cfg) as stream,
                    RecordConsumer(
                        stream,
                        self.group,
                        [self.stream_cfg.topics.events],
                        deadletter_topic=self.stream_cfg.topics.deadletter,
                        expect=[ModelEvent],
                    ) as consumer,
                ):
                    self._consume(consumer)
            except StreamError as exc:
                log.warning(
                    "event watcher %s: %s; retrying in %.0fs (polling still follows the registry)",
                    self.group,
                    exc,
                    self.retry_s,
                )
                self._stop.wait(self.retry_s)

    def _consume(self, consumer: RecordConsumer) -> None:
        while not self._stop.is_set():
            delivered = consumer.poll(max_records=100, timeout_s=self.poll_timeout_s)
            for d in delivered:
                event = d.record
                assert isinstance(event, ModelEvent)
                if event.timestamp < self.started_at - 1.0:
                    continue  # history: the first poll already resolved every alias
                self.num_events += 1
                try:
                    self.on_event(event)
                except Exception:
                    log.exception("event handler failed on %s", event)
            if delivered:
                consumer.commit()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
