"""Settings: declared once (services.py), read once from flags and the environment (declare.py, flags.py)."""
