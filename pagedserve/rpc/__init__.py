"""The services' RPC runtime: the gRPC server and channels, the step channel, TLS and peer
authentication, the internal token, tracing, health and metrics listeners. Above
pagedserve.wire (the contract), below everything else (docs/ARCHITECTURE.md).
"""
