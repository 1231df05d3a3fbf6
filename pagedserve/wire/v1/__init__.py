"""Generated gRPC stubs of the pagedserve.v1 protocol (python proto/generate.py)."""
