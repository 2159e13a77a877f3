"""Write problems.jsonl: 300 two-digit additions, the same every time (seeded), one JSON object a line."""

import json
import random

rng = random.Random(26)
with open("problems.jsonl", "w") as f:
    for _ in range(300):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        row = {"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)}
        f.write(json.dumps(row) + "\n")
