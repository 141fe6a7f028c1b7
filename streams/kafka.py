"""The ``kafka://`` backend, on kafka-python.

- Producers use ``acks=all`` with idempotence and retries; a keyed record goes to
  ``murmur2(key) % partitions`` (Kafka's default), so a cluster stays in order on one
  partition. ``publish`` waits for every acknowledgement before it returns.
- Consumers join a consumer group with auto-commit off; ``commit()`` commits the
  positions after the records ``poll`` returned. Groups with no committed offset start
  at the earliest record.
- Missing topics are created (``num_partitions``, ``replication_factor`` from config)
  before anyone produces to or subscribes to them.
- TLS and SASL settings come from :class:`~specops.streams.config.StreamConfig` and
  ``client_options`` is passed verbatim to every client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka import errors as kerr

from specops.streams.base import Consumer, Delivery, Message, OutMessage, Producer, Stream
from specops.streams.config import StreamConfig
from specops.streams.errors import CommitFailedError, StreamConfigError, StreamUnavailableError

log = logging.getLogger(__name__)

LINGER_MS = 5
"""Producer batching delay: small, because ``publish`` already hands over batches."""
BATCH_BYTES = 1024 * 1024
"""Producer batch size per partition. MissRecords are kilobytes each; kafka-python's
16 KiB default would send about one record per request."""


def client_kwargs(servers: Sequence[str], cfg: StreamConfig) -> dict[str, Any]:
    """Connection settings shared by every kafka-python client (TLS/SASL included)."""
    kw: dict[str, Any] = {
        "bootstrap_servers": list(servers),
        "client_id": "specops",
        "security_protocol": cfg.security_protocol,
        "request_timeout_ms": int(cfg.request_timeout_s * 1000),
        "bootstrap_timeout_ms": int(cfg.request_timeout_s * 1000),
    }
    optional = {
        "ssl_cafile": cfg.ssl_cafile,
        "ssl_certfile": cfg.ssl_certfile,
        "ssl_keyfile": cfg.ssl_keyfile,
        "sasl_mechanism": cfg.sasl_mechanism,
        "sasl_plain_username": cfg.sasl_plain_username,
        "sasl_plain_password": cfg.sasl_plain_password,
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        kw["ssl_check_hostname"] = cfg.ssl_check_hostname
    kw.update(cfg.client_options)
    return kw


def _unavailable(what: str, e: Exception) -> StreamUnavailableError:
    return StreamUnavailableError(f"kafka {what} failed: {type(e).__name__}: {e}")


class KafkaStream(Stream):
    """Kafka at ``kafka://host:port[,host:port]``."""

    def __init__(self, servers: Sequence[str], cfg: StreamConfig) -> None:
        self.servers = list(servers)
        self.cfg = cfg
        self.url = cfg.url
        self._admin: KafkaAdminClient | None = None
        self._known: dict[str, int] = {}

    # ------------------------------------------------------------ admin
    def _kw(self) -> dict[str, Any]:
        return client_kwargs(self.servers, self.cfg)

    def _admin_client(self) -> KafkaAdminClient:
        if self._admin is None:
            try:
                self._admin = KafkaAdminClient(**self._kw())
            except kerr.KafkaError as e:
                raise _unavailable("admin connection", e) from e
        return self._admin

    def list_topics(self) -> dict[str, int]:
        try:
            topics = self._admin_client().describe_topics()
        except kerr.KafkaError as e:
            self._drop_admin()
            raise _unavailable("describe_topics", e) from e
        found = {t["name"]: len(t["partitions"]) for t in topics if not t["name"].startswith("__")}
        self._known.update(found)
        return found

    def ensure_topics(self, topics: Mapping[str, int]) -> None:
        missing = {t: n for t, n in topics.items() if t not in self._known}
        if not missing:
            return
        existing = self.list_topics()
        missing = {t: n for t, n in missing.items() if t not in existing}
        if not missing:
            return
        spec = {t: {"num_partitions": n, "replication_factor": self.cfg.replication_factor} for t, n in missing.items()}
        try:
            self._admin_client().create_topics(spec, raise_errors=False)
        except kerr.KafkaError as e:
            self._drop_admin()
            raise _unavailable("create_topics", e) from e
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while time.monotonic() < deadline:  # creation is asynchronous on some brokers
            if all(t in self.list_topics() for t in missing):
                log.info("created kafka topics %s", ", ".join(f"{t} ({n} partitions)" for t, n in missing.items()))
                return
            time.sleep(0.1)
        raise StreamUnavailableError(
            f"kafka topics {sorted(missing)} did not appear within {self.cfg.request_timeout_s}s"
        )

    def _drop_admin(self) -> None:
        if self._admin is not None:
            try:
                self._admin.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                pass
            self._admin = None

    # ------------------------------------------------------------ clients
    def producer(self) -> Producer:
        return KafkaStreamProducer(self)

    def consumer(self, group: str, topics: Sequence[str]) -> Consumer:
        if not group:
            raise StreamConfigError("a consumer needs a group id")
        self.ensure_topics({t: self.cfg.num_partitions for t in topics})
        return KafkaStreamConsumer(self, group, topics)

    # ------------------------------------------------------------ inspection
    def _reader(self) -> KafkaConsumer:
        try:
            return KafkaConsumer(group_id=None, enable_auto_commit=False, **self._kw())
        except kerr.KafkaError as e:
            raise _unavailable("connection", e) from e

    def _partitions(self, topic: str) -> list[TopicPartition]:
        n = self.list_topics().get(topic)
        if n is None:
            return []
        return [TopicPartition(topic, p) for p in range(n)]

    def end_offsets(self, topic: str) -> dict[int, int]:
        tps = self._partitions(topic)
        if not tps:
            return {}
        reader = self._reader()
        try:
            reader.assign(tps)
            return {tp.partition: end for tp, end in self._true_ends(reader, tps).items()}
        except kerr.KafkaError as e:
            raise _unavailable("end_offsets", e) from e
        finally:
            reader.close()

    @staticmethod
    def _true_ends(
        reader: KafkaConsumer, tps: list[TopicPartition], timeout_s: float = 2.0
    ) -> dict[TopicPartition, int]:
        """End offsets per partition, confirmed by a fetch's high watermark.

        Some Kafka-protocol brokers (tansu 0.6) answer ListOffsets with the base offset
        of the last record batch plus one, not the high watermark. Fetching the last
        listed record returns the true high watermark, so take the larger of the two;
        on Apache Kafka they agree and this costs one fetch.
        """
        listed = reader.end_offsets(tps)
        begins = reader.beginning_offsets(tps)
        ends = {tp: int(listed[tp]) for tp in tps}
        pending = {tp for tp in tps if listed[tp] > begins[tp]}
        for tp in pending:
            reader.seek(tp, max(int(listed[tp]) - 1, int(begins[tp])))
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            reader.poll(timeout_ms=100, max_records=1)
            for tp in list(pending):
                hw = reader.highwater(tp)
                if hw is not None:
                    ends[tp] = max(ends[tp], int(hw))
                    pending.discard(tp)
        return ends

    def committed(self, group: str, topic: str) -> dict[int, int]:
        try:
            found = self._admin_client().list_group_offsets({group: None}).get(group, {})
        except kerr.KafkaError as e:
            self._drop_admin()
            raise _unavailable("list_group_offsets", e) from e
        return {tp.partition: int(om.offset) for tp, om in found.items() if tp.topic == topic and om.offset >= 0}

    def read(self, topic: str, *, from_end: int | None = None, timeout_s: float = 5.0) -> Iterator[Message]:
        tps = self._partitions(topic)
        if not tps:
            return
        reader = self._reader()
        try:
            reader.assign(tps)
            ends = self._true_ends(reader, tps)
            starts = reader.beginning_offsets(tps)
            for tp in tps:
                start = starts[tp] if from_end is None else max(starts[tp], ends[tp] - from_end)
                reader.seek(tp, start)
            remaining = {tp for tp in tps if reader.position(tp) < ends[tp]}
            deadline = time.monotonic() + timeout_s
            while remaining and time.monotonic() < deadline:
                for tp, records in reader.poll(timeout_ms=200).items():
                    for r in records:
                        if r.offset < ends[tp]:
                            yield _message(r)
                for tp in list(remaining):
                    if reader.position(tp) >= ends[tp]:
                        remaining.discard(tp)
        except kerr.KafkaError as e:
            raise _unavailable("read", e) from e
        finally:
            reader.close()

    def close(self) -> None:
        self._drop_admin()


