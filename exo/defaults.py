"""The defaults `exo --help` shows and the node uses, in one module that is cheap to import."""

DEFAULT_API_PORT = 52415
DEFAULT_NATS_PORT = 4222
DEFAULT_DATA_DIR = "~/.exo"
