"""The public API: the gRPC servicer, the frontend (validate, submit, stream) and the
validation of sampling parameters."""
