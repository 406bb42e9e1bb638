"""Training: the elastic trainer (core cell + joining satellites), the cross-cell
gradient reduction, Orbax checkpoints, and the train-on-a-store loop used by launch."""
