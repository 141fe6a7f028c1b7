"""The ``local://`` backend: an embedded, durable, append-only log shared by the processes of
one machine (:class:`specops.streams.local.stream.LocalStream`), with its segment files, frames,
appends, consumer groups and damage handling one module each."""
