"""Text models sharded over several processes: the leader engine and the followers."""
