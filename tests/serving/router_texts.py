"""Clearly separated prompts (Python, English prose, SQL) for the router tests."""

from __future__ import annotations

TRAIN = {
    "code": [
        "def add(a, b):\n    return a + b",
        "for i in range(10):\n    print(i)",
        "import os\npath = os.path.join(root, name)",
        "class Stack:\n    def __init__(self):\n        self.items = []",
        "try:\n    value = int(text)\nexcept ValueError:\n    value = 0",
    ],
    "prose": [
        "The quick brown fox jumps over the lazy dog.",
        "She walked to the market on a sunny morning and bought fresh bread.",
        "History teaches us that empires rise and fall.",
        "The novel tells the story of a young sailor who dreams of the sea.",
        "After the storm, the village gathered to repair the old bridge.",
    ],
    "sql": [
        "SELECT name FROM users WHERE id = 1;",
        "INSERT INTO orders (id, total) VALUES (1, 9.99);",
        "UPDATE accounts SET balance = 0 WHERE id = 7;",
        "CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT);",
        "SELECT o.id, c.name FROM orders o JOIN customers c ON o.customer_id = c.id;",
    ],
}
HELDOUT = {
    "code": [
        "while x < 10:\n    x += 1",
        "def main():\n    return sorted(items, key=len)",
        "with open(path) as f:\n    lines = f.readlines()",
    ],
    "prose": [
        "It was a dark and stormy night, and the rain fell in torrents.",
        "My grandmother loved gardening in the spring.",
        "The children laughed as the kite rose above the hills.",
    ],
    "sql": [
        "SELECT count(*) FROM orders GROUP BY customer_id;",
        "DELETE FROM sessions WHERE expires < now();",
        "ALTER TABLE users ADD COLUMN email TEXT;",
    ],
}
