"""Schema of a retriever index's manifest, ``stoa-index.json`` (on disk and at ``retriever_file_key``).

The manifest is written last into an index directory (an index without it is incomplete) and uploaded last
under ``runs/<run>/retriever/<fingerprint>/``. Its version field is ``format`` (1 since the first index; an
index of another format is refused, to be rebuilt). ``settings`` is kept as the object it is here, bounded in
size and depth; ``stoa.retrieval.manifest.IndexSettings.from_json`` reads it field by field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stoa.schemas import BadSchemaObject, checked, load
from stoa.untrusted import as_object, field_int, field_str

INDEX_MANIFEST = "stoa-index.json"
"""The index directory's manifest (written last: an index without it is incomplete)."""
INDEX_FORMAT = 1
"""Version of the directory layout (the manifest's ``format``)."""
MAX_MANIFEST_BYTES = 1 << 20
"""Largest manifest read (it lists a dozen files and the settings: a few kB)."""
MAX_INDEX_FILES = 64
"""Most files a manifest may list (bm25s writes about eight)."""
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REBUILD = "rebuild the index"


@dataclass(frozen=True)
class IndexFile:
    """One file of an index: its size and SHA-256 digest.

    Args:
        size: bytes.
        digest: hex SHA-256 of its content.
    """

    size: int
    digest: str


@dataclass(frozen=True)
class IndexManifest:
    """What ``stoa-index.json`` holds.

    Args:
        fingerprint: the index's fingerprint (corpus, settings; what the contract names).
        docs: documents in the index.
        files: every other file of the directory by name.
        settings: the index settings' object (``IndexSettings.to_json``).
        kind: the index's kind (``bm25s``).
        bm25s_version: the bm25s that wrote it (informational).
        format: the schema version.
    """

    fingerprint: str
    docs: int
    files: Mapping[str, IndexFile]
    settings: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "bm25s"
    bm25s_version: str = ""
    format: int = INDEX_FORMAT

    def to_json(self) -> bytes:
        """Serialize for the index directory (indented, sorted, one trailing newline)."""
        doc = {"format": self.format, "kind": self.kind, "fingerprint": self.fingerprint, "docs": self.docs,
               "settings": dict(self.settings), "bm25s_version": self.bm25s_version,
               "files": {n: {"size": f.size, "digest": f.digest} for n, f in self.files.items()}}
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, key: str = INDEX_MANIFEST) -> IndexManifest:
        """Parse untrusted bytes (at most 1 MiB, three levels deep; ``format`` 1; at most 64 files, each a plain
        name with an integer size and a digest).

        Args:
            data: the stored bytes.
            key: the manifest's key or path, for the message.

        Raises:
            BadSchemaObject: not a manifest of this format (names the key and the field).
        """
        d = load(data, key, max_bytes=MAX_MANIFEST_BYTES, max_depth=3)
        if d.get("format") != INDEX_FORMAT:
            raise BadSchemaObject(key, f"has format {str(d.get('format'))[:32]!r}, this stoa reads {INDEX_FORMAT}",
                                  REBUILD)
        for name, kind in (("fingerprint", str), ("docs", int), ("files", dict), ("settings", dict)):
            if not isinstance(d.get(name), kind):
                raise BadSchemaObject(key, f"has field {name!r} missing or not a {kind.__name__}", REBUILD)
        return checked(key, lambda: cls(
            field_str(d, "fingerprint", max_len=64), field_int(d, "docs", hi=2**40), _files(d["files"]),
            as_object(d["settings"], "settings"), field_str(d, "kind", max_len=32, default="bm25s"),
            field_str(d, "bm25s_version", max_len=64, default="")), REBUILD)


def _files(files: dict[str, Any]) -> dict[str, IndexFile]:
    """Every entry of a manifest's ``files``: a short name -> ``{"size": int, "digest": str}``."""
    if len(files) > MAX_INDEX_FILES:
        raise ValueError(f"'files' lists {len(files)} files > {MAX_INDEX_FILES}")
    out = {}
    for name, meta in files.items():
        if not _FILE_NAME.fullmatch(name) or name == INDEX_MANIFEST:
            raise ValueError(f"'files' names {name[:64]!r}, not a plain file name")
        if not isinstance(meta, dict):
            raise ValueError(f"'files' entry {name!r} is not {{size, digest}}")
        out[name] = IndexFile(field_int(meta, "size", hi=2**50), field_str(meta, "digest", max_len=128))
    return out
