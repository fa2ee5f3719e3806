"""Data parallel (docs/distributed.md): the ranks and their collectives (distributed.py), a unit as
one rank's shards (sharded.py), the optimizer over ranks (sharded_optimizer.py), checkpoints with
a folder per rank (sharded_checkpoint.py). Only runtime/engine.py builds them. No face: import
each name from the module that defines it."""
