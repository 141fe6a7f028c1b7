"""The OpenAI-compatible HTTP API: request schema, admission, read deadlines, the replica
state behind it and its settings."""
