"""Training loops beyond the synchronous one a user writes: the pipelined loop and checkpoint retention."""
