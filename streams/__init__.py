"""Record schemas and the stream backends (Kafka and an embedded durable log). Not built yet."""
