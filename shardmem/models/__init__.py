"""Models shardmem builds itself: the reference Llama-style decoder with logical axes and remat tags."""
