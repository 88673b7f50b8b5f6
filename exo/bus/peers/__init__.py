"""Node-to-node request/reply over NATS: sharing model files, download control, responders."""
