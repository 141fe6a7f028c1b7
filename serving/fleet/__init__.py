"""What ties a replica to the fleet: hot-swap followers of registry aliases, the prompt
router, alias-change events, the stream logger, and the serving node."""
