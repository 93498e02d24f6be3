"""Planning before a run: targets, the ahead-of-time compile, reading XLA's HLO, and the memory report."""
