"""Getting models in: inspect, acquire, convert, register, qualify, with manifests."""
