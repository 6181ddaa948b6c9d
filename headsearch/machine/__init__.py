"""The machine a search runs on (below search, above training): `plan` (workers, GPUs, step mode; `worker_seat`),
`mps` (NVIDIA MPS for workers sharing a GPU), `bench` + `measured` (`headsearch bench` and what it keeps for the
plan), `fairtime` (the fair clock's keys, and `Seat`: one worker's device, its lock and a lone process's threads).
"""
