"""Code shared by the three services: logging, errors, the gRPC server lifecycle, settings."""
