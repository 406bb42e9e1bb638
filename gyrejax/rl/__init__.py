"""RL objectives: per-token losses by name (`losses`) and the micro-step objective over
packed tree rows (`objective`). Advantages are computed by `gyrejax.trajectory`."""
