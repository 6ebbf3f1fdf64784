"""Administration of a catalog and its files: pack, export-delta, gc, verify, fsck."""