def _message(r: Any) -> Message:
    return Message(
        topic=r.topic, partition=r.partition, offset=r.offset, key=r.key, value=r.value, timestamp_ms=int(r.timestamp)
    )


class KafkaStreamProducer(Producer):
    def __init__(self, stream: KafkaStream) -> None:
        self.stream = stream
        cfg = stream.cfg
        timeout_ms = int(cfg.request_timeout_s * 1000)
        options = {
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": LINGER_MS,
            "batch_size": BATCH_BYTES,
            "max_block_ms": timeout_ms,
            "delivery_timeout_ms": timeout_ms + LINGER_MS,
            "max_request_size": 16 * 1024 * 1024,
            **stream._kw(),
            **cfg.producer_options,
        }
        try:
            self._producer = KafkaProducer(**options)
        except kerr.KafkaError as e:
            raise _unavailable("producer connection", e) from e

    def publish(self, topic: str, messages: Sequence[OutMessage]) -> list[Delivery]:
        if not messages:
            return []
        self.stream.ensure_topics({topic: self.stream.cfg.num_partitions})
        timeout = self.stream.cfg.request_timeout_s
        try:
            futures = [self._producer.send(topic, key=m.key, value=m.value) for m in messages]
            self._producer.flush(timeout=timeout)
            metas = [f.get(timeout=timeout) for f in futures]
        except kerr.KafkaError as e:
            raise _unavailable(f"publish to {topic}", e) from e
        return [Delivery(partition=md.partition, offset=md.offset) for md in metas]

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=1)
            except Exception:  # noqa: BLE001 - closing a broken client
                pass
            self._producer = None  # type: ignore[assignment]


