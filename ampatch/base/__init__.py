"""The bottom layer: primitives every other part of ampatch uses; nothing in ampatch is below.

- `dtypes`: the floating dtypes mixed precision deals in, and their names;
- `tree`: the one walk over nested arguments (lists, tuples, dicts, batch objects);
- `notices`: warnings that point at the user's line, and the "ampatch" logger's guard;
- `counters`: thread-safe call counters (the hot path's only bookkeeping);
- `patcher`: the undo registry every patch goes through, the per-thread cast switch, and the
  watch on `Tensor.data` (writes no version counter sees).
"""
