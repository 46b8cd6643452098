"""Files a run dir relies on: atomic writes, the write fence, path limits and file digests."""
