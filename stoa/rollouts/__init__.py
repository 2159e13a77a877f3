"""The rollout direction: what workers upload and the trainer reads back, as bytes.

``episode`` holds the shape of a recorded episode (token roles, why it ended, its limits, its tool calls),
``header`` the bounded parser of a record's header, ``records`` the record codec and its validation. The
trainer treats every record as hostile: it decodes with these, then replays each episode with its own tools
(``stoa.episodes.replay``).
"""
