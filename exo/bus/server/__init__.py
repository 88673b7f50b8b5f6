"""Running nats-server for exo: the embedded server, its configuration and permissions, and
clustering several of them (discovery, formation, secrets, membership, migration)."""
