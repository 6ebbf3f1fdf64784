"""The demo: a generated model family (`family`) and the command that ingests and merges it (`run`)."""
