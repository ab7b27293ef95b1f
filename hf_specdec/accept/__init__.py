"""Accept: what commits a verdict. `emit.py` appends the accepted block and runs the stopping criteria;
`kv_cache.py` keeps caches full-length and compacts them in place to the accepted path (per row in a batch);
`ragged.py` keeps a batch's valid cache columns per row. The drafter's side of accepting is `Drafter.accept`
(`core/drafter.py`), called by the loop with the same verdict."""