class KafkaStreamConsumer(Consumer):
    def __init__(self, stream: KafkaStream, group: str, topics: Sequence[str]) -> None:
        cfg = stream.cfg
        self.group = group
        options = {
            "group_id": group,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "session_timeout_ms": int(cfg.session_timeout_s * 1000),
            "heartbeat_interval_ms": int(cfg.heartbeat_interval_s * 1000),
            "max_poll_interval_ms": int(cfg.max_poll_interval_s * 1000),
            **stream._kw(),
            **cfg.consumer_options,
        }
        try:
            self._consumer = KafkaConsumer(*topics, **options)
        except kerr.KafkaError as e:
            raise _unavailable("consumer connection", e) from e
        self._closed = False

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Message]:
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except kerr.KafkaError as e:
            raise _unavailable("poll", e) from e
        out: list[Message] = []
        for records in batches.values():
            out.extend(_message(r) for r in records)
        return out

    def commit(self) -> None:
        try:
            self._consumer.commit()
        except kerr.CommitFailedError as e:
            raise CommitFailedError(f"kafka commit refused for group {self.group}: {e}") from e
        except kerr.KafkaError as e:
            raise _unavailable("commit", e) from e

    def assignment(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._consumer.close(autocommit=False)
            except Exception:  # noqa: BLE001 - closing a broken client
                pass
