"""Model states of a model sharded with FSDP2's ``fully_shard``: each rank's optimizer states in
chunks across the tiers, FSDP2's parameters left where FSDP2 keeps them (NOTE [ Sharded model
states ] in :mod:`tiermem.states.sharded.manager`)."""
