"""Weight plane: stored-bit planes, PULSE patches, anchors and bucket sync (pure numpy)."""
