"""What the benchmark scripts share, one implementation each (issue 59):

- ``benchmarks.harness.env``: the environment record (versions, CPU, git state) and the target's name;
- ``benchmarks.harness.servers``: a ``specops serve`` child process (start, wait for ``/readyz``, stop);
- ``benchmarks.harness.prompts``: held-out prompt sets, topped up with random token prompts;
- ``benchmarks.harness.greedy``: the target's greedy continuations in left-padded batches;
- ``benchmarks.harness.interleave``: arms rotated per item, streams mixed into one arrival order;
- ``benchmarks.harness.report``: the JSON, the printed table, the doc section and the PNG.

The modules import only what they use, so importing one costs no more than its own needs
(``benchmarks.common`` re-exports the env and report names for the scripts written before it)."""
