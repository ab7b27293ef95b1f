"""Accept: what commits a verdict. The caches it is committed to (full-length, compacted in place to the accepted
path, per row in a batch) and a batch's ragged rows."""
