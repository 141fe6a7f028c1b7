"""``specops streams inspect|topics``: what is in a stream, readable by a person.

rich and the stream codecs (numpy) load when a subcommand runs, not while ``specops --help`` builds the parser."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from specops.cli.common import add_group, prose

if TYPE_CHECKING:
    from rich.console import Console

    from specops.streams import Message

DAMAGED = 3
"""Exit status of ``inspect`` when the log holds damaged bytes."""

INSPECT = prose(
    """
    Reads TOPIC outside any consumer group (commits nothing) and prints one line per record: partition, offset,
    time, key, type, size and a summary (request, acceptance, rejected positions; or the source and reason of a dead
    letter). Records that fail validation are shown as INVALID with the reason. Ends with totals per type and per
    cluster, and the group's lag with --group. Damaged bytes in a local log (skipped, copied to the partition's
    quarantine directory) are listed last, and the exit status is then 3.
    """
)


def add_parser(sub) -> None:
    streams = add_group(
        sub,
        "streams",
        help="look into a stream: its topics, and the records of one topic",
        description="Read-only tools for the streams serving logs to and the trainer consumes. "
        "URL is local:///abs/path, local://./relative/path or kafka://host:port[,host:port]; "
        "Kafka TLS/SASL settings come from SPECOPS_STREAM_* environment variables.",
    )
    q = streams.add_parser(
        "inspect",
        help="print a readable summary of the records of one topic, dead letters included",
        description=INSPECT,
    )
    q.add_argument("url", help="stream URL")
    q.add_argument("topic", help="topic, e.g. spec.misses, spec.generations, spec.events, spec.deadletter")
    q.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N records of each partition")
    q.add_argument("--limit", type=int, default=50, help="rows to print, 0 = all (default: %(default)s)")
    q.add_argument("--group", default=None, help="also show this consumer group's committed offsets and lag")
    q.add_argument("--json", action="store_true", help="one JSON object per record instead of a table")
    q.set_defaults(func=cmd_streams_inspect)
    q = streams.add_parser(
        "topics",
        help="list topics with partitions and record counts",
        description="Lists every topic at URL with its partitions and records.",
    )
    q.add_argument("url", help="stream URL")
    q.set_defaults(func=cmd_streams_topics)


def cmd_streams_inspect(args: argparse.Namespace) -> int:
    return inspect(args.url, args.topic, limit=args.limit, tail=args.tail, group=args.group, as_json=args.json)


def cmd_streams_topics(args: argparse.Namespace) -> int:
    return topics(args.url)


def summarize(msg: Message) -> dict[str, Any]:
    """One message as a flat dict: where it is, what it is, and the gist of it."""
    from specops.streams.codec import decode
    from specops.streams.errors import RecordValidationError
    from specops.streams.records import DeadLetter, GenerationRecord, MissRecord, ModelEvent

    row: dict[str, Any] = {
        "partition": msg.partition,
        "offset": msg.offset,
        "time": dt.datetime.fromtimestamp(msg.timestamp_ms / 1000).isoformat(timespec="seconds"),
        "key": msg.key.decode(errors="replace") if msg.key is not None else None,
        "bytes": len(msg.value),
    }
    try:
        rec = decode(msg.value)
    except RecordValidationError as e:
        return {**row, "type": "INVALID", "summary": str(e)}
    row["type"] = type(rec).__name__
    if isinstance(rec, MissRecord):
        alpha = rec.num_accepted / rec.num_drafted if rec.num_drafted else 0.0
        k = rec.logprobs.shape[1] if rec.dist_kind == "topk" else "all"
        row.update(
            request_id=rec.request_id,
            cluster=rec.cluster,
            alpha=round(alpha, 4),
            num_rejected=rec.num_rejected,
            num_drafted=rec.num_drafted,
            num_accepted=rec.num_accepted,
            summary=f"{rec.request_id} {rec.method} {rec.draft_model}@{rec.draft_version or '-'} "
            f"tokens {rec.num_prompt_tokens}+{len(rec.token_ids) - rec.num_prompt_tokens} "
            f"accepted {rec.num_accepted}/{rec.num_drafted}, {rec.num_rejected} rejected "
            f"({rec.dist_kind} k={k}, {rec.logprobs.dtype})",
        )
    elif isinstance(rec, GenerationRecord):
        row.update(
            request_id=rec.request_id,
            cluster=rec.cluster,
            summary=f"{rec.request_id} {rec.method} prompt {len(rec.prompt_ids)} output {len(rec.output_ids)} "
            f"finish={rec.finish_reason or '-'}",
        )
    elif isinstance(rec, ModelEvent):
        prev = f" (was {rec.previous_version})" if rec.previous_version else ""
        row["summary"] = f"{rec.kind} {rec.model_name}@{rec.alias} -> {rec.version}{prev} {rec.reason}".strip()
    elif isinstance(rec, DeadLetter):
        from specops.streams.codec import peek_type

        row.update(
            source=f"{rec.source_topic}[{rec.source_partition}]@{rec.source_offset}",
            summary=f"from {rec.source_topic}[{rec.source_partition}]@{rec.source_offset} "
            f"({len(rec.value)} bytes, looks like {peek_type(rec.value)}, group {rec.consumer_group or '-'}): "
            f"{rec.reason}",
        )
    return row


def inspect(url: str, topic: str, *, limit: int, tail: int | None, group: str | None, as_json: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    from specops.streams import StreamConfig, open_stream

    cfg = StreamConfig.from_env(url=url)
    with open_stream(cfg) as stream:
        topics = stream.list_topics()
        if topic not in topics:
            known = ", ".join(sorted(topics)) or "none"
            print(f"topic {topic!r} does not exist at {url} (topics: {known})", file=sys.stderr)
            return 1
        ends = stream.end_offsets(topic)
        rows = [summarize(m) for m in stream.read(topic, from_end=tail)]
        committed = stream.committed(group, topic) if group else {}
        damage = stream.damage(topic)
    rows.sort(key=lambda r: (r["partition"], r["offset"]))
    if as_json:
        for r in rows[:limit] if limit else rows:
            print(json.dumps(r))
        for d in damage:
            print(json.dumps({"damage": d}), file=sys.stderr)
        return DAMAGED if damage else 0
    console = Console()
    table = Table(title=f"{topic} at {url}", show_lines=False)
    for col in ("p", "offset", "time", "key", "type", "bytes", "summary"):
        table.add_column(col, overflow="fold", justify="right" if col in ("p", "offset", "bytes") else "left")
    shown = rows[:limit] if limit else rows
    for r in shown:
        style = "red" if r["type"] in ("INVALID", "DeadLetter") else None
        table.add_row(
            str(r["partition"]),
            str(r["offset"]),
            r["time"],
            r["key"] or "-",
            r["type"],
            str(r["bytes"]),
            r["summary"],
            style=style,
        )
    console.print(table)
    if len(shown) < len(rows):
        console.print(f"... {len(rows) - len(shown)} more (use --limit 0 for all)")
    _print_totals(console, rows, ends, committed, group)
    for d in damage:
        if "offsets" in d:
            console.print(f"DAMAGED p{d['partition']} segment {d['segment']}: {d['where']}", style="bold red")
            continue
        console.print(
            f"DAMAGED p{d['partition']} segment {d['segment']}: {d['bytes']} bytes at {d['start']}-{d['end']} "
            f"({d['where']}); the records there are lost, those around it are listed above; copy: "
            f"{d['quarantine'] or 'none'}",
            style="bold red",
        )
    return DAMAGED if damage else 0


def _print_totals(
    console: Console, rows: list[dict], ends: dict[int, int], committed: dict[int, int], group: str | None
) -> None:
    types = Counter(r["type"] for r in rows)
    console.print(
        "records: "
        + (", ".join(f"{n} {t}" for t, n in sorted(types.items())) or "none")
        + f"; {sum(r['bytes'] for r in rows)} bytes"
    )
    per_cluster: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["type"] == "MissRecord":
            per_cluster[r["cluster"]].append(r)
    for cluster, rs in sorted(per_cluster.items()):
        drafted, accepted = sum(r["num_drafted"] for r in rs), sum(r["num_accepted"] for r in rs)
        rate = f"{accepted / drafted:.3f}" if drafted else "-"
        console.print(
            f"cluster {cluster}: {len(rs)} request(s), acceptance {rate} ({accepted}/{drafted} drafted tokens), "
            f"{sum(r['num_rejected'] for r in rs)} rejected positions"
        )
    reasons = Counter(r["summary"].split(": ", 1)[-1].split(":")[0] for r in rows if r["type"] == "DeadLetter")
    for reason, n in reasons.most_common():
        console.print(f"dead letters: {n} x {reason}", style="red")
    parts = ", ".join(f"p{p}={e}" for p, e in sorted(ends.items()))
    console.print(f"end offsets: {parts or '-'}")
    if group:
        lag = sum(max(0, e - committed.get(p, 0)) for p, e in ends.items())
        done = ", ".join(f"p{p}={c}" for p, c in sorted(committed.items())) or "nothing committed"
        ahead = [p for p, c in sorted(committed.items()) if c > ends.get(p, 0)]
        note = (
            f" (p{', p'.join(map(str, ahead))} committed past the end: records lost with a damaged tail)"
            if ahead
            else ""
        )
        console.print(f"group {group}: {done}; lag {lag} record(s){note}")


def topics(url: str) -> int:
    from rich.console import Console
    from rich.table import Table

    from specops.streams import StreamConfig, open_stream

    cfg = StreamConfig.from_env(url=url)
    console = Console()
    with open_stream(cfg) as stream:
        found = stream.list_topics()
        table = Table(title=f"topics at {url}")
        for col in ("topic", "partitions", "records"):
            table.add_column(col, justify="left" if col == "topic" else "right")
        for name, n in sorted(found.items()):
            table.add_row(name, str(n), str(sum(stream.end_offsets(name).values())))
    console.print(table)
    return 0
