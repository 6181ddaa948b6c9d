"""The machine a search runs on (below search, above training): `plan` (workers, GPUs, step mode), `mps` (NVIDIA
MPS for workers sharing a GPU), `bench` + `measured` (`headsearch bench` and what it keeps for the plan),
`fairtime` (the fair clock: an architecture's seconds with the device to itself).
"""
