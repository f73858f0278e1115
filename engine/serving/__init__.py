"""What a served replica runs, and the vocabulary it speaks to the frontend.

- `types`: the records that cross the seam between a replica and the
  frontend (the one delta type, stage timings, the load report); plain
  Python, no torch.
- `frames`: the request channel's frames, one small dataclass each.
- `channel`: the channel itself (the frontend's server, a replica's client).
- `stage_loop`: the loop thread every stage replica runs, and the dispatch
  of the channel's frames to the stage's handlers.

Both stages and `cluster` import this package; it imports nothing of theirs.
Nothing is imported here, so `engine.serving.types` stays torch-free.
"""
