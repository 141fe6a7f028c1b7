"""A consumer process for kill tests: prints ``partition offset value`` per processed
record (flushed at once), commits only when asked, and runs until killed.

    python -m tests.streams.proc_consumer CONFIG_JSON GROUP TOPIC {commit|nocommit}
"""

from __future__ import annotations

import json
import sys
import time

from specops.streams import StreamConfig, open_stream


def main() -> None:
    cfg_json, group, topic, mode = sys.argv[1:5]
    cfg = StreamConfig(**json.loads(cfg_json))
    stream = open_stream(cfg)
    consumer = stream.consumer(group, [topic])
    while True:
        batch = consumer.poll(max_records=7, timeout_s=0.5)
        for m in batch:
            print(f"{m.partition} {m.offset} {m.value.decode()}", flush=True)
        if batch and mode == "commit":
            consumer.commit()
            print("committed", flush=True)
            time.sleep(0.05)  # slow enough that a kill lands mid-stream


if __name__ == "__main__":
    main()
